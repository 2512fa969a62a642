"""A spider that cannot resume is restarted, and its earlier items are kept or replaced as it declares
(issue 38, item 3: ``resume: restart-replace`` (the default) | ``restart-keep``).

A plain Python spider — no SDK, no Scrapy: it writes one JSON line per page to ``CK_ITEMS_FILE`` —
fetches the item pages of a local site one after the other (harness.crawlsite), on node A of two real
nodes on a real reference master (harness.twonodes). At 40 % node A leaves — migrated (``ckagent stop
--migrate``) or lost (everything of it SIGKILLed, its work dir deleted) — and node B runs the task's
next attempt from scratch. With restart-replace the master drops the first attempt's items (the task
holds each page's item once, the second attempt's); with restart-keep it keeps them (the pages of the
first attempt twice, every page at least once). The master's attempt view says how many it kept and
dropped, and the task log says that the second attempt restarted from scratch and what became of the items.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from harness import LEVEL_PAIRS, CrawlSite, hand_over, page_counts, spider_zip, two_nodes

pytestmark = pytest.mark.slow

PLAIN = '''\
import json, os, re, sys, urllib.request
base = os.environ["START_URL"].split("/list/")[0]
if sys.argv[1:] == ["hold"]:
    urllib.request.urlopen(base + "/hold", timeout=600).read()
    sys.exit(0)
listings, per_listing = (int(n) for n in os.environ["SHAPE"].split("x"))
with open(os.environ["CK_ITEMS_FILE"], "a") as items:
    for i in range(listings * per_listing):
        url = f"{base}/item/{i}"
        page = urllib.request.urlopen(url, timeout=60).read().decode()
        items.write(json.dumps({"url": url, "title": re.search("<h1>(.*?)</h1>", page).group(1)}) + "\\n")
        items.flush()
    for n in range(listings):
        url = f"{base}/list/{n}"
        urllib.request.urlopen(url, timeout=60).read()
        items.write(json.dumps({"url": url}) + "\\n")
        items.flush()
'''
"""Every item page, then every listing, one at a time; an item per page, in CK_ITEMS_FILE."""


@pytest.mark.parametrize(("resume", "how", "level"), [
    ("restart-replace", "lost", LEVEL_PAIRS[0]),
    ("restart-keep", "migrate", LEVEL_PAIRS[-1]),
], ids=["restart-replace-lost", "restart-keep-migrated"])
async def test_a_spider_without_resume_restarts_and_its_items_are_as_declared(
        nursery: trio.Nursery, tmp_path: Path, resume: str, how: str, level: tuple[str, str]) -> None:
    # 100 pages: 2.5 s of fetching; 10 s for the migrated one (see below)
    site = CrawlSite(listings=4, per_listing=24, rate=10.0 if how == "migrate" else 40.0)
    await nursery.start(site.serve)
    # A spider that never answers a persist request is still asked at a migrate, for up to half the
    # migrate's bound (2.5 s here): it must still be crawling by then, or its first attempt succeeds.
    async with two_nodes(nursery, tmp_path, level, task__migrate_timeout=6) as cluster:
        admin = cluster.admin
        spider = await admin.create_spider(name="plain", framework="python", command=["python", "main.py"],
                                           env={"START_URL": site.start_url,
                                                "SHAPE": f"{site.listings}x{site.per_listing}"})
        await admin.upload_package(spider, spider_zip({"main.py": PLAIN}))
        handover = await hand_over(cluster, site, spider, how, holder={"args": ["hold"]}, stored_first=1,
                                   resume=resume,
                                   checkpoint_interval_seconds=1)
    print(f"figures [{level[0]}/{level[1]}] plain {resume} {handover.figures()}")
    final, log = handover.final, handover.log
    assert final["status"] == "SUCCESS", (final, log[-3000:])
    first, second = handover.attempts
    assert first["errorCode"] == {"lost": "NODE_LOST", "migrate": "MIGRATED"}[how], first
    assert first["causeClass"] == "disruption" and first["counted"] is False, first
    assert second["resumedFrom"] is None and handover.resumed_from is None, (second, handover.resumed_from)
    counts = page_counts(handover.items)
    assert set(counts) == set(site.all_paths()), sorted(set(site.all_paths()) - set(counts))[:5]
    written_before = second["itemsKept"] + second["itemsDropped"]
    assert written_before > 0, second  # the first attempt's items had reached the master
    if resume == "restart-replace":
        assert (second["itemsKept"], second["itemsDropped"]) == (0, written_before), second
        assert len(handover.items) == site.pages and set(counts.values()) == {1}, counts.most_common(3)
        assert "attempt 2: no checkpoint; restarting from scratch, earlier items replaced (resume: restart-replace)" \
            in log, log[-3000:]
    else:
        assert (second["itemsKept"], second["itemsDropped"]) == (written_before, 0), second
        assert len(handover.items) == site.pages + written_before, (len(handover.items), written_before)
        order = [f"/item/{i}" for i in range(site.listings * site.per_listing)] + \
            [f"/list/{n}" for n in range(site.listings)]  # (the spider's)
        twice = sorted(path for path, n in counts.items() if n == 2)
        assert twice == sorted(order[:written_before]), (written_before, twice[:5])
        assert "attempt 2: no checkpoint; restarting from scratch, earlier items kept (resume: restart-keep)" \
            in log, log[-3000:]
