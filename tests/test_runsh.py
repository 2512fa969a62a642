"""run.sh driven for real: bash, a release index served over HTTP on 127.0.0.1, the session's ckagent.pyz
(and a real rebuilt one with a bumped version), real agents against the in-process dev master.

Each test gets a node directory holding only run.sh and config/config.yaml (install mode), like an
operator's server. The one stand-in is the "broken release" of the rollback test: a tiny zipapp
that answers ``version`` but never serves /healthz.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import trio
import yaml
from harness import (
    BUMPED,
    REPO,
    RUN_SH,
    EnvironProbe,
    Releases,
    RunShNode,
    eventually,
    failed_versions,
    free_port,
    last_change,
    node_registered,
    out,
    pid_alive,
    same,
)

import ckagent

BROKEN = "100.0.0"


_BROKEN_MAIN = f"""
import signal, sys, time
if sys.argv[1:2] == ["version"]:
    print("ckagent {BROKEN} (a release that never becomes healthy)")
    sys.exit(0)
if sys.argv[1:3] == ["config", "check"]:  # run.sh checks the release before it stops the agent
    print("config OK: (a release that never becomes healthy)")
    sys.exit(0)
if sys.argv[1:2] == ["config"]:
    sys.exit(2)
signal.signal(signal.SIGTERM, lambda *args: sys.exit(0))
while True:
    time.sleep(1)
"""


@pytest.fixture(scope="session")
def broken_pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A zipapp that passes run.sh's `version` check but never answers /healthz."""
    path = tmp_path_factory.mktemp("broken") / "ckagent.pyz"
    with path.open("wb") as out:
        out.write(b"#!/usr/bin/env python3\n")
        with zipfile.ZipFile(out, "w") as archive:
            archive.writestr("__main__.py", _BROKEN_MAIN)
            archive.writestr("site-packages/ckagent/__init__.py", f'__version__ = "{BROKEN}"\n')
    return path


CRASHING = "101.0.0"


@pytest.fixture(scope="session")
def crashing_pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A zipapp that passes run.sh's `version` check and exits 1 as soon as it is started."""
    path = tmp_path_factory.mktemp("crashing") / "ckagent.pyz"
    main = _BROKEN_MAIN.replace(BROKEN, CRASHING).replace("signal.signal(", "sys.exit(1)\nsignal.signal(")
    with path.open("wb") as out:
        out.write(b"#!/usr/bin/env python3\n")
        with zipfile.ZipFile(out, "w") as archive:
            archive.writestr("__main__.py", main)
            archive.writestr("site-packages/ckagent/__init__.py", f'__version__ = "{CRASHING}"\n')
    return path


def _saved_args(node: RunShNode) -> list[bytes]:
    return (node.directory / ".last_daemon_args").read_bytes().split(b"\0")


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


async def test_install_mode_downloads_starts_reports_and_stops(node: RunShNode, releases: Releases, pyz: Path,
                                                                dev_master) -> None:
    refused = await node.sh("start", "--daemon=on", AGENT_AUTO_INSTALL="off", AGENT_RELEASE_URL=releases.url)
    assert refused.returncode == 1
    assert "AGENT_AUTO_INSTALL=off" in out(refused) and "sha256sum -c" in out(refused)
    assert f"{releases.url}/latest.json" in out(refused)
    assert not (node.directory / "ckagent.pyz").exists()

    releases.publish(pyz, ckagent.__version__)
    started = await node.sh("start", "--daemon=on", AGENT_RELEASE_URL=releases.url)
    assert started.returncode == 0, out(started)
    assert "started" in out(started)
    assert same((node.directory / "ckagent.pyz"), pyz)
    pid = node.pid()
    assert pid is not None and pid_alive(pid)
    saved = _saved_args(node)
    assert saved[:2] == [b"-c", str(node.directory / "config" / "config.yaml").encode()]
    assert list((node.directory / ".ckagent" / "pyz").glob("ckagent.pyz_*/site-packages/ckagent"))
    assert (node.directory / "data" / "state.db").exists(), "work_dir ./data is next to run.sh"
    await node_registered(dev_master)
    assert await node.healthz() == 200

    status = await node.sh("status")
    assert status.returncode == 0 and f"pid {pid}" in out(status) and "200" in out(status), out(status)
    logs = await node.sh("logs", "--follow=off")
    assert logs.returncode == 0 and "registered" in out(logs)
    again = await node.sh("start", "--daemon=on")
    assert again.returncode == 0 and "already running" in out(again) and node.pid() == pid

    restarted = await node.sh("restart")
    assert restarted.returncode == 0, out(restarted)
    new_pid = node.pid()
    assert new_pid is not None and new_pid != pid and not pid_alive(pid) and pid_alive(new_pid)
    assert _saved_args(node)[:2] == saved[:2]

    stopped = await node.sh("stop")
    # the bound comes from the config: drain_timeout 5 + max(kill_grace 2, max_stop_grace 2) + flush_timeout 10 + 10
    assert stopped.returncode == 0 and "up to 27s" in out(stopped) and "SIGKILL" not in out(stopped), out(stopped)
    assert not pid_alive(new_pid) and node.pid() is None
    assert "ckagent stopped" in (node.directory / "logs" / "agent.log").read_text()
    down = await node.sh("status")
    assert down.returncode == 3 and "not running" in out(down)


