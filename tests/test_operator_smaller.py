"""The smaller operator traps: a world-readable token file, `config check` = `run` for paths, an
unreadable inherited PYENV_ROOT, a refused second agent, an item over the size limit, a master clock
far off, and the version floor on the reference master's side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml
from harness import AgentProcess, agent_settings, running_agent, submit

from ckagent.delivery.spool import MAX_ITEM_BYTES
from ckagent.master.masterclock import MAX_SKEW_SECONDS, MasterClock
from ckagent.node.config import load_settings
from ckagent.node.notices import Notices
from ckagent.node.preflight import check_paths, check_secret_file

TOKEN = "tok-0123456789abcdef"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "CK_"))}


def _config(path: Path, **sections: Any) -> Path:
    data: dict[str, Any] = {"agent": {"registration_token": TOKEN, "port": 0}, "server": {"url": "http://127.0.0.1:9"}}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("mode", "warned"), [(0o600, False), (0o640, False), (0o644, True), (0o666, True),
                                              (0o620, True)])
def test_a_config_file_holding_the_token_that_others_can_read_gets_a_warning(tmp_path: Path, mode: int,
                                                                              warned: bool) -> None:
    path = _config(tmp_path / "c.yaml")
    path.chmod(mode)
    problems = check_secret_file(load_settings(path, env={}))
    assert bool(problems) == warned
    if warned:
        assert not problems[0].error and f"{mode:04o}" in problems[0].message and "chmod 600" in problems[0].message
        assert TOKEN not in problems[0].message
        checked = subprocess.run([sys.executable, "-m", "ckagent", "config", "check", "-c", str(path)],
                                 capture_output=True, text=True, env=_env(), timeout=60, check=False)
        shown = checked.stderr + checked.stdout
        assert checked.returncode == 0, checked
        assert ("world-readable" in shown) or ("writable by others" in shown), checked


def test_a_config_file_without_a_token_gets_no_warning(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"server": {"url": "http://127.0.0.1:9"}}))
    path.chmod(0o666)
    assert check_secret_file(load_settings(path, env={"AGENT_REGISTRATION_TOKEN": TOKEN})) == []


@pytest.mark.parametrize(("section", "key", "value"), [
    ("task", "work_dir", "/proc/ckagent-data"), ("logging", "file", "/proc/ckagent.log"),
    ("deps", "uv_cache_dir", "/sys/ckagent-uv"),
])
def test_config_check_refuses_the_pseudo_filesystem_paths_that_run_refuses(tmp_path: Path, section: str, key: str,
                                                                          value: str) -> None:
    path = _config(tmp_path / "c.yaml", **{section: {key: value}})
    problems = check_paths(load_settings(path, env={}))
    assert problems and problems[0].error and value in problems[0].message
    checked = subprocess.run([sys.executable, "-m", "ckagent", "config", "check", "-c", str(path)],
                             capture_output=True, text=True, env=_env(), timeout=60, check=False)
    assert checked.returncode == 2 and value in checked.stderr, checked
    ran = subprocess.run([sys.executable, "-m", "ckagent", "run", "-c", str(path)],
                         capture_output=True, text=True, env=_env(), timeout=60, check=False)
    assert ran.returncode == 2 and value in ran.stderr, ran


def test_an_unreadable_inherited_pyenv_root_is_ignored_with_a_warning(tmp_path: Path) -> None:
    """A non-root agent that inherited root's PYENV_ROOT: the scan (in a forked child that became
    user nobody, so the directory is really unreadable) skips it with a warning instead of crashing."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    import pwd

    from ckagent.code import runtimes

    root = tmp_path / "pyenv"
    (root / "versions" / "3.11.7" / "bin").mkdir(parents=True)
    (root / "versions" / "3.11.7" / "bin" / "python3").write_text("")
    root.chmod(0o700)
    nobody = pwd.getpwnam("nobody")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, scan, report, exit without running pytest's cleanup
        code = 1
        try:
            os.close(read_end)
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            os.environ["PYENV_ROOT"] = str(root)
            warnings: list[str] = []
            runtimes.log.warning = lambda msg, *args: warnings.append(msg % args)  # type: ignore[method-assign]
            os.write(write_end, json.dumps([runtimes._pyenv_versions(), warnings]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    versions, warnings = json.loads(data)
    assert versions == [] and len(warnings) == 1 and "cannot be read by this user" in warnings[0], warnings


async def test_a_refused_second_agent_says_so_on_its_own_stderr_only(dev_master: Any, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    log_file = tmp_path / "shared.log"
    first = AgentProcess(tmp_path / "a", dev_master.base_url, dev_master.registration_token,
                         logging__file=str(log_file))
    await first.start()
    try:
        with trio.fail_after(60):  # noqa: ASYNC912 - the loop sleeps until the line is there
            while "registered with" not in (log_file.read_text() if log_file.exists() else ""):  # noqa: ASYNC110
                await trio.sleep(0.1)  # another process's log file: nothing to wait on
        second = await trio.run_process([sys.executable, "-m", "ckagent", "run", "-c", str(first.config_path)],
                                        capture_stdout=True, capture_stderr=True, check=False, env=_env())
        assert second.returncode == 2 and b"is in use by another agent" in second.stderr, second
        assert "in use by another agent" not in log_file.read_text()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await first.kill()


async def test_an_item_over_the_limit_becomes_one_placeholder_that_says_so(dev_master: Any, nursery: trio.Nursery,
                                                                          tmp_path: Path) -> None:
    big = MAX_ITEM_BYTES + MAX_ITEM_BYTES // 2
    spider = (
        "import json, os\n"
        "with open(os.environ['CK_ITEMS_FILE'], 'w') as f:\n"
        "    f.write(json.dumps({'n': 1}) + '\\n')\n"
        f"    f.write(json.dumps({{'blob': 'x' * {big}}}) + '\\n')\n"
        "    f.write(json.dumps({'n': 2}) + '\\n')\n"
    )
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    async with running_agent(nursery, settings):
        task_id = await submit(dev_master.admin, "big-item", {"main.py": spider})
        task = await dev_master.admin.wait_task_final(task_id, 180)
    assert task["status"] == "SUCCESS", task
    items = await dev_master.admin.get_items(task_id)
    assert len(items) == 3, [json.dumps(i)[:200] for i in items]
    assert items[0] == {"n": 1} and items[2] == {"n": 2}
    assert items[1]["_invalidItem"] is None and f"over the limit of {MAX_ITEM_BYTES} bytes" in items[1]["_error"]
    assert str(big + len('{"blob": ""}') + 1) in items[1]["_error"]


def test_a_master_clock_far_off_is_noticed_once_and_cleared_when_it_agrees(caplog: pytest.LogCaptureFixture) -> None:
    now = [1_800_000_000.0]
    notices = Notices()
    clock = MasterClock(notices, clock=lambda: now[0])
    caplog.set_level("INFO")
    clock.observe(formatdate(now[0] + 3 * 3600, usegmt=True))
    assert len(notices.texts()) == 1 and "3.0 h ahead of this node's" in notices.texts()[0]
    now[0] += 60
    clock.observe(formatdate(now[0] - 3 * 3600, usegmt=True))
    assert "behind" in notices.texts()[0]
    now[0] += 60
    clock.observe(formatdate(now[0] + MAX_SKEW_SECONDS / 2, usegmt=True))
    assert notices.texts() == ()
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "master's clock" in r.getMessage()]
    assert len(warnings) == 1
    clock.observe("not a date")
    clock.observe(None)


async def test_a_master_clock_far_off_shows_on_the_status_page(tmp_path: Path) -> None:
    """Through the real master client: a Date header hours off raises the notice in /status."""
    import httpx

    from ckagent.master.client import MasterClient
    from ckagent.master.protocol import RegisterRequest

    notices = Notices()

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"nodeId": "n1", "apiKey": "k1"},
                              headers={"Date": formatdate(1_000_000_000, usegmt=True)})

    body = RegisterRequest(name="n", ip="127.0.0.1", port=1, version="0", os="linux", arch="x86_64", python="3",
                           cpu_count=1, memory_total_bytes=1, max_workers=1)
    client = MasterClient("http://master.test", "token", lambda: body, transport=httpx.MockTransport(handler))
    client.clock = MasterClock(notices)
    await client.register()
    await client.aclose()
    assert notices.texts() and "behind this node's" in notices.texts()[0]


@pytest.mark.slow
async def test_the_reference_master_hands_a_node_below_its_minimum_nothing(dev_master: Any, tmp_path: Path) -> None:
    admin = dev_master.admin
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_HEARTBEAT_INTERVAL="8")  # the agent learns the raise late (after 8 s): the master must hold
    async with trio.open_nursery() as nursery, running_agent(nursery, settings) as agent:
        await admin.set_agent_versions("99.0", None)
        task_id = await submit(admin, "floor", {"main.py": "print('ran')\n"})
        await trio.sleep(4)  # several long polls (2 s each) come and go
        assert (await admin.get_task(task_id))["status"] == "PENDING"
        assert agent.supervisor is not None and not agent.supervisor.running
        await admin.set_agent_versions(None, None)
        task = await admin.wait_task_final(task_id, 60)
        assert task["status"] == "SUCCESS", task
