"""The harness of issue 38's acceptance tests holds what they rely on.

- The site (harness.crawlsite) serves its pages at its rate across connections, links every page, and
  counts each fetch.
- Losing a node (harness.nodekill through harness.twonodes) kills exactly that node: its agent, its
  monitors, its task's processes and cgroups, its work dir — while the other node's task, on the same
  machine and master, at the same level, runs on untouched.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import trio
from harness import RESUME_LEVELS, CrawlSite, node_cgroups, node_pids, spider_zip, two_nodes, wait_for_log

pytestmark = pytest.mark.slow

HOLDER = '''\
import os, urllib.request
print("holder", os.getpid(), flush=True)
urllib.request.urlopen(os.environ["START_URL"].split("/list/")[0] + "/hold", timeout=600).read()
print("released", flush=True)
'''
"""A spider that waits on the site's /hold page (through the egress proxy when the level has one)."""


async def test_the_site_serves_its_pages_at_its_rate_and_counts_them(nursery: trio.Nursery) -> None:
    site = CrawlSite(listings=3, per_listing=4, rate=50.0)
    await nursery.start(site.serve)
    assert site.pages == 15
    seen, queue = set(), ["/list/0"]
    started = time.monotonic()
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=site.url) as client:
            while queue:
                batch, queue = queue, []
                answers: list[str] = []

                async def get(path: str, answers: list[str] = answers) -> None:
                    answers.append((await client.get(path)).text)

                async with trio.open_nursery() as fetching:
                    for path in batch:
                        seen.add(path)
                        fetching.start_soon(get, path)
                for text in answers:
                    queue += [p for p in re.findall(r'href="(/[^"]+)"', text) if p not in seen and p not in queue]
            assert (await client.get("/item/12")).status_code == 404
            assert (await client.get("/list/0")).status_code == 200
    took = time.monotonic() - started
    assert sorted(seen) == sorted(site.all_paths())
    assert site.fetched() == 16 and site.fetched_twice() == 1 and site.fetches["/list/0"] == 2
    assert took >= 15 / 50.0 * 0.9, took  # the steady rate: no burst


@pytest.mark.parametrize("level", RESUME_LEVELS)
async def test_losing_a_node_kills_that_node_and_nothing_of_the_other(
        nursery: trio.Nursery, tmp_path: Path, level: tuple[str, str]) -> None:
    site = CrawlSite(listings=1, per_listing=1)
    await nursery.start(site.serve)
    async with two_nodes(nursery, tmp_path, level) as cluster:
        admin = cluster.admin
        spider = await admin.create_spider(name="holder", framework="python", command=["python", "main.py"],
                                           env={"START_URL": site.start_url})
        await admin.upload_package(spider, spider_zip({"main.py": HOLDER}))
        await cluster.b.start()
        held_b = await cluster.b.occupy(spider)
        await cluster.a.start()
        held_a = await cluster.a.occupy(spider)
        for task in (held_a, held_b):
            await wait_for_log(admin, task, "holder ", 60)
        a_agent, b_agent = cluster.a.agent.process, cluster.b.agent.process
        assert a_agent is not None and b_agent is not None
        pids_a = await trio.to_thread.run_sync(node_pids, a_agent.pid, cluster.a.work_dir)
        pids_b = await trio.to_thread.run_sync(node_pids, b_agent.pid, cluster.b.work_dir)
        spider_a = int(next(line for line in await admin.get_logs(held_a) if "holder " in line).split()[-1])
        spider_b = int(next(line for line in await admin.get_logs(held_b) if "holder " in line).split()[-1])
        assert spider_a in pids_a and spider_b in pids_b and not pids_a & pids_b, (pids_a, pids_b)
        assert len(pids_a) >= 3, pids_a  # the agent, the monitor, the spider
        groups = await trio.to_thread.run_sync(node_cgroups, a_agent.pid, cluster.a.work_dir)
        assert bool(groups) == (level[0] != "process-group"), groups

        killed = await cluster.a.lose()

        assert {a_agent.pid, spider_a} <= killed.pids, (pids_a, killed.pids)  # (others may have ended by themselves)
        assert not any(_alive(pid) for pid in pids_a)
        assert all(_alive(pid) for pid in pids_b), "node B lost a process"
        assert not cluster.a.work_dir.exists() and cluster.b.work_dir.is_dir()
        assert not any(group.exists() for group in groups), groups
        assert b_agent.returncode is None
        site.release()
        final = await admin.wait_task_final(held_b, 60)
        assert final["status"] == "SUCCESS", final


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