async def test_start_and_status_fail_for_an_agent_that_does_not_answer(node: RunShNode, releases: Releases, pyz: Path,
                                                                       broken_pyz: Path, dev_master) -> None:
    releases.publish(pyz, ckagent.__version__)
    assert (await node.sh("start", "--daemon=on", AGENT_RELEASE_URL=releases.url)).returncode == 0
    pid = node.pid()
    assert pid is not None
    # running, but /healthz (here: a port nothing listens on) does not answer: status 4, start 1
    deaf = f"http://127.0.0.1:{free_port()}/healthz"
    status = await node.sh("status", AGENT_HEALTH_URL=deaf)
    assert status.returncode == 4 and "does not answer" in out(status) and "000" in out(status), out(status)
    again = await node.sh("start", "--daemon=on", AGENT_HEALTH_URL=deaf)
    assert again.returncode == 1 and "already running" in out(again) and "restart" in out(again), out(again)
    assert (await node.sh("stop")).returncode == 0 and not pid_alive(pid)
    # a release that hangs at start: start fails, prints the end of the log, leaves nothing running
    shutil.copyfile(broken_pyz, node.directory / "ckagent.pyz")
    hung = await node.sh("start", "--daemon=on", AGENT_START_TIMEOUT="2")
    assert hung.returncode == 1, out(hung)
    assert "did not answer" in out(hung) and "within 2s" in out(hung) and "The end of" in out(hung), out(hung)
    assert node.pid() is None
    assert (await node.sh("status")).returncode == 3


async def test_start_waits_for_ready_and_prints_the_first_clear_error(node: RunShNode, releases: Releases, pyz: Path,
                                                                     dev_master) -> None:
    releases.publish(pyz, ckagent.__version__)
    probe = EnvironProbe(node.directory.parent / "probe")  # (the agent's environ is root's to read)
    wrong = await node.sh("start", "--daemon=on", AGENT_RELEASE_URL=releases.url,
                          AGENT_REGISTRATION_TOKEN="not-the-token-0123456789", **probe.env)
    assert wrong.returncode == 1, out(wrong)
    assert "not ready: registration refused: 401, check AGENT_REGISTRATION_TOKEN" in out(wrong), out(wrong)
    assert "not-the-token" not in out(wrong)
    pid = node.pid()
    assert pid is not None and pid_alive(pid)  # it keeps retrying: a token fixed on the master is picked up
    # the token came in run.sh's environment: neither the agent's environ nor any other shows it
    assert b"not-the-token" not in probe.initial_environ(pid)
    assert b"CKAGENT_SECRETS_FD=" in probe.initial_environ(pid)
    stopped = await node.sh("stop")
    assert stopped.returncode == 0 and not pid_alive(pid), out(stopped)
    started = await node.sh("start", "--daemon=on")
    assert started.returncode == 0 and "started and ready" in out(started), out(started)


async def test_daemon_log_rotates_by_the_logging_settings(node: RunShNode, releases: Releases, pyz: Path,
                                                          dev_master) -> None:
    releases.publish(pyz, ckagent.__version__)
    settings = {"AGENT_RELEASE_URL": releases.url, "AGENT_LOG_MAX_BYTES": "1024", "AGENT_LOG_BACKUP_COUNT": "2"}
    logs = node.directory / "logs"
    for _ in range(8):  # each start and stop writes ~0.8 KB
        started = await node.sh("--daemon=on", "start", **settings)
        assert started.returncode == 0, out(started)
        assert (await node.sh("stop", **settings)).returncode == 0
        if (logs / "agent.log.2").exists():
            break
    assert sorted(p.name for p in logs.iterdir()) == ["agent.log", "agent.log.1", "agent.log.2"]
    for path in logs.iterdir():
        assert path.stat().st_size <= 1024, (path, path.stat().st_size)
    assert "ckagent stopped" in (logs / "agent.log").read_text()


