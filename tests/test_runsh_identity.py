"""run.sh and the identity level, driven for real (bash, source mode: the checkout's virtualenv, a real
agent against the in-process dev master): ``--spider-user=NAME`` keeps its meaning (every spider as
NAME: the ``one-user`` level), ``run.sh status`` says whom spiders run as (and the other levels and the
notices), and ``--spider-user=off`` goes back to the default — a uid per spider, the spider's files
from the one-user days given to its own uid at the restart.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml
from harness import (
    NOBODY_UID,
    REPO,
    RUN_SH,
    RunShNode,
    free_port,
    node_registered,
    out,
    pid_alive,
    spider_python,
    spider_reachable,
    spider_zip,
)

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="spiders run as another user only for a root agent"),
              pytest.mark.slow]  # 21 s: two agents, two spider runs

WHOAMI = ("import json, os\n"
          "print('WHO ' + json.dumps({'uid': os.getuid(), 'data': os.stat(os.environ['CK_DATA_DIR']).st_uid}), "
          "flush=True)\n"
          "open(os.path.join(os.environ['CK_DATA_DIR'], 'runs'), 'a').write('one more\\n')\n")


async def _run(admin: Any, spider_id: str) -> dict[str, Any]:
    task_id = await admin.create_task(spider_id)
    final = await admin.wait_task_final(task_id, 120)
    logs = await admin.get_logs(task_id)
    assert final["status"] == "SUCCESS", (final, logs[-30:])
    [line] = [line for line in logs if line.startswith("WHO ")]
    found: dict[str, Any] = json.loads(line[4:])
    return found


async def test_spider_user_is_one_user_status_says_so_and_off_gives_each_spider_its_uid(
        tmp_path: Path, dev_master: Any) -> None:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    spider_reachable(checkout)
    shutil.copy2(RUN_SH, checkout / "run.sh")
    shutil.copy2(REPO / "pyproject.toml", checkout / "pyproject.toml")
    (checkout / "ckagent").symlink_to(REPO / "ckagent")
    (checkout / ".venv").symlink_to(REPO / ".venv")
    port = free_port()
    (checkout / "agent.yaml").write_text(yaml.safe_dump({
        "server": {"url": dev_master.base_url},
        "agent": {"registration_token": dev_master.registration_token, "name": "ids-node", "ip": "127.0.0.1",
                  "port": port, "ports_registry": str(tmp_path / "agent-ports")},
        "heartbeat": {"interval": 1},
        "task": {"drain_timeout": 2, "kill_grace": 1, "long_poll_wait": 1, "work_dir": str(checkout / "data")},
        "deps": {"python": spider_python()},  # one every uid can run (the suite's lives under /root)
    }))
    node = RunShNode(checkout, port, {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "PYTHONPATH"))})
    admin = dev_master.admin
    spider_id = await admin.create_spider(name="whoami", framework="python")
    await admin.upload_package(spider_id, spider_zip({"main.py": WHOAMI}))
    try:
        with trio.fail_after(300):
            started = await node.sh("--spider-user=nobody", "start", "--daemon=on", "-c", str(checkout / "agent.yaml"))
            assert started.returncode == 0, out(started)
            await node_registered(dev_master, "ids-node")
            status = await node.sh("status")
            assert status.returncode == 0, out(status)
            assert ("  identity: one-user (whom spiders run as): every spider as nobody (uid 65534, gid 65534)"
                    in out(status)), out(status)
            assert "  containment: " in out(status) and "; egress: " in out(status)
            assert await _run(admin, spider_id) == {"uid": NOBODY_UID, "data": NOBODY_UID}  # as before

            restarted = await node.sh("--spider-user=off", "restart")
            assert restarted.returncode == 0, out(restarted)
            status = await node.sh("status")
            assert "  identity: spider-uids (whom spiders run as): each spider its own uid" in out(status), out(status)
            assert "warning: spiders run as" not in out(status)
            mine = await _run(admin, spider_id)
            assert 61184 <= mine["uid"] <= 65519 and mine["data"] == mine["uid"], mine  # its own, its data too
            assert (checkout / "data" / "spider-data" / spider_id / "runs").read_text() == "one more\n" * 2
            log = (checkout / "logs" / "agent.log").read_text()
            assert "migration: the data and home dirs of 1 spider(s) an earlier agent left are given to each " \
                   "spider's own uid (" in log and f"{spider_id} (uid {mine['uid']}; was {NOBODY_UID})" in log
            assert (await node.sh("stop")).returncode == 0
    finally:
        pid = node.pid()
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
