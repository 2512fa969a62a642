"""Containment end to end: escaped descendants of every kind, limits, OOM, fork bomb, graceful stop.

Every test runs at each containment level this machine allows (``task.containment`` forced), with
real processes, the real dev master and an in-process agent (the crash test: a real agent process).
Survivors are found **without the agent's marker**: each escaper carries a unique token in its argv,
and the test scans ``/proc/*/cmdline`` for it.

Escapers (all started by the spider's main process, which then exits or hangs):

==========  ==================================================================================
kind        what it does
==========  ==================================================================================
session     double fork + ``setsid`` (new session and process group), environment kept
empty-env   double fork + ``setsid`` + ``execve`` with an empty environment
new-env     double fork + ``setsid`` + ``execve`` with a replaced environment (PATH, HOME only)
exec        double fork + ``setsid`` + ``execve`` of another program (``sleep``, empty environment)
forker      a process that keeps forking (bounded: 300 children) while the kill is under way
==========  ==================================================================================

At the ``process-group`` level the three scrubbed kinds are *expected* to survive (the documented
limit of that level, docs/operations.md "Containment"): the test asserts exactly that, and kills them.

What this machine (systemd hybrid: v1 controllers + a v2 tree without controllers) cannot exercise:
limits at the ``cgroup-v2`` level (no controllers are delegated to the v2 tree here), ``memory.peak``
/ ``io.stat`` figures, the move of the agent into a leaf cgroup (pure v2 with controllers), and
``cgroup.freeze`` (Linux < 5.14 without cgroup.kill). The pure-v1 path (freezer + SIGKILL + pidfd
waits, no v2 tree) is exercised by forcing ``use_unified=False`` in the jail tests below.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    LEVEL,
    LEVELS_HERE,
    RecordingMaster,
    agent_process,
    alive,
    eventually,
    no_strays,
    running_agent,
    settings_for,
    submit,
    wait_exit,
    wait_for_log,
    wait_registered,
)

from ckagent.containment import Limits, open_containment
from ckagent.containment.hierarchy import memberships, mounts

CGROUP_LEVELS = [lvl for lvl in LEVELS_HERE if lvl != "process-group"]
SCRUBBED = {"empty-env", "new-env", "exec"}
KINDS = ("session", "empty-env", "new-env", "exec", "forker")


def _read_proc(path: str) -> str:
    """A procfs file's text (an instant read from the kernel, fine on the event loop's thread)."""
    with open(path) as fh:
        return fh.read()


@pytest.fixture(params=LEVELS_HERE)
def level(request: pytest.FixtureRequest) -> str:
    """Each containment level this machine allows (settings_for picks it up)."""
    LEVEL["current"] = request.param
    return str(request.param)


def limits_of(level: str) -> frozenset[str]:
    """The controllers ``level`` can limit on this machine."""
    containment = open_containment(level, Path(tempfile.gettempdir()) / "ckagent-levels-probe")
    try:
        return containment.can_limit
    finally:
        containment.close()


def _levels_limiting(controller: str) -> list[Any]:
    """The cgroup levels that can limit ``controller`` here; others are listed as skipped, saying why
    (and with no cgroup level here at all, one skipped case says that)."""
    if not CGROUP_LEVELS:
        return [pytest.param("none", marks=pytest.mark.skip(
            reason=f"no cgroup level on this machine for uid {os.geteuid()} (root, or a delegated cgroup "
                   f"subtree, gives one): {controller} limits need a cgroup"))]
    return [level if controller in limits_of(level) else
            pytest.param(level, marks=pytest.mark.skip(reason=f"{level} has no {controller} controller on "
                                                                f"this machine (none delegated to it)"))
            for level in CGROUP_LEVELS]


# ------------------------------------------------------------------------------ survivors by argv token


def with_token(token: str) -> list[int]:
    """Live (non-zombie) processes whose argv contains ``token`` (read straight from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if any(token.encode() in arg for arg in argv) and alive(int(entry)):
            found.append(int(entry))
    return found


def kinds_alive(token: str) -> set[str]:
    """Which escaper kinds of ``token`` are still alive."""
    kinds = set()
    for pid in with_token(token):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for kind in KINDS:
            if any(arg.endswith(f"{token}-{kind}".encode()) for arg in argv):
                kinds.add(kind)
    return kinds


def kill_token(token: str) -> None:
    """SIGKILL whatever of ``token`` is left (a failing test, or the process-group level's limit)."""
    for _ in range(5):
        for pid in with_token(token):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


ESCAPERS = textwrap.dedent('''
    import os, shutil, subprocess, sys, time
    TOKEN = sys.argv[1]
    SLEEP = "import time; time.sleep(300)"
    FORKER = ("import os, sys, time\\n"
              "for _ in range(300):\\n"
              "    try:\\n"
              "        if os.fork() == 0:\\n"
              "            time.sleep(300); os._exit(0)\\n"
              "    except OSError:\\n"
              "        time.sleep(0.01)\\n"
              "    time.sleep(0.005)\\n"
              "time.sleep(300)\\n")

    def escape(kind, argv, env, path=None):
        """Double fork + setsid, then exec argv with env; returns the escaper's pid."""
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            pid = os.fork()
            if pid == 0:
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.execve(path or argv[0], argv, env)
            os.write(w, str(pid).encode())
            os._exit(0)
        os.close(w)
        pid = int(os.read(r, 32))
        os.wait()
        print("escaped", kind, pid, flush=True)

    py = sys.executable
    escape("session", [py, "-c", SLEEP, TOKEN + "-session"], dict(os.environ))
    escape("empty-env", [py, "-c", SLEEP, TOKEN + "-empty-env"], {})
    escape("new-env", [py, "-c", SLEEP, TOKEN + "-new-env"], {"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    escape("exec", [TOKEN + "-exec", "300"], {}, shutil.which("sleep"))  # another program, argv[0] = token
    forker = subprocess.Popen([py, "-c", FORKER, TOKEN + "-forker"], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("escaped forker", forker.pid, flush=True)
    time.sleep(0.3)  # the forker is forking
    print("ready", flush=True)
    if sys.argv[2] == "hang":
        time.sleep(300)
    go = os.path.join(os.environ["CK_TASK_DIR"], "go")
    for _ in range(3000):  # the test looks at the escapers, then lets the main process exit
        if os.path.exists(go):
            break
        time.sleep(0.01)
''')


def expected_survivors(level: str) -> set[str]:
    """What outlives a task at ``level``: nothing at a cgroup level; the scrubbed double-forked kinds
    at the process-group level (its documented limit)."""
    return SCRUBBED if level == "process-group" else set()


async def _run_escapers(master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, mode: str,
                        stop: str) -> tuple[dict[str, Any], set[str], str]:
    token = "ckesc" + uuid.uuid4().hex[:12]
    admin = master.admin
    try:
        async with running_agent(nursery, settings_for(tmp_path, master)) as agent:
            task_id = await submit(admin, "escapers", {"main.py": ESCAPERS}, args=[token, mode],
                                   timeout_seconds=4 if stop == "timeout" else None)
            await wait_for_log(admin, task_id, "ready", timeout=30)
            assert kinds_alive(token) == set(KINDS), "every escaper runs before the task ends"
            assert agent.containment is not None
            if stop == "cancel":
                await admin.cancel_task(task_id)
            (tmp_path / "agent" / "tasks" / task_id / "go").touch()
            with trio.fail_after(30):
                task = await admin.wait_task_final(task_id, 30)
            survivors = kinds_alive(token)
        return task, survivors, token
    finally:
        kill_token(token)


@pytest.mark.parametrize(("mode", "stop", "status"), [
    ("exit", "none", "SUCCESS"), ("hang", "timeout", "FAILED"), ("hang", "cancel", "CANCELLED"),
])
async def test_escaped_descendants_of_every_kind_die_with_the_task(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, level: str,
    mode: str, stop: str, status: str,
) -> None:
    task, survivors, _ = await _run_escapers(recording_master, nursery, tmp_path, mode, stop)
    assert task["status"] == status, task
    assert survivors == expected_survivors(level), f"{level}: survivors {survivors}"


async def test_after_a_crash_the_task_is_re_adopted_and_its_cancel_kills_the_cgroup(
    recording_master: RecordingMaster, tmp_path: Path, level: str
) -> None:
    """kill -9 of the agent: every escaper of every kind runs on; the restarted agent re-adopts the
    task (ckagent.task.adoption), and a cancel then kills what the level can find: at a cgroup level all."""
    token = "ckesc" + uuid.uuid4().hex[:12]
    admin = recording_master.admin
    agent = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token,
                          task__containment=level)
    env = {"AGENT_REGISTRATION_TOKEN": recording_master.registration_token}
    try:
        await agent.start(extra_env=env)
        await wait_registered(admin, agent)
        task_id = await submit(admin, "crashy-escapers", {"main.py": ESCAPERS}, args=[token, "hang"])
        await wait_for_log(admin, task_id, "ready", timeout=30)
        await agent.kill()  # kill -9: everything of the task is orphaned
        assert kinds_alive(token) == set(KINDS)
        await agent.start(extra_env=env)
        await wait_for_log(admin, task_id, "re-adopted after an agent restart", timeout=30)
        assert kinds_alive(token) == set(KINDS), "re-adopted, not killed"
        await admin.cancel_task(task_id)
        with trio.fail_after(30):
            task = await admin.wait_task_final(task_id, 30)
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 20) == 0
        survivors = kinds_alive(token)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(30):
            await agent.kill()
        kill_token(token)
    assert (task["status"], task["errorCode"]) == ("CANCELLED", "CANCELLED"), task
    # The process-group level loses only the scrubbed double-forked kinds (its documented limit).
    assert survivors == expected_survivors(level), f"{level}: survivors {survivors}"


