"""Ephemeral workers as a pod runs them: ``ckagent supervise -- --max-tasks 1 --exit-when-idle S`` as PID 1 of
a pid namespace of its own (harness.supervised), a real agent, the real reference master on 127.0.0.1.

A one-task Job whose agent is killed (-9) while its task runs: the supervisor restarts the agent in place,
the new agent re-adopts the task (counted once, in work_dir/max-tasks.json), claims nothing more although
two tasks wait, and exits 0 once the task is delivered — so the supervisor exits 0 and the Job is done,
having run one task. An idle pod ends by itself.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harness import SupervisedNode, eventually, submit, wait_for_log

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pid namespaces are Linux's")]

WAITER = {"main.py": textwrap.dedent("""
    import os, time
    print("ready", flush=True)
    go = os.path.join(os.environ["CK_TASK_DIR"], "go")
    for _ in range(2400):  # bounded: at most two minutes
        if os.path.exists(go):
            break
        time.sleep(0.05)
    print("done", flush=True)
""")}
QUICK = {"main.py": "print('hello', flush=True)\n"}


async def test_a_one_task_job_killed_mid_task_runs_one_task_and_ends_0(dev_master, tmp_path: Path) -> None:
    admin = dev_master.admin
    node = SupervisedNode(tmp_path / "node", dev_master.base_url, dev_master.registration_token,
                          agent_args=("--max-tasks", "1", "--exit-when-idle", "60"))
    task = await submit(admin, "job", WAITER)
    await node.start()
    async with node:
        first = await node.new_agent()
        await wait_for_log(admin, task, "ready", timeout=60)
        os.kill(first, signal.SIGKILL)
        await node.new_agent(other_than=first)
        await wait_for_log(admin, task, "re-adopted after an agent restart", 60)
        others = [await submit(admin, f"other-{i}", QUICK) for i in range(2)]  # waiting: not for this pod
        (node.work_dir / "tasks" / task / "go").touch()
        assert await node.wait(90) == 0, node.log_text()[-3000:]
    final = await admin.get_task(task)
    assert (final["status"], final["exitCode"]) == ("SUCCESS", 0), final
    assert [(await admin.get_task(t))["status"] for t in others] == ["PENDING", "PENDING"]
    log = node.log_text()
    assert "max-tasks: 1 of 1 task(s) claimed before this start" in log, log[-3000:]
    assert "max-tasks: 1 of 1 done" in log and "stopped by itself (exit code 0)" in log, log[-3000:]
    assert not (node.work_dir / "max-tasks.json").exists()


async def test_an_idle_pod_ends_by_itself(dev_master, tmp_path: Path) -> None:
    admin = dev_master.admin
    node = SupervisedNode(tmp_path / "node", dev_master.base_url, dev_master.registration_token,
                          agent_args=("--exit-when-idle", "2"))

    async def node_is(key: str) -> bool:
        return any(n["name"] == "proc-node" and n.get(key) for n in await admin.list_nodes())

    await node.start()
    async with node:
        await eventually(lambda: node_is("lastHeartbeat"), 60, "the agent registered")
        registered = time.monotonic()
        assert await node.wait(30) == 0, node.log_text()[-3000:]
        seconds = time.monotonic() - registered
    assert await node_is("leftAt")
    assert seconds < 2 + 5, seconds  # (2 s idle from the registration on, the stop, the supervisor's exit)
    assert "exit-when-idle: idle 2 s" in node.log_text()
