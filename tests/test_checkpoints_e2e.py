"""Checkpoints through a real agent and the reference master, with a spider that answers the control
channel by hand (harness.HAND_ACK_SPIDER: no SDK) — at the strongest containment level here and at the
process-group level.

- a running task is asked to persist every ``checkpointIntervalSeconds``; its snapshots are shipped and its
  result names the newest (``checkpointId``), whose items position is where the spider's state stood;
- a task re-adopted after a kill -9 of its agent goes on being checkpointed (its requests numbered on, an
  answer or upload the dead agent left finished or skipped), its items exactly once;
- a task that fails after a checkpoint runs again (its retry policy) from that checkpoint on the same
  node: its state dir restored, its task log saying so, the master holding every item exactly once.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    HAND_ACK_SPIDER,
    LEVELS_HERE,
    RecordingMaster,
    agent_process,
    agent_settings,
    eventually,
    no_strays,
    running_agent,
    spider_zip,
    submit,
    wait_exit,
    wait_registered,
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
    assert (starts[0][1], starts[0][2]) == ("0", "1"), logs
    resumed_at = int(starts[1][1])
    assert starts[1][2] == "2" and 0 < resumed_at <= 40, starts
    [said] = [line for line in logs if "attempt 2: resuming from checkpoint 1-" in line]
    assert f"of attempt 1 (items 0–{resumed_at - 1} kept)" in said, said
    assert [a.get("attempt") for a in task.get("attempts", [])][:2] == [1, 2], task
    items = [item["n"] for item in await admin.get_items(task_id)]
    assert items == list(range(80)), json.dumps(items)


def _output(tmp_path: Path, task_id: str) -> Path:
    return tmp_path / "node" / "data" / "tasks" / task_id / "output.log"


async def _answered(tmp_path: Path, task_id: str) -> list[int]:
    try:
        text = await trio.Path(_output(tmp_path, task_id)).read_text()
    except FileNotFoundError:
        return []
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("ANSWERED ")]


@pytest.mark.slow  # a real agent process killed and started again around a spider of ~10 s
@pytest.mark.parametrize("level", LEVELS)
async def test_a_readopted_task_keeps_its_checkpoints_going(
    recording_master: RecordingMaster, tmp_path: Path, level: str
) -> None:
    admin = recording_master.admin
    agent = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token,
                          task__containment=level)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "hand-ack", {"main.py": HAND_ACK_SPIDER}, params={"total": 200, "pace": 0.05},
                               checkpoint_interval_seconds=0.5)

        async def answered_three() -> bool:
            return len(await _answered(tmp_path, task_id)) >= 3

        await eventually(answered_three, 60, "three answers")
        await agent.kill()  # kill -9 between two requests, or with one answered and not yet queued or shipped
        before = await _answered(tmp_path, task_id)
        await trio.sleep(1)  # the spider crawls on while no agent runs
        await agent.start()
        final = await admin.wait_task_final(task_id, 120)
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 30) == 0
    logs = await admin.get_logs(task_id)
    assert final["status"] == "SUCCESS", (final, logs)
    assert sum("re-adopted after an agent restart" in line for line in logs) == 1
    answered = await _answered(tmp_path, task_id)
    assert answered == sorted(set(answered)) and len(answered) > len(before), (before, answered)  # numbered on
    task = await admin.get_task(task_id)
    newest = task["checkpoint"]
    assert newest is not None and int(newest["id"].split("-")[1]) > max(before), (newest, before)
    assert [item["n"] for item in await admin.get_items(task_id)] == list(range(200))
