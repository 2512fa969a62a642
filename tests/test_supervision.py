"""Process supervision end to end: real spider processes, the real dev master, an in-process agent.

Timeouts of a tree that ignores SIGTERM, processes that escape the group (setsid, double fork), a
background child holding the stdout pipe, cancellation from the master during the run and during
the dependency install, the spider's environment, and ``task.run_as_user``. "Nothing left" is
checked independently of the agent: by scanning ``/proc/*/environ`` for the task's marker.

Every test runs at each containment level this machine allows (the ``containment_level`` fixture).
The dev master that records final results (``recording_master``) is conftest.py's; the helpers
(``settings_for``, ``alive``, ``marked_pids``, ``no_strays``…) are tests/harness's.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    ESCAPE,
    LEVEL,
    LEVELS_HERE,
    SLOW_BACKEND,
    STRAY_ROOTS,
    RecordingMaster,
    agent_process,
    agent_settings,
    alive,
    eventually,
    marked_pids,
    no_strays,
    node_status,
    package_index,
    pids_in,
    running_agent,
    settings_for,
    spider_writable,
    submit,
    wait_exit,
    wait_for_log,
    wait_for_path,
    wait_registered,
)

from ckagent.master.ids import task_dir as task_dir_of


@pytest.fixture(autouse=True, params=LEVELS_HERE)
def containment_level(request: pytest.FixtureRequest) -> str:
    """Run the test at each containment level this machine allows (settings_for picks it up)."""
    LEVEL["current"] = request.param
    return str(request.param)


SLEEPER = "import time; time.sleep(300)"


# ------------------------------------------------------------------------------ the tests


async def test_timeout_of_a_tree_ignoring_sigterm_ends_at_deadline_plus_grace(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    main = textwrap.dedent("""
        import os, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        CHILD = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                 "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
                 "print('grandchild', g.pid, flush=True); time.sleep(300)")
        child = subprocess.Popen([sys.executable, "-c", CHILD])
        print("child", child.pid, flush=True)
    """) + ESCAPE + textwrap.dedent("""
        escape("escaped")
        print("main", os.getpid(), "ignoring SIGTERM", flush=True)
        while True:
            time.sleep(1)
    """)
    async with running_agent(nursery, settings_for(tmp_path, recording_master)):
        task_id = await submit(recording_master.admin, "stubborn", {"main.py": main}, timeout_seconds=2)
        with trio.fail_after(30):
            task = await recording_master.admin.wait_task_final(task_id, 30)
    assert (task["status"], task["errorCode"], task["errorMessage"]) == ("FAILED", "TIMEOUT", "执行超时"), task
    # deadline 2 s + grace 1 s, then the cleanup (durationMs runs from the spawn to the end of the
    # cleanup): within 2 s more on a loaded machine (4.05 s seen at load 10); a tree the kill missed
    # would run its 600 s
    assert 2000 <= task["durationMs"] <= 5000, task
    lines = await recording_master.admin.get_logs(task_id)
    pids = pids_in(lines, "child") + pids_in(lines, "grandchild") + pids_in(lines, "escaped") + pids_in(lines, "main")
    assert len(pids) == 4, lines
    assert "sent SIGTERM to the main process" in "\n".join(lines)
    ended = [line for line in lines if line]
    assert "] outputs: " in ended[-1], ended[-1]  # the log's very end says what became of the task's files
    last = ended[-2]
    assert re.match(r"\[ckagent \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] timed out after 2 s", last), last
    assert "every process killed at" in last and "task FAILED (TIMEOUT)" in last, last
    assert not [pid for pid in pids if alive(pid)]
    assert marked_pids(task_id) == []


async def test_escaped_child_is_swept_when_the_spider_ends_normally(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    main = "import os, time\n" + ESCAPE + "escape('escaped')\nprint('bye', flush=True)\n"
    async with running_agent(nursery, settings_for(tmp_path, recording_master)):
        task_id = await submit(recording_master.admin, "leaver", {"main.py": main})
        with trio.fail_after(30):
            task = await recording_master.admin.wait_task_final(task_id, 30)
    assert task["status"] == "SUCCESS" and task["exitCode"] == 0, task
    lines = await recording_master.admin.get_logs(task_id)
    [escaped] = pids_in(lines, "escaped")
    assert any("killed 1 leftover process(es)" in line for line in lines), lines
    assert not alive(escaped)
    assert marked_pids(task_id) == []


async def test_background_child_holding_stdout_gets_the_drain_window_then_dies(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    main = textwrap.dedent("""
        import subprocess, sys
        TICKER = "import time\\nwhile True:\\n    print('tick', flush=True)\\n    time.sleep(0.1)"
        child = subprocess.Popen([sys.executable, "-c", TICKER])  # inherits stdout
        print("child", child.pid, flush=True)
        print("main done", flush=True)
    """)
    async with running_agent(nursery, settings_for(tmp_path, recording_master)):
        task_id = await submit(recording_master.admin, "holder", {"main.py": main})
        with trio.fail_after(30):
            task = await recording_master.admin.wait_task_final(task_id, 30)
    assert task["status"] == "SUCCESS", task
    assert task["durationMs"] <= 3500, task  # ~2 s drain window, not until the child ends (300 s)
    lines = await recording_master.admin.get_logs(task_id)
    [child] = pids_in(lines, "child")
    after_main = lines[lines.index("main done"):]
    assert after_main.count("tick") >= 5, lines  # output during the drain window is kept
    assert not alive(child)
    assert marked_pids(task_id) == []


async def test_cancel_from_the_master_during_the_run(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    main = textwrap.dedent(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {SLEEPER!r}])
        print("child", child.pid, flush=True)
    """) + ESCAPE + "escape('escaped')\nprint('started', flush=True)\ntime.sleep(300)\n"
    admin = recording_master.admin
    async with running_agent(nursery, settings_for(tmp_path, recording_master)):
        task_id = await submit(admin, "victim", {"main.py": main})
        lines = await wait_for_log(admin, task_id, "started")
        await admin.cancel_task(task_id)
        await admin.cancel_task(task_id)  # cancel is idempotent
        with trio.fail_after(20):
            task = await admin.wait_task_final(task_id, 20)
        await trio.sleep(1.5)  # a heartbeat and a poll later: no second report
    assert (task["status"], task["errorCode"]) == ("CANCELLED", "CANCELLED"), task
    assert [status for status, body in recording_master.finals(task_id)] == [200]
    assert recording_master.finals(task_id)[0][1]["status"] == "CANCELLED"
    lines = await admin.get_logs(task_id)
    assert any("stopped (cancelled by the master)" in line and "task CANCELLED" in line for line in lines), lines
    for pid in pids_in(lines, "child") + pids_in(lines, "escaped"):
        assert not alive(pid)
    assert marked_pids(task_id) == []


