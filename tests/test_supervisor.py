"""``ckagent supervise``: the pod's PID 1 keeps the agent up, and a crash of the agent loses no crawl.

Against the real reference master, the supervisor runs as PID 1 of a pid namespace of its own
(harness.supervised: ``unshare``, as root and as a plain user) with a real agent: kill -9 of the agent
→ restarted, its running crawls re-adopted and completed exactly once, the orphaned task monitors
reaped (no zombie stays); SIGUSR2 → the agent hands over and the next one re-adopts; SIGTERM →
forwarded, the agent drains, the supervisor exits 0; ``ckagent stop`` (the preStop) → the agent exits
0 and so does the supervisor; an agent refusing its configuration (exit 2) → exit 2; /livez 200 while
the agent restarts, 503 for a wedged one (SIGSTOP) once the start timeout passed; no token in any
process's environ; what the supervisor imports (no Trio, httpx, YAML).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    SupervisedNode,
    eventually,
    marked_pids,
    no_strays,
    process_table,
    submit,
    wait_for_log,
)

from ckagent.pod.supervisor import Backoff

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pid namespaces are Linux's")

WAITER = textwrap.dedent("""
    import json, os, time
    print("ready", flush=True)
    go = os.path.join(os.environ["CK_TASK_DIR"], "go")
    for _ in range(2400):  # bounded: at most two minutes
        if os.path.exists(go):
            break
        time.sleep(0.05)
    with open(os.environ["CK_ITEMS_FILE"], "a") as items:
        items.write(json.dumps({"pid": os.getpid()}) + "\\n")
    print("done", flush=True)
""")
"""Prints ready, waits for the file ``go`` in its task dir, writes one item, exits 0."""


def _task_dir(node: SupervisedNode, task_id: str) -> Path:
    return node.work_dir / "tasks" / task_id


async def _spool_has(node: SupervisedNode, task_id: str, text: str) -> bool:
    try:
        return text in await trio.Path(_task_dir(node, task_id) / "output.log").read_text()
    except FileNotFoundError:
        return False


def _environ(pid: int) -> bytes | None:
    """``/proc/<pid>/environ``, or None when this process may not read it (a non-dumpable owner)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read()
    except PermissionError:
        return None


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(line for line in fh if line.startswith("VmRSS:")).split()[1])


@pytest.mark.slow
async def test_kill_9_of_the_agent_restarts_it_in_place_and_its_crawls_complete_once(dev_master, tmp_path: Path) -> None:
    """PID 1 restarts a killed agent; the next re-adopts both running crawls; the orphaned monitor of
    the first is reaped when it ends; SIGUSR2 restarts in place too; SIGTERM drains and exits 0."""
    admin = dev_master.admin
    node = SupervisedNode(tmp_path / "node", dev_master.base_url, dev_master.registration_token)
    await node.start()
    async with node:
        first = await node.new_agent()
        pid1 = await node.pid1()
        for pid in (pid1, first):  # the token was in the environment of unshare, never in theirs
            environ = await trio.to_thread.run_sync(_environ, pid)
            assert environ is None or dev_master.registration_token.encode() not in environ
            assert environ is None or b"CKAGENT_SECRETS_FD=" in environ
        a = await submit(admin, "crawl-a", {"main.py": WAITER})
        b = await submit(admin, "crawl-b", {"main.py": WAITER})
        for task_id in (a, b):
            await eventually(lambda t=task_id: _spool_has(node, t, "ready"), 60, f"{task_id} ready")
        assert _rss_kib(pid1) < 24 * 1024, _rss_kib(pid1)  # (measured: 17 MB; the agent: 56 MB)

        os.kill(first, signal.SIGKILL)
        second = await node.new_agent(other_than=first)
        table = await node.processes()
        monitors = [pid for pid in await trio.to_thread.run_sync(marked_pids, a) if table.get(pid, (0, ""))[0] == pid1]
        assert monitors, f"crawl a's monitor is an orphan of PID 1 now: {table}"
        for task_id in (a, b):
            await wait_for_log(admin, task_id, "re-adopted after an agent restart", 60)
        (_task_dir(node, a) / "go").touch()
        assert (await admin.wait_task_final(a, 60))["status"] == "SUCCESS"

        async def reaped() -> bool:  # the monitor ended: PID 1 reaped it (no zombie stays)
            rows = await node.processes()
            return not any(pid in rows for pid in monitors) and not [p for p, row in rows.items() if row[1] == "Z"]

        await eventually(reaped, 10, "the orphaned monitor reaped")

        await node.signal(signal.SIGUSR2)  # hand over: the next agent re-adopts crawl b
        third = await node.new_agent(other_than=second)
        await eventually(lambda: _two_notes(admin, b), 60, "crawl b re-adopted again")
        await node.signal(signal.SIGTERM)  # forwarded: the agent drains (crawl b goes on), then exits 0
        await eventually(lambda: _says(node, "SIGTERM forwarded"), 10)
        assert await node.agent_pid() == third
        (_task_dir(node, b) / "go").touch()
        assert await node.wait(90) == 0
    for task_id in (a, b):
        task = await admin.get_task(task_id)
        assert (task["status"], task["exitCode"]) == ("SUCCESS", 0), task
        assert len(task["attempts"]) == 1, task["attempts"]  # never handed back: exactly once
        lines = await admin.get_logs(task_id)
        assert [line for line in lines if line in ("ready", "done")] == ["ready", "done"], lines
        assert len(await admin.get_items(task_id)) == 1
    assert "AGENT_LOST" not in node.log_text()
    assert "ended unasked" in node.log_text() and "handed its crawls over" in node.log_text()


