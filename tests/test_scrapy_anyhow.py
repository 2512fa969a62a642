"""Scrapy items reach the master however the crawl is started, and the project's own FEEDS keep working.

One real agent on the dev master's demo site runs ``sdk/examples/scrapy_books_feeds`` three ways:
through ``sh -c 'python database_setup.py && scrapy crawl bookspider'`` (a setup step first), as
``python -m scrapy crawl bookspider``, and as ``python run.py`` (a script building a
``CrawlerProcess`` from settings of its own). Each delivers every product once, and the log shows
that the project's own feed stored its items too. A fourth task runs the shell way with the feed's
file declared in ``outputs.items``: the agent adds no feed of its own, so each item comes once. They
share one environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from harness import agent_settings, assert_default_identity, running_agent

import ckagent
from ckagent.devmaster.client import zip_directory
from ckagent.devmaster.demosite import expected_products

EXAMPLES = Path(ckagent.__file__).resolve().parent.parent / "sdk" / "examples"
TIMEOUT = 600.0

pytestmark = pytest.mark.slow

COMMANDS = {
    "shell": ["sh", "-c", "python database_setup.py && scrapy crawl bookspider"],
    # Without the setup step: the run keeps the price pipeline only (books.db does not exist).
    "module": ["python", "-m", "scrapy", "crawl", "bookspider", "-s",
               'ITEM_PIPELINES={"bookscraper.pipelines.PricePipeline": 100}'],
    "script": ["python", "run.py"],
}
# The shell way again, with the project's own feed file declared as the task's items.
DECLARED = {"declared": {"items": ["output/books.jsonl"]}}


async def test_scrapy_items_however_it_is_started(dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    site = f"{dev_master.base_url}/demo-site/"
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_SYNC_TIMEOUT="600", AGENT_MAX_WORKERS="1")
    package = await trio.to_thread.run_sync(zip_directory, EXAMPLES / "scrapy_books_feeds")
    tasks = {}
    async with running_agent(nursery, settings):
        for name, command in {**COMMANDS, "declared": COMMANDS["shell"]}.items():
            spider = await admin.create_spider(name=f"books-{name}", framework="scrapy", command=command,
                                               env={"START_URL": site}, outputs=DECLARED.get(name))
            await admin.upload_package(spider, package)
            tasks[name] = await admin.create_task(spider)
        with trio.fail_after(TIMEOUT):
            results = {name: await admin.wait_task_final(t, TIMEOUT) for name, t in tasks.items()}
    skus = sorted(e["sku"] for e in expected_products())
    for name, task_id in tasks.items():
        log = "\n".join(await admin.get_logs(task_id))
        assert results[name]["status"] == "SUCCESS", (name, results[name], log[-4000:])
        assert_default_identity(log)
        items = await admin.get_items(task_id)
        assert sorted(i["sku"] for i in items) == skus, (name, len(items), log[-3000:])  # each once
        # Without declared outputs the agent adds its feed; with outputs.items, the declared file only.
        assert ("scraped items also go to the task's items file" in log) == (name != "declared"), (name, log[-3000:])
        assert "will not be collected" not in log
        own_feed = "output/books.jsonl" if name != "script" else "output/script.csv"
        assert f"Stored {'jsonlines' if name != 'script' else 'csv'} feed (30 items) in: {own_feed}" in log, \
            (name, log[-3000:])
    declared_log = "\n".join(await admin.get_logs(tasks["declared"]))
    assert "output/books.jsonl → 30 items" in declared_log, declared_log[-3000:]
    shell_log = "\n".join(await admin.get_logs(tasks["shell"]))
    assert "database ready: books.db" in shell_log
    # The pipelines ran before the items were taken: prices are numbers.
    assert all(isinstance(i["price"], float) for i in await admin.get_items(tasks["shell"]))
