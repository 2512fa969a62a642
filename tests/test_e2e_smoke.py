"""A first end-to-end check: real dev master, in-process agent, real spider processes."""

from __future__ import annotations

from pathlib import Path

import trio
from harness import agent_settings, running_agent, submit


async def test_python_spider_runs_and_reports(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    async with running_agent(nursery, settings):
        ok = await submit(dev_master.admin, "ok", {
            "main.py": "import crawlerkeeper_sdk as ck\nprint('hello')\nck.save_item({'n': 1})\n",
        })
        bad = await submit(dev_master.admin, "bad", {
            "main.py": "import sys\nprint('oops', file=sys.stderr)\nsys.exit(3)\n",
        })
        with trio.fail_after(60):
            ok_task = await dev_master.admin.wait_task_final(ok, 60)
            bad_task = await dev_master.admin.wait_task_final(bad, 60)
    assert ok_task["status"] == "SUCCESS", ok_task
    assert await dev_master.admin.get_items(ok) == [{"n": 1}]
    assert "hello" in await dev_master.admin.get_logs(ok)
    assert bad_task["status"] == "FAILED" and bad_task["errorCode"] == "EXIT_NONZERO"
    assert bad_task["exitCode"] == 3
    assert "oops" in await dev_master.admin.get_logs(bad)
