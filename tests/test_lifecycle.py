"""Lifecycle records (ckagent.delivery.lifecycle) on their one channel, the canonical task line they
feed, and the heartbeat's one report in (ckagent.master.heartbeat.NodeReport) and one answer out."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.lowlevel
import trio.testing

from ckagent.delivery.lifecycle import (
    CanonicalLine,
    DepsPrepared,
    Lifecycle,
    Record,
    TaskAdmitted,
    TaskDelivered,
    TaskFinished,
    TaskLost,
    TaskStarted,
)
from ckagent.master.client import MasterClient
from ckagent.master.heartbeat import HeartbeatLoop, NodeReport
from ckagent.master.protocol import HeartbeatResponse, RegisterRequest, TaskResult
from ckagent.node.broadcast import Broadcast
from ckagent.node.resources import HealthSampler

RESULT = TaskResult(status="SUCCESS", duration_ms=1500, item_count=3, log_lines=7)


async def test_records_reach_every_consumer_in_order_and_a_failing_consumer_spoils_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Record] = []

    def broken(record: Record) -> None:
        raise RuntimeError("a consumer's bug")

    lifecycle = Lifecycle([broken, seen.append])
    records: list[Record] = [TaskAdmitted("t1", "s1", 10.0), TaskStarted("t1", 10.0, 12.5),
                             DepsPrepared("t1", 0.25, True), TaskFinished("t1", RESULT),
                             TaskDelivered("t1", "shop", 10.0, RESULT), TaskLost("t0", RESULT)]
    for record in records[:2]:
        lifecycle.emit(record)  # before the reader runs: buffered
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(lifecycle.run)
            for record in records[2:]:
                lifecycle.emit(record)
            await trio.testing.wait_all_tasks_blocked()  # the reader has handed over all
            nursery.cancel_scope.cancel()
    assert seen == records
    assert records[1].queue_wait_seconds == 2.5  # type: ignore[union-attr]
    assert sum("a consumer's bug" in (r.exc_text or "") or "failed on" in r.getMessage()
               for r in caplog.records) == len(records)


async def test_a_full_channel_drops_and_counts_instead_of_blocking_the_task(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Record] = []
    lifecycle = Lifecycle([seen.append], max_buffered=2)
    with caplog.at_level(logging.WARNING, "ckagent.delivery.lifecycle"):
        for n in range(5):  # nobody reads yet: the third record on is dropped, and emit returns at once
            lifecycle.emit(TaskAdmitted(f"t{n}", "s", 0.0))
        assert lifecycle.dropped == 3
        full = [r.getMessage() for r in caplog.records if "channel is full" in r.getMessage()]
        assert len(full) == 1, full  # one warning per episode
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                await nursery.start(lifecycle.run)
                await trio.testing.wait_all_tasks_blocked()  # the reader has handed over all
                lifecycle.emit(TaskAdmitted("t9", "s", 0.0))  # room again: the episode ends, said once
                await trio.testing.wait_all_tasks_blocked()  # the reader has handed over all
                nursery.cancel_scope.cancel()
    assert [r.task_id for r in seen] == ["t0", "t1", "t9"]  # type: ignore[union-attr]
    assert any("caught up; 3 record(s) dropped" in r.getMessage() for r in caplog.records)


async def test_what_is_buffered_when_the_reader_is_cancelled_is_still_handed_over() -> None:
    seen: list[Record] = []
    lifecycle = Lifecycle([seen.append])
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(lifecycle.run)
            lifecycle.emit(TaskDelivered("t1", "shop", 0.0, RESULT))
            lifecycle.emit(TaskDelivered("t2", "shop", 0.0, RESULT))
            nursery.cancel_scope.cancel()  # before the reader ran again
    assert [r.task_id for r in seen] == ["t1", "t2"]  # type: ignore[union-attr]


def test_without_consumers_records_are_discarded_at_once() -> None:
    lifecycle = Lifecycle(max_buffered=1)
    for n in range(3):
        lifecycle.emit(TaskAdmitted(f"t{n}", "s", 0.0))
    assert lifecycle.dropped == 0


def test_the_canonical_line_carries_the_install_figures_of_its_own_task(caplog: pytest.LogCaptureFixture) -> None:
    line = CanonicalLine()
    with caplog.at_level(logging.INFO, "ckagent.delivery.lifecycle"):
        line(DepsPrepared("t1", 2.3456, False))
        line(DepsPrepared("t2", 0.01, True))
        line(TaskFinished("t1", RESULT))  # no line yet: the master has not acknowledged the result
        assert not caplog.records
        line(TaskDelivered("t1", "my shop", 0.0, RESULT))
        line(TaskDelivered("t3", None, 0.0, TaskResult(status="FAILED", error_code="AGENT_LOST")))
    first, second = (r.getMessage() for r in caplog.records)
    assert first == ('task finished task_id=t1 spider="my shop" status=SUCCESS error_code=- exit_code=- '
                     'duration_seconds=1.500 items=3 log_lines=7 install_seconds=2.346 cache_hit=false')
    assert "task_id=t3 spider=- status=FAILED error_code=AGENT_LOST" in second and "install_seconds=-" in second
    assert line.pending == 1  # t2's figures wait for its delivery


def _register_body() -> RegisterRequest:
    return RegisterRequest(name="n1", ip="127.0.0.1", port=9000, version="0", os="linux", arch="x86_64",
                           python="3.11", cpu_count=2, memory_total_bytes=1 << 30, max_workers=2)


async def test_a_heartbeat_sends_the_one_report_and_hands_the_whole_answer_back(tmp_path: Path) -> None:
    beats: list[dict[str, Any]] = []

    async def master(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return httpx.Response(200, json={"nodeId": "node-1", "apiKey": "key-1"})
        assert request.url.path == "/api/nodes/node-1/heartbeat"
        beats.append(json.loads(request.content))
        return httpx.Response(200, json={"cancelTaskIds": ["t2"], "desiredAgentVersion": "9.9"})

    client = MasterClient("http://master.test", "token", _register_body, transport=httpx.MockTransport(master))
    reports = [NodeReport(status="RUNNING", max_workers=4, free_slots=2, running_task_ids=("t2", "t1"),
                          running_spider_ids=("s1",), claiming_task_ids=("t3",), claim_poll_ids=(7,),
                          last_claim_poll_id=7, reporting_task_ids=("t0",), runtimes={"uv": {"version": "1"}},
                          paused_reason="disk full")]
    answers: list[HeartbeatResponse] = []
    loop = HeartbeatLoop(client, HealthSampler(tmp_path), 30.0, report=lambda: reports[-1], on_answer=answers.append)
    try:
        with trio.fail_after(10):
            await client.register()
            assert await loop.beat_once()
            assert await loop.beat_once(NodeReport(status="STOPPED", max_workers=4, free_slots=4,
                                                   reporting_task_ids=("t0", "t1")))
    finally:
        await client.aclose()
    first, last = beats
    assert {k: first[k] for k in ("status", "maxWorkers", "freeSlots", "runningTaskIds", "runningSpiderIds",
                                  "claimingTaskIds", "claimPollIds", "lastClaimPollId", "reportingTaskIds",
                                  "runtimes", "pausedReason")} == {
        "status": "RUNNING", "maxWorkers": 4, "freeSlots": 2, "runningTaskIds": ["t1", "t2"],
        "runningSpiderIds": ["s1"], "claimingTaskIds": ["t3"], "claimPollIds": [7], "lastClaimPollId": 7,
        "reportingTaskIds": ["t0"], "runtimes": {"uv": {"version": "1"}}, "pausedReason": "disk full"}
    assert last["status"] == "STOPPED" and last["reportingTaskIds"] == ["t0", "t1"] and last["runningTaskIds"] == []
    assert [a.cancel_task_ids for a in answers] == [["t2"], ["t2"]]
    assert answers[0].policy.desired_agent_version == "9.9"
    assert loop.beats == 2 and loop.last_success is not None


async def test_a_broadcast_wakes_every_waiter_and_the_next_wait_waits_for_the_next_set() -> None:
    changed = Broadcast()
    woken: list[int] = []

    async def waiter(n: int) -> None:
        await changed.wait()
        woken.append(n)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for n in range(3):
                nursery.start_soon(waiter, n)
            await trio.testing.wait_all_tasks_blocked()
            changed.set()
        assert sorted(woken) == [0, 1, 2] and changed.count == 1
        with trio.move_on_after(0.05) as late:  # a set before the wait is not remembered
            await changed.wait()
        assert late.cancelled_caught
