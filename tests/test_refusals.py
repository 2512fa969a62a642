"""No refusal, stall or slow answer loses a line: the fault proxy between the agent and the real dev master.

One row per answer a misbehaving deployment gives (docs/protocol.md, "When something fails"); each
test checks at the master that every line and item arrived once, in order, and what the task
reported. Outages are kept to seconds by settings (``server.request_timeout``,
``server.refusal_timeout``, ``server.download_stall_timeout``).

| fault | expected |
| --- | --- |
| 404 ``{"error"}`` on the task streams for 1 s | retried, nothing lost, SUCCESS |
| 404 in Spring Boot's shape for 0.75 s | the same |
| 413 for 5 s | smaller batches, then everything |
| 404 for longer than ``server.refusal_timeout`` | the result says ``incomplete: true`` with the counts the master holds |
| only ``/batches`` hangs mid-body | a partial outage, logged and on /readyz; then everything |
| heartbeats answered after 2 intervals | answers used: beats counted, a cancel in them applied |
| the code download hangs mid-body, then the master is fine | retried after the stall time-out, SUCCESS |
| 429 with ``Retry-After: 3`` | the next try waits 3 s |
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from faultproxy import FaultProxy
from harness import agent_settings, eventually, items_of, output_lines, running_agent, submit

from ckagent.agent import Agent

LINES = 1000

NUMBERED = r"""
import sys, time
import crawlerkeeper_sdk as ck
items = sys.argv[1] == "items"
for i in range(1000):
    print(f"line {i:04d}", flush=True)
    if items:
        ck.save_item({"n": i})
    if i % 50 == 49:
        time.sleep(float(sys.argv[2]))
