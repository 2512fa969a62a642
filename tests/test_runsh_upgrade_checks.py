"""Upgrades and restarts that cannot take a healthy node down (issue 36, item 3), driven for real: bash
run.sh, the session's ckagent.pyz and its bumped rebuild served over HTTP on 127.0.0.1, real agents
against the in-process dev master, /healthz polled all through each command.

Before the running agent stops, run.sh checks what it will start: the release runs here and its
`config check` accepts this node's config and environment (the spider user can run the interpreter)
and a registration token reaches it. A refusal stops nothing, replaces nothing and marks no version
failed; a rollback says the node's true state, with an exit code `status` agrees with. The stand-in
releases (a release whose check crashes, one that leaves a stray process on the agent's port) are
zipapps from harness.runsh.stand_in_release.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml
from harness import (
    BUMPED,
    NOBODY,
    OTHER_USER_PYTHON,
    RUN_SH,
    Releases,
    RunShNode,
    SystemUser,
    eventually,
    failed_versions,
    free_port,
    last_change,
    node_registered,
    out,
    pid_alive,
    same,
    stand_in_release,
    unprivileged_user,
    watch_health,
)

import ckagent

pytestmark = pytest.mark.slow

ENV = {"AGENT_UPGRADE_HEALTH_TIMEOUT": "20"}


def _config(node: RunShNode) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((node.directory / "config" / "config.yaml").read_text())
    return loaded


def _write_config(node: RunShNode, config: dict[str, Any]) -> None:
    (node.directory / "config" / "config.yaml").write_text(yaml.safe_dump(config))


def _token_from_the_environment(node: RunShNode) -> str:
    """Take the registration token out of the node's config; returns it (to give in the environment)."""
    config = _config(node)
    token: str = config["agent"].pop("registration_token")
    _write_config(node, config)
    return token


async def _start(node: RunShNode, releases: Releases, pyz: Path, **env: str) -> int:
    releases.publish(pyz, ckagent.__version__)
    started = await node.sh("start", "--daemon=on", AGENT_RELEASE_URL=releases.url, **ENV, **env)
    assert started.returncode == 0, out(started)
    pid = node.pid()
    assert pid is not None and await node.healthz() == 200
    return pid


def _untouched(node: RunShNode, pid: int, pyz: Path) -> None:
    """Nothing stopped, nothing replaced, nothing marked failed, no download left behind."""
    assert node.pid() == pid and pid_alive(pid)
    assert same(node.directory / "ckagent.pyz", pyz) and not (node.directory / "ckagent.pyz.prev").exists()
    assert failed_versions(node) == []
    assert not list(node.directory.glob(".ckagent/ckagent-*.pyz")) and not (node.directory / ".ckagent" / "check").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="reading the running agent's credentials needs root (the agent is "
                    "non-dumpable); the refusal a plain user gets instead is "
                    "test_a_plain_user_without_the_token_is_refused_before_anything_stops")
