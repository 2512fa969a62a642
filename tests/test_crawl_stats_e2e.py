"""Live stats, honest outcomes and the stall watchdog, end to end: real agent, real dev master, real spiders.

- A spider's stats reach the master while it runs; the final ones arrive with the result.
- An agent SIGKILLed and a master stopped in the middle lose no final snapshot.
- A spider that prints nothing and hangs is stopped STALLED; a signal kill is SIGNALED; a log cut
  at the budget is SUCCESS/LOG_BUDGET.
- The demo's Scrapy spider shows requests and items at the master while it runs (slow: installs Scrapy).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import AgentProcess, agent_settings, eventually, running_agent, submit

import ckagent
from ckagent.devmaster.client import zip_directory

EXAMPLES = Path(ckagent.__file__).resolve().parent.parent / "sdk" / "examples"

# Reports stats every 0.1 s while the flag file (params.flag) is absent, then a final snapshot, then exits 0.
REPORTER = r"""
import os, sys, time
from crawlerkeeper_sdk import report_stats, progress, save_item, task_context
flag = task_context().params["flag"]
n = 0
while not os.path.exists(flag) and n < 3000:
    n += 1
    if n % 10 == 0:
        save_item({"n": n})
    report_stats({"requests": n, "items": n // 10, "responsesByStatus": {"200": n}})
    progress(n)
    time.sleep(0.1)
print(f"reporter done after {n}", flush=True)
report_stats({"requests": n, "items": n // 10, "responsesByStatus": {"200": n}, "finishReason": "flagged"},
             final=True)
"""


async def live_stats(admin: Any, task_id: str, at_least: int = 1) -> dict[str, Any] | None:
    """The master's latest live snapshot of a RUNNING task once it has ``requests >= at_least``."""
    task = await admin.get_task(task_id)
    latest = (await admin.get_stats(task_id))["latest"]
    if task["status"] == "RUNNING" and latest and latest["stats"].get("requests", 0) >= at_least:
        return latest
    return None


def flag_params(tmp_path: Path, name: str = "stop") -> dict[str, Any]:
    """Task params naming the file whose existence ends the REPORTER spider."""
    return {"params": {"flag": str(tmp_path / name)}}


async def test_live_stats_reach_the_master_and_the_final_ones_come_with_the_result(
        dev_master: Any, nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckagent.delivery.stats.STATS_INTERVAL", 0.5)
    admin = dev_master.admin
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token)
    async with running_agent(nursery, settings) as agent:
        task_id = await submit(admin, "reporter", {"main.py": REPORTER}, **flag_params(tmp_path))
        first: list[dict[str, Any]] = []
        later: list[dict[str, Any]] = []

        async def seen(into: list[dict[str, Any]], at_least: int) -> bool:
            got = await live_stats(admin, task_id, at_least)
            if got:
                into.append(got)
            return got is not None

        await eventually(lambda: seen(first, 1), 60)
        await eventually(lambda: seen(later, first[0]["stats"]["requests"] + 5), 30)  # it keeps moving
        assert later[-1]["seq"] > first[0]["seq"] and later[-1]["progress"]["done"] >= 1
        (tmp_path / "stop").touch()
        task = await admin.wait_task_final(task_id, 60)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}") as client:
            metrics = (await client.get("/metrics")).text
    assert task["status"] == "SUCCESS" and task["errorCode"] is None, task
    stats = await admin.get_stats(task_id)
    assert stats["final"] and stats["latest"]["stats"]["finishReason"] == "flagged"
    n = stats["latest"]["stats"]["requests"]
    assert stats["latest"]["stats"]["items"] == n // 10 == task["itemCount"]
    assert task["finishReason"] == "flagged"
    assert f"reporter done after {n}" in await admin.get_logs(task_id)
    assert len(stats["history"]) >= 3  # live snapshots, then the final one
    # The crawl metrics count the same totals (per spider, from the snapshots' differences).
    assert f'ckagent_crawl_requests_total{{spider="reporter"}} {float(n)}' in metrics
    assert f'ckagent_crawl_items_total{{spider="reporter"}} {float(n // 10)}' in metrics
    assert f'ckagent_crawl_responses_total{{spider="reporter",status_class="2xx"}} {float(n)}' in metrics
    assert 'ckagent_tasks_finished_total{error_code="none",status="SUCCESS"} 1.0' in metrics


async def test_an_agent_killed_mid_crawl_re_adopts_it_and_reports_the_last_stats(
        dev_master: Any, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    agent = AgentProcess(tmp_path / "a", dev_master.base_url, dev_master.registration_token)
    admin = dev_master.admin
    async with agent:
        await agent.start()
        task_id = await submit(admin, "reporter", {"main.py": REPORTER}, **flag_params(tmp_path))
        await eventually(lambda: live_stats(admin, task_id, 1), 60)
        agent.signal(signal.SIGKILL)
        with trio.fail_after(10):
            await agent.wait()
        await trio.sleep(0.5)  # the spider (in its own session) goes on writing stats meanwhile
        await agent.start()  # re-adopts the running spider (ckagent.task.adoption)
        await eventually(lambda: _re_adopted(admin, task_id), 60)
        (tmp_path / "stop").touch()  # the spider ends: its last line is the final snapshot
        task = await admin.wait_task_final(task_id, 60)
    assert (task["status"], task["finishReason"]) == ("SUCCESS", "flagged"), task
    stats_file = tmp_path / "a" / "data" / "tasks" / task_id / "stats.jsonl"
    last = json.loads(stats_file.read_text().splitlines()[-1])
    stats = await admin.get_stats(task_id)
    assert stats["final"] and stats["latest"]["stats"] == last["stats"]
    assert stats["latest"]["seq"] == stats_file.stat().st_size


async def _re_adopted(admin: Any, task_id: str) -> bool:
    return any("re-adopted after an agent restart" in line for line in await admin.get_logs(task_id))


@pytest.mark.slow
async def test_a_master_outage_loses_no_final_stats(
        dev_master_process: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    url = await dev_master_process.start()
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, url, dev_master_process.registration_token)
    async with running_agent(nursery, settings) as agent:
        async with dev_master_process.admin() as admin:
            task_id = await submit(admin, "reporter", {"main.py": REPORTER}, **flag_params(tmp_path))
            await eventually(lambda: live_stats(admin, task_id, 1), 60)
        await dev_master_process.stop()
        (tmp_path / "stop").touch()  # the spider ends while the master is down

        async def ended() -> bool:
            return agent.supervisor is not None and not agent.supervisor.running

        await eventually(ended, 30)
        await trio.sleep(1.0)
        await dev_master_process.start(same_port=True)
        async with dev_master_process.admin() as admin:
            task = await admin.wait_task_final(task_id, 90)
            stats = await admin.get_stats(task_id)
    assert task["status"] == "SUCCESS", task
    assert stats["final"] and stats["latest"]["stats"]["finishReason"] == "flagged"
    assert task["finishReason"] == "flagged"


HANGER = r"""
import time
print("about to hang", flush=True)
time.sleep(3600)
"""

CHATTY_HANGER = r"""
import time
for i in range(3600):
    print(f"still here {i}", flush=True)
    time.sleep(0.5)
"""


async def test_a_silent_hang_is_stopped_stalled_and_a_chatty_one_is_not(
        dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_TASK_STALL_TIMEOUT="3")
    async with running_agent(nursery, settings):
        quiet = await submit(admin, "hanger", {"main.py": HANGER})
        chatty = await submit(admin, "chatty", {"main.py": CHATTY_HANGER}, timeout_seconds=8)
        # The task's stallTimeoutSeconds overrides the node's: 0 turns the watchdog off for it.
        exempt = await submit(admin, "exempt", {"main.py": HANGER}, timeout_seconds=4, stall_timeout_seconds=0)
        started = trio.current_time()
        task = await admin.wait_task_final(quiet, 60)
        took = trio.current_time() - started
        other = await admin.wait_task_final(chatty, 60)
        off = await admin.wait_task_final(exempt, 60)
    assert (task["status"], task["errorCode"]) == ("FAILED", "STALLED"), task
    assert "no output, items or stats for 3 s" in task["errorMessage"]
    assert took < 30
    logs = await admin.get_logs(quiet)
    assert "about to hang" in logs and any("task FAILED (STALLED)" in line for line in logs), logs
    assert other["errorCode"] == "TIMEOUT", other  # printing every 0.5 s kept it alive until its timeout
    assert off["errorCode"] == "TIMEOUT" and off["stallTimeoutSeconds"] == 0, off


SEGFAULTER = r"""
import os, signal
print("crashing", flush=True)
os.kill(os.getpid(), signal.SIGSEGV)
"""

FLOODER = r"""
import sys
for i in range(2000):
    print("x" * 99, flush=True)
"""


async def test_signaled_and_log_budget_outcomes(dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_TASK_MAX_LOG_BYTES="20000")
    async with running_agent(nursery, settings):
        crash = await submit(admin, "crash", {"main.py": SEGFAULTER})
        flood = await submit(admin, "flood", {"main.py": FLOODER})
        crashed = await admin.wait_task_final(crash, 60)
        flooded = await admin.wait_task_final(flood, 60)
    assert (crashed["status"], crashed["errorCode"], crashed["exitCode"]) == ("FAILED", "SIGNALED", -11), crashed
    assert crashed["errorMessage"].startswith("killed by SIGSEGV (exit code -11)")
    assert (flooded["status"], flooded["errorCode"], flooded["exitCode"]) == ("SUCCESS", "LOG_BUDGET", 0), flooded
    assert "bytes dropped because the task's log budget of 20000 bytes" in flooded["errorMessage"]


@pytest.mark.slow
async def test_the_scrapy_demo_shows_requests_and_items_while_it_runs(
        dev_master: Any, nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckagent.delivery.stats.STATS_INTERVAL", 0.5)
    admin = dev_master.admin
    spider_id = await admin.create_spider(name="products", framework="scrapy")
    await admin.upload_package(spider_id, await trio.to_thread.run_sync(zip_directory, EXAMPLES / "scrapy_demo"))
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_SYNC_TIMEOUT="400")
    async with running_agent(nursery, settings):
        task_id = await admin.create_task(
            spider_id, params={"start_url": f"{dev_master.base_url}/demo-site/"},
            args=["-s", "DOWNLOAD_DELAY=1", "-s", "RANDOMIZE_DOWNLOAD_DELAY=False",
                  "-s", "CRAWLERKEEPER_STATS_INTERVAL=0.5"])
        live: list[dict[str, Any]] = []

        async def items_while_running() -> bool:
            got = await live_stats(admin, task_id, 1)
            if got and got["stats"].get("items", 0) > 0:
                live.append(got)
                return True
            return False

        await eventually(items_while_running, 420)
        task = await admin.wait_task_final(task_id, 120)
    logs = await admin.get_logs(task_id)
    assert task["status"] == "SUCCESS", (task, logs[-30:])
    assert 0 < live[0]["stats"]["items"] < 30 and live[0]["stats"]["requests"] >= 1
    assert live[0]["stats"]["responsesByStatus"]["200"] >= 1
    final = (await admin.get_stats(task_id))["latest"]["stats"]
    assert final["items"] == 30 == task["itemCount"] and final["requests"] >= 5
    assert final["finishReason"] == task["finishReason"] == "finished"
    assert final["scrapy"]["item_scraped_count"] == 30