"""


@asynccontextmanager
async def behind_proxy(dev_master: Any, nursery: trio.Nursery, tmp_path: Path,
                       **env: str) -> AsyncIterator[tuple[FaultProxy, Agent]]:
    """A fault proxy in front of the dev master and an agent talking through it."""
    proxy = FaultProxy(int(dev_master.base_url.rsplit(":", 1)[1]))
    port = await nursery.start(proxy.serve)
    settings = agent_settings(tmp_path / "agent", f"http://127.0.0.1:{port}", dev_master.registration_token, **env)
    async with running_agent(nursery, settings) as agent:
        yield proxy, agent


async def stored_lines(admin: Any, task_id: str, at_least: int) -> bool:
    return int((await admin.get_task(task_id))["storedLogLines"]) >= at_least


async def check_everything_arrived(dev_master: Any, tmp_path: Path, task_id: str, task: dict[str, Any],
                                   with_items: bool = True) -> None:
    """At the master: every line of output.log and every item, once, in order; the counts reported."""
    task_dir = tmp_path / "agent" / "tasks" / task_id
    logs = await dev_master.admin.get_logs(task_id)
    assert logs == output_lines(task_dir)
    assert [line for line in logs if line.startswith("line ")] == [f"line {i:04d}" for i in range(LINES)]
    items = await dev_master.admin.get_items(task_id)
    assert items == items_of(task_dir) == ([{"n": i} for i in range(LINES)] if with_items else [])
    assert task["logLines"] == len(logs) and task["itemCount"] == len(items)
    assert not task.get("incomplete"), task


async def run_with_fault(dev_master: Any, nursery: trio.Nursery, tmp_path: Path, mode: str, calls: list[str],
                         seconds: float, **env: str) -> tuple[FaultProxy, str, dict[str, Any]]:
    """Run NUMBERED (1000 lines and items); ``mode`` on ``calls`` for ``seconds`` once lines flow."""
    async with behind_proxy(dev_master, nursery, tmp_path, **env) as (proxy, _agent):
        task_id = await submit(dev_master.admin, "numbered", {"main.py": NUMBERED}, args=["items", "0.1"])
        await eventually(lambda: stored_lines(dev_master.admin, task_id, 50), 60)
        proxy.set(mode, calls)
        await trio.sleep(seconds)
        proxy.heal()
        task = await dev_master.admin.wait_task_final(task_id, 120)
    assert proxy.faulted("logs") + proxy.faulted("items") > 0, "the fault never met a batch"
    return proxy, task_id, task


@pytest.mark.parametrize(("mode", "seconds"), [("404_json", 1.0), ("404_spring", 0.75)])
async def test_a_404_of_a_restarting_master_is_retried_and_nothing_is_lost(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path, mode: str, seconds: float
) -> None:
    _, task_id, task = await run_with_fault(dev_master, nursery, tmp_path, mode, ["logs", "items"], seconds)
    assert task["status"] == "SUCCESS" and task.get("errorCode") is None, task
    await check_everything_arrived(dev_master, tmp_path, task_id, task)


async def test_a_413_for_five_seconds_sends_smaller_batches_then_everything(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    _, task_id, task = await run_with_fault(dev_master, nursery, tmp_path, "413", ["logs", "items"], 5.0)
    assert task["status"] == "SUCCESS", task
    await check_everything_arrived(dev_master, tmp_path, task_id, task)
    logs = await dev_master.admin.get_logs(task_id)
    assert not any("refused by the master" in line for line in logs)  # no placeholder: the 413 passed


async def test_a_404_longer_than_the_refusal_timeout_reports_the_result_incomplete(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    async with behind_proxy(dev_master, nursery, tmp_path, AGENT_SERVER_REFUSAL_TIMEOUT="2") as (proxy, _agent):
        task_id = await submit(dev_master.admin, "numbered", {"main.py": NUMBERED}, args=["items", "0.1"])
        await eventually(lambda: stored_lines(dev_master.admin, task_id, 50), 60)
        proxy.set("404_json", ["logs", "items"])  # the result itself passes
        task = await dev_master.admin.wait_task_final(task_id, 120)
        proxy.heal()
    assert task["status"] == "SUCCESS" and task["incomplete"] is True, task
    logs = await dev_master.admin.get_logs(task_id)
    items = await dev_master.admin.get_items(task_id)
    task_dir = tmp_path / "agent" / "tasks" / task_id
    assert len(logs) < len(output_lines(task_dir)) and logs == output_lines(task_dir)[: len(logs)]
    assert items == items_of(task_dir)[: len(items)]
    assert task["logLines"] == len(logs) and task["itemCount"] == len(items)  # what the master holds
    assert (task_dir / "items.jsonl").exists()  # the spool stays on the node


async def test_only_batches_hanging_mid_body_is_a_partial_outage_and_then_everything_arrives(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ckagent.master.client")
    async with behind_proxy(dev_master, nursery, tmp_path, AGENT_SERVER_REQUEST_TIMEOUT="2") as (proxy, agent):
        task_id = await submit(dev_master.admin, "numbered", {"main.py": NUMBERED}, args=["items", "0.2"])
        await eventually(lambda: stored_lines(dev_master.admin, task_id, 50), 60)
        proxy.set("hang_body", ["batches"])
        problems: list[str] = []

        async def named() -> bool:  # the agent's view, as /readyz reads it
            problem = agent.master.connectivity.problem
            if problem and "partial outage" in problem:
                problems.append(problem)
            return bool(problems)

        await eventually(named, 12)
        await trio.sleep(4)  # longer than /readyz's limit (3 heartbeat intervals)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}", timeout=10) as client:
            ready = await client.get("/readyz")
            doc = (await client.get("/status")).json()
            page = (await client.get("/")).text
        proxy.heal()
        task = await dev_master.admin.wait_task_final(task_id, 120)
    assert problems and "task streams" in problems[0], "the hang of /batches was never named"
    assert "partial outage" in ready.text, ready.text  # /readyz names it
    backlog = doc["outbox"]["backlog"]  # the status shows the task's data waiting, and for how long
    assert backlog and backlog[0]["taskId"] == task_id and backlog[0]["logLines"] > 0, doc["outbox"]
    assert backlog[0]["ageSeconds"] > 0 and doc["outbox"]["oldestSeconds"] > 0
    assert "partial outage" in doc["masterProblem"]
    assert "Waiting for the master" in page and task_id in page and "partial outage" in page
    starts = [r.getMessage() for r in caplog.records if "partial outage" in r.getMessage()]
    assert len(starts) == 1, starts  # logged once
    assert any("master answers task streams again" in r.getMessage() for r in caplog.records)
    assert task["status"] == "SUCCESS", task
    await check_everything_arrived(dev_master, tmp_path, task_id, task)


SLEEPER = r"""
import time
for i in range(600):
    print(f"tick {i}", flush=True)
    time.sleep(0.1)
