"""Tasks outlive the agent: ``kill -9`` of a real agent process, a restart, and the tasks carry on.

At every containment level this machine allows (``task.containment`` forced), against the real
reference master: three tasks streaming lines and items across the crash (every line and item once,
in order, SUCCESS); a task that exits 3 while no agent runs (FAILED/EXIT_NONZERO, exit code 3); a
cancel issued while no agent runs (CANCELLED); a deadline that passes while no agent runs (TIMEOUT).
Then: a task that forks, changes session and clears its environment, re-adopted and cancelled
(nothing left running); the hand-over signal (the next agent re-adopts, the task started once); a
state store of the previous schema (migrated, its tasks delivered) and one of a newer (refused).
"""

from __future__ import annotations

import json
import signal
import sqlite3
import textwrap
import time
from pathlib import Path

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    ESCAPE,
    LEVELS_HERE,
    RecordingMaster,
    agent_process,
    alive,
    eventually,
    marked_pids,
    no_strays,
    pids_in,
    submit,
    wait_exit,
    wait_for_log,
    wait_registered,
)

from ckagent.node.state import SCHEMA_VERSION, StateStore, StateStoreError

LINES = 3000

STREAMER = textwrap.dedent(f"""
    import json, os, time
    items = open(os.environ["CK_ITEMS_FILE"], "a")
    for i in range({LINES}):
        print(f"line {{i}}", flush=True)
        items.write(json.dumps({{"n": i}}) + "\\n")
        items.flush()
        if i % 50 == 0:
            time.sleep(0.05)
""")

WAITER = textwrap.dedent("""
    import os, sys, time
    print("ready", os.getpid(), flush=True)
    go = os.path.join(os.environ["CK_TASK_DIR"], "go")
    for _ in range(1200):  # bounded: at most a minute
        if os.path.exists(go):
            print("exiting 3", flush=True)
            sys.exit(3)
        time.sleep(0.05)
""")

SLEEPER = "import os, time\nprint('ready', os.getpid(), flush=True)\ntime.sleep(600)\n"
ONCE_SLEEPER = ("import os, sys, time\nif os.environ.get('CK_ATTEMPT', '1') != '1':\n    sys.exit(0)\n"
                "print('ready', os.getpid(), flush=True)\ntime.sleep(600)\n")
"""SLEEPER in its first attempt; a later attempt (the master's after a disruption) ends at once."""

ESCAPER = textwrap.dedent("""
    import os, time
""") + ESCAPE + textwrap.dedent("""
    escape("escaped")
    print("main", os.getpid(), flush=True)
    print("ready", flush=True)
    time.sleep(600)
""")


def _spool(tmp_path: Path, task_id: str) -> Path:
    return tmp_path / "node" / "data" / "tasks" / task_id / "output.log"


async def _lines_in(path: Path, text: str) -> bool:
    try:
        return text in await trio.Path(path).read_text()
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("level", LEVELS_HERE)
async def test_kill_9_the_agent_tasks_run_on_and_report_their_true_outcome(
    recording_master: RecordingMaster, tmp_path: Path, level: str
) -> None:
    admin = recording_master.admin
    token = recording_master.registration_token
    agent = agent_process(tmp_path, recording_master.base_url, token, task__containment=level,
                          agent__max_workers=8)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        streams = [await submit(admin, f"stream-{i}", {"main.py": STREAMER}) for i in range(3)]
        waiter = await submit(admin, "exit-3", {"main.py": WAITER})
        cancelled = await submit(admin, "cancel-me", {"main.py": SLEEPER})
        deadline = await submit(admin, "deadline", {"main.py": SLEEPER}, timeout_seconds=6)
        for task_id in (waiter, cancelled, deadline):
            await eventually(lambda t=task_id: _lines_in(_spool(tmp_path, t), "ready"), 30)
        for task_id in streams[1:]:  # every spider started (one still preparing is rightly AGENT_LOST)
            await eventually(lambda t=task_id: _lines_in(_spool(tmp_path, t), "line 0"), 30)
        await eventually(lambda: _lines_in(_spool(tmp_path, streams[0]), "line 300"), 30)
        started = time.time()
        await agent.kill()  # kill -9, mid-flood
        pids = [int(line.split()[1]) for t in (waiter, cancelled, deadline)
                for line in _spool(tmp_path, t).read_text().splitlines() if line.startswith("ready")]
        assert all(alive(pid) for pid in pids), "the spiders outlive the agent"
        await admin.cancel_task(cancelled)  # while no agent runs
        (_spool(tmp_path, waiter).parent / "go").touch()  # exits 3 while no agent runs

        async def exited() -> bool:
            return not alive(pids[0])

        await eventually(exited, 10)
        # Down past the deadline (6 s after the spider started; it started before `started`).
        await trio.sleep(max(0.0, started + 6.5 - time.time()))
        await agent.start()
        finals = {t: await admin.wait_task_final(t, 60) for t in (*streams, waiter, cancelled, deadline)}
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 30) == 0
    for task_id in streams:
        task = finals[task_id]
        assert (task["status"], task["exitCode"]) == ("SUCCESS", 0), task
        lines = await admin.get_logs(task_id)
        assert [line for line in lines if line.startswith("line ")] == [f"line {i}" for i in range(LINES)]
        assert sum("re-adopted after an agent restart" in line for line in lines) == 1, lines[-5:]
        assert [item["n"] for item in await admin.get_items(task_id)] == list(range(LINES))
        assert [status for status, _ in recording_master.finals(task_id)] == [200]
    w = finals[waiter]
    assert (w["status"], w["errorCode"], w["exitCode"]) == ("FAILED", "EXIT_NONZERO", 3), w
    c = finals[cancelled]
    assert (c["status"], c["errorCode"]) == ("CANCELLED", "CANCELLED"), c
    d = finals[deadline]
    assert (d["status"], d["errorCode"]) == ("FAILED", "TIMEOUT"), d
    if level != "process-group":
        assert d.get("cpuSeconds") is not None, d  # resource figures of the adopted task's cgroup
    for task_id in (waiter, cancelled, deadline):
        assert marked_pids(task_id) == []
    assert not [pid for pid in pids if alive(pid)]
    assert "AGENT_LOST" not in agent.log_text()