async def test_cancel_from_the_master_during_the_dependency_install(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    # A package whose (offline) build backend hangs, from a package index on 127.0.0.1: uv waits on it
    # for ever. (A package of the project's own tree is never built: installers run as the node's
    # builder, which runs no code of the spider's — ckagent.code.builder.) Its pid file is written by
    # the builder's uid: in a directory every uid may write.
    pid_file = spider_writable(tmp_path / "shared") / "backend.pid"
    slowpkg = {
        "pyproject.toml": textwrap.dedent("""
            [build-system]
            requires = []
            build-backend = "slowbackend"
            backend-path = ["."]
            [project]
            name = "slowpkg"
            version = "0.1"
        """),
        "slowbackend.py": SLOW_BACKEND.format(pid_file=str(pid_file)),
    }
    files = {"main.py": "print('the spider must never start')\n", "requirements.txt": "slowpkg==0.1\n"}
    admin = recording_master.admin
    with package_index(tmp_path / "index", [], [("slowpkg", "0.1", slowpkg)]) as index:
        settings = settings_for(tmp_path, recording_master, AGENT_UV_INDEX_URL=index.url)
        async with running_agent(nursery, settings):
            task_id = await submit(admin, "slow-install", files)
            await wait_for_path(pid_file, timeout=30)
            await trio.sleep(0.1)
            backend = int(pid_file.read_text())
            assert alive(backend)
            assert marked_pids(task_id), "installers carry the task's marker"
            await admin.cancel_task(task_id)
            with trio.fail_after(20):
                task = await admin.wait_task_final(task_id, 20)
            await trio.sleep(1.5)
    assert (task["status"], task["errorCode"]) == ("CANCELLED", "CANCELLED"), task
    assert [status for status, _ in recording_master.finals(task_id)] == [200]
    lines = await admin.get_logs(task_id)
    assert not any("the spider must never start" in line for line in lines)
    assert any("stopped before the spider started: cancelled by the master" in line for line in lines), lines
    assert not alive(backend)
    assert marked_pids(task_id) == []


async def test_spider_environment_holds_no_agent_secret(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent's own environment carries secrets (as it would under systemd or k8s).
    api_key = "preissued-" + uuid.uuid4().hex
    monkeypatch.setenv("AGENT_REGISTRATION_TOKEN", recording_master.registration_token)
    monkeypatch.setenv("AGENT_API_KEY", api_key)
    monkeypatch.setenv("AGENT_SERVER_URL", recording_master.base_url)
    # The spider writes where it may: its own task dir (it may run under a uid of its own).
    main = "import json, os\njson.dump(dict(os.environ), open(os.environ['CK_TASK_DIR'] + '/env.json', 'w'))\n"
    settings = settings_for(tmp_path, recording_master)
    async with running_agent(nursery, settings):
        task_id = await submit(recording_master.admin, "env-dump", {"main.py": main}, env={"MY_SETTING": "42"})
        with trio.fail_after(30):
            task = await recording_master.admin.wait_task_final(task_id, 30)
    assert task["status"] == "SUCCESS", task
    env = json.loads((task_dir_of(settings.task.work_dir, task_id) / "env.json").read_text())
    assert env["CK_TASK_ID"] == task_id and env["MY_SETTING"] == "42"
    secrets = [recording_master.registration_token, recording_master.admin_token, api_key,
               *recording_master.recorder.api_keys]
    assert recording_master.recorder.api_keys, "the agent registered"
    for name, value in env.items():
        assert not name.startswith("AGENT_"), name
        for secret in secrets:
            assert secret not in value, f"{name} carries a secret"
            assert secret not in name


def _can_exec_as(uid: int, gid: int, path: str) -> bool:
    try:
        return subprocess.run([path, "-c", "pass"], user=uid, group=gid, extra_groups=[],
                              capture_output=True, timeout=30).returncode == 0
    except OSError:
        return False


def owner(path: Path) -> int:
    """The uid owning ``path`` (blocking: call through trio.to_thread)."""
    return path.lstat().st_uid


@dataclass
class SpiderUser:
    """A throwaway user and a work dir it can reach (pytest's tmp_path is 0700 root)."""

    name: str
    uid: int
    gid: int
    home: str
    work: Path
    report: Path


@pytest.fixture
def spider_user() -> Any:
    """A throwaway system user with a home directory (root only; removed after the test)."""
    if os.geteuid() != 0:
        pytest.skip(f"task.run_as_user needs the agent to run as root; this test runs as uid {os.geteuid()}")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel not available to create a throwaway user")
    name = "ck" + uuid.uuid4().hex[:10]
    created = subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], capture_output=True, text=True)
    if created.returncode != 0:
        pytest.skip(f"useradd failed: {created.stderr.strip()}")
    work = Path(tempfile.mkdtemp(prefix="ck-run-as-"))
    STRAY_ROOTS.append(work)
    try:
        work.chmod(0o755)
        report = work / "report"
        report.mkdir()
        report.chmod(0o777)
        pw = pwd.getpwnam(name)
        yield SpiderUser(name, pw.pw_uid, pw.pw_gid, pw.pw_dir, work, report)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        subprocess.run(["userdel", "-r", name], capture_output=True)


