"""Shared fixtures: a real dev master, in-process (``dev_master``) or as a subprocess (``dev_master_process``).

Both listen on 127.0.0.1 with a port picked by the OS and keep their data in a SQLite file under the
test's ``tmp_path``.

The suite's clock (the hooks at the end): every test's wall time (setup + call + teardown) and CPU time
(the test process's own plus that of the child processes it reaped) are measured; the summary lists
the tests over :data:`SLOW_SECONDS` that are not marked ``slow`` (the marker ``./scripts/test --quick``
skips), and ``--file-times`` adds a table of wall and CPU seconds per test file.
"""

from __future__ import annotations

import logging
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml
from harness import (
    RUN_SH,
    ExampleRuns,
    RecordingMaster,
    Releases,
    RunShNode,
    bump_and_build,
    free_port,
    pid_alive,
    pyz_dir,
    reachable_basetemp,
    serve_recording_master,
    served_directory,
    session_build,
    session_pyz,
    user_temp_dir,
)
from hypothesis.configuration import set_hypothesis_home_dir

import ckagent
from ckagent.devmaster.client import AdminClient
from ckagent.devmaster.server import DevMasterConfig, serve

_REPO_ROOT = Path(ckagent.__file__).resolve().parent.parent

set_hypothesis_home_dir(user_temp_dir("ckagent-hypothesis"))
"""Hypothesis keeps its example database (and caches) in one place for every test process: not
``.hypothesis/`` in the checkout, and not a fixed name in /tmp that another user's suite may own
(its tests would warn that the database is unusable, and warnings fail tests)."""


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """As root, the session's temporary files (``tmp_path``) live below a root every uid can search
    (harness.identities.reachable_basetemp): agents there give each spider a uid of its own, as a node
    does, and pytest's ``/tmp/pytest-of-root`` — set back to 0700 by every session that starts on the
    machine — is not on their way. Not for an explicit ``--basetemp``, nor in xdist's workers (the
    controller's root reaches them)."""
    if os.geteuid() == 0 and config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = str(reachable_basetemp())


def _remove_tables_under(root: Path) -> list[str]:
    """Delete the agents' nft tables whose work dir is below ``root`` (an agent killed with -9 leaves
    its table: the next start in that work dir would replace it, but a test's directory never sees
    one). Only where this process may change nftables."""
    if os.geteuid() != 0:
        return []
    from ckagent.containment.egress.owners import remove_orphans

    # (also the tables of agents a test ran in a mount namespace of its own: the pod box's)
    return remove_orphans(lambda work_dir: work_dir.startswith(str(root) + os.sep), all_namespaces=True)


