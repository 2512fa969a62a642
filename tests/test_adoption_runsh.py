"""``run.sh upgrade`` hands a running task over: the old agent leaves it running, the new one re-adopts it.

A 60 s task runs while the installed agent is upgraded to a new release (a real pyz through
run.sh, against the reference master): it ends SUCCESS, started once, every line once and in order.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from harness import submit
from test_runsh import (  # noqa: F401 -- fixtures
    BUMPED,
    Node,
    Releases,
    _alive,
    _node_registered,
    bumped_pyz,
    eventually,
    node,
    out,
    pyz,
    releases,
)

import ckagent

UV = Path(sys.executable).with_name("uv")
SPIDER = "import time\nfor i in range(60):\n    print('tick', i, flush=True)\n    time.sleep(1)\n"


async def test_upgrade_hands_a_60_s_task_over_to_the_new_agent(
    node: Node, releases: Releases, pyz: Path, bumped_pyz: Path, dev_master  # noqa: F811 -- fixtures
) -> None:
    admin = dev_master.admin
    config_path = node.directory / "config" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config.setdefault("deps", {})["uv_path"] = str(UV)  # no release index with a uv here
    config_path.write_text(yaml.safe_dump(config))
    env = {"AGENT_RELEASE_URL": releases.url, "AGENT_UPGRADE_HEALTH_TIMEOUT": "30"}
    releases.publish(pyz, ckagent.__version__)
    assert (await node.sh("start", "--daemon=on", **env)).returncode == 0
    first_pid = node.pid()
    await _node_registered(dev_master)
    task_id = await submit(admin, "sixty-seconds", {"main.py": SPIDER})

    async def ticking() -> bool:
        return any(line.startswith("tick 2") for line in await admin.get_logs(task_id))

    await eventually(ticking, 60)
    releases.publish(bumped_pyz, BUMPED)
    upgraded = await node.sh("upgrade", **env)
    assert upgraded.returncode == 0 and f"upgraded to {BUMPED}: healthy" in out(upgraded), out(upgraded)
    assert "SIGUSR2, its running tasks keep running" in out(upgraded), out(upgraded)
    assert first_pid is not None and not _alive(first_pid) and node.pid() != first_pid
    task = await admin.wait_task_final(task_id, 120)
    assert (task["status"], task["exitCode"]) == ("SUCCESS", 0), task
    lines = await admin.get_logs(task_id)
    assert [line for line in lines if line.startswith("tick")] == [f"tick {i}" for i in range(60)]
    assert sum(line.startswith("[ckagent") and "] running " in line for line in lines) == 1, lines  # started once
    assert sum("re-adopted after an agent restart" in line for line in lines) == 1, lines