@pytest.mark.parametrize("level", LEVELS_HERE)
async def test_an_escaped_task_is_re_adopted_then_cancelled_with_nothing_left(
    recording_master: RecordingMaster, tmp_path: Path, level: str
) -> None:
    admin = recording_master.admin
    agent = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token,
                          task__containment=level)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "escaper", {"main.py": ESCAPER})
        await eventually(lambda: _lines_in(_spool(tmp_path, task_id), "ready"), 30)
        await agent.kill()
        written = _spool(tmp_path, task_id).read_text().splitlines()
        pids = [pid for label in ("escaped", "main") for pid in pids_in(written, label)]
        assert len(pids) == 2 and all(alive(pid) for pid in pids), written
        await agent.start()
        await wait_for_log(admin, task_id, "re-adopted after an agent restart", 30)
        assert all(alive(pid) for pid in pids), "re-adopted, not killed"
        await admin.cancel_task(task_id)
        task = await admin.wait_task_final(task_id, 30)
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 30) == 0
    assert (task["status"], task["errorCode"]) == ("CANCELLED", "CANCELLED"), task
    assert not [pid for pid in pids if alive(pid)], "the escaped process was found and killed"
    assert marked_pids(task_id) == []


async def test_the_hand_over_signal_leaves_the_task_to_the_next_agent(
    recording_master: RecordingMaster, tmp_path: Path
) -> None:
    admin = recording_master.admin
    agent = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token)
    spider = "import time\nfor i in range(40):\n    print('tick', i, flush=True)\n    time.sleep(0.1)\n"
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "handed", {"main.py": spider})
        await wait_for_log(admin, task_id, "tick 3", 30)
        agent.signal(signal.SIGUSR2)
        assert await wait_exit(agent, 15) == 0
        assert (await admin.get_task(task_id))["status"] == "RUNNING"
        await agent.start()
        task = await admin.wait_task_final(task_id, 30)
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 30) == 0
    assert (task["status"], task["exitCode"]) == ("SUCCESS", 0), task
    lines = await admin.get_logs(task_id)
    assert [line for line in lines if line.startswith("tick")] == [f"tick {i}" for i in range(40)]
    assert sum(line.startswith("[ckagent") and "running " in line for line in lines) == 1  # started once
    assert "leaving 1 running task(s) to the next agent" in agent.log_text()
    assert "handed over: 1 task(s) left running for the next agent (" in agent.log_text()  # the bounded flush


ENV_HOLDER = textwrap.dedent("""
    import os, sys, time
    print("ready", sys.prefix, flush=True)
    go = os.path.join(os.environ["CK_TASK_DIR"], "go")
    for _ in range(1200):  # bounded: at most a minute
        if os.path.exists(go):
            break
        time.sleep(0.05)
    print("env intact" if os.path.exists(os.path.join(sys.prefix, "pyvenv.cfg")) else "env removed", flush=True)
""")