@pytest.fixture(autouse=True)
def no_leftover_tables(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that had a ``tmp_path``: remove the nft tables of the agents it ran there,
    also when it failed (tests/test_egress.py checks its own tables besides)."""
    yield
    tmp = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") else None
    if isinstance(tmp, Path):
        _remove_tables_under(tmp)


@pytest.fixture(autouse=True, scope="session")
def no_leftover_tables_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end of the session: the tables of agents that ran anywhere below its temporary root."""
    yield
    _remove_tables_under(tmp_path_factory.getbasetemp())


@pytest.fixture
def inline_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """``trio.to_thread.run_sync`` runs its function inline, on the loop (after a checkpoint).

    For tests on the autojump clock that use the real state store or spool files: that clock jumps
    to the next deadline whenever every task waits — also while one waits for a thread — so a SQLite
    write that is slow under load lets a whole backoff of virtual time pass, and the test's
    durations measure the machine's load instead of the logic."""

    async def run_inline(fn: Any, *args: Any, **_options: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", run_inline)


@dataclass
class DevMaster:
    """A running dev master: where it listens, its secrets, its database and an admin client."""

    base_url: str
    registration_token: str
    admin_token: str
    db_path: Path
    admin: AdminClient


@pytest.fixture
async def dev_master(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[DevMaster]:
    """An in-process dev master (port 0, fresh SQLite file, random tokens), stopped after the test."""
    config = DevMasterConfig(
        db_path=tmp_path / "master.sqlite",
        registration_token=secrets.token_urlsafe(16),
        admin_token=secrets.token_urlsafe(16),
        port=0,
    )
    base_url = await nursery.start(serve, config)
    async with AdminClient(base_url, config.admin_token) as admin:
        yield DevMaster(
            base_url=base_url,
            registration_token=config.registration_token,
            admin_token=config.admin_token,
            db_path=config.db_path,
            admin=admin,
        )


@pytest.fixture
async def recording_master(tmp_path: Path) -> AsyncIterator[RecordingMaster]:
    """A dev master that records the final results it receives and the API keys it issues
    (tests/harness ``RecordingMaster``), stopped after the test."""
    async with serve_recording_master(tmp_path) as master:
        yield master


@pytest.fixture(scope="session")
def example_runs(tmp_path_factory: pytest.TempPathFactory) -> ExampleRuns:
    """The session's runs of the sdk/examples spiders, each made once per path (tests/harness/examples.py)."""
    return ExampleRuns(tmp_path_factory.mktemp("example-runs"))


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


class DevMasterProcess:
    """A dev master in its own process (``python -m ckagent.devmaster``), restartable on the same db.

    ``await start()`` launches it and returns the base URL (the port may change between starts);
    ``await stop()`` sends SIGTERM and returns the exit code; ``await kill()`` sends SIGKILL (a crash).
    The process's stderr goes to ``<tmp_path>/dev-master.stderr.log``.
    """

    def __init__(self, tmp_path: Path, *, startup_timeout: float = 20.0) -> None:
        self.db_path = tmp_path / "master.sqlite"
        self.registration_token = secrets.token_urlsafe(16)
        self.admin_token = secrets.token_urlsafe(16)
        self.stderr_path = tmp_path / "dev-master.stderr.log"
        self.startup_timeout = startup_timeout
        self.base_url: str | None = None
        self.process: trio.Process | None = None

    async def start(self, *, same_port: bool = False) -> str:
        """Start the process and wait for its "listening on URL" line. Returns the URL.

        ``same_port``: listen on the port of the previous start (agents configured with the old URL
        find it again); otherwise a free port is picked. Raises RuntimeError (with the stderr tail) if it exits or stays silent for ``startup_timeout`` s.
        """
        if self.process is not None and self.process.returncode is None:
            raise RuntimeError("the dev master is already running")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])),
            # tokens through the environment: flags would show in `ps` (and a token may start with "-")
            "DEVMASTER_REGISTRATION_TOKEN": self.registration_token,
            "DEVMASTER_ADMIN_TOKEN": self.admin_token,
        }
        command = [
            sys.executable,
            "-m",
            "ckagent.devmaster",
            f"--db={self.db_path}",
            "--host=127.0.0.1",
            f"--port={_port_of(self.base_url) if same_port and self.base_url else 0}",
        ]
        with self.stderr_path.open("ab") as stderr:
            self.process = await trio.lowlevel.open_process(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=env
            )
        assert self.process.stdout is not None
        line = b""
        with trio.move_on_after(self.startup_timeout):  # noqa: ASYNC912 - receive_some checkpoints
            while not line.endswith(b"\n"):
                chunk = await self.process.stdout.receive_some(1)
                if not chunk:
                    break
                line += chunk
        text = line.decode(errors="replace").strip()
        marker = "listening on "
        if marker not in text:
            await self.kill()
            tail = self.stderr_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"dev master did not start (stdout: {text!r}); stderr:\n{tail}")
        self.base_url = text.split(marker, 1)[1].split(" ", 1)[0]
        return self.base_url

    async def stop(self, grace: float = 10.0) -> int:
        """SIGTERM, then wait for the exit (SIGKILL after ``grace`` seconds). Returns the exit code."""
        return await self._end(signal.SIGTERM, grace)

    async def kill(self) -> int:
        """SIGKILL (simulates a crash) and reap. Returns the exit code (negative signal number)."""
        return await self._end(signal.SIGKILL, 10.0)

    async def _end(self, signum: int, grace: float) -> int:
        process = self.process
        if process is None:
            return 0
        if process.returncode is None:
            process.send_signal(signum)
            with trio.move_on_after(grace):
                await process.wait()
            if process.returncode is None:
                process.kill()
        code = await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()
        return code

    def admin(self) -> AdminClient:
        """A new AdminClient for the current URL (use it as an async context manager)."""
        assert self.base_url is not None, "start() first"
        return AdminClient(self.base_url, self.admin_token)


