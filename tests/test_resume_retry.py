"""Why a task failed decides whether it runs again (issue 38, item 4), end to end: real agents, a real
reference master, a spider whose attempt N ends as the test says (``EXITS``: a comma-separated list,
the N-th entry for attempt N — an exit code, or ``hold``: wait on the site's ``/hold`` page).

- exit codes: ``exitCodes: [3]`` retries EXIT_NONZERO 3 until ``maxAttempts`` (3) counted attempts were
  made, each after ``backoffSeconds × factor^(n-1)`` (1 s, then 2 s); an exit code not listed (4), its
  class (spider) not in ``on``, is final at once;
- classes: ``on: [spider]`` retries an exit 4; ``on: [resource]`` retries a TIMEOUT;
- disruptions never count: attempt 1 on node A, node A lost (agent, monitors, task SIGKILLed, work dir
  deleted): NODE_LOST after the master's grace, not counted — then two attempts exiting 3 on node B with
  ``maxAttempts: 2``: three attempts in all, the task FAILED with "2 of retry.maxAttempts 2 made".

Each attempt's end (errorCode, causeClass, counted, decision) is read from the master's task view.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import RESUME_LEVELS, CrawlSite, epoch_of, spider_zip, two_nodes, wait_for_log

pytestmark = pytest.mark.slow

EXITS = '''\
import os, sys, urllib.request
attempt = int(os.environ.get("CK_ATTEMPT", "1"))
plan = os.environ["EXITS"].split(",")
what = plan[min(attempt, len(plan)) - 1]
print(f"attempt {attempt}: {what}", flush=True)
if what == "hold":
    urllib.request.urlopen(os.environ["START_URL"].split("/list/")[0] + "/hold", timeout=600).read()
    what = "0"
sys.exit(int(what))
'''

FINAL = ("SUCCESS", "FAILED", "CANCELLED")


def _ends(view: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(a.get("status"), a.get("errorCode"), a.get("exitCode"), a.get("causeClass"), a.get("counted"))
            for a in view.get("attempts") or []]


def _gaps(view: dict[str, Any]) -> list[tuple[float, float]]:
    """(notBefore − the previous attempt's finishedAt, startedAt − that finishedAt) per later attempt, s."""
    attempts = view.get("attempts") or []
    out = []
    for before, after in itertools.pairwise(attempts):
        finished = epoch_of(before.get("finishedAt")) or 0.0
        not_before = epoch_of(after.get("notBefore"))
        started = epoch_of(after.get("startedAt")) or 0.0
        out.append((0.0 if not_before is None else not_before - finished, started - finished))
    return out


@pytest.mark.parametrize("level", RESUME_LEVELS[:1])
async def test_retry_policy_exit_codes_classes_backoff_and_disruptions_not_counted(
        nursery: trio.Nursery, tmp_path: Path, level: tuple[str, str]) -> None:
    site = CrawlSite(listings=1, per_listing=1)
    await nursery.start(site.serve)
    async with two_nodes(nursery, tmp_path, level, agent__max_workers=5) as cluster:
        admin = cluster.admin

        async def task(exits: str, retry: dict[str, Any], **more: Any) -> str:
            """A task of a spider of its own (a node runs one spider's tasks one after the other)."""
            spider = await admin.create_spider(name="exits", framework="python", command=["python", "main.py"],
                                               env={"START_URL": site.start_url})
            await admin.upload_package(spider, spider_zip({"main.py": EXITS}))
            return str(await admin.create_task(spider, env={"EXITS": exits}, retry=retry, **more))

        await cluster.a.start()
        by_code = await task("3,3,3,0", {"maxAttempts": 3, "backoffSeconds": 1, "factor": 2, "exitCodes": [3]})
        not_listed = await task("4,0", {"maxAttempts": 3, "backoffSeconds": 0.2, "exitCodes": [3]})
        by_class = await task("4,0", {"maxAttempts": 3, "backoffSeconds": 0.2, "on": ["spider"]})
        resource = await task("hold,0", {"maxAttempts": 2, "backoffSeconds": 0.2, "on": ["resource"]},
                              timeout_seconds=2)
        lost = await task("hold,3,3,0", {"maxAttempts": 2, "backoffSeconds": 0.2, "exitCodes": [3]})
        views = {}
        for name, task_id in [("by_code", by_code), ("not_listed", not_listed), ("by_class", by_class),
                              ("resource", resource)]:
            views[name] = await admin.wait_task_final(task_id, 120)
        await wait_for_log(admin, lost, "attempt 1: hold", 60)
        await cluster.b.start()
        await cluster.a.lose()
        views["lost"] = await admin.wait_task_final(lost, 120)
        node_a, node_b = await cluster.a.node_id(), await cluster.b.node_id()
    print("figures retry gaps (notBefore, startedAt after the previous end, s):",
          {name: [(round(x, 2), round(y, 2)) for x, y in _gaps(v)] for name, v in views.items()})

    spider_ends = ("FAILED", "EXIT_NONZERO")
    assert _ends(views["by_code"]) == [(*spider_ends, 3, "spider", True)] * 3, views["by_code"]
    assert views["by_code"]["status"] == "FAILED" and views["by_code"]["exitCode"] == 3, views["by_code"]
    assert views["by_code"]["attempts"][-1]["decision"] == "3 of retry.maxAttempts 3 made", views["by_code"]
    # 1 s × 2^(n-1) after the attempt ended (the master's clock: up to a delivery's lag after the agent's)
    (wait_1, start_1), (wait_2, start_2) = _gaps(views["by_code"])
    assert 1.0 - 0.05 <= wait_1 <= 2.0 and 2.0 - 0.05 <= wait_2 <= 3.0, _gaps(views["by_code"])
    assert start_1 >= wait_1 - 0.05 and start_2 >= wait_2 - 0.05, _gaps(views["by_code"])  # not handed out before

    assert _ends(views["not_listed"]) == [(*spider_ends, 4, "spider", True)], views["not_listed"]
    assert "retry.exitCodes no 4" in views["not_listed"]["attempts"][0]["decision"], views["not_listed"]

    assert _ends(views["by_class"]) == [(*spider_ends, 4, "spider", True), ("SUCCESS", None, 0, None, True)], \
        views["by_class"]
    assert views["by_class"]["status"] == "SUCCESS"

    assert [e[:2] + e[3:] for e in _ends(views["resource"])] == [
        ("FAILED", "TIMEOUT", "resource", True), ("SUCCESS", None, None, True)], views["resource"]

    lost_view = views["lost"]
    assert [e[1:] for e in _ends(lost_view)] == [
        ("NODE_LOST", None, "disruption", False), ("EXIT_NONZERO", 3, "spider", True),
        ("EXIT_NONZERO", 3, "spider", True)], lost_view
    assert lost_view["status"] == "FAILED" and lost_view["attempts"][-1]["decision"] == "2 of retry.maxAttempts 2 made"
    assert [a["nodeId"] for a in lost_view["attempts"]] == [node_a, node_b, node_b], lost_view
    assert f"the node-lost grace is {cluster.node_lost_after:g} s" in lost_view["attempts"][0]["errorMessage"]