"""


async def test_slow_heartbeat_answers_are_used_and_their_cancels_applied(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    async with behind_proxy(dev_master, nursery, tmp_path, AGENT_HEARTBEAT_INTERVAL="1",
                            AGENT_SERVER_REQUEST_TIMEOUT="10") as (proxy, agent):
        task_id = await submit(dev_master.admin, "sleeper", {"main.py": SLEEPER})
        await eventually(lambda: stored_lines(dev_master.admin, task_id, 5), 60)
        assert agent.heartbeat is not None
        proxy.slow_seconds = 2.5  # 2.5 intervals per answer
        proxy.set("slow", ["heartbeat"])
        beats = agent.heartbeat.beats
        await trio.sleep(9)  # an answer 2.5 s after each beat: about three answers
        assert agent.heartbeat.beats >= beats + 2  # the late answers count
        await dev_master.admin.cancel_task(task_id)
        task = await dev_master.admin.wait_task_final(task_id, 30)  # the cancel came in a slow answer
        proxy.heal()
    assert task["status"] == "CANCELLED" and task["errorCode"] == "CANCELLED", task
    logs = await dev_master.admin.get_logs(task_id)
    assert logs == output_lines(tmp_path / "agent" / "tasks" / task_id)


async def test_a_download_that_hangs_mid_body_is_retried_after_the_stall_timeout(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    async with behind_proxy(dev_master, nursery, tmp_path, AGENT_SERVER_DOWNLOAD_STALL_TIMEOUT="1") as (proxy, _):
        proxy.set("hang_body", ["download"])
        task_id = await submit(dev_master.admin, "numbered", {"main.py": NUMBERED}, args=["items", "0"])

        async def stalled() -> bool:
            return proxy.faulted("download") > 0

        await eventually(stalled, 30)
        await trio.sleep(3)  # a few stalled attempts
        proxy.heal()
        task = await dev_master.admin.wait_task_final(task_id, 120)
    assert proxy.faulted("download") >= 2, proxy.seen
    assert task["status"] == "SUCCESS", task
    logs = await dev_master.admin.get_logs(task_id)
    assert any("package: download attempt" in line for line in logs), logs[:10]
    await check_everything_arrived(dev_master, tmp_path, task_id, task)


async def test_retry_after_of_a_429_is_waited_out(dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    async with behind_proxy(dev_master, nursery, tmp_path) as (proxy, _agent):
        proxy.retry_after = 3
        task_id = await submit(dev_master.admin, "numbered", {"main.py": NUMBERED}, args=["lines", "0.2"])
        await eventually(lambda: stored_lines(dev_master.admin, task_id, 50), 60)
        proxy.set("429_retry", ["logs"])
        await trio.sleep(7)
        proxy.heal()
        task = await dev_master.admin.wait_task_final(task_id, 120)
    refused = [t for t, call, mode in proxy.seen if call in ("logs", "batches") and mode == "429_retry"]
    assert len(refused) >= 2, refused
    gaps = [b - a for a, b in itertools.pairwise(refused)]
    assert all(gap >= 2.9 for gap in gaps), gaps  # one stream, each try after the 3 s asked for
    assert task["status"] == "SUCCESS", task
    await check_everything_arrived(dev_master, tmp_path, task_id, task, with_items=False)
