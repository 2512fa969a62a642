"""The poller's side of an ephemeral worker, against a scripted master (httpx.MockTransport) on the autojump
clock: a poll never asks for more than the max-tasks budget leaves and a master's surplus is refused; the
idle stop's soft gate cuts a held poll at once but lets a claim on the wire finish and run (nothing handed
back), and :meth:`Poller.wait_settled` says when the poller holds nothing more."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio
import trio.testing
from harness import HoldingSupervisor, PollMaster, register_request, task_json

from ckagent.master.client import MasterClient
from ckagent.master.protocol import CLAIM_IN_POLL
from ckagent.node.ephemeral import IDLE_KEY
from ckagent.node.intake import IntakeGate
from ckagent.node.taskbudget import TaskBudget
from ckagent.task.poller import Poller


async def _run(master: PollMaster, tmp_path: Path, body: Any, *, budget: int = 0, max_workers: int = 3) -> None:
    """Run a poller (with an intake gate, and a max-tasks budget when ``budget``) while ``body`` runs."""
    client = MasterClient("http://master.test", "token", register_request, transport=httpx.MockTransport(master))
    sup = HoldingSupervisor(max_workers, tmp_path)
    if budget:
        sup.budget = TaskBudget.load(budget, tmp_path)
    gate = IntakeGate()
    poller = Poller(client, sup, poll_interval=5.0, long_poll_wait=20.0, request_timeout=10.0, gate=gate)
    with trio.fail_after(3600):  # virtual seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run, nursery)
            await body(poller, sup, gate)
            nursery.cancel_scope.cancel()
    await client.aclose()


async def test_a_poll_asks_for_no_more_than_the_budget_and_a_surplus_is_given_back(
        autojump_clock: Any, tmp_path: Path) -> None:
    """Budget 2, three free slots: the poll asks (and claims) 2; a master that claims 3 anyway gets the third
    back; the budget is spent, so no poll follows however long the node waits (its slots are free)."""
    master = PollMaster(answers=[{"tasks": [task_json(f"t{i}", f"s{i}", claimed=True) for i in (1, 2, 3)],
                                  "cancelTaskIds": []}], hold_empty=True, features=[CLAIM_IN_POLL])

    async def body(poller: Poller, sup: HoldingSupervisor, gate: IntakeGate) -> None:
        await master.wait_polls(1)
        await trio.testing.wait_all_tasks_blocked()
        assert (master.polls[0].params["limit"], master.polls[0].params["claim"]) == ("2", "2")
        assert sorted(sup.started) == ["t1", "t2"] and master.releases == ["t3"]
        assert sup.budget is not None and sup.budget.spent and sup.free_slots() == 0
        sup.release("t1")
        sup.release("t2")
        await trio.sleep(600)
        assert len(master.polls) == 1

    await _run(master, tmp_path, body, budget=2)
    assert (tmp_path / "max-tasks.json").exists()


async def test_the_soft_gate_lets_a_claim_on_the_wire_finish_and_run(autojump_clock: Any, tmp_path: Path) -> None:
    """The idle timer fires while a claim is on the wire (the master takes 5 s to answer it): the gate closes
    softly, the claim finishes and its task runs (not given back); wait_settled returns then, and no poll
    goes out while the gate stays closed."""
    master = PollMaster(answers=[{"tasks": [task_json("t1", "s1")], "cancelTaskIds": []}], hold_empty=True,
                        claim_delay=5.0)

    async def body(poller: Poller, sup: HoldingSupervisor, gate: IntakeGate) -> None:
        await master.wait_polls(1)
        await trio.sleep(1)
        assert sup.claiming == {"t1"}
        closed_at = trio.current_time()
        gate.close(IDLE_KEY, "idle", soft=True)
        await poller.wait_settled()
        assert trio.current_time() - closed_at == 4  # the claim's answer, not before
        assert sup.started == ["t1"] and master.releases == [] and not sup.claiming
        await trio.sleep(300)
        assert len(master.polls) == 1  # closed: nothing asked for
        gate.open(IDLE_KEY)
        await master.wait_polls(2)

    await _run(master, tmp_path, body)


async def test_the_soft_gate_cuts_a_held_poll_at_once(autojump_clock: Any, tmp_path: Path) -> None:
    """An idle node's held long poll (nothing claimed by it) is cut short the moment the gate closes:
    wait_settled returns at once, nothing was claimed or given back."""
    master = PollMaster(hold_empty=True)

    async def body(poller: Poller, sup: HoldingSupervisor, gate: IntakeGate) -> None:
        await master.wait_polls(1)
        await trio.sleep(3)
        assert poller.polling
        closed_at = trio.current_time()
        gate.close(IDLE_KEY, "idle", soft=True)
        await poller.wait_settled()
        assert trio.current_time() == closed_at and not poller.polling
        assert master.releases == [] and master.results == {}

    await _run(master, tmp_path, body)