async def test_stop_escalates_to_sigkill_after_the_bound(node: RunShNode, releases: Releases, pyz: Path,
                                                         dev_master) -> None:
    releases.publish(pyz, ckagent.__version__)
    assert (await node.sh("start", "--daemon=on", AGENT_RELEASE_URL=releases.url)).returncode == 0
    pid = node.pid()
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # a stuck agent: SIGTERM stays pending
    stopped = await node.sh("stop", AGENT_STOP_TIMEOUT="1")
    assert stopped.returncode == 0 and "SIGKILL" in out(stopped), out(stopped)
    assert not pid_alive(pid)
    assert (await node.sh("status")).returncode == 3


async def test_foreground_start_runs_in_place_and_drains_on_sigterm(node: RunShNode, releases: Releases, pyz: Path,
                                                                    dev_master) -> None:
    releases.publish(pyz, ckagent.__version__)
    stderr = (node.directory.parent / "foreground.stderr").open("wb")  # what systemd's journal would get
    process = await trio.lowlevel.open_process(
        ["bash", str(node.run_sh), "start"], env={**node.env, "AGENT_RELEASE_URL": releases.url},
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
    )
    try:
        await node_registered(dev_master)
        assert node.pid() == process.pid, "run.sh execs the agent: agent.pid is the foreground process"
        assert (await node.sh("status")).returncode == 0
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(40):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(10, shield=True):  # a cancelled test still reaps the agent
                await process.wait()
    stderr.close()
    journal = (node.directory.parent / "foreground.stderr").read_text()
    assert "registered" in journal and "draining" in journal and "ckagent stopped" in journal
    log = node.directory / "logs" / "agent.log"
    assert not log.exists() or "draining" not in log.read_text(), "in the foreground the log goes to stderr"
    assert not (node.directory / ".last_daemon_args").exists()


async def test_cleanup_temp_files_removes_stale_extractions_and_partial_deployments(
    node: RunShNode, releases: Releases, pyz: Path, dev_master
) -> None:
    releases.publish(pyz, ckagent.__version__)
    stale = node.directory / ".ckagent" / "pyz" / f"ckagent.pyz_{'a' * 64}"
    (stale / "site-packages").mkdir(parents=True)
    (stale.parent / f".{stale.name}_lock").touch()
    partial = node.directory / ".ckagent" / "ckagent-9.9.9.pyz.part"
    partial.write_bytes(b"half")
    deploy = node.directory / "data" / "spiders" / "s1" / ".deploy-x1"
    deploy.mkdir(parents=True)
    kept = node.directory / "data" / "spiders" / "s1" / "code"
    kept.mkdir()
    # a task the master has fully acknowledged (deleted) and one it has not (kept)
    from ckagent.node.state import StateStore

    store = StateStore(node.directory / "data" / "state.db")
    for task_id, acked in (("t-acked", True), ("t-pending", False)):
        task_dir = node.directory / "data" / "tasks" / task_id
        task_dir.mkdir(parents=True)
        (task_dir / "output.log").write_text("spider output\n")
        store.add_task(task_id, "s1", {"id": task_id}, task_dir)
        store.set_result(task_id, {"status": "SUCCESS"})
        if acked:
            store.mark_result_acked(task_id)
    store.close()
    # the form crawlerkeeper-agent's operators use: flags before the command
    started = await node.sh("--cleanup_temp_files=on", "--daemon=on", "start", AGENT_RELEASE_URL=releases.url)
    assert started.returncode == 0, out(started)
    assert not stale.exists() and not partial.exists() and not deploy.exists() and kept.exists()
    tasks = node.directory / "data" / "tasks"
    await eventually(lambda: trio.to_thread.run_sync(lambda: not (tasks / "t-acked").exists()), 30)
    assert (tasks / "t-pending" / "output.log").exists()
    assert len(list((node.directory / ".ckagent" / "pyz").glob("ckagent.pyz_*"))) == 1
    assert (await node.sh("stop")).returncode == 0