# ------------------------------------------------------------------------------ graceful stop


SCRAPY_LIKE = textwrap.dedent('''
    import os, signal, subprocess, sys, time
    BROWSER = ("import signal, sys, time\\n"
               "def bye(*a):\\n"
               "    print('browser closing', flush=True); time.sleep(0.2); sys.exit(0)\\n"
               "signal.signal(signal.SIGTERM, bye)\\n"
               "print('browser up', flush=True)\\n"
               "time.sleep(300)\\n")
    browser = subprocess.Popen([sys.executable, "-c", BROWSER])
    print("browser", browser.pid, flush=True)
    stopping = []

    def close_spider(signum, frame):
        stopping.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, close_spider)
    signal.signal(signal.SIGINT, close_spider)
    time.sleep(0.3)
    print("crawling", flush=True)
    while not stopping:
        time.sleep(0.05)
    print("close hooks: got", stopping[0], "; browser still alive:", browser.poll() is None, flush=True)
    browser.terminate()
    browser.wait(5)
    print("close hooks ran", flush=True)
    sys.exit(0)
''')


@pytest.mark.parametrize("stop_signal", [None, "SIGINT"])
async def test_cancel_stops_the_main_process_first_so_close_hooks_run(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, level: str, stop_signal: str | None,
) -> None:
    admin = recording_master.admin
    settings = settings_for(tmp_path, recording_master, AGENT_TASK_KILL_GRACE="5")
    async with running_agent(nursery, settings):
        spider_id = await admin.create_spider(name="scrapy-like", framework="python", stop_signal=stop_signal)
        from harness import spider_zip
        await admin.upload_package(spider_id, spider_zip({"main.py": SCRAPY_LIKE}))
        task_id = str(await admin.create_task(spider_id))
        lines = await wait_for_log(admin, task_id, "crawling")
        [browser] = [int(line.split()[1]) for line in lines if line.startswith("browser ") and line.split()[1].isdigit()]
        started = trio.current_time()
        await admin.cancel_task(task_id)
        with trio.fail_after(20):
            task = await admin.wait_task_final(task_id, 20)
        took = trio.current_time() - started
    assert (task["status"], task["exitCode"]) == ("CANCELLED", 0), task
    assert took < 5, "the spider stopped itself within the grace"
    lines = await admin.get_logs(task_id)
    wanted = stop_signal or "SIGTERM"
    assert f"close hooks: got {wanted} ; browser still alive: True" in lines, lines
    assert "browser closing" in lines and "close hooks ran" in lines, lines
    assert not alive(browser)


