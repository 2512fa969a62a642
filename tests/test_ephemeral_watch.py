"""The ephemeral worker's rules on the autojump clock (ckagent.node.ephemeral, ckagent.node.taskbudget):
when the idle timer starts, what restarts it, a claim racing its firing, the max-tasks budget on disk,
and the soft intake gate. Real agents: tests/test_ephemeral.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from harness.ephemeral import FakeNode

from ckagent.master.protocol import Task
from ckagent.node.ephemeral import BUDGET_KEY, EXIT_UNDELIVERED, IDLE_KEY, EphemeralWatch
from ckagent.node.intake import IntakeGate
from ckagent.node.taskbudget import BUDGET_FILE, TaskBudget
from ckagent.task.admission import Admission
from ckagent.task.lifespan import end_of_life


async def test_an_idle_agent_stops_after_exactly_the_idle_seconds(autojump_clock: trio.abc.Clock) -> None:
    node = FakeNode()
    watch = EphemeralWatch(node.gate, node.activity(), node.stop, exit_when_idle=60, budget=None)
    started = trio.current_time()
    with trio.fail_after(600):
        await watch.run()
    assert trio.current_time() - started == pytest.approx(60)
    assert node.stopped == ["exit-when-idle: idle 60 s"] and watch.reason == "exit-when-idle: idle 60 s"
    assert node.gate.is_closed(IDLE_KEY) and node.gate.refusal is None  # soft: an answer in hand still runs
    assert watch.to_json() == {"exitWhenIdleSeconds": 60, "maxTasks": None, "tasksClaimed": None,
                               "stopReason": "exit-when-idle: idle 60 s"}


async def test_a_task_and_its_delivery_restart_the_idle_timer(autojump_clock: trio.abc.Clock) -> None:
    """Idle 10 s: a task runs from t=5 to t=8, its results are delivered until t=12: the agent stops at 22."""
    node = FakeNode()
    watch = EphemeralWatch(node.gate, node.activity(), node.stop, exit_when_idle=10, budget=None)
    stopped_at: list[float] = []

    async def watching() -> None:
        await watch.run()
        stopped_at.append(trio.current_time())

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watching)
        await trio.sleep(5)
        node.set(running=True)
        await trio.sleep(3)
        node.set(running=False, delivering=True)  # the task ended; its results are on their way
        await trio.sleep(4)
        assert not node.stopped
        node.set(delivering=False)
    assert stopped_at == [pytest.approx(start + 22)]


async def test_a_claim_at_the_instant_the_timer_fires_keeps_the_agent(autojump_clock: trio.abc.Clock) -> None:
    """The poller holds an answer when the timer fires: the gate is closed first, the answer settled (the task
    admitted: nothing handed back), the agent goes on with the gate open; idle again, it stops later."""
    node = FakeNode()
    node.answer_in_hand = True  # settled() admits it
    watch = EphemeralWatch(node.gate, node.activity(), node.stop, exit_when_idle=5, budget=None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await trio.sleep(5.5)  # fired at 5: the gate closed, the claim settled, the gate opened again
        assert node.settle_calls == 1 and not node.stopped
        assert node.gate.reason is None and node.closed_while_settling == [IDLE_KEY]
        node.set(running=False)  # the task ends (delivered at once)
    assert node.stopped == ["exit-when-idle: idle 5 s"]
    assert node.settle_calls == 2


async def test_the_budget_closes_the_gate_at_the_nth_claim_and_stops_once_it_is_done(
        autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    node = FakeNode()
    budget = TaskBudget.load(2, tmp_path)
    watch = EphemeralWatch(node.gate, node.activity(), node.stop, exit_when_idle=0, budget=budget)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        budget.take("t1")
        node.set(running=True)
        await trio.sleep(1)
        assert node.gate.reason is None
        budget.take("t2")
        node.set(running=True)
        await trio.sleep(1)
        assert node.gate.is_closed(BUDGET_KEY) and node.gate.refusal is not None  # hard: nothing more runs
        assert not node.stopped
        node.set(running=False, delivering=True)  # the budget's stop does not wait for delivery: the flush does
    assert node.stopped == ["max-tasks: 2 of 2 done"]
    assert watch.to_json()["tasksClaimed"] == 2


async def test_a_restart_with_the_budget_spent_stops_at_once(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    TaskBudget.load(1, tmp_path).take("t1")
    node = FakeNode()
    watch = EphemeralWatch(node.gate, node.activity(), node.stop, exit_when_idle=60,
                           budget=TaskBudget.load(1, tmp_path))
    start = trio.current_time()
    await watch.run()
    assert trio.current_time() == start and node.stopped == ["max-tasks: 1 of 1 done"]


def test_the_budget_is_kept_on_disk_until_the_life_ends(tmp_path: Path) -> None:
    budget = TaskBudget.load(2, tmp_path)
    assert (budget.left, budget.spent, (tmp_path / BUDGET_FILE).exists()) == (2, False, False)
    budget.take("a")
    budget.take("a")  # counted once
    assert json.loads((tmp_path / BUDGET_FILE).read_text())["claimed"] == ["a"]
    again = TaskBudget.load(2, tmp_path)  # a restart (kill -9): the count goes on
    assert (again.claimed, again.left) == (["a"], 1)
    again.take("b")
    assert TaskBudget.load(2, tmp_path).spent
    again.end_life()
    assert TaskBudget.load(2, tmp_path).left == 2
    (tmp_path / BUDGET_FILE).write_text("{not json")
    assert TaskBudget.load(2, tmp_path).left == 2  # said in the log, counted from 0
    with pytest.raises(ValueError):
        TaskBudget(0, tmp_path / BUDGET_FILE, [])


def _task(task_id: str) -> Task:
    return Task.from_json({"id": task_id, "spiderId": f"s-{task_id}", "framework": "python"})


def test_admissions_count_against_the_budget_but_adoptions_do_not(tmp_path: Path) -> None:
    admission = Admission(max_workers=4)
    admission.budget = TaskBudget.load(2, tmp_path)
    assert admission.free_slots() == 2  # the poll asks for no more than the budget allows
    admission.admit(_task("adopted"), adopted=True)  # an earlier agent's (counted when it was claimed, if at all)
    assert admission.free_slots() == 2
    admission.claim_started("c1")
    assert admission.free_slots() == 1  # a claim on the wire holds its share
    admission.admit(_task("c1"))
    admission.claim_ended("c1")
    assert admission.free_slots() == 1 and admission.budget.claimed == ["c1"]
    admission.admit(_task("c2"))
    assert admission.free_slots() == 0 and admission.budget.spent
    admission.task_left("c1")
    admission.task_left("c2")
    assert admission.free_slots() == 0  # slots free, budget spent


def test_a_soft_cause_stops_polls_but_refuses_no_answer_in_hand() -> None:
    gate = IntakeGate()
    cut = trio.CancelScope()
    with gate.cancel_on_close(cut):
        gate.close(IDLE_KEY, "idle", soft=True)
    assert cut.cancel_called and gate.reason == "idle" and gate.refusal is None
    gate.close("disk", "disk low")
    assert gate.refusal == "disk low" and gate.reason == "idle; disk low"
    gate.open("disk")
    gate.open(IDLE_KEY)
    assert gate.reason is None and gate.refusal is None
    gate.close(IDLE_KEY, "now hard")  # closing again without soft makes the cause hard
    assert gate.refusal == "now hard"


async def test_the_exit_code_and_the_end_of_the_life(tmp_path: Path) -> None:
    """end_of_life: 3 after an ephemeral stop with results undelivered (the count kept for the next start);
    a hand-over keeps the count; any other clean stop removes it — also an agent's without max_tasks, so a
    count a crashed life left never carries over into a later one."""
    node = FakeNode()
    budget = TaskBudget.load(1, tmp_path)
    budget.take("t1")
    watch = EphemeralWatch(node.gate, node.activity(), node.stop, exit_when_idle=0, budget=budget)
    await watch.run()
    assert await end_of_life(watch, tmp_path, undelivered=1, handed_over=False) == EXIT_UNDELIVERED
    assert (tmp_path / BUDGET_FILE).exists()
    assert await end_of_life(None, tmp_path, undelivered=0, handed_over=True) == 0
    assert (tmp_path / BUDGET_FILE).exists()
    assert await end_of_life(None, tmp_path, undelivered=1, handed_over=False) == 0  # (not an ephemeral stop)
    assert not (tmp_path / BUDGET_FILE).exists()
