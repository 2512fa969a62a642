"""A Node spider started by `npm start` that traps SIGTERM: a cancel reaches it through npm and `sh -c`.

``sdk/examples/node_sigterm`` buffers items and flushes them in its SIGTERM handler. One real agent
on the dev master's demo site runs it; the task is cancelled after two pages. The handler must run
(the buffered items arrive), and the log must say the signal went to node below the launcher and
that the spider exited within the grace period — not that it was killed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import agent_settings, assert_default_identity, running_agent

import ckagent
from ckagent.devmaster.client import zip_directory

EXAMPLES = Path(ckagent.__file__).resolve().parent.parent / "sdk" / "examples"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("npm") is None, reason="needs node and npm")]


async def test_npm_start_spider_flushes_on_cancel(dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    spider = await admin.create_spider(name="node-sigterm", framework="node", env={
        "START_URL": f"{dev_master.base_url}/demo-site/", "PAGE_DELAY_MS": "2000"})
    await admin.upload_package(spider, await trio.to_thread.run_sync(zip_directory, EXAMPLES / "node_sigterm"))
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_TASK_KILL_GRACE="10")
    async with running_agent(nursery, settings):
        task_id = await admin.create_task(spider)
        with trio.fail_after(180):
            for _ in range(900):  # the master has no log event to wait on: ask it again
                if any("page 2:" in line for line in await admin.get_logs(task_id)):
                    break
                await trio.sleep(0.2)
            await admin.cancel_task(task_id)
            task = await admin.wait_task_final(task_id, 120)
    log = "\n".join(await admin.get_logs(task_id))
    assert task["status"] == "CANCELLED", (task, log[-3000:])
    assert_default_identity(log)  # npm and node under the spider's own uid: the agent's SIGTERM reaches them
    assert "default command from package.json scripts.start" in log
    assert "SIGTERM: flushed 12 buffered items, closing" in log, log[-3000:]
    sent = next(line for line in log.splitlines() if "sent SIGTERM to" in line)
    assert "node crawl.js" in sent and "below the launcher" in sent, sent
    assert "the spider exited within the grace period" in log and "killed every process" not in log, log[-2000:]
    items = await admin.get_items(task_id)
    assert [i["page"] for i in items] == [1] * 6 + [2] * 6, items