async def test_an_upgrade_from_a_shell_without_the_token_hands_the_running_agents_token_on(
        node: RunShNode, releases: Releases, pyz: Path, bumped_pyz: Path, dev_master: Any) -> None:
    """The node was started with AGENT_REGISTRATION_TOKEN in its environment; `run.sh upgrade` from a
    shell without it: as root run.sh reads the running agent's credentials (its memory file) and hands
    them on, so the new release registers. (Without root it refuses: the next test.)"""
    token = _token_from_the_environment(node)
    first = await _start(node, releases, pyz, AGENT_REGISTRATION_TOKEN=token)
    await node_registered(dev_master)
    releases.publish(bumped_pyz, BUMPED)
    upgraded = await node.sh("upgrade", AGENT_RELEASE_URL=releases.url, **ENV)
    assert upgraded.returncode == 0 and f"upgraded to {BUMPED}: healthy" in out(upgraded), out(upgraded)
    assert f"the ones the running agent (pid {first}) was started with go on to the new one" in out(upgraded)
    assert token not in out(upgraded)
    second = node.pid()
    assert second not in (None, first) and same(node.directory / "ckagent.pyz", bumped_pyz)

    async def registered_as_bumped() -> bool:  # the new agent has the token: the master took it
        return any(n.get("version") == BUMPED and n.get("lastHeartbeatAt") for n in await dev_master.admin.list_nodes())

    await eventually(registered_as_bumped, 30)
    assert failed_versions(node) == []
    change = last_change(node)
    assert {k: change[k] for k in ("action", "from", "to", "outcome")} == {
        "action": "upgrade", "from": ckagent.__version__, "to": BUMPED, "outcome": "healthy"}, change
    # a restart from the same shell: the credentials go on again
    restarted = await node.sh("restart")
    assert restarted.returncode == 0 and "go on to the new one" in out(restarted), out(restarted)
    assert node.pid() not in (None, second) and last_change(node)["action"] == "restart"
    second = node.pid()
    assert second is not None
    environ = (await trio.Path(f"/proc/{second}/environ").read_bytes()).split(b"\0")
    assert f"CK_RUNSH_STATE_DIR={node.directory / '.ckagent'}".encode() in environ
    assert not any(token.encode() in entry for entry in environ)


@pytest.fixture
def runsh_user() -> Iterator[SystemUser]:
    """A user without root for run.sh (a throwaway one as root: conftest.py's SERIAL_GROUPS "system-users";
    the suite's own user otherwise)."""
    with unprivileged_user("ckrunsh") as user:
        yield user


