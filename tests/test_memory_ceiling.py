"""The soft memory ceiling (issue 38, item 6) on a real agent, a real spider with a bounded leak (it
allocates up to a fixed size, then stops growing) and the reference master: the task is stopped
FAILED/MEMORY_LIMIT with a message naming the ceiling and the figure, at the cgroup level the node gives
(v1 or v2) and at the process-group level; the node default applies to a task that names none; an idle
node's watch does not wake up."""

from __future__ import annotations

import importlib.util
import os
import textwrap
from pathlib import Path

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    agent_settings,
    eventually,
    marked_pids,
    no_strays,
    running_agent,
    submit,
    wait_for_log,
)

from ckagent.task.memwatch import SoftMemoryWatch

MiB = 1024 * 1024

LEAK = textwrap.dedent("""
    # A bounded leak: 8 MiB more every 0.5 s (pages written, so resident) up to LEAK_BYTES, then it
    # holds them and waits — it never grows past that.
    import os, time
    print("started", flush=True)
    held, target = [], int(os.environ["LEAK_BYTES"])
    while len(held) * (8 << 20) < target:
        held.append(b"\\x01" * (8 << 20))
        time.sleep(0.5)  # 10 s to its end: the watch (every 2 s) and a persist request first fit before
    print("holding", len(held) * 8, "MiB", flush=True)
    time.sleep(600)
""")

SDK_LEAK = textwrap.dedent("""
    # The bounded leak of a spider that persists its state with the SDK (a counter of the MiB it holds).
    import os, time
    import crawlerkeeper_sdk as ck
    state = ck.load_state({"mib": 0})
    ck.on_persist(lambda: dict(state))
    print("started", flush=True)
    held, target = [], int(os.environ["LEAK_BYTES"])
    while len(held) * (8 << 20) < target:
        held.append(b"\\x01" * (8 << 20))
        state["mib"] = len(held) * 8
        time.sleep(0.25)
    print("holding", state["mib"], "MiB", flush=True)
    time.sleep(600)
""")

pytestmark = pytest.mark.slow


async def _run_leak(dev_master, tmp_path: Path, containment: str, *, own: int | None,
                    node_default: int | None, spider: str = LEAK) -> dict:
    admin = dev_master.admin
    env = {"AGENT_TASK_CONTAINMENT": containment, "AGENT_TASK_MIGRATE_TIMEOUT": "5"}
    if node_default is not None:
        env["AGENT_TASK_MEMORY_SOFT_BYTES"] = str(node_default)
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token, **env)
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery, running_agent(nursery, settings) as agent:
            resources = {"memorySoftBytes": own} if own is not None else None
            task_id = await submit(admin, f"leak-{containment}", {"main.py": spider}, env={"LEAK_BYTES": str(160 * MiB)},
                                   resources=resources)
            await wait_for_log(admin, task_id, "started", timeout=60)
            async def ended() -> dict | None:  # (attempt 1's end: a resumable one may start attempt 2)
                task = await admin.get_task(task_id)
                first = (task.get("attempts") or [{}])[0]
                return task if task["status"] not in ("PENDING", "RUNNING") or first.get("errorCode") else None
            task = await eventually(ended, 60, "the task ends")
            assert agent.supervisor is not None and agent.supervisor.memory_watch.samples >= 1
    assert marked_pids(task_id) == []
    task["log"] = await admin.get_logs(task_id)
    return task


@pytest.mark.parametrize("containment", ["auto", "process-group"])
async def test_a_task_over_its_soft_ceiling_stops_memory_limit(dev_master, tmp_path: Path, containment: str) -> None:
    task = await _run_leak(dev_master, tmp_path, containment, own=64 * MiB, node_default=None)
    assert (task["status"], task["errorCode"]) == ("FAILED", "MEMORY_LIMIT"), task
    message = task["errorMessage"]
    assert message.startswith("over its soft memory ceiling: ") and "> 64 MiB (resources.memorySoftBytes)" in message
    # "auto" is a cgroup level as root here; a plain user gets the process-group level (no cgroup rights)
    rss, working_set = "its processes' RSS summed", "the cgroup's working set"
    figures = {rss} if containment == "process-group" else {working_set} if os.geteuid() == 0 else {rss, working_set}
    assert any(figure in message for figure in figures), message
    assert message.endswith("its next attempt restarts from scratch (resume: restart-replace)"), message  # (no SDK)
    assert not any("holding" in line for line in task["log"]), "stopped before the leak reached its end"


async def test_the_node_default_ceiling_applies_to_a_task_that_names_none(dev_master, tmp_path: Path) -> None:
    task = await _run_leak(dev_master, tmp_path, "process-group", own=None, node_default=48 * MiB)
    assert (task["status"], task["errorCode"]) == ("FAILED", "MEMORY_LIMIT"), task
    assert "> 48 MiB (task.memory_soft_bytes)" in task["errorMessage"], task


async def test_the_watch_sleeps_while_no_task_has_a_ceiling(autojump_clock: object) -> None:
    """No task: the watch waits for an admission (no sample, no wake-up), however long the node idles."""
    from ckagent.task.admission import Admission

    admission = Admission(2)
    watch = SoftMemoryWatch(admission, node_default=None, bound=5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await trio.sleep(3600)
        assert watch.samples == 0
        nursery.cancel_scope.cancel()


@pytest.mark.skipif(importlib.util.find_spec("ckagent.task.checkpoints") is None,
                    reason="the agent's checkpoints (loop's ckagent.task.checkpoints) have not landed yet")
async def test_a_spider_that_persists_is_checkpointed_before_its_memory_stop(dev_master, tmp_path: Path) -> None:
    task = await _run_leak(dev_master, tmp_path, "auto", own=64 * MiB, node_default=None, spider=SDK_LEAK)
    first = task["attempts"][0]
    assert (first["status"], first["errorCode"], first["causeClass"]) == ("FAILED", "MEMORY_LIMIT", "resource"), first
    assert first["checkpointId"] and first["errorMessage"].endswith(f": checkpoint {first['checkpointId']} shipped")
    assert first["retryable"] is True