# ------------------------------------------------------------------------------ limits


HOG = textwrap.dedent('''
    import sys, time
    chunks = []
    # Bounded: 1 GiB at most, even if the limit does not hold (the node must survive a broken test).
    for i in range(1, 103):
        chunks.append(bytearray(b"\\x01") * (10 << 20))   # touched: really resident
        if i % 5 == 0:
            print("allocated", i * 10, "MiB", flush=True)
    print("the limit did not hold", flush=True)
    sys.exit(3)
''')

NEIGHBOUR = "import time\nprint('neighbour up', flush=True)\ntime.sleep(3)\nprint('neighbour done', flush=True)\n"


@pytest.mark.parametrize("limited", _levels_limiting("memory"))
async def test_memory_hog_is_oom_killed_at_its_limit_and_the_neighbour_lives(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, limited: str,
) -> None:
    LEVEL["current"] = limited
    async with running_agent(nursery, settings_for(tmp_path, recording_master)):
        admin = recording_master.admin
        neighbour = await submit(admin, "neighbour", {"main.py": NEIGHBOUR})
        await wait_for_log(admin, neighbour, "neighbour up")
        hog = await submit(admin, "hog", {"main.py": HOG}, resources={"memoryBytes": 200 << 20})
        with trio.fail_after(60):
            task = await admin.wait_task_final(hog, 60)
            beside = await admin.wait_task_final(neighbour, 60)
    assert (task["status"], task["errorCode"]) == ("FAILED", "OOM_KILLED"), task
    assert "memory limit 200 MiB" in task["errorMessage"] and "peak" in task["errorMessage"], task
    assert 150 << 20 <= task["memoryPeakBytes"] <= 210 << 20, task
    assert task["cpuSeconds"] > 0 and task["resources"] == {"memoryBytes": 200 << 20}, task
    assert beside["status"] == "SUCCESS" and beside["memoryPeakBytes"] < 100 << 20, beside