@pytest.mark.slow
async def test_upgrade_verifies_never_downgrades_restarts_and_rolls_back(
    node: RunShNode, releases: Releases, pyz: Path, bumped_pyz: Path, dev_master
) -> None:
    env = {"AGENT_RELEASE_URL": releases.url, "AGENT_UPGRADE_HEALTH_TIMEOUT": "20"}
    pyz_path = node.directory / "ckagent.pyz"
    prev_path = node.directory / "ckagent.pyz.prev"
    releases.publish(pyz, ckagent.__version__)
    assert (await node.sh("start", "--daemon=on", **env)).returncode == 0
    first_pid = node.pid()

    # dry run: says what it would do, changes nothing
    releases.publish(bumped_pyz, BUMPED)
    dry = await node.sh("upgrade", AGENT_UPGRADE_DRY_RUN="on", **env)
    assert dry.returncode == 0 and "dry run" in out(dry) and BUMPED in out(dry), out(dry)
    assert same(pyz_path, pyz) and not prev_path.exists() and node.pid() == first_pid

    # corrupt download: sha256 mismatch → nothing replaced, agent untouched
    releases.publish(bumped_pyz, BUMPED, sha256="0" * 64)
    corrupt = await node.sh("upgrade", **env)
    assert corrupt.returncode == 1 and "sha256 mismatch" in out(corrupt), out(corrupt)
    assert same(pyz_path, pyz) and not prev_path.exists()
    assert node.pid() == first_pid and first_pid is not None and pid_alive(first_pid)
    assert not list(node.directory.rglob("*.part")) and not list(node.directory.glob(".ckagent/ckagent-*.pyz"))

    # a good release: replaced, previous kept, running agent restarted on it and healthy
    releases.publish(bumped_pyz, BUMPED)
    upgraded = await node.sh("upgrade", **env)
    assert upgraded.returncode == 0 and f"upgraded to {BUMPED}: healthy" in out(upgraded), out(upgraded)
    assert same(pyz_path, bumped_pyz) and same(prev_path, pyz)
    second_pid = node.pid()
    assert second_pid != first_pid and not pid_alive(first_pid) and await node.healthz() == 200
    async def reported_new_version() -> bool:
        return any(n.get("version") == BUMPED for n in await dev_master.admin.list_nodes())

    await eventually(reported_new_version, 30)
    status = await node.sh("status")
    assert status.returncode == 0 and f"ckagent {BUMPED} is running" in out(status)

    # an older version only when asked with --downgrade; nothing to do at the same version
    older = await node.sh("upgrade", ckagent.__version__, **env)
    assert older.returncode == 1 and "not downgrading" in out(older) and "--downgrade" in out(older), out(older)
    current = await node.sh("upgrade", **env)
    assert current.returncode == 0 and "nothing to do" in out(current)
    assert same(pyz_path, bumped_pyz) and node.pid() == second_pid


@pytest.mark.slow
async def test_rollback_goes_back_and_is_remembered_and_a_named_version_goes_either_way(
    node: RunShNode, releases: Releases, pyz: Path, bumped_pyz: Path, dev_master
) -> None:
    """The middle of the upgrade story above (its own test, so that the parts run side by side): the
    node as an upgrade from the session's version to 99.0.0 leaves it (ckagent.pyz 99.0.0, the
    previous one kept as ckagent.pyz.prev), running."""
    env = {"AGENT_RELEASE_URL": releases.url, "AGENT_UPGRADE_HEALTH_TIMEOUT": "20"}
    pyz_path = node.directory / "ckagent.pyz"
    prev_path = node.directory / "ckagent.pyz.prev"
    releases.publish(pyz, ckagent.__version__)
    releases.publish(bumped_pyz, BUMPED)
    shutil.copy2(bumped_pyz, pyz_path)
    shutil.copy2(pyz, prev_path)
    assert (await node.sh("start", "--daemon=on", **env)).returncode == 0
    second_pid = node.pid()
    assert second_pid is not None

    # rollback: back to the previous verified release, healthy; the release left is not taken again
    back = await node.sh("rollback", **env)
    assert back.returncode == 0 and f"rolled back to {ckagent.__version__}: healthy" in out(back), out(back)
    assert same(pyz_path, pyz) and same(prev_path, bumped_pyz)
    rolled_pid = node.pid()
    assert rolled_pid not in (None, second_pid) and await node.healthz() == 200
    change = last_change(node)
    assert (change["action"], change["from"], change["to"], change["outcome"]) == (
        "rollback", BUMPED, ckagent.__version__, "healthy"), change
    skipped = await node.sh("upgrade", **env)
    assert skipped.returncode == 0 and f"not retrying ckagent {BUMPED}" in out(skipped), out(skipped)
    # named by the operator: upgraded again (the same verification and health check)
    forward = await node.sh("upgrade", BUMPED, **env)
    assert forward.returncode == 0 and f"upgraded to {BUMPED}: healthy" in out(forward), out(forward)
    # a downgrade asked for explicitly: verified, health-checked
    down = await node.sh("upgrade", "--downgrade", ckagent.__version__, **env)
    assert down.returncode == 0 and f"upgraded to {ckagent.__version__}: healthy" in out(down), out(down)
    assert same(pyz_path, pyz) and same(prev_path, bumped_pyz)
    forward = await node.sh("upgrade", BUMPED, **env)
    assert forward.returncode == 0 and same(pyz_path, bumped_pyz), out(forward)


