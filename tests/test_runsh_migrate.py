"""``run.sh stop --migrate`` (issue 38, item 5): the daemon's running task is reported MIGRATED and the
agent exits within task.migrate_timeout + flush; with an agent that has no migrate it drains."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from harness import submit, wait_for_log
from harness.runsh import Releases, RunShNode, node_registered, out, pid_alive
from harness.stopping import moved_on

import ckagent

LONG = textwrap.dedent("""
    import time
    print("started", flush=True)
    time.sleep(600)
""")

pytestmark = pytest.mark.slow


async def test_run_sh_stop_migrate_hands_the_running_task_over(node: RunShNode, releases: Releases, pyz: Path,
                                                               dev_master) -> None:
    config = node.directory / "config" / "config.yaml"
    settings = yaml.safe_load(config.read_text())
    settings["task"]["migrate_timeout"] = 5
    settings["deps"] = {"uv_path": str(Path(sys.executable).parent / "uv")}  # (the dev venv's: no download)
    config.write_text(yaml.safe_dump(settings))
    releases.publish(pyz, ckagent.__version__)
    assert (await node.sh("start", "--daemon=on", AGENT_RELEASE_URL=releases.url)).returncode == 0
    pid = node.pid()
    assert pid is not None
    await node_registered(dev_master)
    task_id = await submit(dev_master.admin, "long", {"main.py": LONG})
    await wait_for_log(dev_master.admin, task_id, "started", timeout=60)
    assert (await node.sh("start", "--migrate")).returncode == 2  # --migrate goes with stop only
    stopped = await node.sh("stop", "--migrate")
    said = out(stopped)
    assert stopped.returncode == 0, said
    assert "migrating its running tasks to other nodes (up to 25s)" in said, said  # 5 + flush 10 + 10
    assert "SIGKILL" not in said and "handed over to other nodes (MIGRATED)" in said, said
    assert not pid_alive(pid) and node.pid() is None
    first = moved_on(await dev_master.admin.get_task(task_id))
    assert (first["status"], first["errorCode"]) == ("FAILED", "MIGRATED"), first
    assert (await node.sh("stop", "--migrate")).returncode == 0  # nothing runs: said, 0
