"""The agent-side views of attempts and checkpoints: /status's running tasks carry their attempt and last
checkpoint (age, size, items position), the status page's cells say them, and ``ckagent exec``'s summary
says each attempt's cause class and the last checkpoint — with whatever the JSON holds (hostile or
missing fields shown as "—", never an exception).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from harness import task_json

from ckagent.cli.execview import attempt_lines
from ckagent.master.protocol import Task
from ckagent.port.metrics import AgentMetrics
from ckagent.port.status import AgentStatistics, AgentStatus
from ckagent.port.statusrows import attempt_text, cause_text, checkpoint_text
from ckagent.port.taskstats import checkpoint_json, task_statistics
from ckagent.resume.ship import ShippedCheckpoint
from ckagent.task.admission import RunningTask


def running(attempt: int, last: ShippedCheckpoint | None) -> RunningTask:
    rt = RunningTask(task=Task.from_json(task_json("t-7", "s-1", attempt=attempt)), phase="run", pid=4242)
    rt.checkpoints = SimpleNamespace(last=last)
    return rt


async def test_status_shows_each_running_tasks_attempt_and_last_checkpoint() -> None:
    created = datetime.fromtimestamp(time.time() - 42, timezone.utc)
    last = ShippedCheckpoint("2-5", created, 5_460_000, 2_200_000, 450, 1200, "interval")
    tasks = (task_statistics(running(2, last), None), task_statistics(running(1, None), None))
    stats = AgentStatistics(state="RUNNING", name="n", node_id="n1", registered=True, master_up=True,
                            heartbeat_last_success=None, heartbeat_interval=10.0, max_workers=2, free_slots=0,
                            tasks=tasks)
    doc = await AgentStatus(lambda: stats, AgentMetrics("0", "n"), None).status()
    first, second = doc["runningTasks"]
    assert first["attempt"] == 2
    checkpoint = first["checkpoint"]
    assert checkpoint["ageSeconds"] == pytest.approx(42, abs=2)
    assert {k: v for k, v in checkpoint.items() if k != "ageSeconds"} == {
        "id": "2-5", "createdAt": created.strftime("%Y-%m-%dT%H:%M:%S.") + f"{created.microsecond // 1000:03d}Z",
        "sizeBytes": 5_460_000, "packedBytes": 2_200_000, "itemSeq": 450, "logSeq": 1200, "reason": "interval"}
    assert (second["attempt"], second["checkpoint"]) == (1, None)
    assert checkpoint_text(checkpoint) == "2-5, 42 s ago, 5.2 MiB, items 0–449 (interval)"
    assert checkpoint_text(second["checkpoint"]) == "none yet"


def test_the_page_cells_take_whatever_the_json_holds() -> None:
    assert checkpoint_text({"id": "1-1", "ageSeconds": 3700, "sizeBytes": 10, "itemSeq": 0, "reason": "migrate"}) == (
        "1-1, 1 h 1 min ago, 10 B, no items (migrate)")
    assert checkpoint_text({"id": "x", "ageSeconds": "soon", "sizeBytes": None, "itemSeq": -3}) == "x, — ago, —, —"
    assert checkpoint_text(["not", "a", "dict"]) == "none yet"
    assert cause_text({"status": "FAILED", "causeClass": "disruption", "retryable": True}) == "disruption, retryable"
    assert cause_text({"causeClass": "spider", "retryable": False}) == "spider, not retryable"
    assert cause_text({"causeClass": "setup"}) == "setup"
    assert cause_text({"status": "SUCCESS", "causeClass": None}) == cause_text("junk") == "—"
    assert attempt_text(3) == "3" and attempt_text(None) == attempt_text(True) == attempt_text(-1) == "1"
    assert checkpoint_json(None) is None
    assert checkpoint_json((("id", "1-2"), ("created", 100.0)), now=160.0) == {
        "id": "1-2", "createdAt": "1970-01-01T00:01:40.000Z", "ageSeconds": 60.0}


def _attempt(n: int, status: str, code: str | None, cause: str | None, retryable: bool | None) -> dict[str, Any]:
    return {"attempt": n, "status": status, "errorCode": code, "causeClass": cause, "retryable": retryable}


def test_exec_says_each_attempts_cause_and_the_last_checkpoint() -> None:
    task = {"status": "SUCCESS", "attempt": 3, "attempts": [
        _attempt(1, "FAILED", "MIGRATED", "disruption", True), _attempt(2, "FAILED", "EXIT_NONZERO", "spider", True),
        _attempt(3, "SUCCESS", None, None, False)],
        "checkpoint": {"id": "2-9", "ageSeconds": 75, "sizeBytes": 3 << 20, "itemSeq": 900, "reason": "stop"}}
    assert attempt_lines(task) == [
        "[ckagent exec] attempt 1: FAILED (MIGRATED), cause disruption, retryable",
        "[ckagent exec] attempt 2: FAILED (EXIT_NONZERO), cause spider, retryable",
        "[ckagent exec] last checkpoint: 2-9, 1 min 15 s ago, 3.0 MiB, items 0–899 (stop)"]
    failed = {"status": "FAILED", "attempts": [_attempt(1, "FAILED", "BAD_TASK", "setup", False)], "checkpoint": None}
    assert attempt_lines(failed) == ["[ckagent exec] attempt 1, cause: setup, not retryable"]
    assert attempt_lines({"status": "SUCCESS"}) == []  # an older master: nothing to say
    assert attempt_lines({"attempts": "junk", "checkpoint": 7}) == []