FORK_BOMB = textwrap.dedent('''
    import os, sys, time
    children = 0
    for _ in range(200):       # bounded even without the limit
        try:
            pid = os.fork()
        except OSError as exc:
            print("fork refused after", children, "children:", exc.strerror, flush=True)
            sys.exit(1)
        if pid == 0:
            time.sleep(300)
            os._exit(0)
        children += 1
    print("the limit did not hold", flush=True)
    sys.exit(3)
''')


@pytest.mark.parametrize("limited", _levels_limiting("pids"))
async def test_fork_bomb_under_a_pids_limit_fails_cleanly(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, limited: str,
) -> None:
    LEVEL["current"] = limited
    async with running_agent(nursery, settings_for(tmp_path, recording_master)) as agent:
        admin = recording_master.admin
        task_id = await submit(admin, "bomb", {"main.py": FORK_BOMB}, resources={"pids": 32})
        with trio.fail_after(60):
            task = await admin.wait_task_final(task_id, 60)
        assert agent.state == "RUNNING"
    assert (task["status"], task["errorCode"], task["exitCode"]) == ("FAILED", "EXIT_NONZERO", 1), task
    lines = await admin.get_logs(task_id)
    assert any(line.startswith("fork refused after") for line in lines), lines
    assert task["pidsPeak"] <= 32, task


async def test_status_and_metrics_show_the_level_and_live_figures(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, level: str,
) -> None:
    admin = recording_master.admin
    async with running_agent(nursery, settings_for(tmp_path, recording_master)) as agent:
        task_id = await submit(admin, "busy", {"main.py": "import time\nprint('up', flush=True)\n"
                                              "t = time.time()\nwhile time.time() - t < 1.5: pass\ntime.sleep(30)\n"})
        await wait_for_log(admin, task_id, "up")
        await trio.sleep(1.0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}") as client:
            status = (await client.get("/status")).json()
            metrics = (await client.get("/metrics")).text
        await admin.cancel_task(task_id)
        with trio.fail_after(20):
            task = await admin.wait_task_final(task_id, 20)
        nodes = await admin.list_nodes()
    assert status["containment"]["level"] == level
    assert f'ckagent_containment_level{{level="{level}"}} 1.0' in metrics
    [running] = status["runningTasks"]
    if level == "process-group":
        assert running["resources"] == {} and "cpuSeconds" not in task
    else:
        assert running["resources"]["cpuSeconds"] > 0.3, running
        assert task["cpuSeconds"] >= running["resources"]["cpuSeconds"], task
    [node] = [n for n in nodes if n["name"] == "test-node"]
    assert node["containment"]["level"] == level


# ------------------------------------------------------------------------------ the jails themselves


