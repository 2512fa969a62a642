"""Graceful shutdown of the agent as a real process: SIGTERM drains, the drain deadline and SIGINT
terminate, the exit is bounded (drain_timeout + kill_grace + flush_timeout + a few seconds) even
with the master down, and what was not delivered is delivered by the next start.

Each test runs ``python -m ckagent run`` (tests/harness ``AgentProcess``) against a real dev master
and signals it; spiders are real processes.
"""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    AgentProcess,
    agent_process,
    alive,
    eventually,
    marked_pids,
    no_strays,
    node_status,
    pids_in,
    submit,
    wait_exit,
    wait_for_log,
    wait_registered,
)

SLACK = 8.0
"""Seconds allowed on top of the documented exit bound: interpreter start/stop, a heartbeat, and a
loaded machine's slow task starts (a fresh checkout's first run — cold bytecode, every file linted
beside the tests — took a 4 s task to 8.9 s, and 4 s of slack was exceeded). Still well short of
the drain deadlines the tests tell apart (30 s)."""

WORKER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)
    print("started", flush=True)
    time.sleep(float(os.environ.get("WORK_SECONDS", "600")))
    child.kill()
    print("done", flush=True)
""")


async def test_sigterm_lets_running_tasks_finish_reports_draining_and_exits_0(dev_master, tmp_path: Path) -> None:
    admin = dev_master.admin
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token, task__drain_timeout=30)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        tasks = [await submit(admin, f"five-seconds-{i}", {"main.py": WORKER}, env={"WORK_SECONDS": "4"})
                 for i in range(2)]
        for task_id in tasks:
            await wait_for_log(admin, task_id, "started")
        agent.signal(signal.SIGTERM)
        signalled = trio.current_time()
        late = await submit(admin, "late", {"main.py": "print('must not run')\n"})
        async def draining() -> bool:
            return await node_status(admin) == "DRAINING"

        await eventually(draining, 10)  # the master sees the node draining
        code = await wait_exit(agent, 30 + 2 + 10 + SLACK)
        elapsed = trio.current_time() - signalled
    assert code == 0, agent.log_text()[-3000:]
    assert elapsed < 4 + SLACK, elapsed  # it left as soon as its tasks were done, not at the deadline
    assert await node_status(admin) == "STOPPED"  # its last heartbeat says so
    for task_id in tasks:
        task = await admin.get_task(task_id)
        assert task["status"] == "SUCCESS", task
        assert "done" in await admin.get_logs(task_id)
    assert (await admin.get_task(late))["status"] == "PENDING"  # nothing claimed while draining


async def test_drain_deadline_terminates_long_tasks_as_cancelled(dev_master, tmp_path: Path) -> None:
    admin = dev_master.admin
    drain, grace, flush = 3.0, 2.0, 10.0
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token,
                          task__drain_timeout=drain, task__kill_grace=grace, task__flush_timeout=flush)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        polite = await submit(admin, "ten-minutes", {"main.py": WORKER})
        stubborn = await submit(admin, "ten-minutes-stubborn", {"main.py": WORKER}, env={"IGNORE_TERM": "1"})
        for task_id in (polite, stubborn):
            await wait_for_log(admin, task_id, "started")
        agent.signal(signal.SIGTERM)
        signalled = trio.current_time()
        code = await wait_exit(agent, drain + grace + flush + SLACK)
        elapsed = trio.current_time() - signalled
    assert code == 0, agent.log_text()[-3000:]
    assert drain <= elapsed <= drain + grace + SLACK, elapsed
    for task_id in (polite, stubborn):
        task = await admin.get_task(task_id)
        assert (task["status"], task["errorCode"], task["errorMessage"]) == (
            "CANCELLED", "CANCELLED", "agent terminating"), task
        lines = await admin.get_logs(task_id)
        assert any("stopped (agent terminating)" in line for line in lines), lines
        assert not [pid for pid in pids_in(lines, "child") if alive(pid)]
        assert marked_pids(task_id) == []
    assert "drain deadline (3 s) passed" in agent.log_text()


async def test_sigint_terminates_at_once(dev_master, tmp_path: Path) -> None:
    admin = dev_master.admin
    grace, flush = 2.0, 10.0
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token,
                          task__drain_timeout=60, task__kill_grace=grace, task__flush_timeout=flush)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "interrupted", {"main.py": WORKER}, env={"IGNORE_TERM": "1"})
        await wait_for_log(admin, task_id, "started")
        agent.signal(signal.SIGINT)
        signalled = trio.current_time()
        code = await wait_exit(agent, grace + flush + SLACK)
        elapsed = trio.current_time() - signalled
    assert code == 0, agent.log_text()[-3000:]
    assert elapsed <= grace + SLACK, elapsed  # no drain period
    task = await admin.get_task(task_id)
    assert (task["status"], task["errorCode"]) == ("CANCELLED", "CANCELLED"), task
    assert marked_pids(task_id) == []


async def test_exit_is_bounded_with_the_master_down_and_the_next_start_delivers(
    dev_master_process, tmp_path: Path
) -> None:
    drain, grace, flush = 1.0, 1.0, 2.0
    base_url = await dev_master_process.start()
    token = dev_master_process.registration_token
    settings = {"task__drain_timeout": drain, "task__kill_grace": grace, "task__flush_timeout": flush}
    agent = agent_process(tmp_path, base_url, token, **settings)
    await agent.start()
    async with agent:
        async with dev_master_process.admin() as admin:
            await wait_registered(admin, agent)
            task_id = await submit(admin, "orphaned-by-the-master", {"main.py": WORKER})
            await wait_for_log(admin, task_id, "started")
        await dev_master_process.kill()
        agent.signal(signal.SIGTERM)
        signalled = trio.current_time()
        code = await wait_exit(agent, drain + grace + flush + SLACK)
        elapsed = trio.current_time() - signalled
    assert code == 0, agent.log_text()[-3000:]
    assert elapsed <= drain + grace + flush + SLACK, elapsed
    assert marked_pids(task_id) == []
    assert "stay in" in agent.log_text() or "leaving unsent data" in agent.log_text()

    # The master comes back (on a new port); the next start delivers the CANCELLED result and the logs.
    base_url = await dev_master_process.start()
    again = agent_process(tmp_path, base_url, token, **settings)
    await again.start()
    async with again:
        async with dev_master_process.admin() as admin:
            with trio.fail_after(30):
                task = await admin.wait_task_final(task_id, 30)
            lines = await admin.get_logs(task_id)
        again.signal(signal.SIGTERM)
        assert await wait_exit(again, drain + grace + flush + SLACK) == 0
    assert (task["status"], task["errorCode"]) == ("CANCELLED", "CANCELLED"), task
    assert "started" in lines and any("stopped (agent terminating)" in line for line in lines), lines