def run_as_settings(user: SpiderUser, master: RecordingMaster) -> Any:
    """Agent settings with ``task.run_as_user`` and the work dir in the user-reachable directory."""
    # The agent refuses a user that cannot execute the spiders' interpreter: give it the system's then.
    python = {} if _can_exec_as(user.uid, user.gid, sys.executable) else {"AGENT_DEPS_PYTHON": "/usr/bin/python3"}
    return agent_settings(user.work / "agent", master.base_url, master.registration_token,
                          AGENT_TASK_RUN_AS_USER=user.name, AGENT_TASK_KILL_GRACE="1",
                          AGENT_UV_INDEX_URL="http://127.0.0.1:9/simple", **python)


async def test_run_as_user_runs_the_installer_and_the_spider_as_that_user(
    recording_master: RecordingMaster, nursery: trio.Nursery, spider_user: SpiderUser
) -> None:
    user = spider_user
    # A Node spider: `npm install` (the installer) and the spider both run as the user.
    node = textwrap.dedent(f"""
        const fs = require('fs');
        fs.writeFileSync('written-by-spider.txt', 'ok');
        fs.writeFileSync(process.env.CK_TASK_DIR + '/in-task-dir.txt', 'ok');
        fs.writeFileSync({str(user.report / 'node.json')!r}, JSON.stringify({{
          uid: process.getuid(), gid: process.getgid(), groups: process.getgroups(),
          home: process.env.HOME, user: process.env.USER, cwd: process.cwd()}}));
    """)
    admin = recording_master.admin
    async with running_agent(nursery, run_as_settings(user, recording_master)):
        task_id = await submit(admin, "as-user-node", {
            "index.js": node, "package.json": '{"name": "s", "version": "1.0.0", "private": true}',
        }, framework="node")
        with trio.fail_after(60):
            task = await admin.wait_task_final(task_id, 60)
    assert task["status"] == "SUCCESS", (task, await admin.get_logs(task_id))
    seen = json.loads((user.report / "node.json").read_text())
    assert (seen["uid"], seen["gid"]) == (user.uid, user.gid)
    assert 0 not in seen["groups"], "root's supplementary groups are dropped"
    # HOME is the spider's own (not the agent's, not the user's): its tools' files stay per spider.
    assert Path(seen["home"]).parent == user.work / "agent" / "spider-home" and seen["user"] == user.name
    code_dir = Path(seen["cwd"])  # the task's private working copy, given to the user
    assert code_dir.parent == user.work / "agent" / "spiders" / ".runs"
    task_dir = user.work / "agent" / "tasks" / task_id
    # The cached code version stays the agent's: the spider's user cannot change it for later runs.
    [version] = [p for p in (user.work / "agent" / "spiders").glob("*/*") if p.parent.name != ".runs"]
    assert await trio.to_thread.run_sync(owner, version / "index.js") == 0
    locks = await trio.to_thread.run_sync(lambda: list((user.work / "agent").rglob("package-lock.json")))
    assert locks, "npm install wrote a lockfile"
    # npm ran as the user (the node's builder at this level); the finished environment is sealed, root's
    # (ckagent.code.builder), so its files no longer say who built them: the task log does.
    log = "\n".join(await admin.get_logs(task_id))
    assert f"as the node's builder, uid {user.uid} ({user.name})" in log, log
    owned = [task_dir, task_dir / "in-task-dir.txt", Path(seen["home"])]
    for path in owned:
        assert await trio.to_thread.run_sync(owner, path) == user.uid, path