def _jail_cases() -> list[tuple[str, bool]]:
    cases = [(lvl, True) for lvl in LEVELS_HERE]
    if "cgroup-v1" in LEVELS_HERE:
        cases.append(("cgroup-v1", False))  # pure v1: freezer + SIGKILL + pidfd waits
    return cases


@pytest.mark.parametrize(("jail_level", "use_unified"), _jail_cases())
async def test_a_child_joins_before_exec_and_kill_all_catches_a_racing_forker(
    tmp_path: Path, jail_level: str, use_unified: bool
) -> None:
    token = "ckjail" + uuid.uuid4().hex[:12]
    containment = open_containment(jail_level, tmp_path, use_unified=use_unified)
    jail = containment.jail(token, Limits(pids=400) if jail_level != "process-group" else Limits())
    forker = ("import os, sys, time\n"
              "print(open('/proc/self/cgroup').read(), flush=True)\n"
              "for _ in range(300):\n"
              "    try:\n"
              "        if os.fork() == 0:\n"
              "            os.setsid(); time.sleep(300); os._exit(0)\n"
              "    except OSError:\n"
              "        pass\n"
              "    time.sleep(0.002)\n"
              "time.sleep(300)\n")
    env = {"CK_TASK_ID": token, "PATH": os.environ.get("PATH", "")}
    try:
        with trio.fail_after(30):
            argv, options = jail.spawn([sys.executable, "-c", forker, token], env)
            proc = await trio.lowlevel.open_process(argv, env=env, stdout=subprocess.PIPE, start_new_session=True,
                                                    **options)
            jail.watch(proc.pid)
            assert proc.stdout is not None
            first = (await proc.stdout.receive_some(4096)).decode()
            if jail_level != "process-group":
                assert "task-" + token in first, first  # it ran its first line inside its cgroup
            assert _read_proc(f"/proc/{proc.pid}/oom_score_adj").strip() == "500"
            await eventually(lambda: _async(len(with_token(token)) > 20))
            assert jail.populated()
            killed = await jail.kill_all()  # the forker keeps forking while this runs
            assert killed > 20
            await proc.wait()
            assert not jail.populated()
            assert with_token(token) == []
            figures = jail.figures()
            if jail_level != "process-group":
                assert figures.cpu_seconds is not None and figures.cpu_seconds > 0
            if jail_level == "cgroup-v1":
                assert figures.pids_peak is not None and figures.pids_peak > 20
                assert figures.memory_peak_bytes is not None and figures.memory_peak_bytes > 1 << 20
    finally:
        kill_token(token)
        jail.close()
        containment.close()


async def _async(value: Any) -> Any:
    return value


# ------------------------------------------------------------------------------ hierarchy parsing (pure)


HYBRID_MOUNTINFO = """\
30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
33 30 0:29 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct
35 30 0:31 / /sys/fs/cgroup/pids rw,nosuid - cgroup cgroup rw,pids
"""
PURE_V2_CONTAINER = "612 600 0:26 /kubepods/pod1/c1 /sys/fs/cgroup ro - cgroup2 cgroup rw\n"


def test_mountinfo_of_a_hybrid_host_and_of_a_container() -> None:
    found = mounts(HYBRID_MOUNTINFO)
    assert found["unified"] == (Path("/sys/fs/cgroup/unified"), "/")
    assert found["cpu"] == found["cpuacct"] == (Path("/sys/fs/cgroup/cpu,cpuacct"), "/")
    assert "freezer" not in found
    assert mounts(PURE_V2_CONTAINER) == {"unified": (Path("/sys/fs/cgroup"), "/kubepods/pod1/c1")}
    assert memberships("12:memory:/a/b\n3:cpu,cpuacct:/a\n0::/system.slice/ckagent.service\n") == {
        "memory": "/a/b", "cpu": "/a", "cpuacct": "/a", "unified": "/system.slice/ckagent.service"}


def test_a_forced_level_that_is_missing_fails_the_start_with_a_reason(tmp_path: Path) -> None:
    from ckagent.containment import ContainmentError
    with pytest.raises(ContainmentError, match=r"task\.containment"):
        open_containment("cgroup-v3", tmp_path)