async def test_a_re_adopted_tasks_environment_is_not_collected_under_it(
    recording_master: RecordingMaster, tmp_path: Path
) -> None:
    """Environments over the budget are collected least recently used first, never one in use: a
    re-adopted spider's environment counts as in use at the next agent too."""
    admin = recording_master.admin
    agent = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token,
                          deps__env_budget_bytes=1)  # every environment but those in use is over it
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        holder = await submit(admin, "env-holder", {"main.py": ENV_HOLDER})
        await eventually(lambda: _lines_in(_spool(tmp_path, holder), "ready"), 60)
        [prefix] = [line.split(" ", 1)[1] for line in _spool(tmp_path, holder).read_text().splitlines()
                    if line.startswith("ready ")]
        assert await trio.Path(prefix, "pyvenv.cfg").exists(), prefix
        await agent.kill()
        await agent.start()
        await wait_for_log(admin, holder, "re-adopted", 60)
        # Another key (a UV_ variable enters it): a new environment is built, then collection runs.
        other = await submit(admin, "env-other", {"main.py": "print('other ran')\n"}, env={"UV_NO_CACHE": "1"})
        done = await admin.wait_task_final(other, 60)
        assert done["status"] == "SUCCESS", done
        assert "built Python environment" in agent.log_text().split("re-adopted")[-1]
        assert await trio.Path(prefix, "pyvenv.cfg").exists(), "the re-adopted spider's environment was collected"
        (_spool(tmp_path, holder).parent / "go").touch()
        task = await admin.wait_task_final(holder, 60)
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 30) == 0
    assert (task["status"], task["exitCode"]) == ("SUCCESS", 0), task
    assert "env intact" in await admin.get_logs(holder)


def _previous_store(path: Path, task_dir: Path) -> None:
    """A state store as the previous agent wrote it (schema 1: no handle column, no user_version)."""
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE tasks (task_id TEXT PRIMARY KEY, spider_id TEXT NOT NULL, task_json TEXT NOT NULL,
            task_dir TEXT NOT NULL, pid INTEGER, pgid INTEGER, claimed_at REAL NOT NULL, result_json TEXT,
            result_acked INTEGER NOT NULL DEFAULT 0, finished_at REAL);
        CREATE TABLE streams (task_id TEXT NOT NULL, stream TEXT NOT NULL, acked_seq INTEGER NOT NULL,
            acked_offset INTEGER NOT NULL DEFAULT 0, position TEXT, PRIMARY KEY (task_id, stream));
    """)
    db.execute("INSERT INTO tasks (task_id, spider_id, task_json, task_dir, pid, pgid, claimed_at) "
               "VALUES (?,?,?,?,?,?,?)", ("old-1", "s1", json.dumps({"id": "old-1", "spiderId": "s1"}),
                                          str(task_dir), 999999, 999999, time.time() - 60))
    db.commit()
    db.close()


def test_a_store_of_the_previous_schema_is_migrated_and_a_newer_one_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    _previous_store(path, tmp_path / "tasks" / "old-1")
    store = StateStore(path)
    [record] = store.pending_delivery()
    assert (record.task_id, record.handle, record.pid) == ("old-1", None, 999999)
    store.set_handle("old-1", {"monitor_pid": 1})
    assert store.get("old-1").handle == {"monitor_pid": 1}  # type: ignore[union-attr]
    store.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(StateStoreError, match=r"written by a newer ckagent \(schema 4; this agent reads up to 3\)"):
        StateStore(path)


async def test_a_previous_agents_running_task_is_reported_lost_with_the_reason(
    recording_master: RecordingMaster, tmp_path: Path
) -> None:
    """A task the previous version left running has no handle: killed and AGENT_LOST, saying why."""
    admin = recording_master.admin
    agent = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "old", {"main.py": ONCE_SLEEPER})
        await eventually(lambda: _lines_in(_spool(tmp_path, task_id), "ready"), 30)
        await agent.kill()
        db_path = tmp_path / "node" / "data" / "state.db"
        db = sqlite3.connect(db_path)  # what the previous schema kept of it: no handle
        db.execute("UPDATE tasks SET handle=NULL")
        db.execute("PRAGMA user_version=0")
        db.commit()
        db.close()
        await agent.start()
        task = await admin.wait_task_final(task_id, 30)
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 30) == 0
    first = task["attempts"][0]  # AGENT_LOST is a disruption: the master ran a second attempt at once
    assert (first["status"], first["errorCode"]) == ("FAILED", "AGENT_LOST"), task
    assert "not re-adopted: its spider had not started, or an agent without re-adoption ran it" in \
        first["errorMessage"], task
    assert (task["status"], task["attempt"]) == ("SUCCESS", 2), task
    assert marked_pids(task_id) == []