@pytest.fixture
def python_user(spider_user: SpiderUser) -> SpiderUser:
    """``spider_user``, when it can run the agent's interpreter (the spider venvs are built on it)."""
    if not _can_exec_as(spider_user.uid, spider_user.gid, sys.executable):
        pytest.skip(f"the venv is built on the agent's interpreter {sys.executable}, which {spider_user.name} "
                    "cannot execute here (it lives under a private directory); the Node test covers run_as_user")
    return spider_user


async def test_run_as_user_runs_the_python_spider_in_a_sealed_venv(
    recording_master: RecordingMaster, nursery: trio.Nursery, python_user: SpiderUser
) -> None:
    """One-user level: uv ran as the node's builder (the user), the spider runs as the user, and the
    finished venv is sealed — root's, no write bit — so the spider cannot poison it for later tasks."""
    user = python_user
    main = ("import json, os, sys\n"
            "venv = os.environ['VIRTUAL_ENV']\n"
            "try:\n"
            "    open(os.path.join(venv, 'planted.pth'), 'w').write('import os')\n"
            "    wrote = True\n"
            "except OSError:\n"
            "    wrote = False\n"
            f"json.dump({{'uid': os.getuid(), 'venv': venv, 'wrote': wrote, 'exe': sys.executable}}, "
            f"open({str(user.report / 'py.json')!r}, 'w'))\n")
    admin = recording_master.admin
    async with running_agent(nursery, run_as_settings(user, recording_master)):
        task_id = await submit(admin, "as-user-py", {"main.py": main})
        with trio.fail_after(60):
            task = await admin.wait_task_final(task_id, 60)
    logs = await admin.get_logs(task_id)
    assert task["status"] == "SUCCESS", (task, logs)
    seen = json.loads((user.report / "py.json").read_text())
    assert seen["uid"] == user.uid and seen["exe"].startswith(seen["venv"])
    assert not seen["wrote"], "the spider wrote into its sealed environment"
    venv = Path(seen["venv"])
    mode = (await trio.to_thread.run_sync(venv.stat)).st_mode
    assert await trio.to_thread.run_sync(owner, venv) == 0 and not mode & 0o022, oct(mode)


def test_agent_refuses_a_user_that_cannot_execute_the_spiders_interpreter(spider_user: SpiderUser,
                                                                          tmp_path: Path) -> None:
    """The interpreter lies in a directory only root may enter: refused at start, naming the fix."""
    from ckagent.node.preflight import check_users

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "python3").symlink_to("/usr/bin/python3")
    base = dict(AGENT_TASK_RUN_AS_USER=spider_user.name)
    refused = check_users(agent_settings(tmp_path / "a", "http://127.0.0.1:9", "t", **base,
                                         AGENT_DEPS_PYTHON=str(private / "python3")))
    assert len(refused) == 1 and refused[0].error, refused
    text = refused[0].message
    assert f"user {spider_user.name!r} cannot execute the spiders' interpreter {private / 'python3'}" in text
    assert "AGENT_TASK_RUN_AS_USER" in text and "AGENT_DEPS_PYTHON" in text
    assert check_users(agent_settings(tmp_path / "b", "http://127.0.0.1:9", "t", **base,
                                      AGENT_DEPS_PYTHON="/usr/bin/python3")) == []