@pytest.fixture
async def dev_master_process(tmp_path: Path) -> AsyncIterator[DevMasterProcess]:
    """A not-yet-started ``DevMasterProcess`` on ``tmp_path``; killed after the test if still running."""
    handle = DevMasterProcess(tmp_path)
    try:
        yield handle
    finally:
        with trio.CancelScope(shield=True):
            await handle.kill()


# ------------------------------------------------------------------------------------ the suite's clock

SLOW_SECONDS = 5.0
"""A test that takes longer than this (wall, setup + call + teardown) is marked ``slow``."""

SLOW: tuple[str, ...] = (
    # end to end through and through: real agents (in process or not) with real spiders, run.sh,
    # zipapp builds, package installs, outages
    "test_runsh.py", "test_adoption_runsh.py", "test_pyz.py", "test_release.py", "test_shutdown.py",
    "test_crawl_stats_e2e.py", "test_delivery_faults.py", "test_containment.py", "test_adoption.py",
    "test_claims_e2e.py", "test_agent_e2e.py", "test_refusals.py", "test_diskfull.py",
    "test_artifacts_delivery.py", "test_outputs_e2e.py", "test_e2e_smoke.py", "test_hostile_spider.py",
    "test_task_setup_failure.py", "test_recovery.py", "test_real_spiders.py", "test_bench_smoke.py",
    "test_bench_flood_smoke.py", "test_outputs_examples.py", "test_public_examples.py",
    "test_scrapy_anyhow.py", "test_node_sigterm_e2e.py",
    # a dev master in its own process, restarted
    "fixture:dev_master_process",
)
"""Marked ``slow`` here as a whole (entries as in :data:`SERIAL_GROUPS`); single tests elsewhere carry
``@pytest.mark.slow`` in their file. The summary of every run lists the tests over
:data:`SLOW_SECONDS` that are marked neither way."""

_STARTED = pytest.StashKey[tuple[float, float]]()

# ----------------------------------------------------------------- what must not run side by side (xdist)

SERIAL_GROUPS: dict[str, tuple[str, ...]] = {
    # useradd/userdel lock /etc/passwd and /etc/group: two at once fail ("cannot lock /etc/passwd")
    "system-users": ("fixture:spider_user", "fixture:demo_user", "fixture:agent_user", "fixture:runsh_user",
                     "test_runsh.py::test_spider_user_is_created_on_request_and_remembered"),
    # the session's runs of the sdk/examples spiders (tests/harness/examples.py) are per process: the tests
    # that read them share a worker, so each example runs once per path
    "example-runs": ("fixture:example_runs",),
}
"""Tests that share a machine-wide resource, by group: ``./scripts/test`` runs the suite with
``--dist loadgroup``, which runs each group's tests in one worker, one after the other. An entry is a
test file, a ``file::test`` node id prefix, or ``fixture:NAME`` (every test that uses that fixture).

What needs no group: nft tables, cgroups, task directories and ports are named per test (the agent's
group and table names come from its work_dir under ``tmp_path``; ports are 0); the session's
ckagent.pyz and run.sh's bumped release are built once for all workers under a file lock
(``session_build`` in tests/test_pyz.py), so test_runsh.py's tests spread over the workers too."""


