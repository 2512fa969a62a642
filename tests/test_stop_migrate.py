"""``ckagent stop [--migrate] -c CONFIG`` and ``agent.sigterm`` on a real agent process, real spiders and the
reference master (issue 38, item 5): a migrate stops every task within task.migrate_timeout (their stop
grace cut to what is left) and reports each FAILED/MIGRATED; a plain stop drains as SIGTERM does; SIGTERM
means migrate with agent.sigterm=migrate; no agent on the work dir, and an agent older than the request
file, are said clearly with their exit codes (ckagent.cli.stopagent)."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
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
from harness.stopping import OLD_AGENT, SDK_COUNTER, ckagent_stop, moved_on

from ckagent.node.config import load_settings
from ckagent.node.stoprequest import REQUEST_FILE, NoAgent, StopMode, agent_pid, take_request

SLACK = 8.0
"""Seconds on top of a documented bound: interpreter start and exit, the last heartbeat, a loaded machine."""

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

pytestmark = pytest.mark.slow


async def test_stop_migrate_reports_every_running_task_migrated_within_the_bound(dev_master, tmp_path: Path) -> None:
    """Two spiders, one ignoring SIGTERM, with a 60 s stop grace of their own: `ckagent stop --migrate`
    returns 0 within migrate_timeout + flush + slack, both are FAILED/MIGRATED, their processes gone."""
    admin = dev_master.admin
    migrate, flush = 6.0, 10.0
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token, task__kill_grace=60,
                          task__drain_timeout=120, task__migrate_timeout=migrate, task__flush_timeout=flush)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        polite = await submit(admin, "polite", {"main.py": WORKER})
        stubborn = await submit(admin, "stubborn", {"main.py": WORKER}, env={"IGNORE_TERM": "1"})
        for task_id in (polite, stubborn):
            await wait_for_log(admin, task_id, "started")
        late = await submit(admin, "late", {"main.py": "print('must not run')\n"})
        with trio.fail_after(migrate + flush + 10 + SLACK):
            code, said, seconds = await ckagent_stop(agent.config_path, migrate=True)
        assert code == 0, said + agent.log_text()[-3000:]
        assert await wait_exit(agent, 1) == 0
    assert seconds < migrate + SLACK, (seconds, said)
    assert "to migrate" in said and "exited after" in said, said
    for task_id in (polite, stubborn):
        first = moved_on(await admin.get_task(task_id))  # attempt 2 waits for a node
        assert (first["status"], first["errorCode"]) == ("FAILED", "MIGRATED"), first
        assert first["errorMessage"].startswith("migrated: the spider d"), first  # does not checkpoint / did not persist
        assert first["errorMessage"].endswith("its next attempt restarts from scratch (resume: restart-replace)"), first
        lines = await admin.get_logs(task_id)
        assert not [pid for pid in pids_in(lines, "child") if alive(pid)]
        assert marked_pids(task_id) == []
    assert (await admin.get_task(late))["status"] == "PENDING"  # nothing claimed while migrating
    assert await node_status(admin) == "STOPPED"
    log = agent.log_text()
    assert "SIGTERM with `ckagent stop --migrate`" in log and "migrating: every task stopped" in log, log[-3000:]
    assert not (agent.directory / "data" / REQUEST_FILE).exists()


@pytest.mark.skipif(importlib.util.find_spec("ckagent.task.checkpoints") is None,
                    reason="the agent's checkpoints (loop's ckagent.task.checkpoints) have not landed yet")
async def test_stop_migrate_ships_each_spider_s_checkpoint_and_the_next_attempt_resumes_from_it(
        dev_master, tmp_path: Path) -> None:
    """Two SDK spiders that persist their state: `ckagent stop --migrate` asks each one (`migrating` with
    the seconds left), ships its checkpoint, stops it and reports it MIGRATED naming that checkpoint,
    within the default migrate_timeout; the master's next attempt starts from it, and an agent of another
    node resumes it there (its count goes on, no item twice)."""
    admin = dev_master.admin
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token, task__kill_grace=30,
                          task__checkpoint_interval=0)  # (no periodic checkpoint: the migrate's is the only one)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        tasks = [await submit(admin, f"counter-{i}", {"main.py": SDK_COUNTER}) for i in range(2)]
        for task_id in tasks:
            await wait_for_log(admin, task_id, "started", timeout=60)
            async def some_items(task_id: str = task_id) -> bool:
                return len(await admin.get_items(task_id)) >= 3
            await eventually(some_items, 30, "a few items")
        with trio.fail_after(20 + 10 + 10 + SLACK):
            code, said, seconds = await ckagent_stop(agent.config_path, migrate=True)
        assert code == 0, said + agent.log_text()[-3000:]
    assert seconds < 20 + SLACK, seconds
    for task_id in tasks:
        task = await admin.get_task(task_id)
        first = moved_on(task)
        assert (first["status"], first["errorCode"]) == ("FAILED", "MIGRATED"), first
        assert first["checkpointId"] and first["errorMessage"] == f"migrated: checkpoint {first['checkpointId']} shipped"
        assert (task.get("checkpoint") or {}).get("id") == first["checkpointId"], task
        lines = await admin.get_logs(task_id)
        assert any(line.startswith("migrating: ") and "s left" in line for line in lines), lines
    (tmp_path / "b").mkdir()
    other = agent_process(tmp_path / "b", dev_master.base_url, dev_master.registration_token, agent__name="node-b")
    await other.start()
    async with other:
        await wait_registered(admin, other, "node-b")
        for task_id in tasks:
            async def resumed(task_id: str = task_id) -> list[int]:
                return [int(line.split()[-1]) for line in await admin.get_logs(task_id)
                        if line.startswith("resumed at ") and line != "resumed at 0"]
            [count] = await eventually(resumed, 60, "attempt 2 resumes")
            assert count > 0
            await admin.cancel_task(task_id)
    for task_id in tasks:
        counts = [item["n"] for item in await admin.get_items(task_id)]
        assert counts == list(range(1, len(counts) + 1)), counts  # every count once, none lost


async def test_stop_without_migrate_drains_even_when_sigterm_means_migrate(dev_master, tmp_path: Path) -> None:
    """`ckagent stop` drains (the task finishes SUCCESS) although agent.sigterm says migrate: the request
    file says what is asked."""
    admin = dev_master.admin
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token, agent__sigterm="migrate",
                          task__drain_timeout=30)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "short", {"main.py": WORKER}, env={"WORK_SECONDS": "3"})
        await wait_for_log(admin, task_id, "started")
        with trio.fail_after(30 + 2 + 10 + 10 + SLACK):
            code, said, _seconds = await ckagent_stop(agent.config_path)
        assert code == 0, said + agent.log_text()[-3000:]
    assert (await admin.get_task(task_id))["status"] == "SUCCESS"
    assert "SIGTERM (`ckagent stop`): draining" in agent.log_text()


async def test_sigterm_migrates_with_agent_sigterm_migrate(dev_master, tmp_path: Path) -> None:
    admin = dev_master.admin
    migrate = 4.0
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token, agent__sigterm="migrate",
                          task__migrate_timeout=migrate, task__kill_grace=30)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "long", {"main.py": WORKER}, env={"IGNORE_TERM": "1"})
        await wait_for_log(admin, task_id, "started")
        agent.signal(signal.SIGTERM)
        signalled = trio.current_time()
        assert await wait_exit(agent, migrate + 10 + SLACK) == 0
        elapsed = trio.current_time() - signalled
    assert elapsed < migrate + SLACK, elapsed
    first = moved_on(await admin.get_task(task_id))
    assert (first["status"], first["errorCode"]) == ("FAILED", "MIGRATED"), first
    assert "SIGTERM (agent.sigterm: migrate): migrating" in agent.log_text()


async def test_a_migrate_request_during_a_drain_migrates(dev_master, tmp_path: Path) -> None:
    """A drain (SIGTERM) waiting for a long task, then `ckagent stop --migrate`: the task is migrated and
    the agent leaves within the migrate's bound, not the drain's."""
    admin = dev_master.admin
    migrate = 4.0
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token, task__drain_timeout=120,
                          task__migrate_timeout=migrate)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "long", {"main.py": WORKER})
        await wait_for_log(admin, task_id, "started")
        agent.signal(signal.SIGTERM)

        async def draining() -> bool:
            return await node_status(admin) == "DRAINING"
        await eventually(draining, 10, "the node drains")
        with trio.fail_after(migrate + 10 + 10 + SLACK):
            code, said, seconds = await ckagent_stop(agent.config_path, migrate=True)
        assert code == 0, said + agent.log_text()[-3000:]
    assert seconds < migrate + SLACK, seconds
    first = moved_on(await admin.get_task(task_id))
    assert (first["status"], first["errorCode"]) == ("FAILED", "MIGRATED"), first


async def test_no_agent_on_the_work_dir_is_said_with_exit_code_3(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text(f"task:\n  work_dir: {tmp_path / 'data'}\n")
    with trio.fail_after(30):
        code, said, _seconds = await ckagent_stop(config, migrate=True)
    assert code == 3, said
    assert f"no agent runs on {tmp_path / 'data'}" in said, said
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "agent.lock").write_text("12345\n")  # a stale lock file: nothing holds it
    with trio.fail_after(30):
        code, said, _seconds = await ckagent_stop(config)
    assert code == 3 and "nothing holds its agent.lock" in said, said


async def test_an_agent_older_than_the_request_drains_and_stop_migrate_says_so(tmp_path: Path) -> None:
    """An agent that does not know the request file (it drains on SIGTERM) is stopped, the request is
    cleared, and `ckagent stop --migrate` exits 4 saying it drained."""
    work_dir = tmp_path / "data"
    work_dir.mkdir()
    config = tmp_path / "agent.yaml"
    config.write_text(f"task:\n  work_dir: {work_dir}\n")
    old = await trio.lowlevel.open_process([sys.executable, "-c", OLD_AGENT, str(work_dir)],
                                           stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert old.stdout is not None
        with trio.fail_after(30):
            assert (await old.stdout.receive_some(100)).startswith(b"locked")
            assert await trio.to_thread.run_sync(agent_pid, work_dir) == old.pid  # proven by /proc/locks
            code, said, _seconds = await ckagent_stop(config, migrate=True)
            assert await old.wait() == 0
    finally:
        with trio.move_on_after(5, shield=True):
            old.kill()
            await old.wait()
    assert code == 4, said
    assert "did not take the request" in said, said
    assert not (work_dir / REQUEST_FILE).exists()


def test_a_request_is_taken_only_by_the_agent_it_names(tmp_path: Path) -> None:
    (tmp_path / REQUEST_FILE).write_text('{"mode": "migrate", "pid": 1}')
    assert take_request(tmp_path, pid=2) is None  # another process's (a stale one): SIGTERM means agent.sigterm
    assert not (tmp_path / REQUEST_FILE).exists()  # and it is gone
    (tmp_path / REQUEST_FILE).write_text('{"mode": "migrate", "pid": 7}')
    assert take_request(tmp_path, pid=7) is StopMode.MIGRATE
    (tmp_path / REQUEST_FILE).write_text("not json")
    assert take_request(tmp_path, pid=7) is None
    assert take_request(tmp_path, pid=7) is None  # no file
    with pytest.raises(NoAgent):
        agent_pid(tmp_path)


def test_settings_name_what_sigterm_means() -> None:
    settings = load_settings(None, env={}, require_token=False)
    assert StopMode(settings.agent.sigterm) is StopMode.DRAIN
    assert settings.task.migrate_timeout == 20.0 and settings.task.memory_soft_bytes is None
    assert load_settings(None, env={"AGENT_SIGTERM": "migrate"}, require_token=False).agent.sigterm == "migrate"