@pytest.mark.parametrize("limited", _levels_limiting("cpu"))
async def test_a_cpus_limit_throttles_the_task(tmp_path: Path, limited: str) -> None:
    containment = open_containment(limited, tmp_path)
    jail = containment.jail("cpu-" + uuid.uuid4().hex[:8], Limits(cpus=0.2))
    busy = "import time\nt = time.time()\nwhile time.time() - t < 1.0: pass\n"
    try:
        argv, options = jail.spawn([sys.executable, "-c", busy], {"PATH": os.environ.get("PATH", "")})
        with trio.fail_after(30):
            proc = await trio.lowlevel.open_process(argv, start_new_session=True, **options)
            await proc.wait()
            await jail.kill_all()
        cpu = jail.figures().cpu_seconds
        assert cpu is not None and 0.05 < cpu < 0.45, cpu  # ≈ 0.2 of the 1 s it spun (unthrottled: ≈ 1)
    finally:
        jail.close()
        containment.close()


async def test_a_death_by_signal_names_the_signal(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    LEVEL["current"] = "auto"
    async with running_agent(nursery, settings_for(tmp_path, recording_master)):
        task_id = await submit(recording_master.admin, "segv", {"main.py": "import os, signal\n"
                                                                         "os.kill(os.getpid(), signal.SIGSEGV)\n"})
        with trio.fail_after(30):
            task = await recording_master.admin.wait_task_final(task_id, 30)
    assert (task["status"], task["errorCode"], task["exitCode"]) == ("FAILED", "SIGNALED", -11), task
    assert task["errorMessage"].startswith("killed by SIGSEGV (exit code -11)"), task


def test_without_a_shell_the_join_falls_back_to_a_preexec_fn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckagent.containment.base as base

    if "cgroup-v2" not in LEVELS_HERE:
        pytest.skip(f"the cgroup-v2 level is not available here to uid {os.geteuid()} (no v2 tree, or not root "
                    f"and no delegated subtree)")
    containment = open_containment("cgroup-v2", tmp_path)
    jail = containment.jail("noshell", Limits())
    try:
        argv, options = jail.spawn(["true"], {"PATH": "/usr/bin:/bin"})
        assert argv[0] == base.SHELL and argv[3].endswith("/true") and not options  # the shim: vfork spawn
        with pytest.raises(FileNotFoundError):  # as Popen would raise it
            jail.spawn(["no-such-program-ck"], {"PATH": "/usr/bin:/bin"})
        monkeypatch.setattr(base, "SHELL", str(tmp_path / "no-sh"))
        argv, options = jail.spawn(["true"], {"PATH": "/usr/bin:/bin"})
        assert argv == ["true"] and callable(options["preexec_fn"])
    finally:
        jail.close()
        containment.close()


DAEMON_THAT_ENDS = textwrap.dedent('''
    import os, sys, time
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        pid = os.fork()
        if pid == 0:  # scrubbed and double-forked: the process-group level cannot attribute it
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(2.0)"], {})
        os.write(w, str(pid).encode())
        os._exit(0)
    os.close(w)
    print("daemon", int(os.read(r, 32)), flush=True)
    os.wait()
''')


async def test_process_group_level_reaps_adopted_orphans_and_gives_the_subreaper_role_back(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    import ctypes

    from ckagent.containment.base import libc

    LEVEL["current"] = "process-group"
    admin = recording_master.admin
    async with running_agent(nursery, settings_for(tmp_path, recording_master)):
        first = await submit(admin, "leaves-a-daemon", {"main.py": DAEMON_THAT_ENDS})
        with trio.fail_after(30):
            await admin.wait_task_final(first, 30)
        [daemon] = [int(line.split()[1]) for line in await admin.get_logs(first) if line.startswith("daemon ")]
        assert _read_proc(f"/proc/{daemon}/stat").rsplit(")", 1)[1].split()[1] == str(os.getpid()), \
            "re-parented to the agent"
        await eventually(lambda: _async(not alive(daemon)))  # it ended on its own: a zombie of the agent
        assert await trio.Path(f"/proc/{daemon}").exists(), "nobody else reaped it"
        second = await submit(admin, "next", {"main.py": "print('hi')\n"})
        with trio.fail_after(30):
            await admin.wait_task_final(second, 30)
        assert not await trio.Path(f"/proc/{daemon}").exists(), "the next task's end reaped the adopted zombie"
    flag = ctypes.c_int(-1)
    assert libc().prctl(37, ctypes.byref(flag), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    assert flag.value == 0, "the stopped agent is no longer the child subreaper"