@pytest.mark.slow
async def test_a_failed_upgrade_is_rolled_back_and_remembered_and_a_bad_version_refused(
    node: RunShNode, releases: Releases, bumped_pyz: Path, broken_pyz: Path, crashing_pyz: Path, dev_master
) -> None:
    """The end of the upgrade story above (its own test, so that the parts run side by side): an
    agent installed and running at version 99.0.0 meets releases that fail."""
    env = {"AGENT_RELEASE_URL": releases.url, "AGENT_UPGRADE_HEALTH_TIMEOUT": "20"}
    pyz_path = node.directory / "ckagent.pyz"
    releases.publish(bumped_pyz, BUMPED)
    assert (await node.sh("start", "--daemon=on", **env)).returncode == 0
    assert same(pyz_path, bumped_pyz)
    second_pid = node.pid()

    # a release that never becomes healthy: rolled back to the previous pyz, which runs again
    releases.publish(broken_pyz, BROKEN)
    failed = await node.sh("upgrade", AGENT_UPGRADE_HEALTH_TIMEOUT="3", AGENT_START_TIMEOUT="1",
                           AGENT_RELEASE_URL=releases.url)
    assert failed.returncode == 1 and "rolled back" in out(failed), out(failed)
    assert same(pyz_path, bumped_pyz)
    third_pid = node.pid()
    assert third_pid not in (None, second_pid) and pid_alive(third_pid)
    async def healthy() -> bool:
        return await node.healthz() == 200

    await eventually(healthy, 30)
    assert list(node.directory.glob(f".ckagent/ckagent-{BROKEN}.failed.pyz"))
    # the previous release came back healthy: the new one failed, and is marked so
    assert failed_versions(node) == [BROKEN]
    assert "rolled back: ckagent 99.0.0 is running (pid" in out(failed) and "and healthy" in out(failed), out(failed)
    change = last_change(node)
    assert (change["action"], change["from"], change["to"], change["outcome"]) == (
        "upgrade", BUMPED, BROKEN, "rolled-back"), change

    # the failed version is remembered: not tried again from latest.json (nor when the agent asks) ...
    again = await node.sh("upgrade", **env)
    assert again.returncode == 0 and f"not retrying ckagent {BROKEN}" in out(again), out(again)
    auto = await node.sh("upgrade", BROKEN, AGENT_UPGRADE_AUTO="on", **env)
    assert auto.returncode == 0 and f"not retrying ckagent {BROKEN}" in out(auto), out(auto)
    assert same(pyz_path, bumped_pyz) and node.pid() == third_pid

    # a release version that is not PEP 440 is refused before anything is downloaded
    releases.publish(bumped_pyz, "banana")
    banana = await node.sh("upgrade", **env)
    assert banana.returncode == 1 and "'banana', which is not a PEP 440 version; nothing was downloaded" in out(banana)
    assert not list(node.directory.glob(".ckagent/ckagent-banana*"))
    bad_name = await node.sh("upgrade", "latest-please", **env)
    assert bad_name.returncode == 2 and "not a PEP 440 version: 'latest-please'" in out(bad_name)

    # a release that exits during its start is rolled back at once, not after the health timeout
    releases.publish(crashing_pyz, CRASHING)
    began = trio.current_time()
    crashed = await node.sh("upgrade", AGENT_UPGRADE_HEALTH_TIMEOUT="120", AGENT_RELEASE_URL=releases.url)
    assert crashed.returncode == 1 and "exited during its start" in out(crashed), out(crashed)
    assert trio.current_time() - began < 60, "rolled back without waiting out the 120 s health timeout"
    assert same(pyz_path, bumped_pyz)
    await eventually(healthy, 30)

    # not running: the new file is installed, nothing is started
    assert (await node.sh("stop")).returncode == 0
    releases.publish(bumped_pyz, "99.1.0")  # the bumped pyz under a newer index entry
    quiet = await node.sh("upgrade", **env)
    assert quiet.returncode == 1 and "nothing was replaced" in out(quiet), out(quiet)
    assert same(pyz_path, bumped_pyz), "a file that reports another version is refused"
    releases.publish(broken_pyz, BROKEN)
    installed = await node.sh("upgrade", BROKEN, **env)  # named by the operator: tried again
    assert installed.returncode == 0 and "not running: not starting it" in out(installed), out(installed)
    assert same(pyz_path, broken_pyz) and node.pid() is None
    assert (await node.sh("status")).returncode == 3