@pytest.mark.slow
async def test_sigterm_between_two_agents_stops_the_crawls_as_asked_not_with_the_pod(dev_master, tmp_path: Path) -> None:
    """SIGTERM to PID 1 while a killed agent's restart is pending and its crawl runs on: PID 1 does not
    exit (that would end the crawl with the pod, its task RUNNING at the master until the node-lost grace)
    but starts the next agent at once, which re-adopts the crawl and then acts on the SIGTERM itself (a
    drain here: the crawl finishes, once); the supervisor exits with the agent's 0 (a new user found it)."""
    admin = dev_master.admin
    node = SupervisedNode(tmp_path / "node", dev_master.base_url, dev_master.registration_token)
    await node.start()
    async with node:
        first = await node.new_agent()
        task_id = await submit(admin, "crawl", {"main.py": WAITER})
        await eventually(lambda: _spool_has(node, task_id, "ready"), 60, "ready")
        os.kill(first, signal.SIGKILL)
        await eventually(lambda: _says(node, "ended unasked"), 10, "the restart pending")
        await node.signal(signal.SIGTERM)  # within the 1 s backoff
        second = await node.new_agent(other_than=first)
        await eventually(lambda: _says(node, "crawls are still running: starting the agent now"), 10)
        await wait_for_log(admin, task_id, "re-adopted after an agent restart", 60)
        await eventually(lambda: _spool_has(node, task_id, "ready"), 10)
        assert await node.agent_pid() == second
        (_task_dir(node, task_id) / "go").touch()
        assert await node.wait(90) == 0, node.log_text()[-3000:]
    task = await admin.get_task(task_id)
    assert (task["status"], len(task["attempts"])) == ("SUCCESS", 1), task
    assert len(await admin.get_items(task_id)) == 1
    assert "draining" in node.log_text(), node.log_text()[-3000:]


def test_the_supervisor_and_the_agent_name_one_stop_at_start_variable() -> None:
    from ckagent.node.stopsignals import STOP_AT_START_ENV, stop_at_start
    from ckagent.pod.supervisor import STOP_AT_START_ENV as SUPERVISOR_ENV

    assert SUPERVISOR_ENV == STOP_AT_START_ENV
    environ = {STOP_AT_START_ENV: "SIGTERM", "PATH": "/bin"}
    assert stop_at_start(environ) == signal.SIGTERM and environ == {"PATH": "/bin"}  # taken out: no spider sees it
    assert stop_at_start({STOP_AT_START_ENV: "SIGKILL"}) is None and stop_at_start({}) is None


async def _two_notes(admin, task_id: str) -> bool:  # type: ignore[no-untyped-def]
    lines = await admin.get_logs(task_id)
    return sum("re-adopted after an agent restart" in line for line in lines) == 2


async def _says(node: SupervisedNode, text: str) -> bool:
    return text in node.log_text()


