"""A Scrapy crawl survives its node (issue 38's acceptance tests, Scrapy).

A real Scrapy project (harness.scrapyprojects ``siteproj``: one item per page) crawls a local site of
1,050 pages served at a steady 100 pages/s (harness.crawlsite), on node A — a real agent of its own
(work dir, name, status port) on a real reference master, with node B beside it (harness.twonodes). At
40 % of the pages node A leaves:

- migrated: ``ckagent stop --migrate -c <A's config>``: A asks the crawl to persist (the agent's Scrapy
  hook: dupefilter, queues, requests in flight), ships the checkpoint, reports MIGRATED and exits; B
  resumes the crawl within seconds;
- lost: A's agent, monitors and the task's processes and cgroup SIGKILLed, its work dir deleted: after
  the master's node-lost grace B resumes from A's last periodic checkpoint (every 2 s here).

In both, the task ends SUCCESS with every page's item exactly once at the master, the pages fetched
twice are at most those of one checkpoint's age (plus the requests in flight), and the master's task
view shows both attempts and why the first ended. At a cgroup level with nftables and at the
process-group level with the egress proxy (harness.twonodes.RESUME_LEVELS).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio
from harness import (
    RESUME_LEVELS,
    SITE_IN_FLIGHT,
    Cluster,
    CrawlSite,
    Handover,
    hand_over,
    two_nodes,
    write_site_project,
)

from ckagent.devmaster.client import zip_directory

pytestmark = pytest.mark.slow

INTERVAL = 2.0
"""The crawl's checkpointIntervalSeconds (the node default is 60 s)."""
SHIP_SLACK = 1.5
"""Seconds a periodic checkpoint may take from its snapshot to being durable at the master: the pages
fetched again are at most (INTERVAL + this) × the site's rate, and the requests in flight."""


async def _scrapy_spider(cluster: Cluster, site: CrawlSite, tmp_path: Path) -> str:
    admin = cluster.admin
    project = await trio.to_thread.run_sync(write_site_project, tmp_path / "project")
    spider = await admin.create_spider(name="site", framework="scrapy", command=["scrapy", "crawl", "site"],
                                       env={"START_URL": site.start_url})
    await admin.upload_package(spider, await trio.to_thread.run_sync(zip_directory, project))
    return str(spider)


def _kept_in_flight(handover: Handover) -> int:
    """How many requests in flight the checkpoint B resumed from kept (the hook's line for it in attempt 1's
    log: "checkpoint N: … K in flight kept"; responses downloaded but not yet processed count too)."""
    number = str((handover.resumed_from or {}).get("id", "-")).rsplit("-", 1)[-1]
    found = re.search(rf"checkpoint {re.escape(number)}: \d+ seen, \d+ pending, (\d+) in flight kept", handover.log)
    return int(found.group(1)) if found else 3 * SITE_IN_FLIGHT


@pytest.mark.parametrize("level", RESUME_LEVELS)
@pytest.mark.parametrize("how", ["migrate", "lost"])
async def test_a_scrapy_crawl_survives_its_node(nursery: trio.Nursery, tmp_path: Path, level: tuple[str, str],
                                                how: str) -> None:
    site = CrawlSite(listings=50, per_listing=20, rate=100.0)
    await nursery.start(site.serve)
    async with two_nodes(nursery, tmp_path, level) as cluster:
        spider = await _scrapy_spider(cluster, site, tmp_path)
        handover = await hand_over(cluster, site, spider, how, holder={"args": ["-a", "hold=1"]},
                                   checkpoint_interval_seconds=INTERVAL)
    print(f"figures [{level[0]}/{level[1]}] scrapy {handover.figures()}")
    age = handover.checkpoint_age()
    if how == "migrate":
        assert handover.migrate_codes == (0, 0), (handover.migrate_codes, handover.migrate_output)
        # B resumes from a checkpoint taken once the migrate began (its reason "migrate", or "interval"
        # when a periodic request came in the same instant: one snapshot answers both, named after the newer)
        assert age is not None and age <= 0.05, f"{handover.figures()}\n{handover.story()}"
        bound = site.interval_worth(INTERVAL, SITE_IN_FLIGHT)
        resumed = handover.resumed_after()
        assert resumed is not None and resumed < 15, (resumed, handover.figures())  # "within seconds"
    else:
        # Fetched again: only what came after the checkpoint (its age when A died), and so at most one
        # interval's worth (and the checkpoint's upload); the age itself grows with the machine's load.
        assert age is not None and age > 0, handover.figures()
        in_flight = _kept_in_flight(handover) + SITE_IN_FLIGHT  # (and those at the site when A died)
        bound = min(site.interval_worth(age, in_flight), site.interval_worth(INTERVAL + SHIP_SLACK, in_flight))
        resumed = handover.resumed_after()
        # not before the grace from A's last heartbeat (a beat a second: at most 1 s before it died)
        assert resumed is not None and resumed >= cluster.node_lost_after - 1.0, handover.figures()
    problems = handover.problems(site, twice_at_most=bound)
    assert not problems, "\n\n".join(problems) + "\n" + handover.figures() + "\n" + handover.story()
    assert "resuming from checkpoint" in handover.log, handover.log[-3000:]
