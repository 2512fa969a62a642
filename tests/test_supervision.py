"""Process supervision end to end: real spider processes, the real dev master, an in-process agent.

Timeouts of a tree that ignores SIGTERM, processes that escape the group (setsid, double fork), a
background child holding the stdout pipe, cancellation from the master during the run and during
the dependency install, the spider's environment, and ``task.run_as_user``. "Nothing left" is
checked independently of the agent: by scanning ``/proc/*/environ`` for the task's marker.

The ``recording_master`` fixture (a dev master behind an ASGI wrapper that counts the final
results it receives and remembers the API keys it issues) is shared with test_recovery.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import agent_settings, eventually, running_agent, submit
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from ckagent.containment import available_levels
from ckagent.devmaster.app import Notifier, create_app
from ckagent.devmaster.client import AdminClient
from ckagent.devmaster.store import Store

FINAL = ("SUCCESS", "FAILED", "CANCELLED")
_RESULT_PATH = re.compile(r"^/api/tasks/([^/]+)/result$")


# ------------------------------------------------------------------------------ a recording master


class Recorder:
    """ASGI wrapper around the dev master app: final results received per task, API keys issued."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.final_posts: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
        self.api_keys: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        result = _RESULT_PATH.match(path) if scope["type"] == "http" and scope["method"] == "POST" else None
        register = scope["type"] == "http" and path == "/api/nodes/register"
        if result is None and not register:
            await self.app(scope, receive, send)
            return
        messages: list[dict[str, Any]] = []
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        status: list[int] = []
        answer = bytearray()

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                answer.extend(message.get("body", b""))
            await send(message)

        await self.app(scope, replay, capture)
        if result is not None:
            data = json.loads(body or b"{}")
            if data.get("status") in FINAL:
                self.final_posts[result.group(1)].append((status[0], data))
        elif status and status[0] == 200:
            self.api_keys.append(json.loads(bytes(answer))["apiKey"])


@dataclass
class RecordingMaster:
    """A running dev master (in this process) and what it recorded."""

    base_url: str
    registration_token: str
    admin_token: str
    admin: AdminClient
    recorder: Recorder = field(repr=False)

    def finals(self, task_id: str) -> list[tuple[int, dict[str, Any]]]:
        """Every final result (status code, body) the master received for ``task_id``."""
        return list(self.recorder.final_posts.get(task_id, []))


@pytest.fixture
async def recording_master(tmp_path: Path) -> AsyncIterator[RecordingMaster]:
    """The dev master app behind :class:`Recorder`, served by hypercorn on 127.0.0.1:0."""
    store = await trio.to_thread.run_sync(Store, tmp_path / "master.sqlite")
    registration_token, admin_token = uuid.uuid4().hex, uuid.uuid4().hex
    recorder = Recorder(create_app(store, Notifier(), registration_token=registration_token,
                                   admin_token=admin_token, max_long_poll_seconds=30.0))
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.loglevel = "WARNING"
    config.graceful_timeout = 0.5
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(hypercorn_serve, recorder, config))
            base_url = str(binds[0]).rstrip("/")
            async with AdminClient(base_url, admin_token) as admin:
                yield RecordingMaster(base_url, registration_token, admin_token, admin, recorder)
            nursery.cancel_scope.cancel()
    finally:
        store.close()


# ------------------------------------------------------------------------------ process helpers


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    state = _state(pid)
    return state is not None and state not in ("Z", "X")


def marked_pids(task_id: str) -> list[int]:
    """Live processes whose environment carries CK_TASK_ID=<task_id> (read straight from /proc)."""
    marker = f"CK_TASK_ID={task_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            continue
        if marker in environ.split(b"\0") and alive(int(entry)):
            found.append(int(entry))
    return found


LEVELS_HERE = available_levels(Path(tempfile.gettempdir()) / "ckagent-levels-probe")
"""Containment levels this machine can run; every test here runs at each (``task.containment``)."""
LEVEL = {"current": "auto"}


@pytest.fixture(autouse=True, params=LEVELS_HERE)
def containment_level(request: pytest.FixtureRequest) -> str:
    """Run the test at each containment level this machine allows (settings_for picks it up)."""
    LEVEL["current"] = request.param
    return str(request.param)


STRAY_ROOTS: list[Path] = []
"""Work dirs outside tmp_path whose spiders the ``no_strays`` fixture also cleans up."""


@pytest.fixture(autouse=True)
def no_strays(tmp_path: Path) -> Any:
    """After each test, SIGKILL spider processes it left alive (only a failing test does), so one
    failure does not leave 10-minute sleepers behind. Matched by CK_TASK_DIR under the test's dirs."""
    yield
    roots = [str(tmp_path), *map(str, STRAY_ROOTS)]
    STRAY_ROOTS.clear()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
        except OSError:
            continue
        task_dirs = [v[len(b"CK_TASK_DIR="):].decode(errors="replace") for v in environ
                     if v.startswith(b"CK_TASK_DIR=")]
        if any(d.startswith(root + os.sep) for d in task_dirs for root in roots):
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)