async def test_a_plain_user_without_the_token_is_refused_before_anything_stops(
        runsh_user: SystemUser, tmp_path: Path, releases: Releases, pyz: Path, bumped_pyz: Path,
        dev_master: Any) -> None:
    """As a user without root (the agent, run.sh and the operator's shell all that user), the node
    started with the token in its environment: `restart` and `upgrade` from a shell without it are
    refused before anything stops — the running agent's credentials cannot be read — saying what to
    do; /healthz answers 200 throughout, no version is marked failed. With the token: restarted."""
    user = runsh_user
    base = tmp_path if user.current else user.home
    directory = base / "runsh-node"
    (directory / "config").mkdir(parents=True)
    shutil.copy2(RUN_SH, directory / "run.sh")
    shutil.copy2(pyz, directory / "ckagent.pyz")
    port = free_port()
    (directory / "config" / "config.yaml").write_text(yaml.safe_dump({
        "server": {"url": dev_master.base_url},
        "agent": {"name": "plain-node", "ip": "127.0.0.1", "port": port, "max_workers": 1},
        "heartbeat": {"interval": 1},
        "task": {"poll_interval": 0.5, "long_poll_wait": 1, "kill_grace": 2, "drain_timeout": 5},
    }))
    if not user.current:
        await trio.run_process(["chown", "-R", f"{user.uid}:{user.gid}", str(directory)])
    env = user.environ({k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "SHIV_", "PYTHONPATH"))})
    env.update(AGENT_PYTHON=OTHER_USER_PYTHON, AGENT_START_TIMEOUT="30", AGENT_RELEASE_URL=releases.url, **ENV)
    node = RunShNode(directory, port, env)
    options = {**user.popen_options(), "cwd": str(directory)}
    token = dev_master.registration_token
    try:
        with trio.fail_after(150):
            started = await watch_health(node, "start", "--daemon=on", options=options,
                                         env={"AGENT_REGISTRATION_TOKEN": token})
            assert started.result.returncode == 0, out(started.result)
            pid = node.pid()
            assert pid is not None
            await node_registered(dev_master, "plain-node")

            for args in (("restart",), ("upgrade", BUMPED)):
                if args[0] == "upgrade":
                    releases.publish(bumped_pyz, BUMPED)
                refused = await watch_health(node, *args, options=options)
                said = out(refused.result)
                assert refused.result.returncode == 1, said
                assert "would have no registration token" in said and "AGENT_REGISTRATION_TOKEN=" in said, said
                assert "only root can read a running agent's credentials" in said, said
                assert refused.healthy_throughout, (refused.codes, said)
                assert node.pid() == pid and same(directory / "ckagent.pyz", pyz), said
                assert failed_versions(node) == [] and last_change(node)["outcome"] == "refused"
                assert not list(directory.glob(".ckagent/ckagent-*.pyz"))

            restarted = await node.sh("restart", AGENT_REGISTRATION_TOKEN=token) if user.current else (
                await watch_health(node, "restart", options=options, env={"AGENT_REGISTRATION_TOKEN": token})).result
            assert restarted.returncode == 0, out(restarted)
            assert node.pid() not in (None, pid) and await node.healthz() == 200
            assert last_change(node)["outcome"] == "healthy"
    finally:
        pid = node.pid()
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def _nobody_can_run_python() -> bool:
    """Whether ``nobody`` can execute the interpreter run.sh runs the agent with (python3 on PATH)."""
    found = shutil.which("python3")
    if found is None:
        return False
    probe = subprocess.run([found, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                           check=False)
    try:
        return subprocess.run([probe.stdout.strip(), "-c", "pass"], user=NOBODY, group=NOBODY, extra_groups=[],
                              capture_output=True, check=False, cwd="/").returncode == 0
    except OSError:  # PermissionError: it lives below a directory nobody may enter (/root)
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="--spider-user needs root")
async def test_a_spider_user_that_cannot_run_the_interpreter_is_refused_before_anything_stops(
        node: RunShNode, releases: Releases, pyz: Path, dev_master: Any) -> None:
    """`--spider-user=nobody restart` where nobody cannot execute the spiders' interpreter (the suite's,
    under /root): refused with the check's reason, the agent untouched, the spider user not remembered."""
    if _nobody_can_run_python():
        pytest.skip("nobody can run this suite's interpreter here: nothing to refuse")
    pid = await _start(node, releases, pyz)
    refused = await watch_health(node, "--spider-user=nobody", "restart")
    said = out(refused.result)
    assert refused.result.returncode == 1 and "not restarting" in said, said
    assert "user 'nobody' cannot execute the spiders' interpreter" in said and "nothing was stopped" in said, said
    assert refused.healthy_throughout, (refused.codes, said)
    _untouched(node, pid, pyz)
    assert not (node.directory / ".ckagent" / "spider_user").exists()
    assert last_change(node)["outcome"] == "refused" and last_change(node)["action"] == "restart"


async def test_settings_the_next_agent_refuses_stop_nothing(
        node: RunShNode, releases: Releases, pyz: Path, bumped_pyz: Path, dev_master: Any) -> None:
    """A config edited with a typo: `restart` and `upgrade` are refused (the check's error shown), the
    running agent keeps answering, the new release is not marked failed; fixed, the upgrade goes on."""
    pid = await _start(node, releases, pyz)
    good = _config(node)
    _write_config(node, {**good, "task": {**good["task"], "drain_timout": 5}})
    releases.publish(bumped_pyz, BUMPED)
    for args in (("restart",), ("upgrade",)):
        refused = await watch_health(node, *args, env={"AGENT_RELEASE_URL": releases.url, **ENV})
        said = out(refused.result)
        assert refused.result.returncode == 1 and "unknown key 'task.drain_timout'" in said, said
        assert "nothing was stopped" in said or "nothing was replaced or stopped" in said, said
        assert refused.healthy_throughout, (refused.codes, said)
        _untouched(node, pid, pyz)
        assert last_change(node)["outcome"] == "refused"
    assert last_change(node)["to"] == BUMPED and "not marked failed" in said
    # the running agent (started by run.sh: CK_RUNSH_STATE_DIR) shows the record on /status
    async with httpx.AsyncClient(timeout=5) as client:
        upgrades = (await client.get(f"http://127.0.0.1:{node.port}/status")).json()["upgrades"]
    assert upgrades["stateDir"] == str(node.directory / ".ckagent"), upgrades
    assert (upgrades["lastChange"]["action"], upgrades["lastChange"]["to"], upgrades["lastChange"]["outcome"]) == (
        "upgrade", BUMPED, "refused"), upgrades
    assert upgrades["failedVersions"] == [], upgrades

    _write_config(node, good)
    upgraded = await node.sh("upgrade", AGENT_RELEASE_URL=releases.url, **ENV)
    assert upgraded.returncode == 0 and f"upgraded to {BUMPED}: healthy" in out(upgraded), out(upgraded)
    assert failed_versions(node) == [] and last_change(node)["outcome"] == "healthy"

    # a rollback is checked the same way: the previous release refuses the typo, nothing changes
    upgraded_pid = node.pid()
    _write_config(node, {**good, "task": {**good["task"], "drain_timout": 5}})
    refused = await watch_health(node, "rollback", env=ENV)
    said = out(refused.result)
    assert refused.result.returncode == 1 and "not rolling back" in said and "drain_timout" in said, said
    assert refused.healthy_throughout, (refused.codes, said)
    assert node.pid() == upgraded_pid and same(node.directory / "ckagent.pyz", bumped_pyz)
    assert same(node.directory / "ckagent.pyz.prev", pyz) and failed_versions(node) == []
    assert (last_change(node)["action"], last_change(node)["outcome"]) == ("rollback", "refused")