async def test_source_mode_runs_the_checkouts_virtualenv(tmp_path: Path, dev_master) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy2(RUN_SH, checkout / "run.sh")
    shutil.copy2(REPO / "pyproject.toml", checkout / "pyproject.toml")
    (checkout / "ckagent").symlink_to(REPO / "ckagent")
    (checkout / ".venv").symlink_to(REPO / ".venv")
    port = free_port()
    (checkout / "agent.yaml").write_text(yaml.safe_dump({
        "server": {"url": dev_master.base_url},
        "agent": {"registration_token": dev_master.registration_token, "name": "source-node", "ip": "127.0.0.1",
                  "port": port},
        "heartbeat": {"interval": 1},
        "task": {"drain_timeout": 2, "kill_grace": 1, "long_poll_wait": 1},
    }))
    node = RunShNode(checkout, port, {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "PYTHONPATH"))})
    try:
        started = await trio.run_process(["bash", "run.sh", "start", "--daemon=on", "-c", "agent.yaml"],
                                         cwd=checkout, env=node.env, capture_stdout=True, capture_stderr=True,
                                         check=False)
        assert started.returncode == 0, out(started)
        await node_registered(dev_master, "source-node")
        status = await node.sh("status")
        assert status.returncode == 0 and "source mode" in out(status)
        pid = node.pid()
        assert pid is not None and b"-m\0ckagent" in _cmdline(pid)
        upgrade = await node.sh("upgrade")
        assert upgrade.returncode == 1 and "source mode" in out(upgrade)
        assert not (checkout / "ckagent.pyz").exists()
        assert (await node.sh("stop")).returncode == 0
    finally:
        pid = node.pid()
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_shell_scripts_pass_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("NOT LINTED: shellcheck is not installed (apt-get install shellcheck)")
    scripts = [RUN_SH, REPO / "build" / "publish.sh", REPO / "build" / "bump_version.sh",
               REPO / "sdk" / "python" / "publish.sh"]
    result = subprocess.run([shellcheck, "--severity=style", *map(str, scripts)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout


def _sh(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(cwd / "run.sh"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False, env={k: v for k, v in os.environ.items() if not k.startswith("AGENT_")})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["stop", "now"], "stop takes no arguments"),
        (["status", "x"], "status takes no arguments"),
        (["frob"], "unknown command 'frob' (commands: start, stop, restart, status, logs, upgrade, rollback, help)"),
        ([], "no command given"),
        (["--daemon=maybe", "start"], "--daemon=maybe: expected on or off"),
        (["logs", "--tail"], "logs: unknown option --tail"),
        (["upgrade", "1.0", "2.0"], "upgrade takes at most one argument"),
        (["upgrade", "--downgrade"], "upgrade --downgrade needs the VERSION"),
        (["upgrade", "--sideways", "1.0"], "upgrade: unknown option --sideways"),
        (["rollback", "now"], "rollback takes no arguments"),
        (["status", "--spider-user=ck"], "--spider-user goes with start or restart"),
        (["start", "--spider-user=Bad User"], "--spider-user=Bad User: not a user name"),
        (["start", "-c"], "-c needs a file"),
    ],
)
def test_usage_errors_are_one_line_with_exit_2_and_no_stray_code(tmp_path: Path, args: list[str], message: str) -> None:
    shutil.copy2(RUN_SH, tmp_path / "run.sh")
    result = _sh(*args, cwd=tmp_path)
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert result.stderr == f"run.sh: {message}{result.stderr.split(message, 1)[1]}"
    assert result.stderr.endswith(" (./run.sh --help shows the usage)\n") and result.stderr.count("\n") == 1
    assert " 2 (" not in result.stderr and not result.stderr.rstrip().endswith(" 2")


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["help"], ["--daemon=on", "--help"]])
def test_help_prints_the_whole_header_and_exits_0(tmp_path: Path, args: list[str]) -> None:
    shutil.copy2(RUN_SH, tmp_path / "run.sh")
    result = _sh(*args, cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    header = []
    for line in RUN_SH.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        header.append(line[2:] if line.startswith("# ") else line[1:])
    assert result.stdout == "\n".join(header) + "\n"
    for word in ("--daemon=on|off", "--cleanup_temp_files=on|off", "before or after the command", "upgrade [VERSION]",
                 "AGENT_RELEASE_URL", "Exit codes (every command: 2 = usage error):", "upgrade --downgrade VERSION",
                 "rollback", "--spider-user=NAME|off", "status    0 running and /healthz 200; 3 not running; 4 running"):
        assert word in result.stdout
    # every command has its exit codes in the help, and docs/deploy.md says the same
    codes = result.stdout.split("Exit codes", 1)[1]
    deploy = (REPO / "docs" / "deploy.md").read_text()
    for command in ("start", "stop", "restart", "status", "logs", "upgrade", "rollback"):
        assert f"\n  {command} " in codes, command
        assert f"| `{command}` |" in deploy, command


def test_flags_before_or_after_the_command_are_the_same(tmp_path: Path) -> None:
    """Parsed the same both ways: the same usage error for the same bad config path."""
    shutil.copy2(RUN_SH, tmp_path / "run.sh")
    before = _sh("--cleanup_temp_files=off", "--daemon=off", "status", cwd=tmp_path)
    after = _sh("status", "--daemon=off", "--cleanup_temp_files=off", cwd=tmp_path)
    assert before.returncode == after.returncode == 3
    assert before.stdout == after.stdout and "not running" in before.stdout


def test_run_sh_state_is_ignored_by_git() -> None:
    ignored = subprocess.run(["git", "check-ignore", "--no-index", ".ckagent/pyz/x", "agent.pid", "logs/agent.log",
                              ".last_daemon_args", "ckagent.pyz.prev"],
                             cwd=REPO, capture_output=True, text=True, check=False)
    assert ignored.stdout.split() == [".ckagent/pyz/x", "agent.pid", "logs/agent.log", ".last_daemon_args",
                                      "ckagent.pyz.prev"]


EXAMPLES = REPO / "sdk" / "examples"
DEV_UV = Path(sys.executable).parent / "uv"


def _path_without_uv() -> str:
    """This PATH minus every directory holding a `uv` (a server with python3 and no uv), and every
    directory this user cannot look into (a PATH inherited from root's session by `su`)."""
    def usable(d: str) -> bool:
        try:
            return not (Path(d) / "uv").exists() and Path(d) != DEV_UV.parent and os.access(d, os.X_OK)
        except OSError:
            return False

    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep) if d and usable(d))


