"""A Scrapy spider's data dir between its tasks, and polite stops, through the reference master (issue 37, items 4-5).

One real agent (as root: each spider under a uid of its own, the node's default level) runs a real Scrapy
project (harness.scrapyprojects) against a loopback origin that records every request:

- the ``cached`` spider (HTTPCACHE_ENABLED, the cache in the project's ``.scrapy``) twice: the second
  task is served from the cache the first one wrote (no request reaches the origin, Scrapy's stats say
  ``httpcache/hit``), the cache is the spider's (its uid) in its data dir, and counts in neither the
  working copy's outputs; a third task with ``cleanStart`` starts empty (every page fetched again);
- the ``polite`` spider (DOWNLOAD_DELAY, AutoThrottle, four requests in flight: its graceful close takes
  longer than the node's 2 s ``task.kill_grace``) cancelled through the master, or stopped by the agent
  terminating (its exit bound follows the longest grace of its tasks): Scrapy gets one SIGTERM,
  closes with reason ``shutdown`` (kept as the result's finishReason), its pipeline's ``close_spider``
  line is in the log, nothing is killed (exit status 0, not -9).
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import (
    CACHE_PAGES,
    PIPELINE_LINE,
    IdentityOrigin,
    agent_settings,
    assert_default_identity,
    eventually,
    running_agent,
    write_cache_and_polite_project,
)

from ckagent.code.frameworks import SCRAPY_STOP_GRACE
from ckagent.devmaster.client import zip_directory

TIMEOUT = 600.0

pytestmark = pytest.mark.slow


def _fetched(origin: IdentityOrigin, prefix: str) -> list[str]:
    return [seen.target for seen in origin.seen if seen.target.startswith(prefix)]


async def _log(admin: Any, task_id: str) -> str:
    return "\n".join(await admin.get_logs(task_id))


async def test_http_cache_is_kept_between_a_spiders_tasks_and_clean_start_empties_it(
        dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    origin = IdentityOrigin(host="127.0.0.3")
    port = await nursery.start(origin.serve)
    project = await trio.to_thread.run_sync(write_cache_and_polite_project, tmp_path / "project")
    package = await trio.to_thread.run_sync(zip_directory, project)
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_SYNC_TIMEOUT="600", AGENT_MAX_WORKERS="1")
    async with running_agent(nursery, settings):
        spider = await admin.create_spider(name="cached", framework="scrapy",
                                           env={"START_URL": f"http://127.0.0.3:{port}/"})
        await admin.upload_package(spider, package)
        results, logs = [], []
        for clean in (False, False, True):
            task = await admin.create_task(spider, clean_start=clean)
            with trio.fail_after(TIMEOUT):
                results.append(await admin.wait_task_final(task, TIMEOUT))
            logs.append(await _log(admin, task))
            assert results[-1]["status"] == "SUCCESS", (results[-1], logs[-1][-4000:])
            if len(logs) == 1:
                assert len(_fetched(origin, "/c/")) == CACHE_PAGES, logs[-1][-3000:]
            elif len(logs) == 2:  # every page from the first task's cache: nothing reached the origin
                assert len(_fetched(origin, "/c/")) == CACHE_PAGES, (origin.seen, logs[-1][-3000:])
                assert f"'httpcache/hit': {CACHE_PAGES}" in logs[-1], logs[-1][-3000:]
    uid = assert_default_identity(logs[0])
    first, second, third = logs
    data = work_dir / "spider-data"
    [spider_data] = [p for p in data.iterdir() if (p / "scrapy").is_dir()]
    cache = spider_data / "scrapy" / "httpcache" / "cached"
    assert cache.is_dir(), sorted(str(p) for p in spider_data.rglob("*"))[:20]
    if os.geteuid() == 0:  # the spider's own, written by it
        assert {p.stat().st_uid for p in cache.rglob("*")} == {uid}
    assert re.search(r"Scrapy's data dir \(\.scrapy → \S+/scrapy\): empty; kept between", first), first[-3000:]
    assert re.search(r"Scrapy's data dir \(\.scrapy → \S+\): [\d.]+ [KM]iB kept from this spider's earlier tasks",
                     second), second[-3000:]
    assert "cleanStart: emptied (" in third, third[-3000:]
    assert len(_fetched(origin, "/c/")) == 2 * CACHE_PAGES, "a clean start fetches every page again"
    assert "'httpcache/miss'" in third and "'httpcache/hit'" not in third, third[-3000:]
    for log in logs:  # the cache is no output: not an artifact, not kept
        assert "httpcache" not in log.split("outputs:")[-1], log[-2000:]


@pytest.mark.parametrize("stopped_by", ["master", "agent"])
async def test_a_polite_crawl_stopped_closes_gracefully(dev_master: Any, nursery: trio.Nursery, tmp_path: Path,
                                                        stopped_by: str) -> None:
    """Cancelled through the master, or the agent terminating (its exit bound follows the task's grace,
    not task.kill_grace: the result is still delivered): the same graceful close."""
    admin = dev_master.admin
    origin = IdentityOrigin(host="127.0.0.3")
    port = await nursery.start(origin.serve)
    project = await trio.to_thread.run_sync(write_cache_and_polite_project, tmp_path / "project")
    package = await trio.to_thread.run_sync(zip_directory, project)
    # The close (four requests behind a 2 s randomized delay: 4 s at least) outlasts task.kill_grace +
    # flush_timeout (3 s), the agent's exit bound before stop graces: only the task's grace lets it finish.
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_SYNC_TIMEOUT="600", AGENT_MAX_WORKERS="1", AGENT_TASK_KILL_GRACE="1",
                              AGENT_TASK_FLUSH_TIMEOUT="2")
    async with running_agent(nursery, settings) as agent:
        spider = await admin.create_spider(name="polite", framework="scrapy",
                                           env={"START_URL": f"http://127.0.0.3:{port}/"})
        await admin.upload_package(spider, package)
        task = await admin.create_task(spider)
        with trio.fail_after(TIMEOUT):
            async def crawling() -> bool:  # politely, requests queued behind the delay
                return len(_fetched(origin, "/p/")) >= 3
            await eventually(crawling, TIMEOUT, "the polite crawl's third page")
            if stopped_by == "master":
                await admin.cancel_task(task)
                result = await admin.wait_task_final(task, TIMEOUT)
            else:
                agent.terminate()  # (running_agent waits for its exit)
    if stopped_by == "agent":
        result = await admin.get_task(task)
    log = await _log(admin, task)
    assert_default_identity(log)
    assert result["status"] == "CANCELLED", (result, log[-4000:])
    assert f"stop grace {SCRAPY_STOP_GRACE:g} s: Scrapy's default stop grace" in log, log[-4000:]
    assert "sent SIGTERM to" in log, log[-4000:]
    assert log.count("Received SIGTERM, shutting down gracefully") == 1, log[-4000:]  # one signal only
    assert "Closing spider (shutdown)" in log and "polite spider closed: shutdown" in log, log[-4000:]
    assert PIPELINE_LINE in log, log[-4000:]
    assert "killed every process" not in log, log[-4000:]
    assert result["exitCode"] == 0, (result, log[-3000:])  # not -9: Scrapy ended by itself
    assert result["finishReason"] == "shutdown", result
    # The close outlasted the node's kill_grace + flush_timeout: the framework's grace let it finish.
    sent = re.search(r"\[ckagent (\S+ \S+)\] [^\n]*sent SIGTERM to", log)
    closed = re.search(r"(\S+ \S+) \[scrapy.core.engine\] INFO: Spider closed \(shutdown\)", log)
    assert sent and closed, log[-4000:]
    took = datetime.fromisoformat(closed.group(1)) - datetime.fromisoformat(sent.group(1))
    assert took.total_seconds() >= 3, (took, log[-4000:])


async def test_a_polite_crawl_paused_with_a_jobdir_in_scrapy_resumes_in_the_spiders_next_task(
        dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    """Scrapyd's habit: ``-s JOBDIR=.scrapy/jobs/<name>`` (relative to the working directory, so through
    the ``.scrapy`` link into the spider's data dir), stop the crawl politely, schedule it again: the next
    task resumes the queue the graceful close wrote."""
    admin = dev_master.admin
    origin = IdentityOrigin(host="127.0.0.3")
    port = await nursery.start(origin.serve)
    project = await trio.to_thread.run_sync(write_cache_and_polite_project, tmp_path / "project")
    package = await trio.to_thread.run_sync(zip_directory, project)
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_SYNC_TIMEOUT="600", AGENT_MAX_WORKERS="1")
    logs = []
    async with running_agent(nursery, settings):
        spider = await admin.create_spider(name="polite", framework="scrapy",
                                           env={"START_URL": f"http://127.0.0.3:{port}/"})
        await admin.upload_package(spider, package)
        for _round in (1, 2):
            task = await admin.create_task(spider, args=["-s", "JOBDIR=.scrapy/jobs/polite"])
            with trio.fail_after(TIMEOUT):
                async def crawling(at_least: int = len(_fetched(origin, "/p/")) + 3) -> bool:
                    return len(_fetched(origin, "/p/")) >= at_least  # (this task's: Scrapy's handlers are on)
                await eventually(crawling, TIMEOUT, "the polite crawl's pages")
                await admin.cancel_task(task)
                result = await admin.wait_task_final(task, TIMEOUT)
            logs.append(await _log(admin, task))
            assert result["status"] == "CANCELLED" and result["finishReason"] == "shutdown", (result, logs[-1][-3000:])
    first, second = logs
    assert "Resuming crawl" not in first, first[-3000:]
    assert re.search(r"Resuming crawl \(\d+ requests scheduled\)", second), second[-4000:]
    [jobdir] = list((work_dir / "spider-data").glob("*/scrapy/jobs/polite"))
    assert (jobdir / "requests.seen").is_file(), sorted(p.name for p in jobdir.iterdir())