async def test_a_release_that_fails_its_check_is_refused_and_not_installed(
        node: RunShNode, releases: Releases, pyz: Path, tmp_path: Path, dev_master: Any) -> None:
    """A release whose `config check` crashes is refused before the agent stops: nothing replaced."""
    pid = await _start(node, releases, pyz)
    releases.publish(stand_in_release(tmp_path / "crash.pyz", "102.0.0", check="crash"), "102.0.0")
    refused = await watch_health(node, "upgrade", env={"AGENT_RELEASE_URL": releases.url, **ENV})
    said = out(refused.result)
    assert refused.result.returncode == 1 and "the downloaded ckagent 102.0.0 fails its `config check`" in said, said
    assert "this release is broken" in said and "nothing was replaced" in said, said
    assert refused.healthy_throughout, (refused.codes, said)
    _untouched(node, pid, pyz)
    change = last_change(node)
    assert (change["action"], change["to"], change["outcome"]) == ("upgrade", "102.0.0", "refused"), change
    assert isinstance(change["at"], int) and "this release is broken" in change["reason"]


async def test_a_rollback_that_leaves_nothing_running_says_so_and_status_agrees(
        node: RunShNode, releases: Releases, pyz: Path, tmp_path: Path, dev_master: Any) -> None:
    """A release that passes the checks but, started, leaves a stray process on the agent's port and
    exits: the upgrade rolls back, and the previous release cannot start either (its port is taken).
    run.sh says the node is down and exits 3, as `status` does; the version is not marked failed
    (the previous one failed too: the cause may be the node)."""
    await _start(node, releases, pyz)
    stray_file = tmp_path / "stray.pid"
    releases.publish(stand_in_release(tmp_path / "hold.pyz", "103.0.0", hold_port=True), "103.0.0")
    try:
        failed = await node.sh("upgrade", AGENT_RELEASE_URL=releases.url, STAND_IN_HOLD_PORT=str(node.port),
                               STAND_IN_STRAY_PID=str(stray_file), **ENV)
        said = out(failed)
        assert failed.returncode == 3, said
        assert "exited during its start" in said and "did not come back either" in said, said
        assert "no agent is running: the node is down (./run.sh status: 3)" in said, said
        assert "103.0.0 is not marked failed" in said, said
        assert (await node.sh("status")).returncode == 3
        assert same(node.directory / "ckagent.pyz", pyz)
        assert failed_versions(node) == []
        change = last_change(node)
        assert (change["action"], change["to"], change["outcome"]) == ("upgrade", "103.0.0", "down"), change
    finally:
        if stray_file.exists():
            os.killpg(int(stray_file.read_text()), signal.SIGKILL)