@pytest.mark.slow
async def test_livez_200_while_the_agent_restarts_and_503_for_a_wedged_one(dev_master, tmp_path: Path) -> None:
    """/livez: ok; 200 through a kill -9 and the restart; 503 for an agent stopped (SIGSTOP) after it
    answered, and for a new one stopped before it answered once --start-timeout passed; signals PID 1
    does not handle leave it running; then `ckagent stop` (the preStop's drain): the agent exits 0, the
    supervisor too."""
    node = SupervisedNode(tmp_path / "node", dev_master.base_url, dev_master.registration_token, start_timeout=20)
    await node.start()
    async with node:
        first = await node.new_agent()

        async def ok() -> bool:
            return await node.livez() == (200, "ok")

        await eventually(ok, 30, "/livez ok")
        assert (await node.livez("/healthz"))[0] == 404
        os.kill(first, signal.SIGKILL)
        answers = []
        with trio.fail_after(30):
            while (answer := await node.livez()) != (200, "ok"):
                answers.append(answer)
                await trio.sleep(0.1)
        assert answers and all(status == 200 and body.startswith("starting: ") for status, body in answers), "\n".join(map(str, answers))
        second = await node.new_agent(other_than=first)
        os.kill(second, signal.SIGSTOP)  # wedged after it answered: 503 from the next probe (≤ 1 + 2 s)

        async def wedged() -> str | None:
            status, body = await node.livez()
            return body if status == 503 else None

        assert (await eventually(wedged, 6, "/livez 503 for a stopped agent")).startswith("wedged: the agent answered")
        os.kill(second, signal.SIGCONT)
        await eventually(ok, 10, "/livez ok again")
        os.kill(second, signal.SIGKILL)
        third = await node.new_agent(other_than=second)
        os.kill(third, signal.SIGSTOP)  # stopped before it answered: starting, until the start timeout
        assert (await node.livez())[0] == 200
        assert "after its (re)start" in await eventually(wedged, 40, "/livez 503 after --start-timeout")
        os.kill(third, signal.SIGCONT)
        await eventually(ok, 20, "/livez ok again")
        for signum in (signal.SIGQUIT, signal.SIGALRM, signal.SIGTRAP, signal.SIGVTALRM, signal.SIGXCPU):
            await node.signal(signum)  # PID 1 never dies of a signal it did not handle (the kernel drops them)
        await eventually(ok, 10, "/livez ok after the signals")
        assert await node.agent_pid() == third
        assert node.process is not None and node.process.returncode is None
        stop = await trio.run_process([sys.executable, "-m", "ckagent", "stop", "-c", str(node.config_path)],
                                      capture_stdout=True, capture_stderr=True, check=False)
        assert stop.returncode == 0, stop.stderr
        assert await node.wait(30) == 0
    assert "stopped by itself (exit code 0)" in node.log_text()


@pytest.mark.slow
async def test_an_agent_that_refuses_its_configuration_ends_the_supervisor_with_2(dev_master, tmp_path: Path) -> None:
    """Exit 2 of the agent (here: an unknown `run` argument) is not restarted: the supervisor exits 2;
    a configuration the supervisor cannot read exits 2 before anything starts."""
    node = SupervisedNode(tmp_path / "node", dev_master.base_url, dev_master.registration_token,
                          agent_args=("--no-such-flag",))
    await node.start()
    async with node:
        assert await node.wait(30) == 2
    assert "refused its configuration or its arguments (exit code 2)" in node.log_text()
    assert node.log_text().count("agent started") == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("agent: [\n")
    with trio.fail_after(30):
        done = await trio.run_process([sys.executable, "-m", "ckagent", "supervise", "-c", str(bad)],
                                      capture_stderr=True, check=False)
    assert done.returncode == 2
    assert b"config error" in done.stderr and b"bad.yaml" in done.stderr, done.stderr


def test_the_supervisor_holds_no_trio_httpx_yaml_nor_settings() -> None:
    """What `ckagent supervise` imports for its life (its settings are read in a forked child)."""
    code = ("import sys, runpy; sys.argv = ['ckagent', 'supervise', '--help']\n"
            "import ckagent.pod.command, ckagent.__main__\n"
            "print(__import__('json').dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, timeout=30)
    modules = set(json.loads(out.stdout))
    heavy = {"trio", "httpx", "yaml", "prometheus_client", "cyclopts", "ckagent.node.config", "ckagent.cli"}
    assert not heavy & modules, heavy & modules


def test_restart_backoff_doubles_from_one_to_thirty_seconds_and_resets_after_a_minute_up() -> None:
    backoff = Backoff()
    assert [backoff.next(lived=2) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.next(lived=60) == 1
    assert backoff.next(lived=5) == 2