def pids_in(lines: list[str], label: str) -> list[int]:
    """Pids a spider printed as ``<label> <pid>``."""
    return [int(m.group(1)) for line in lines if (m := re.search(rf"\b{label} (\d+)\b", line))]


async def wait_for_log(admin: AdminClient, task_id: str, text: str, timeout: float = 20) -> list[str]:  # noqa: ASYNC109
    """Poll the master until the task's log holds ``text``; returns the lines."""
    with trio.fail_after(timeout):
        while True:
            lines = await admin.get_logs(task_id)
            if any(text in line for line in lines):
                return lines
            await trio.sleep(0.1)


async def wait_for_path(path: Path, timeout: float = 20) -> None:  # noqa: ASYNC109
    """Wait until ``path`` exists."""
    await eventually(trio.Path(path).exists, timeout)


def settings_for(tmp_path: Path, master: RecordingMaster, **env: str) -> Any:
    """Agent settings for these tests: 1 s kill grace, no index probing."""
    values = {"AGENT_TASK_KILL_GRACE": "1", "AGENT_UV_INDEX_URL": "http://127.0.0.1:9/simple",
              "AGENT_TASK_CONTAINMENT": LEVEL["current"]}
    values.update(env)
    return agent_settings(tmp_path / "agent", master.base_url, master.registration_token, **values)


# Spider building blocks (Python source).
ESCAPE = textwrap.dedent("""
    def escape(label):
        # Double fork + setsid: the grandchild leaves the spider's process group and session.
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            pid = os.fork()
            if pid == 0:
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                time.sleep(300)
                os._exit(0)
            os.write(w, str(pid).encode())
            os._exit(0)
        os.close(w)
        pid = int(os.read(r, 32))
        os.wait()
        print(label, pid, flush=True)
""")

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


SLOW_BACKEND = '''
import os, time

def get_requires_for_build_wheel(config_settings=None):
    with open({pid_file!r}, "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(300)
    return []

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("never reached")
'''


async def test_cancel_from_the_master_during_the_dependency_install(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    # A local package whose (in-tree, offline) build backend hangs: uv waits on it for ever.
    pid_file = tmp_path / "backend.pid"
    files = {
        "main.py": "print('the spider must never start')\n",
        "requirements.txt": "./slowpkg\n",
        "slowpkg/pyproject.toml": textwrap.dedent("""
            [build-system]
            requires = []
            build-backend = "slowbackend"
            backend-path = ["."]
            [project]
            name = "slowpkg"
            version = "0.1"
        """),
        "slowpkg/slowbackend.py": SLOW_BACKEND.format(pid_file=str(pid_file)),
    }
    admin = recording_master.admin
    async with running_agent(nursery, settings_for(tmp_path, recording_master)):
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
    dump = tmp_path / "env.json"
    main = f"import json, os\njson.dump(dict(os.environ), open({str(dump)!r}, 'w'))\n"
    settings = settings_for(tmp_path, recording_master)
    async with running_agent(nursery, settings):
        task_id = await submit(recording_master.admin, "env-dump", {"main.py": main}, env={"MY_SETTING": "42"})
        with trio.fail_after(30):
            task = await recording_master.admin.wait_task_final(task_id, 30)
    assert task["status"] == "SUCCESS", task
    env = json.loads(dump.read_text())
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
    owned = [task_dir, task_dir / "in-task-dir.txt", Path(seen["home"]), *locks]
    for path in owned:
        assert await trio.to_thread.run_sync(owner, path) == user.uid, path


@pytest.fixture
def python_user(spider_user: SpiderUser) -> SpiderUser:
    """``spider_user``, when it can run the agent's interpreter (the spider venvs are built on it)."""
    if not _can_exec_as(spider_user.uid, spider_user.gid, sys.executable):
        pytest.skip(f"the venv is built on the agent's interpreter {sys.executable}, which {spider_user.name} "
                    "cannot execute here (it lives under a private directory); the Node test covers run_as_user")
    return spider_user


async def test_run_as_user_gives_the_python_venv_to_that_user(
    recording_master: RecordingMaster, nursery: trio.Nursery, python_user: SpiderUser
) -> None:
    user = python_user
    main = ("import json, os\n"
            f"json.dump({{'uid': os.getuid(), 'venv': os.environ['VIRTUAL_ENV']}}, "
            f"open({str(user.report / 'py.json')!r}, 'w'))\n")
    admin = recording_master.admin
    async with running_agent(nursery, run_as_settings(user, recording_master)):
        task_id = await submit(admin, "as-user-py", {"main.py": main})
        with trio.fail_after(60):
            task = await admin.wait_task_final(task_id, 60)
    assert task["status"] == "SUCCESS", (task, await admin.get_logs(task_id))
    seen = json.loads((user.report / "py.json").read_text())
    assert seen["uid"] == user.uid
    assert await trio.to_thread.run_sync(owner, Path(seen["venv"])) == user.uid


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
