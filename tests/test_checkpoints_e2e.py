"""Checkpoints through a real agent and the reference master, with a spider that answers the control
channel by hand (harness.HAND_ACK_SPIDER: no SDK) — at the strongest containment level here and at the
process-group level.

- a running task is asked to persist every ``checkpointIntervalSeconds``; its snapshots are shipped and its
  result names the newest (``checkpointId``), whose items position is where the spider's state stood;
- a task that fails after a checkpoint runs again (its retry policy) from that checkpoint on the same
  node: its state dir restored, its task log saying so, the master holding every item exactly once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    HAND_ACK_SPIDER,
    LEVELS_HERE,
    RecordingMaster,
    agent_settings,
    no_strays,
    running_agent,
    spider_zip,
)

LEVELS = sorted({LEVELS_HERE[0], "process-group"})


async def _spider(admin: Any) -> str:
    spider_id = await admin.create_spider(name="hand-ack", framework="python")
    await admin.upload_package(spider_id, spider_zip({"main.py": HAND_ACK_SPIDER}))
    return str(spider_id)


@pytest.mark.slow  # a real agent and a spider of a few seconds, per level
@pytest.mark.parametrize("level", LEVELS)
async def test_a_running_task_is_checkpointed_every_interval_and_its_result_names_the_newest(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, level: str
) -> None:
    admin = recording_master.admin
    settings = agent_settings(tmp_path / "node", recording_master.base_url, recording_master.registration_token,
                              AGENT_TASK_CONTAINMENT=level)
    spider_id = await _spider(admin)
    async with running_agent(nursery, settings):
        task_id = str(await admin.create_task(spider_id, params={"total": 60, "pace": 0.05},
                                              checkpoint_interval_seconds=0.5))
        final = await admin.wait_task_final(task_id, 120)
        logs = await admin.get_logs(task_id)
        assert final["status"] == "SUCCESS", (final, logs)
        task = await admin.get_task(task_id)
    answered = [line for line in logs if line.startswith("ANSWERED ")]
    assert len(answered) >= 3, logs  # ~3 s of crawl, a request every 0.5 s
    newest = task["checkpoint"]
    assert newest is not None and final.get("checkpointId", task.get("checkpointId")) in (None, newest["id"])
    number = int(newest["id"].split("-")[1])
    assert newest["id"].startswith("1-")
    # The checkpoint's items position is the spider's state at its answer: "ANSWERED N at item K".
    at_item = {int(line.split()[1]): int(line.split()[-1]) for line in answered}
    assert newest["itemSeq"] == at_item[number], (newest, answered)
    assert [item["n"] for item in await admin.get_items(task_id)] == list(range(60))


@pytest.mark.slow  # a real agent, two attempts of a few seconds
@pytest.mark.parametrize("level", LEVELS)
async def test_a_failed_attempt_resumes_from_its_checkpoint_with_every_item_once(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, level: str
) -> None:
    admin = recording_master.admin
    settings = agent_settings(tmp_path / "node", recording_master.base_url, recording_master.registration_token,
                              AGENT_TASK_CONTAINMENT=level)
    spider_id = await _spider(admin)
    async with running_agent(nursery, settings):
        task_id = str(await admin.create_task(
            spider_id, params={"total": 80, "pace": 0.05, "fail_at": 30, "answered": 2, "linger": 2},
            checkpoint_interval_seconds=0.5, retry={"maxAttempts": 2, "on": ["spider"], "backoffSeconds": 0}))
        final = await admin.wait_task_final(task_id, 180)
        logs = await admin.get_logs(task_id)
        assert final["status"] == "SUCCESS", (final, logs)
        task = await admin.get_task(task_id)
    starts = [line.split() for line in logs if line.startswith("START ")]
    assert [(s[1], s[2]) for s in starts][0] == ("0", "1"), logs
    resumed_at = int(starts[1][1])
    assert starts[1][2] == "2" and 0 < resumed_at <= 40, starts
    [said] = [line for line in logs if "attempt 2: resuming from checkpoint 1-" in line]
    assert f"of attempt 1 (items 0–{resumed_at - 1} kept)" in said, said
    assert [a.get("attempt") for a in task.get("attempts", [])][:2] == [1, 2], task
    items = [item["n"] for item in await admin.get_items(task_id)]
    assert items == list(range(80)), json.dumps(items)