@pytest.mark.slow
async def test_a_bare_server_fetches_pyz_and_uv_and_runs_the_scrapy_example(
    tmp_path: Path, releases: Releases, pyz: Path, dev_master
) -> None:
    """Done-when of issue 16: a fresh directory with only run.sh and config.yaml, python3 and no uv."""
    from ckagent.devmaster.client import zip_directory

    path = _path_without_uv()
    no_uv = await trio.run_process(["bash", "-c", "command -v uv"], env={"PATH": path}, check=False)
    has_python = await trio.run_process(["bash", "-c", "command -v python3"], env={"PATH": path}, check=False)
    assert (no_uv.returncode, has_python.returncode) == (1, 0)
    releases.publish(pyz, ckagent.__version__, uv=DEV_UV)
    server = tmp_path / "server"
    server.mkdir()
    shutil.copy2(RUN_SH, server / "run.sh")
    port = free_port()
    (server / "config.yaml").write_text(yaml.safe_dump({
        "server": {"url": dev_master.base_url},
        "agent": {"registration_token": dev_master.registration_token, "name": "bare-server", "ip": "127.0.0.1",
                  "port": port},
        "heartbeat": {"interval": 1},
        "task": {"poll_interval": 0.5, "long_poll_wait": 1, "kill_grace": 2, "drain_timeout": 5},
        "deps": {"uv_sync_timeout": 400},
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "SHIV_", "PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(PATH=path, AGENT_RELEASE_URL=releases.url, AGENT_START_TIMEOUT="60")
    admin = dev_master.admin
    spider_id = await admin.create_spider(name="products", framework="scrapy")
    await admin.upload_package(spider_id, await trio.to_thread.run_sync(zip_directory, EXAMPLES / "scrapy_demo"))
    task_id = await admin.create_task(spider_id, params={"start_url": f"{dev_master.base_url}/demo-site/"})
    with trio.fail_after(120):
        started = await trio.run_process(["bash", "./run.sh", "--daemon=on", "start"], cwd=server, env=env,
                                         capture_stdout=True, capture_stderr=True, check=False)
    try:
        assert started.returncode == 0, out(started)
        assert "installing uv" in out(started)
        uv = server / ".ckagent" / "bin" / "uv"
        assert uv.read_bytes() == DEV_UV.read_bytes()
        with trio.fail_after(480):
            task = await admin.wait_task_final(task_id, 470)
        logs = await admin.get_logs(task_id)
        assert task["status"] == "SUCCESS", (task, logs[-30:])
        assert task["itemCount"] == 30

        async def reports_its_uv() -> bool:
            [node] = [n for n in await admin.list_nodes() if n["name"] == "bare-server"]
            runtimes = node["runtimes"]
            return runtimes.get("uv", {}).get("path") == str(uv) and "uv" not in runtimes.get("missing", {})

        await eventually(reports_its_uv, 30)
        assert "uv not found" not in (server / "logs" / "agent.log").read_text()
    finally:
        with trio.fail_after(120, shield=True):  # a cancelled test still stops the daemon
            await trio.run_process(["bash", "./run.sh", "stop"], cwd=server, env=env, check=False,
                                   capture_stdout=True, capture_stderr=True)


@pytest.mark.slow
async def test_a_desired_version_upgrades_the_agent_itself_and_a_bad_one_rolls_back_once(
    node: RunShNode, releases: Releases, pyz: Path, bumped_pyz: Path, broken_pyz: Path, dev_master
) -> None:
    """agent.auto_upgrade on: the master's desiredAgentVersion → the agent runs `run.sh upgrade` (drain,
    verify, swap, health check); a release that never becomes healthy is rolled back and not retried."""
    config = yaml.safe_load((node.directory / "config" / "config.yaml").read_text())
    config["agent"]["auto_upgrade"] = True
    (node.directory / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    env = {"AGENT_RELEASE_URL": releases.url, "AGENT_UPGRADE_HEALTH_TIMEOUT": "5", "AGENT_START_TIMEOUT": "10"}
    releases.publish(pyz, ckagent.__version__)
    assert (await node.sh("--daemon=on", "start", **env)).returncode == 0
    first = node.pid()
    await node_registered(dev_master)
    admin = dev_master.admin

    releases.publish(bumped_pyz, BUMPED)
    await admin.set_agent_versions(None, BUMPED)

    async def runs_bumped() -> bool:
        return any(n.get("version") == BUMPED and n.get("lastHeartbeat") for n in await admin.list_nodes()) and (
            await node.healthz() == 200)

    await eventually(runs_bumped, 90)
    second = node.pid()
    assert second not in (None, first) and same(node.directory / "ckagent.pyz", bumped_pyz)
    upgrade_log = node.directory / "logs" / "upgrade.log"

    async def upgrade_done() -> bool:
        return f"upgraded to {BUMPED}: healthy" in upgrade_log.read_text()

    await eventually(upgrade_done, 30)
    assert f"upgrading to agent version {BUMPED} as the master asks" in (node.directory / "logs" / "agent.log").read_text()

    releases.publish(broken_pyz, BROKEN, latest=False)
    await admin.set_agent_versions(None, BROKEN)

    async def rolled_back_and_not_retried() -> bool:
        text = upgrade_log.read_text()
        return "rolled back" in text and f"not retrying ckagent {BROKEN}" in text

    await eventually(rolled_back_and_not_retried, 120)
    assert same(node.directory / "ckagent.pyz", bumped_pyz)
    assert (node.directory / ".ckagent" / "failed_versions").read_text() == f"{BROKEN}\n"

    async def healthy_again() -> bool:
        return await node.healthz() == 200

    await eventually(healthy_again, 30)
    assert node.pid() not in (None, second)
    assert (await node.sh("stop")).returncode == 0


def test_spider_user_is_created_on_request_and_remembered(tmp_path: Path) -> None:
    """`--spider-user=NAME` creates a system user without login when missing (root only) and keeps the
    choice for later starts; the user is removed again afterwards, also on failure."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd")
    name = f"ckspider{os.getpid() % 100000}"
    assert subprocess.run(["id", "-u", name], capture_output=True, check=False).returncode != 0, "name taken"
    shutil.copy2(RUN_SH, tmp_path / "run.sh")
    try:
        # no ckagent.pyz and AGENT_AUTO_INSTALL=off: the start itself fails after the user is made
        result = subprocess.run(["bash", str(tmp_path / "run.sh"), f"--spider-user={name}", "start"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=60, check=False,
                                env={**{k: v for k, v in os.environ.items() if not k.startswith("AGENT_")},
                                     "AGENT_AUTO_INSTALL": "off"})
        assert f"created the system user {name}" in result.stdout, result
        assert result.returncode == 1 and "AGENT_AUTO_INSTALL=off" in result.stderr, result
        entry = subprocess.run(["getent", "passwd", name], capture_output=True, text=True, check=True).stdout
        assert entry.rstrip().endswith(":/usr/sbin/nologin") and ":0:" not in entry.split(":", 3)[2], entry
        assert (tmp_path / ".ckagent" / "spider_user").read_text() == f"{name}\n"
        off = subprocess.run(["bash", str(tmp_path / "run.sh"), "--spider-user=off", "start"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, check=False,
                             env={"PATH": os.environ["PATH"], "AGENT_AUTO_INSTALL": "off"})
        assert off.returncode == 1 and not (tmp_path / ".ckagent" / "spider_user").exists(), off
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)
        subprocess.run(["groupdel", name], capture_output=True, check=False)
