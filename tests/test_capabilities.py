"""A node without uv (or node/npm) says so once at start, reports it in its runtimes, and does not take
the spiders that need it — they stay PENDING for other nodes — until the tool is there again."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
from harness import agent_settings, eventually, running_agent, submit

import ckagent.code.capabilities
import ckagent.code.runtimes
from ckagent.code.capabilities import Capabilities
from ckagent.master.protocol import Task


@pytest.fixture
def bare_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No uv anywhere the agent looks, and a PATH without node or npm."""
    monkeypatch.setattr(ckagent.code.capabilities, "find_uv", lambda configured: None)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def _task(framework: str) -> Task:
    return Task.from_json({"id": "t1", "spiderId": "s1", "framework": framework})


def test_missing_tools_are_named_with_their_cost_and_fix_once(bare_node: None,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caps = Capabilities(None)
    assert set(caps.missing) == {"uv", "node", "npm"}
    with caplog.at_level(logging.WARNING, "ckagent.code.capabilities"):
        caps.warn()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0].startswith("uv not found on this node: Python spiders (scrapy, python, playwright, selenium)")
    assert "does not take them" in lines[0] and "fix: run.sh installs it from the release index" in lines[0]
    assert all("fix: " in line for line in lines)
    for framework in ("scrapy", "python", "playwright", "selenium"):
        assert (caps.cannot_run(_task(framework)) or "").startswith("uv is missing")
    assert (caps.cannot_run(_task("node")) or "").startswith("node is missing")
    caps.missing.pop("node")  # node without npm: Node spiders without a package.json still run
    assert caps.cannot_run(_task("node")) is None


def test_a_node_with_its_tools_runs_everything(tmp_path: Path) -> None:
    caps = Capabilities(None)  # the dev venv has uv beside the interpreter
    assert "uv" not in caps.missing
    assert caps.cannot_run(_task("scrapy")) is None


async def test_python_spiders_stay_pending_without_uv_and_run_once_it_is_there(
    bare_node: None, dev_master, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    admin = dev_master.admin
    settings = agent_settings(tmp_path / "w", dev_master.base_url, dev_master.registration_token)
    async with trio.open_nursery() as nursery, running_agent(nursery, settings) as agent:
        assert "uv" in agent.capabilities.missing
        assert "uv not found on this node" in caplog.text
        task_id = await submit(admin, "needs-uv", {"main.py": "print('ran')\n"})
        task = await admin.get_task(task_id)

        async def left_alone() -> bool:
            return task["spiderId"] in agent.poller.unrunnable

        await eventually(left_alone)

        async def reported() -> bool:
            return any("uv" in (n.get("runtimes") or {}).get("missing", {}) for n in await admin.list_nodes())

        await eventually(reported)
        await trio.sleep(1.5)
        assert (await admin.get_task(task_id))["status"] == "PENDING"
        assert caplog.text.count(f"(spider {task['spiderId']}, framework python) not taken: uv is missing") == 1
        # uv appears (e.g. pip install uv): the next scan lets Python spiders in again
        monkeypatch.undo()
        agent.capabilities.refresh()
        agent.poller.forget_unrunnable()
        final = await admin.wait_task_final(task_id, 60)
        assert final["status"] == "SUCCESS", final


def test_npms_version_is_read_from_its_package_and_asked_only_when_that_fails(tmp_path: Path) -> None:
    """npm is a Node script: its version comes from the package.json of the package its command runs
    (no Node started at every agent start); a command laid out otherwise is asked (`npm --version`)."""
    package = tmp_path / "lib" / "node_modules" / "npm"
    (package / "bin").mkdir(parents=True)
    (package / "package.json").write_text('{"name": "npm", "version": "10.8.2"}')
    cli = package / "bin" / "npm-cli.js"
    cli.write_text("#!/bin/sh\necho 0.0.1\n")  # run, it would say another version
    cli.chmod(0o755)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "npm").symlink_to(cli)
    assert ckagent.code.runtimes._npm_version(str(tmp_path / "bin" / "npm")) == "10.8.2"
    other = tmp_path / "other-npm"
    other.write_text("#!/bin/sh\necho 9.9.9\n")
    other.chmod(0o755)
    assert ckagent.code.runtimes._npm_version(str(other)) == "9.9.9"
    (package / "package.json").write_text("{not json")
    assert ckagent.code.runtimes._npm_version(str(tmp_path / "bin" / "npm")) == "0.0.1"
