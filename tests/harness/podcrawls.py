"""Crawls for the pod box (tests/test_pod_sandbox.py): what runs in a :class:`harness.podbox.PodBox` against
the reference master outside it, and what to check of it.

- :func:`demo_tasks` queues what ``ckagent demo`` queues (its three example spiders on the master's demo
  shop) and the many-page Scrapy crawl of tests/harness/demo.py (:data:`harness.demo.CRAWL_EXAMPLE`);
  :func:`demo_problems` says, in words, where their results differ from what they promise.
- :func:`resumable_spider` uploads sdk/examples/python_resume (a plain-Python crawl whose frontier is its
  checkpointed state: it survives its node), :func:`crawl_problems` checks one crawl of a
  :class:`harness.crawlsite.CrawlSite`: SUCCESS, the attempts expected, every page's item exactly once.
"""

from __future__ import annotations

from typing import Any

import trio

from ckagent.cli.demo import SPIDERS, DemoResult, check_result, first_difference
from ckagent.devmaster.client import AdminClient, zip_directory
from ckagent.devmaster.demosite import expected_products
from harness.crawlsite import CrawlSite
from harness.demo import CRAWL_EXAMPLE
from harness.examples import EXAMPLES
from harness.handover import page_counts

__all__ = ["crawl_problems", "demo_problems", "demo_tasks", "resumable_spider"]


async def demo_tasks(admin: AdminClient, base_url: str) -> dict[str, str]:
    """Upload the demo's spiders and :data:`CRAWL_EXAMPLE` (its ``products`` spider) and queue one task of
    each on ``base_url``'s demo shop; returns {spider name: task id} (the crawl as ``CRAWL_EXAMPLE``)."""
    tasks = {}
    shop = f"{base_url}/demo-site/"
    for spider in SPIDERS:
        spider_id = await admin.create_spider(name=spider.name, framework=spider.framework)
        await admin.upload_package(spider_id, await trio.to_thread.run_sync(zip_directory, EXAMPLES / spider.directory))
        tasks[spider.name] = str(await admin.create_task(spider_id, params={"start_url": shop}))
    crawl = await admin.create_spider(name="shop_products", framework="scrapy", command=["scrapy", "crawl", "products"])
    await admin.upload_package(crawl, await trio.to_thread.run_sync(zip_directory, EXAMPLES / CRAWL_EXAMPLE))
    tasks[CRAWL_EXAMPLE] = str(await admin.create_task(crawl, args=["-a", f"start_url={shop}"]))
    return tasks


async def demo_problems(admin: AdminClient, tasks: dict[str, str], timeout: float) -> list[str]:  # noqa: ASYNC109
    """Wait (≤ ``timeout`` seconds in all) for every task of :func:`demo_tasks` to end; what differs from
    the promises: the demo's own check per spider (ckagent.cli.demo.check_result) and the crawl's SUCCESS
    with every product of the shop once (by SKU: the crawl is concurrent)."""
    problems = []
    expected = expected_products()
    with trio.fail_after(timeout):
        for spider in SPIDERS:
            record = await admin.wait_task_final(tasks[spider.name], timeout)
            items = await admin.get_items(tasks[spider.name])
            problem = check_result(DemoResult(spider, tasks[spider.name], record, items), expected)
            if problem is not None:
                log = "\n".join(await admin.get_logs(tasks[spider.name]))[-2000:]
                problems.append(f"{spider.name}: {problem}\n{log}")
        record = await admin.wait_task_final(tasks[CRAWL_EXAMPLE], timeout)
        items = await admin.get_items(tasks[CRAWL_EXAMPLE])
    if record.get("status") != "SUCCESS":
        log = "\n".join(await admin.get_logs(tasks[CRAWL_EXAMPLE]))[-3000:]
        problems.append(f"{CRAWL_EXAMPLE}: {record.get('status')}/{record.get('errorCode')}: "
                        f"{record.get('errorMessage')}\n{log}")
    difference = first_difference(sorted(items, key=lambda item: str(item.get("sku"))), expected)
    if difference is not None:
        problems.append(f"{CRAWL_EXAMPLE}: {len(items)} items of the shop's {len(expected)} ({difference})")
    return problems


async def resumable_spider(admin: AdminClient, name: str = "resumable") -> str:
    """Upload sdk/examples/python_resume as spider ``name``; returns its id."""
    spider_id = await admin.create_spider(name=name, framework="python")
    await admin.upload_package(spider_id, await trio.to_thread.run_sync(zip_directory, EXAMPLES / "python_resume"))
    return str(spider_id)


def crawl_problems(final: dict[str, Any], items: list[dict[str, Any]], site: CrawlSite, *,
                   attempts: int) -> list[str]:
    """What is not as promised of one crawl of ``site``: SUCCESS, ``attempts`` attempts in the master's
    view, every page's item exactly once (no page missing, none twice, nothing else)."""
    out = []
    if final.get("status") != "SUCCESS":
        out.append(f"task {final.get('status')}/{final.get('errorCode')}: {final.get('errorMessage')}")
    got = list(final.get("attempts") or [])
    if len(got) != attempts:
        out.append(f"{len(got)} attempts, not {attempts}: {got}")
    counts = page_counts(items)
    expected = set(site.all_paths())
    missing = sorted(expected - set(counts))
    doubled = sorted(path for path, n in counts.items() if n > 1)
    strange = sorted(set(counts) - expected)
    if missing or doubled or strange:
        out.append(f"{len(items)} items for {site.pages} pages: {len(missing)} missing {missing[:5]}, "
                   f"{len(doubled)} twice or more {doubled[:5]}, {len(strange)} not pages {strange[:5]}")
    return out