def _is_member(item: pytest.Item, members: tuple[str, ...]) -> bool:
    nodeid = item.nodeid.removeprefix("tests/")
    fixtures = set(getattr(item, "fixturenames", ()))
    for member in members:
        if member.startswith("fixture:") and member.removeprefix("fixture:") in fixtures:
            return True
        if nodeid == member or nodeid.startswith((member + "::", member + "[")):
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before -m selects: the markers added here count
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    xdist = config.pluginmanager.hasplugin("xdist")  # without it (-p no:xdist) nothing runs side by side
    for item in items:
        if _is_member(item, SLOW):
            item.add_marker(pytest.mark.slow)
        if not xdist:
            continue
        for group, members in SERIAL_GROUPS.items():
            if _is_member(item, members):
                item.add_marker(pytest.mark.xdist_group(group))
                break
    if xdist:
        # The slow tests first (a stable sort: each kind keeps its order), so that the workers end
        # on short tests together instead of one worker's last minutes going to one long test.
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--file-times", action="store_true",
                     help="after the run, print wall and CPU seconds per test file (CPU: the test "
                          "process's own and that of the child processes it reaped)")


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_STARTED] = (time.perf_counter(), _cpu_seconds())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    started = item.stash.get(_STARTED, None)
    if report.when == "teardown" and started is not None:
        wall, cpu = time.perf_counter() - started[0], _cpu_seconds() - started[1]
        # user_properties travel with the report to the controller under pytest-xdist
        report.user_properties.append(("wall_seconds", round(wall, 3)))
        report.user_properties.append(("cpu_seconds", round(cpu, 3)))
        report.user_properties.append(("marked_slow", item.get_closest_marker("slow") is not None))
    return report


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    measured: dict[str, dict[str, Any]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) == "teardown" and report.user_properties:
                measured[report.nodeid] = dict(report.user_properties)
    unmarked = sorted(((m["wall_seconds"], nodeid) for nodeid, m in measured.items()
                       if m.get("wall_seconds", 0) > SLOW_SECONDS and not m.get("marked_slow")), reverse=True)
    if unmarked:
        terminalreporter.write_sep("=", f"{len(unmarked)} tests over {SLOW_SECONDS:g} s not marked slow")
        for wall, nodeid in unmarked:
            terminalreporter.write_line(f"{wall:8.1f} s  {nodeid}")
    if config.getoption("file_times"):
        files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        for nodeid, m in measured.items():
            row = files[nodeid.split("::", 1)[0]]
            row[0] += m.get("wall_seconds", 0.0)
            row[1] += m.get("cpu_seconds", 0.0)
            row[2] += 1
        terminalreporter.write_sep("=", "wall and CPU seconds per test file")
        terminalreporter.write_line(f"{'wall s':>9} {'cpu s':>9} {'tests':>6}  file")
        for name, (wall, cpu, count) in sorted(files.items(), key=lambda kv: -kv[1][0]):
            terminalreporter.write_line(f"{wall:9.1f} {cpu:9.1f} {int(count):6d}  {name}")
        total = [sum(row[i] for row in files.values()) for i in range(3)]
        terminalreporter.write_line(f"{total[0]:9.1f} {total[1]:9.1f} {int(total[2]):6d}  total")


# ------------------------------------------------------------------------------ the .pyz and run.sh (tests/harness/pyz.py, runsh.py)


@pytest.fixture(scope="session")
def pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's ckagent.pyz (built once for every worker; do not modify it: copy it)."""
    return session_pyz(tmp_path_factory)


@pytest.fixture(scope="session")
def bumped_pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real ckagent.pyz of version 99.0.0: the session's source, bumped with build/bump_version.sh.
    Built once per session for all pytest-xdist workers (test_adoption_runsh.py uses it too)."""
    return session_build(tmp_path_factory, pyz_dir(tmp_path_factory).with_name("ckagent-pyz-bumped"),
                         bump_and_build)


@pytest.fixture
def releases(tmp_path: Path) -> Iterator[Releases]:
    """A static HTTP server on 127.0.0.1 (port 0) serving a fresh release directory."""
    root = tmp_path / "releases"
    directory = root / "ckagent"
    directory.mkdir(parents=True)
    with served_directory(root) as base:
        yield Releases(f"{base}/ckagent", directory)


@pytest.fixture
def node(tmp_path: Path, dev_master) -> Iterator[RunShNode]:
    """A node directory in install mode, configured for the dev master; its agent is killed afterwards."""
    directory = tmp_path / "node"
    (directory / "config").mkdir(parents=True)
    shutil.copy2(RUN_SH, directory / "run.sh")
    port = free_port()
    config = {
        "server": {"url": dev_master.base_url},
        "agent": {"registration_token": dev_master.registration_token, "name": "runsh-node", "ip": "127.0.0.1",
                  "port": port, "max_workers": 1},
        "heartbeat": {"interval": 1},
        "task": {"poll_interval": 0.5, "long_poll_wait": 1, "kill_grace": 2, "max_stop_grace": 2, "drain_timeout": 5},
    }
    (directory / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "SHIV_", "PYTHONPATH"))}
    env.update(AGENT_START_TIMEOUT="30", AGENT_DOWNLOAD_TIMEOUT="30")
    handle = RunShNode(directory, port, env)
    try:
        yield handle
    finally:
        pid = handle.pid()
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)

@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, restored after the test (setup_logging replaces its handlers)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield root
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            if handler not in handlers:
                handler.close()
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
