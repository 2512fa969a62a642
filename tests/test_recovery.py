"""Crash recovery: ``kill -9`` of the agent (a real process) mid-task, then a restart.

A task whose spider can be proven to be the same is re-adopted (tests/test_adoption.py). This
one cannot: its re-adoption handle is gone from the state store (as a lost or older store would
have it). The restarted agent must, before it polls: kill the orphaned process tree (group members
and escaped, marked processes), ship the logs written up to the crash, and report the task
FAILED/AGENT_LOST exactly once (counted at the master), saying why it was not re-adopted. The agent's own log file must not hold a
secret (registration token, any API key the master issued). AGENT_LOST is a disruption: the master gives
the task a second attempt at once (docs/protocol.md, "Causes and retries"), which this spider ends at once.
"""

from __future__ import annotations

import signal
import sqlite3
import textwrap
from pathlib import Path

import httpx
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    ESCAPE,
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

SPIDER = textwrap.dedent("""
    import os, subprocess, sys, time
    if os.environ.get("CK_ATTEMPT", "1") != "1":
        sys.exit(0)  # the master's second attempt after AGENT_LOST: done at once
    CHILD = ("import os, subprocess, sys, time; "
             "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
             "print('grandchild', g.pid, flush=True); "
             "open(os.path.join(os.environ['CK_TASK_DIR'], 'child.ready'), 'w').close(); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    print("child", child.pid, flush=True)
    while not os.path.exists(os.path.join(os.environ["CK_TASK_DIR"], "child.ready")):
        time.sleep(0.01)
""") + ESCAPE + textwrap.dedent("""
    escape("escaped")
    for i in range(200):
        print(f"line {i}", flush=True)
    print("main", os.getpid(), flush=True)
    print("ready", flush=True)
    time.sleep(600)
""")


async def test_kill_9_mid_task_then_restart_kills_orphans_and_reports_agent_lost_once(
    recording_master: RecordingMaster, tmp_path: Path
) -> None:
    admin = recording_master.admin
    log_file = tmp_path / "agent-own.log"
    agent = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token,
                          logging__file=str(log_file), logging__level="DEBUG")
    await agent.start(extra_env={"AGENT_REGISTRATION_TOKEN": recording_master.registration_token})
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "crashy", {"main.py": SPIDER})
        await wait_for_log(admin, task_id, "child")
        # Kill as soon as the spider is up: part of its output has not been shipped yet (the point).
        spool = tmp_path / "node" / "data" / "tasks" / task_id / "output.log"
        async def ready() -> bool:
            return b"ready" in await trio.Path(spool).read_bytes()

        await eventually(ready)
        await agent.kill()  # kill -9
        written = spool.read_text().splitlines()
        pids = [pid for label in ("child", "grandchild", "escaped", "main") for pid in pids_in(written, label)]
        assert len(pids) == 4, written
        assert all(alive(pid) for pid in pids), "the orphans outlive the crashed agent"
        assert (await admin.get_task(task_id))["status"] == "RUNNING"
        db = sqlite3.connect(tmp_path / "node" / "data" / "state.db")
        db.execute("UPDATE tasks SET handle=NULL")  # nothing proves the orphans are this task's spider
        db.commit()
        db.close()

        await agent.start(extra_env={"AGENT_REGISTRATION_TOKEN": recording_master.registration_token})
        with trio.fail_after(30):
            task = await admin.wait_task_final(task_id, 30)
        await trio.sleep(1.5)  # a heartbeat later: still exactly one final result
        # the lost task counts as finished in the restarted agent's metrics
        [node] = [n for n in await admin.list_nodes() if n.get("status") != "OFFLINE"] or await admin.list_nodes()
        async with httpx.AsyncClient(timeout=5) as client:
            metrics = (await client.get(f"http://127.0.0.1:{node['port']}/metrics")).text
        assert 'ckagent_tasks_finished_total{error_code="AGENT_LOST",status="FAILED"} 1.0' in metrics
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 20) == 0
    first = task["attempts"][0]
    assert (first["status"], first["errorCode"], first["causeClass"]) == ("FAILED", "AGENT_LOST", "disruption"), task
    assert task["status"] == "SUCCESS" and task["attempt"] == 2, task  # the disruption's new attempt
    finals = recording_master.finals(task_id)
    assert [(status, body.get("errorCode")) for status, body in finals] == [(200, "AGENT_LOST"), (200, None)]
    assert not [pid for pid in pids if alive(pid)]
    assert marked_pids(task_id) == []
    lines = await admin.get_logs(task_id)
    assert [line for line in lines if line.startswith("line ")] == [f"line {i}" for i in range(200)]
    assert "ready" in lines
    # the four the spider printed and its monitor (ckagent.containment.monitor)
    assert any("on restart it killed 5 leftover process(es); task FAILED (AGENT_LOST): not re-adopted" in line
               for line in lines), lines[-3:]

    own_log = log_file.read_text()
    assert "AGENT_LOST" in own_log and task_id in own_log  # the file is the agent's log
    secrets = [recording_master.registration_token, *recording_master.recorder.api_keys]
    assert len(recording_master.recorder.api_keys) == 2  # registered twice
    for secret in secrets:
        assert secret not in own_log
        assert secret not in agent.log_text()