async def test_a_restart_that_leaves_nothing_running_says_so_and_status_agrees(
        node: RunShNode, releases: Releases, pyz: Path, tmp_path: Path, dev_master: Any) -> None:
    """The installed file replaced under a running agent by a release that passes the check but, started,
    leaves a stray on the agent's port and exits: `restart` says no agent runs and exits 3, as `status`."""
    await _start(node, releases, pyz)
    stray_file = tmp_path / "stray.pid"
    stand_in_release(tmp_path / "hold.pyz", "104.0.0", hold_port=True)
    shutil.copy2(tmp_path / "hold.pyz", node.directory / "ckagent.pyz")
    try:
        restarted = await node.sh("restart", STAND_IN_HOLD_PORT=str(node.port), STAND_IN_STRAY_PID=str(stray_file))
        said = out(restarted)
        assert restarted.returncode == 3, said
        assert "after the restart: no agent is running: the node is down (./run.sh status: 3)" in said, said
        assert (await node.sh("status")).returncode == 3
        change = last_change(node)
        assert (change["action"], change["from"], change["to"], change["outcome"]) == (
            "restart", "104.0.0", "104.0.0", "down"), change
    finally:
        if stray_file.exists():
            os.killpg(int(stray_file.read_text()), signal.SIGKILL)


async def test_a_recycled_pid_naming_another_ckagent_is_not_this_nodes_agent(tmp_path: Path) -> None:
    """agent.pid names a live process whose command line says ckagent but that runs elsewhere (another
    node's agent, a pid recycled while none ran here): run.sh takes it for no agent of its own —
    `status` says not running, `stop` and `restart` neither signal it nor read its credentials."""
    directory = tmp_path / "node"
    directory.mkdir()
    shutil.copy2(RUN_SH, directory / "run.sh")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "SHIV_", "PYTHONPATH"))}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            stranger: trio.Process = await nursery.start(partial(
                trio.run_process, [sys.executable, "-c", "import time; time.sleep(120)", "ckagent.pyz", "run"],
                cwd=elsewhere, check=False))
            try:
                (directory / "agent.pid").write_text(f"{stranger.pid}\n")
                node = RunShNode(directory, 9, {**env, "AGENT_AUTO_INSTALL": "off"})
                status = await node.sh("status")
                assert status.returncode == 3 and "not running" in out(status), out(status)
                stopped = await node.sh("stop")
                assert stopped.returncode == 0 and "not running" in out(stopped), out(stopped)
                await trio.sleep(0.2)  # a signal, had one been sent, is delivered by now
                assert stranger.returncode is None and pid_alive(stranger.pid)
            finally:
                stranger.kill()


async def test_a_token_put_in_the_config_is_the_one_the_restarted_agent_gets(
        node: RunShNode, releases: Releases, pyz: Path, dev_master: Any) -> None:
    """Started with a wrong token in the environment (it runs, the master refuses it), the right one
    then written into the config and `restart` from a shell without the variable: the config's token is
    the new agent's — the running agent's credentials are handed on only when the config names none."""
    token = _token_from_the_environment(node)
    releases.publish(pyz, ckagent.__version__)
    wrong = await node.sh("start", "--daemon=on", AGENT_RELEASE_URL=releases.url,
                          AGENT_REGISTRATION_TOKEN="not-the-token", **ENV)
    assert wrong.returncode == 1 and "not ready" in out(wrong), out(wrong)
    first = node.pid()
    assert first is not None and await node.healthz() == 200
    config = _config(node)
    config["agent"]["registration_token"] = token
    _write_config(node, config)
    restarted = await node.sh("restart")
    assert restarted.returncode == 0 and "ready" in out(restarted), out(restarted)
    assert "go on to the new one" not in out(restarted)
    assert node.pid() not in (None, first)
    await node_registered(dev_master)
    assert last_change(node)["outcome"] == "healthy"
