"""``run.sh upgrade`` hands a running task over: the old agent leaves it running, the new one re-adopts it.

A task that ticks until the test tells it to stop (a file appears) runs while the installed agent is
upgraded to a new release (a real pyz through run.sh, against the reference master); it is stopped only
once the new agent has shipped lines the task wrote after the old agent left. It ends SUCCESS, started
once, every line once and in order.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from harness import BUMPED, Releases, RunShNode, eventually, node_registered, out, pid_alive, submit

import ckagent

UV = Path(sys.executable).with_name("uv")
# Ticks every 0.2 s until the file named by the task parameter `stop` exists (at most 10 minutes).
SPIDER = """
import json, os, time
stop = json.loads(os.environ["CK_PARAMS"])["stop"]
for i in range(3000):
    print('tick', i, flush=True)
    if os.path.exists(stop):
        break
    time.sleep(0.2)
"""


async def test_upgrade_hands_a_running_task_over_to_the_new_agent(
    node: RunShNode, releases: Releases, pyz: Path, bumped_pyz: Path, dev_master
) -> None:
    admin = dev_master.admin
    config_path = node.directory / "config" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config.setdefault("deps", {})["uv_path"] = str(UV)  # no release index with a uv here
    # the stop file lies beside the node directory: seen in the task's own /tmp (mount-namespace level)
    config.setdefault("task", {})["private_tmp_shared"] = str(node.directory.parent)
    config_path.write_text(yaml.safe_dump(config))
    env = {"AGENT_RELEASE_URL": releases.url, "AGENT_UPGRADE_HEALTH_TIMEOUT": "30"}
    releases.publish(pyz, ckagent.__version__)
    assert (await node.sh("start", "--daemon=on", **env)).returncode == 0
    first_pid = node.pid()
    await node_registered(dev_master)
    stop = node.directory.parent / "stop-the-task"
    task_id = await submit(admin, "until-told", {"main.py": SPIDER}, params={"stop": str(stop)})

    async def ticks() -> list[str]:
        return [line for line in await admin.get_logs(task_id) if line.startswith("tick")]

    async def ticking() -> bool:
        return any(line.startswith("tick 2") for line in await ticks())

    await eventually(ticking, 60)
    releases.publish(bumped_pyz, BUMPED)
    upgraded = await node.sh("upgrade", **env)
    assert upgraded.returncode == 0 and f"upgraded to {BUMPED}: healthy" in out(upgraded), out(upgraded)
    assert "SIGUSR2, its running tasks keep running" in out(upgraded), out(upgraded)
    assert first_pid is not None and not pid_alive(first_pid) and node.pid() != first_pid
    # the task outlived the old agent: the new one ships what it writes from now on (5 ticks, 1 s)
    after = len(await ticks())

    async def shipped_by_the_new_agent() -> bool:
        return len(await ticks()) >= after + 5

    await eventually(shipped_by_the_new_agent, 60)
    assert (await admin.get_task(task_id))["status"] == "RUNNING"
    stop.touch()
    task = await admin.wait_task_final(task_id, 120)
    assert (task["status"], task["exitCode"]) == ("SUCCESS", 0), task
    lines = await admin.get_logs(task_id)
    ticked = [line for line in lines if line.startswith("tick")]
    assert len(ticked) >= after + 5 and ticked == [f"tick {i}" for i in range(len(ticked))]
    assert sum(line.startswith("[ckagent") and "] running " in line for line in lines) == 1, lines  # started once
    assert sum("re-adopted after an agent restart" in line for line in lines) == 1, lines
