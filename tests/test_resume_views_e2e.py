"""The agent's views of a real checkpointed task (issue 38, "Visible"): a real in-process agent runs a
spider that answers the control channel (harness.HAND_ACK_SPIDER) against the reference master;
/status shows its attempt and last checkpoint (age, size, items position) while it runs, the status page
shows them in its running tasks, and a failed attempt's cause class in its recent tasks. Units of the
same views with hostile JSON: tests/test_resume_views.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import HAND_ACK_SPIDER, agent_settings, eventually, running_agent, spider_zip


async def _spider(admin: Any, name: str) -> str:
    spider_id = await admin.create_spider(name=name, framework="python")
    await admin.upload_package(spider_id, spider_zip({"main.py": HAND_ACK_SPIDER}))
    return str(spider_id)


@pytest.mark.slow  # a real agent and two spiders of a few seconds
async def test_status_and_the_page_show_the_attempt_its_checkpoint_and_a_failed_attempts_cause(
        dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    settings = agent_settings(tmp_path / "node", dev_master.base_url, dev_master.registration_token)
    with trio.fail_after(120):
        async with running_agent(nursery, settings) as agent, \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}", timeout=10) as client:
            crawling = str(await admin.create_task(await _spider(admin, "crawls"), params={"total": 120, "pace": 0.05},
                                                   checkpoint_interval_seconds=0.5))
            failing = str(await admin.create_task(await _spider(admin, "fails"), params={"total": 50, "pace": 0.01,
                                                                                         "fail_at": 3, "answered": 0}))

            async def checkpointed() -> dict[str, Any] | None:
                tasks = (await client.get("/status")).json()["runningTasks"]
                mine = [t for t in tasks if t["id"] == crawling]
                return mine[0] if mine and mine[0]["checkpoint"] is not None else None

            running = await eventually(checkpointed, 60, "a checkpoint of the running task in /status")
            checkpoint = running["checkpoint"]
            assert running["attempt"] == 1 and checkpoint["id"].startswith("1-")
            assert checkpoint["reason"] == "interval" and checkpoint["sizeBytes"] > 0
            assert 0 <= checkpoint["ageSeconds"] < 30 and checkpoint["itemSeq"] >= 1
            page = (await client.get("/")).text
            assert "<th>attempt</th><th>last checkpoint</th>" in page
            assert f"<td>{checkpoint['id']}, " in page and " ago, " in page and "items 0–" in page

            assert (await admin.wait_task_final(failing, 60))["status"] == "FAILED"
            assert (await admin.wait_task_final(crawling, 60))["status"] == "SUCCESS"

            async def recent() -> str | None:
                text = (await client.get("/")).text
                return text if f"<code>{failing}</code>" in text.split("Recent tasks")[-1] else None

            page = await eventually(recent, 20, "the failed task among the recent ones")
    row = next(r for r in page.split("Recent tasks")[-1].split("<tr>") if f"<code>{failing}</code>" in r)
    assert "FAILED (EXIT_NONZERO)" in row and "<td>spider, retryable</td>" in row, row
    done = next(r for r in page.split("Recent tasks")[-1].split("<tr>") if f"<code>{crawling}</code>" in r)
    assert "<td class=n>1</td><td>—</td><td>1-" in done, done  # attempt 1, no cause, its last checkpoint
