"""The poller's logic against a scripted master (httpx.MockTransport) under the autojump clock.

The supervisor is the real one (admission, free slots, running spiders, waiting for a slot); only
``run_task`` is replaced by a task that holds its slot until the test releases it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from harness import PENDING, HoldingSupervisor, PollMaster, register_request, task_json

from ckagent.master.client import MasterClient
from ckagent.master.protocol import CLAIM_IN_POLL, POLL_FOLLOWS_RESULTS, Task
from ckagent.task.poller import FOLLOW_GRACE, Poller
from ckagent.task.stop import StopReason

POLL_INTERVAL = 5.0
LONG_POLL_WAIT = 20.0


async def run_poller(
    master: PollMaster, tmp_path: Path, body: Callable[[Poller, HoldingSupervisor], Awaitable[None]],
    *, max_workers: int = 3, long_poll_wait: float = LONG_POLL_WAIT,
    cannot_run: Callable[[Task], str | None] | None = None,
) -> HoldingSupervisor:
    """Run a poller against ``master`` while ``body`` runs, then cancel it."""
    client = MasterClient("http://master.test", "token", register_request, transport=httpx.MockTransport(master))
    supervisor = HoldingSupervisor(max_workers, tmp_path)
    poller = Poller(client, supervisor, poll_interval=POLL_INTERVAL, long_poll_wait=long_poll_wait,
                    request_timeout=10.0, cannot_run=cannot_run)
    with trio.fail_after(3600):  # virtual seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run, nursery)
            await body(poller, supervisor)
            nursery.cancel_scope.cancel()
    await client.aclose()
    return supervisor


async def started(sup: HoldingSupervisor, task_ids: list[str]) -> None:
    """The admitted ``task_ids`` have started running (and nothing else has). A task is admitted (in
    ``sup.running``) before the poll after its answer goes out, but its Trio task runs at the next
    schedule point, in an order Trio varies on purpose: which one comes first, that task or the
    master's receipt of the next poll, is not for a test to assume. So this waits until every task is
    blocked (the master holds the poll, the admitted tasks wait for their release) before it looks."""
    await trio.testing.wait_all_tasks_blocked()
    assert sorted(sup.started) == sorted(task_ids)


# ---------------------------------------------------------------------------- limit and exclusion


async def test_limit_is_free_slots_and_running_spiders_are_excluded(autojump_clock: Any, tmp_path: Path) -> None:
    master = PollMaster(answers=[
        {"tasks": [task_json("t1", "s1")], "cancelTaskIds": []},
        {"tasks": [task_json("t2", "s2")], "cancelTaskIds": []},
        {"tasks": [task_json("t3", "s3")], "cancelTaskIds": []},
    ], hold_empty=True)

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(3)
        await trio.sleep(1)  # all three claimed, slots full: no fourth poll however long we wait
        assert sorted(sup.started) == ["t1", "t2", "t3"]
        await trio.sleep(600)
        assert len(master.polls) == 3
        released_at = trio.current_time()
        sup.release("t2")
        await master.wait_polls(4)
        assert master.polls[3].at == released_at  # a freed slot is polled for at once
        assert master.polls[3].params["limit"] == "1"
        assert master.polls[3].params["excludeSpiderIds"] == "s1,s3"

    await run_poller(master, tmp_path, body)
    first, second, third = (p.params for p in master.polls[:3])
    assert first["limit"] == "3" and "excludeSpiderIds" not in first
    assert second["limit"] == "2" and second["excludeSpiderIds"] == "s1"
    assert third["limit"] == "1" and third["excludeSpiderIds"] == "s1,s2"
    assert all(float(p.params["waitSeconds"]) == LONG_POLL_WAIT for p in master.polls)
    assert all(master.results[t][0]["status"] == "RUNNING" for t in ("t1", "t2", "t3"))
    # A master that did not offer claim-in-poll is not asked for it.
    assert not any("claim" in p.params or "pollId" in p.params for p in master.polls)


# ---------------------------------------------------------------------------- claims in the poll answer


async def test_a_claimed_answer_starts_its_tasks_without_a_claim(autojump_clock: Any, tmp_path: Path) -> None:
    master = PollMaster(answers=[
        {"tasks": [task_json("t1", "s1", claimed=True), task_json("t2", "s2", claimed=True)], "cancelTaskIds": []},
    ], hold_empty=True, features=[CLAIM_IN_POLL])

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(2)
        assert sorted(sup.running) == ["t1", "t2"]  # admitted before the next poll went out
        assert master.polls[1].at == master.polls[0].at  # no claim round trip before the next poll
        await started(sup, ["t1", "t2"])
        assert sup.claim_polls == {int(master.polls[1].params["pollId"])}  # the held poll is on the wire

    sup = await run_poller(master, tmp_path, body)
    assert master.results == {}  # no claim (POST .../result RUNNING) at all
    first, second = (p.params for p in master.polls[:2])
    assert (first["limit"], first["claim"]) == ("3", "3") and (second["limit"], second["claim"]) == ("1", "1")
    assert int(second["pollId"]) > int(first["pollId"])  # a settled poll's id is never sent again
    assert sup.claim_polls == set()  # the poll cut off by the end of the test is closed
    assert sup.last_claim_poll == int(second["pollId"])


async def test_a_lost_claiming_answer_is_asked_again_with_the_same_poll_id(autojump_clock: Any,
                                                                           tmp_path: Path) -> None:
    master = PollMaster(answers=[{"tasks": [task_json("t1", "s1", claimed=True)], "cancelTaskIds": []}],
                        hold_empty=True, features=[CLAIM_IN_POLL], lose_polls=2)

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(4)
        assert list(sup.running) == ["t1"]
        await started(sup, ["t1"])

    await run_poller(master, tmp_path, body)
    ids = [p.params["pollId"] for p in master.polls]
    assert ids[0] == ids[1] == ids[2] != ids[3]  # the master answers the claims of the lost answers again


async def test_a_claimed_task_the_node_cannot_run_is_given_back(autojump_clock: Any, tmp_path: Path) -> None:
    master = PollMaster(answers=[
        {"tasks": [task_json("t1", "s1", claimed=True), task_json("t2", "nodejs", claimed=True)], "cancelTaskIds": []},
    ], hold_empty=True, features=[CLAIM_IN_POLL])

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(2)
        assert master.releases == ["t2"]  # given back before the poll's id was settled
        assert master.polls[1].params["excludeSpiderIds"] == "nodejs,s1"

    sup = await run_poller(master, tmp_path, body,
                           cannot_run=lambda task: "node is missing" if task.spider_id == "nodejs" else None)
    assert sup.started == ["t1"]


async def test_a_stop_cuts_the_claiming_poll_off_and_settles_its_id(autojump_clock: Any, tmp_path: Path) -> None:
    master = PollMaster(hold_empty=True, features=[CLAIM_IN_POLL])
    client = MasterClient("http://master.test", "token", register_request, transport=httpx.MockTransport(master))
    sup = HoldingSupervisor(2, tmp_path)
    poller = Poller(client, sup, poll_interval=POLL_INTERVAL, long_poll_wait=LONG_POLL_WAIT, request_timeout=10.0)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run, nursery)
            await master.wait_polls(1)
            poll_id = int(master.polls[0].params["pollId"])
            assert sup.claim_polls == {poll_id}
            poller.stop()  # returns at once: nothing to wait for (the master's reconciliation settles it)
    await client.aclose()
    assert sup.claim_polls == set() and sup.last_claim_poll == poll_id
    assert master.releases == [] and master.results == {}


# ---------------------------------------------------------------------------- pacing


async def test_held_long_poll_is_followed_by_an_immediate_poll(autojump_clock: Any, tmp_path: Path) -> None:
    master = PollMaster(hold_empty=True)

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(4)

    await run_poller(master, tmp_path, body)
    starts = [p.at for p in master.polls]
    assert [b - a for a, b in pairwise(starts)] == [LONG_POLL_WAIT] * 3
    for answered, next_poll in zip(master.answered_at, starts[1:], strict=False):
        assert next_poll == answered  # no poll_interval wait after a held poll


async def test_instant_empty_answer_waits_poll_interval(autojump_clock: Any, tmp_path: Path) -> None:
    master = PollMaster(hold_empty=False)

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(4)

    await run_poller(master, tmp_path, body)
    starts = [p.at for p in master.polls]
    assert [b - a for a, b in pairwise(starts)] == [POLL_INTERVAL] * 3


async def test_without_long_poll_every_empty_answer_waits_poll_interval(autojump_clock: Any,
                                                                        tmp_path: Path) -> None:
    master = PollMaster()

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(3)

    await run_poller(master, tmp_path, body, long_poll_wait=0)
    starts = [p.at for p in master.polls]
    assert [b - a for a, b in pairwise(starts)] == [POLL_INTERVAL] * 2
    assert all("waitSeconds" not in p.params for p in master.polls)


async def test_an_answer_with_tasks_is_followed_by_an_immediate_poll(autojump_clock: Any, tmp_path: Path) -> None:
    master = PollMaster(answers=[{"tasks": [task_json("t1", "s1")], "cancelTaskIds": []}])

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(2)

    await run_poller(master, tmp_path, body)
    assert master.polls[1].at == master.polls[0].at


async def test_held_poll_excluding_a_spider_that_finished_is_asked_again(autojump_clock: Any,
                                                                         tmp_path: Path) -> None:
    # A spider's next task must not wait out a long poll that still excludes the spider (bench.dispatch).
    master = PollMaster(answers=[{"tasks": [task_json("t1", "s1")], "cancelTaskIds": []}], hold_empty=True)

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(2)
        assert master.polls[1].params["excludeSpiderIds"] == "s1"
        await trio.sleep(3)  # the second poll is being held
        released_at = trio.current_time()
        sup.release("t1")
        await master.wait_polls(3)
        assert master.polls[2].at == released_at
        assert "excludeSpiderIds" not in master.polls[2].params
        await master.wait_polls(4)  # an ordinary held poll (nothing excluded) runs its full wait
        assert master.polls[3].at == master.polls[2].at + LONG_POLL_WAIT

    await run_poller(master, tmp_path, body)


async def test_a_held_poll_is_kept_across_a_spider_finishing_with_a_master_that_follows_results(
    autojump_clock: Any, tmp_path: Path
) -> None:
    # poll-follows-results: the master hands the spider's next task out in the held poll once the
    # node's result arrives, so the poll (and its connection) is not abandoned when the spider ends —
    # for FOLLOW_GRACE s: a result that takes longer to arrive must not hold the spider's next task
    # (this master never answers: the poll is abandoned then and sent again, as without the feature).
    master = PollMaster(answers=[{"tasks": [task_json("t1", "s1")], "cancelTaskIds": []}], hold_empty=True,
                        features=[POLL_FOLLOWS_RESULTS])

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(2)
        assert master.polls[1].params["excludeSpiderIds"] == "s1"
        assert master.polls[1].params["runningSpiderIds"] == "s1"
        await trio.sleep(3)
        sup.release("t1")
        released = trio.current_time()
        await master.wait_polls(3)
        assert master.polls[2].at == pytest.approx(released + FOLLOW_GRACE, abs=0.01)  # kept, then abandoned
        assert "runningSpiderIds" not in master.polls[2].params

    await run_poller(master, tmp_path, body)


# ---------------------------------------------------------------------------- claims


async def test_the_claims_of_one_answer_go_out_together(autojump_clock: Any, tmp_path: Path) -> None:
    master = PollMaster(answers=[{"tasks": [task_json("t1", "s1"), task_json("t2", "s2")], "cancelTaskIds": []}],
                        hold_empty=True, claim_delay=1.0)

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(1)
        polled_at = master.polls[0].at
        await master.wait_polls(2)
        assert sorted(sup.running) == ["t1", "t2"]
        assert master.polls[1].at == polled_at + 1.0  # one claim's time, not two in a row
        await started(sup, ["t1", "t2"])

    await run_poller(master, tmp_path, body)


async def test_a_task_claimed_elsewhere_is_not_admitted(autojump_clock: Any, tmp_path: Path) -> None:
    master = PollMaster(
        answers=[{"tasks": [task_json("lost", "s1"), task_json("won", "s2")], "cancelTaskIds": []}],
        claim_status=lambda task_id: 409 if task_id == "lost" else 200,
    )

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(2)
        await trio.sleep(1)
        assert sup.started == ["won"]
        assert set(sup.running) == {"won"}

    sup = await run_poller(master, tmp_path, body)
    assert sup.started == ["won"]
    assert [r["status"] for r in master.results["lost"]] == ["RUNNING"]  # claimed once, no retry
    # The lost task's slot is free again and its spider is not excluded.
    assert master.polls[1].params["limit"] == "2"
    assert master.polls[1].params["excludeSpiderIds"] == "s2"


async def test_every_claim_lost_admits_nothing(autojump_clock: Any, tmp_path: Path) -> None:
    master = PollMaster(answers=[{"tasks": [task_json("t1", "s1")], "cancelTaskIds": []}],
                        claim_status=lambda task_id: 409)

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(3)

    sup = await run_poller(master, tmp_path, body)
    assert sup.started == [] and sup.running == {}
    assert all(p.params["limit"] == "3" and "excludeSpiderIds" not in p.params for p in master.polls)


async def test_a_malformed_task_is_reported_bad_and_the_good_one_runs(autojump_clock: Any, tmp_path: Path) -> None:
    bad = task_json("bad1", "s9", framework="cobol")
    master = PollMaster(answers=[{"tasks": [bad, task_json("good", "s1")], "cancelTaskIds": []}])

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(2)
        await trio.sleep(1)

    sup = await run_poller(master, tmp_path, body)
    assert sup.started == ["good"]
    [report] = master.results["bad1"]
    assert report["status"] == "FAILED" and report["errorCode"] == "BAD_TASK"
    assert "framework" in report["errorMessage"]
    assert report["finishedAt"] and report["durationMs"] == 0


async def test_cancel_ids_in_the_poll_answer_stop_running_tasks(autojump_clock: Any, tmp_path: Path) -> None:
    master = PollMaster(answers=[
        {"tasks": [task_json("t1", "s1")], "cancelTaskIds": []},
        {"tasks": [], "cancelTaskIds": ["t1", "unknown"]},
    ])

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(3)
        assert sup.running["t1"].stop.reason is StopReason.CANCELLED

    await run_poller(master, tmp_path, body)


async def test_a_task_ending_during_the_poll_interval_is_followed_by_an_immediate_poll(
    autojump_clock: Any, tmp_path: Path
) -> None:
    # A cancel arrives in an answer without tasks (the master answers at once): the cancelled task's
    # spider frees a moment later, and its next task must not wait out poll_interval (new-user trial:
    # 3.7 s instead of ~10 ms).
    master = PollMaster(answers=[
        {"tasks": [task_json("t1", "s1")], "cancelTaskIds": []},
        {"tasks": [], "cancelTaskIds": ["t1"]},
        {"tasks": [], "cancelTaskIds": []},
    ])

    async def body(poller: Poller, sup: HoldingSupervisor) -> None:
        await master.wait_polls(3)  # the third answer is empty and immediate: a poll_interval pause starts
        await trio.sleep(1.0)
        released_at = trio.current_time()
        sup.release("t1")  # the cancelled task ends
        await master.wait_polls(4)
        assert master.polls[3].at == released_at
        assert "excludeSpiderIds" not in master.polls[3].params

    await run_poller(master, tmp_path, body, long_poll_wait=0)


@pytest.mark.parametrize("status", [500, 403])
async def test_poll_trouble_is_retried_not_fatal(status: int, autojump_clock: Any, tmp_path: Path) -> None:
    failures = [status, status]
    base = PollMaster(answers=[{"tasks": [task_json("t1", "s1")], "cancelTaskIds": []}])

    async def master(request: httpx.Request) -> httpx.Response:
        if request.url.path == PENDING and failures:
            failures.pop()
            return httpx.Response(status, json={"error": "trouble"})
        return await base(request)

    client = MasterClient("http://master.test", "token", register_request, transport=httpx.MockTransport(master))
    sup = HoldingSupervisor(2, tmp_path)
    poller = Poller(client, sup, poll_interval=POLL_INTERVAL, long_poll_wait=LONG_POLL_WAIT, request_timeout=10.0)
    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run, nursery)
            await base.wait_polls(2)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
    await client.aclose()
    assert sup.started == ["t1"]


# ---------------------------------------------------------------------------- the intake gate


async def test_a_gate_closing_cuts_the_poll_in_flight_and_no_poll_goes_out_until_it_opens(
    autojump_clock: Any, tmp_path: Path
) -> None:
    """Below the master's minimum from the moment the agent learns it: the held poll is cut short (what
    it would claim must not run here) and no poll goes out while the gate is closed."""
    from ckagent.node.intake import IntakeGate

    gate = IntakeGate()
    master = PollMaster(hold_empty=True, features=[CLAIM_IN_POLL])
    client = MasterClient("http://master.test", "token", register_request, transport=httpx.MockTransport(master))
    sup = HoldingSupervisor(2, tmp_path)
    poller = Poller(client, sup, poll_interval=POLL_INTERVAL, long_poll_wait=LONG_POLL_WAIT, request_timeout=10.0,
                    gate=gate)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run, nursery)
            await master.wait_polls(1)
            await trio.sleep(1)
            gate.close("version", "older than the master's minimum")
            await trio.sleep(LONG_POLL_WAIT * 3)
            assert len(master.polls) == 1 and master.answered_at == []  # cut short, and no new poll
            master.answers.append({"tasks": [task_json("t1", "s1", claimed=True)], "cancelTaskIds": []})
            gate.open("version")
            await master.wait_polls(2)
            assert master.polls[1].params["pollId"] == master.polls[0].params["pollId"]  # the cut poll's id again
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
    await client.aclose()
    assert sup.started == ["t1"]
