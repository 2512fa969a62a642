"""A spider may replace the files of its own task dir: the agent must neither follow nor block on them.

The agent can run as root while spiders run as another user (task.run_as_user); a symlink from
items.jsonl to a file the spider cannot read, or a FIFO the agent would block on, must not leak a
byte nor hang the task, the status port or shutdown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio
from harness import agent_settings, running_agent, submit


async def test_items_file_replaced_by_a_fifo_or_a_symlink(dev_master: Any, nursery: trio.Nursery,
                                                         tmp_path: Path) -> None:
    secret = tmp_path / "not-for-spiders.txt"
    secret.write_text('{"stolen": "root-only secret line"}\n')
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_PORT="0")
    fifo_spider = "import os\nos.mkfifo(os.environ['CK_ITEMS_FILE'])\nprint('made a fifo')\n"
    link_spider = (f"import os\nos.symlink({str(secret)!r}, os.environ['CK_ITEMS_FILE'])\n"
                   "print('made a symlink')\n")
    async with running_agent(nursery, settings) as agent:
        fifo = await submit(dev_master.admin, "fifo", {"main.py": fifo_spider})
        link = await submit(dev_master.admin, "link", {"main.py": link_spider})
        with trio.fail_after(30):
            fifo_task = await dev_master.admin.wait_task_final(fifo, 30)
            link_task = await dev_master.admin.wait_task_final(link, 30)
            async with httpx.AsyncClient() as client:  # the status port still answers (metrics read the spool too)
                metrics = await client.get(f"http://127.0.0.1:{agent.status_port}/metrics")
    assert metrics.status_code == 200
    assert fifo_task["status"] == "SUCCESS", fifo_task
    assert link_task["status"] == "SUCCESS", link_task
    assert await dev_master.admin.get_items(fifo) == []
    assert await dev_master.admin.get_items(link) == []  # the symlink was not followed
    assert "made a symlink" in await dev_master.admin.get_logs(link)
