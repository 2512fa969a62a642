"""Every result the agent sends says its attempt, why it ended and whether it may run again
(docs/protocol.md, "Causes and retries"): the final results of ckagent.task.outcome, the AGENT_LOST
of a restart (ckagent.task.recovery), a BAD_TASK and the claim (ckagent.task.poller)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from harness import HoldingSupervisor, PollMaster, register_request, task_json

from ckagent.master.client import MasterClient
from ckagent.master.protocol import ERROR_CODES, OUTCOME_STATUS, CauseClass, Task, TaskResult, cause_of
from ckagent.node.state import AsyncStateStore, StateStore
from ckagent.task.admission import RunningTask
from ckagent.task.outcome import TaskOutcome, cause_fields, task_result
from ckagent.task.poller import Poller
from ckagent.task.recovery import recover_lost_tasks

EXPECTED = {
    "AGENT_LOST": ("disruption", True), "AGENT_ERROR": ("disruption", True), "MIGRATED": ("disruption", True),
    "NODE_LOST": ("disruption", True), "OOM_KILLED": ("resource", True), "MEMORY_LIMIT": ("resource", True),
    "TIMEOUT": ("resource", True), "STALLED": ("resource", True), "DISK_FULL": ("resource", True),
    "EXIT_NONZERO": ("spider", True), "SIGNALED": ("spider", True), "DEPLOY_FAILED": ("setup", True),
    "DEPS_FAILED": ("setup", True), "BAD_TASK": ("setup", False), "CANCELLED": (None, False),
    "LOG_BUDGET": (None, False),
}


def _rt(attempt: int = 3) -> RunningTask:
    return RunningTask(Task(id="t1", spider_id="s1", spider_name="", framework="python", attempt=attempt))


@pytest.mark.parametrize("code", ERROR_CODES)
def test_each_error_codes_result_carries_its_class_and_attempt(code: str) -> None:
    result = task_result(_rt(), TaskOutcome(OUTCOME_STATUS[code], code, "why"), 0.0)
    wire = result.to_json()
    assert (wire.get("causeClass"), wire["retryable"]) == EXPECTED[code]
    assert wire["attempt"] == 3
    assert TaskResult.from_json(wire) == result


def test_a_success_has_no_class_and_is_not_retryable() -> None:
    wire = task_result(_rt(1), TaskOutcome("SUCCESS", exit_code=0), 0.0).to_json()
    assert "causeClass" not in wire and wire["retryable"] is False and wire["attempt"] == 1


def test_a_disk_another_task_filled_is_a_disruption() -> None:
    result = task_result(_rt(), TaskOutcome("FAILED", "DISK_FULL", "x", disk_culprit=False), 0.0)
    assert (result.cause_class, result.retryable) == (CauseClass.DISRUPTION, True)
    assert cause_fields("DISK_FULL") == {"cause_class": CauseClass.RESOURCE, "retryable": True}


def test_the_result_names_the_newest_checkpoint_shipped() -> None:
    rt = _rt()
    assert task_result(rt, TaskOutcome("FAILED", "MIGRATED", "x"), 0.0).checkpoint_id is None
    rt.checkpoints = SimpleNamespace(last=SimpleNamespace(id="3-7"))  # type: ignore[attr-defined]
    assert task_result(rt, TaskOutcome("FAILED", "EXIT_NONZERO", "x"), 0.0).checkpoint_id == "3-7"
    told = TaskOutcome("FAILED", "MEMORY_LIMIT", "x", checkpoint_id="3-8")
    assert task_result(rt, told, 0.0).to_json()["checkpointId"] == "3-8"


async def test_a_task_lost_in_a_restart_is_agent_lost_of_its_attempt_a_disruption(tmp_path: Path) -> None:
    store = AsyncStateStore(await trio.to_thread.run_sync(StateStore, tmp_path / "state.db"))
    (tmp_path / "t1").mkdir()
    (tmp_path / "t0").mkdir()
    await store.add_task("t1", "s1", task_json("t1", "s1", attempt=4), tmp_path / "t1")
    await store.add_task("t0", "s2", task_json("t0", "s2"), tmp_path / "t0")  # an older master's: no attempt
    with trio.fail_after(30):
        await recover_lost_tasks(store)
    for task_id, attempt in (("t1", 4), ("t0", None)):
        record = await store.get(task_id)
        assert record is not None and record.result is not None
        result = TaskResult.from_json(record.result)
        assert (result.error_code, result.attempt) == ("AGENT_LOST", attempt)
        assert (result.cause_class, result.retryable) == cause_of("AGENT_LOST") == (CauseClass.DISRUPTION, True)


async def test_the_claim_and_a_bad_tasks_result_carry_the_attempt(autojump_clock: Any, tmp_path: Path) -> None:
    bad = task_json("bad1", "s9", framework="cobol", attempt=2)
    master = PollMaster(answers=[{"tasks": [bad, task_json("good", "s1", attempt=5)], "cancelTaskIds": []}])
    client = MasterClient("http://master.test", "token", register_request, transport=httpx.MockTransport(master))
    supervisor = HoldingSupervisor(3, tmp_path)
    poller = Poller(client, supervisor, poll_interval=5.0, long_poll_wait=20.0, request_timeout=10.0)
    with trio.fail_after(3600):  # virtual seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poller.run, nursery)
            await master.wait_polls(2)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
    await client.aclose()
    [claim] = master.results["good"]
    assert (claim["status"], claim["attempt"]) == ("RUNNING", 5)
    assert "causeClass" not in claim and "retryable" not in claim
    [report] = master.results["bad1"]
    assert (report["errorCode"], report["attempt"], report["causeClass"], report["retryable"]) == \
        ("BAD_TASK", 2, "setup", False)
