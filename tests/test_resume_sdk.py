"""A crawl of an SDK spider survives its node (issue 38's acceptance tests, the Python and Node SDKs).

``sdk/examples/python_resume`` (plain Python, the SDK's ``load_state`` / ``on_persist`` /
``on_migrating``) and ``sdk/examples/node_resume`` (the Node SDK's ``loadState`` / ``onPersist`` /
``onMigrating``) crawl a local site of 1,050 pages served at 100 pages/s (harness.crawlsite), one page
at a time, on node A of two real nodes on a real reference master (harness.twonodes). At 40 % node A
leaves — migrated (``ckagent stop --migrate``: the spider is told ``migrating`` with the seconds left,
persists, the checkpoint is shipped, MIGRATED) or lost (everything of it SIGKILLed, its work dir
deleted: node B resumes after the master's node-lost grace from the last periodic checkpoint, every 2 s
here). In both the task ends SUCCESS on node B with every page's item exactly once, at most one
checkpoint's age of pages fetched twice, and both attempts in the master's task view. Each example
runs once each way, at a cgroup level for one and the process-group level for the other.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio
from harness import EXAMPLES, LEVEL_PAIRS, CrawlSite, hand_over, spider_zip, two_nodes

from ckagent.devmaster.client import zip_directory

pytestmark = pytest.mark.slow

INTERVAL = 2.0
"""The crawl's checkpointIntervalSeconds."""
SHIP_SLACK = 1.5
"""Seconds a periodic checkpoint may take from its snapshot to being durable at the master."""
HOLDER = '''\
import os, urllib.request
urllib.request.urlopen(os.environ["START_URL"].split("/list/")[0] + "/hold", timeout=600).read()
'''
"""Node B's holding task: waits on the site's /hold page."""

CASES = [
    ("python_resume", "python", ["python", "main.py"], "migrate", LEVEL_PAIRS[0]),
    ("python_resume", "python", ["python", "main.py"], "lost", LEVEL_PAIRS[-1]),
    ("node_resume", "node", ["node", "index.js"], "migrate", LEVEL_PAIRS[-1]),
    ("node_resume", "node", ["node", "index.js"], "lost", LEVEL_PAIRS[0]),
]


@pytest.mark.parametrize(("example", "framework", "command", "how", "level"), [
    pytest.param(*case, id=f"{case[0]}-{case[3]}-{case[4][0]}",
                 marks=[pytest.mark.skipif(case[1] == "node" and shutil.which("node") is None, reason="needs node")])
    for case in CASES])
async def test_an_sdk_crawl_survives_its_node(nursery: trio.Nursery, tmp_path: Path, example: str, framework: str,
                                              command: list[str], how: str, level: tuple[str, str]) -> None:
    site = CrawlSite(listings=50, per_listing=20, rate=100.0)
    await nursery.start(site.serve)
    async with two_nodes(nursery, tmp_path, level) as cluster:
        admin = cluster.admin
        spider = await admin.create_spider(name=example, framework=framework, command=command,
                                           env={"START_URL": site.start_url})
        await admin.upload_package(spider, await trio.to_thread.run_sync(zip_directory, EXAMPLES / example))
        holder = await admin.create_spider(name="holder", framework="python", command=["python", "main.py"],
                                           env={"START_URL": site.start_url})
        await admin.upload_package(holder, spider_zip({"main.py": HOLDER}))
        handover = await hand_over(cluster, site, str(spider), how, holder={"spider": holder},
                                   checkpoint_interval_seconds=INTERVAL)
    print(f"figures [{level[0]}/{level[1]}] {example} {handover.figures()}")
    if how == "migrate":
        assert handover.migrate_codes == (0, 0), (handover.migrate_codes, handover.migrate_output)
        # B resumes from a checkpoint taken once the migrate began (its reason "migrate", or "interval"
        # when a periodic request came in the same instant: one snapshot answers both, named after the newer)
        age = handover.checkpoint_age()
        assert age is not None and age <= 0.05, f"{handover.figures()}\n{handover.story()}"
        bound = site.interval_worth(INTERVAL, 1)
        resumed = handover.resumed_after()
        assert resumed is not None and resumed < 15, handover.figures()  # "within seconds"
        assert "migrating: the agent stops this spider in" in handover.log, handover.log[-3000:]
    else:
        age = handover.checkpoint_age()
        # Fetched again: only what came after the checkpoint (its age when A died), and so at most one
        # interval's worth (and the checkpoint's upload); the age itself grows with the machine's load.
        assert age is not None and age > 0, handover.figures()
        # one page in flight in the spider, one at the site when A died
        bound = min(site.interval_worth(age, 2), site.interval_worth(INTERVAL + SHIP_SLACK, 2))
    problems = handover.problems(site, twice_at_most=bound)
    assert not problems, "\n\n".join(problems) + "\n" + handover.figures() + "\n" + handover.story()
    assert "resuming from checkpoint" in handover.log, handover.log[-3000:]
