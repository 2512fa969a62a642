"""Projects shaped like popular public ones (sdk/examples) run end to end, as their authors wrote them,
through one real agent on the dev master's demo site — only their start URLs point at it; as root each
spider under a uid of its own (the default identity level).

- ``scrapy_shop``: `scrapy startproject` layout, two spiders, pipelines and middlewares, no SDK: its
  items reach the master through the SDK extension the agent's environment adds, once each. Its two
  spiders share one environment.
- ``requests_bs4``: a requests + BeautifulSoup script with argparse, its requirements.txt asking for
  ``crawlerkeeper-sdk`` (as migrate_spiders.py writes it) — served by the agent's bundled copy.
- ``node_esm_crawler``: `"type": "module"`, cheerio, `npm start`; items through the SDK's JS helper.
- ``scrapy_playwright_shop``: scrapy-playwright on Debian's Chromium (CK_CHROMIUM_PATH); skipped
  where Chromium is not installed.

The Selenium script (``selenium_demo``) runs in tests/test_frameworks.py. Packages come from PyPI
(or the mirror) and npm through uv's and npm's caches; one agent runs everything, so each distinct
environment is built once.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import DEFAULT_IDENTITY, agent_settings, assert_default_identity, running_agent

import ckagent
from ckagent.code.runtimes import find_chromium
from ckagent.devmaster.client import zip_directory
from ckagent.devmaster.demosite import expected_products

EXAMPLES = Path(ckagent.__file__).resolve().parent.parent / "sdk" / "examples"
TIMEOUT = 900.0
"""Seconds for the whole batch, cold caches included (Scrapy, Playwright ~40 MB, cheerio)."""

pytestmark = pytest.mark.slow


async def _spider(admin: Any, example: str, name: str, framework: str, **extra: Any) -> str:
    spider_id = await admin.create_spider(name=name, framework=framework, **extra)
    await admin.upload_package(spider_id, await trio.to_thread.run_sync(zip_directory, EXAMPLES / example))
    return str(spider_id)


async def test_public_shaped_projects_run_as_written(dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    site = f"{dev_master.base_url}/demo-site/"
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_SYNC_TIMEOUT="600", AGENT_MAX_WORKERS="2")
    products = await _spider(admin, "scrapy_shop", "products", "scrapy")
    listing = await _spider(admin, "scrapy_shop", "listing", "scrapy")
    script = await _spider(admin, "requests_bs4", "requests_bs4", "python")
    node_ok = shutil.which("node") is not None and shutil.which("npm") is not None
    node = await _spider(admin, "node_esm_crawler", "node_esm", "node", env={"START_URL": site}) if node_ok else None
    browser = await _spider(admin, "scrapy_playwright_shop", "rendered", "scrapy") if find_chromium() else None
    async with running_agent(nursery, settings):
        tasks = {
            "products": await admin.create_task(products, args=["-a", f"start_url={site}"]),
            "listing": await admin.create_task(listing, args=["-a", f"start_url={site}"]),
            "script": await admin.create_task(script, args=["--start-url", site, "--max-pages", "5"]),
        }
        if node is not None:
            tasks["node"] = await admin.create_task(node)
        if browser is not None:
            tasks["browser"] = await admin.create_task(browser, args=["-a", f"start_url={site}"])
        with trio.fail_after(TIMEOUT):
            results = {name: await admin.wait_task_final(t, TIMEOUT) for name, t in tasks.items()}
    logs = {name: "\n".join(await admin.get_logs(t)) for name, t in tasks.items()}
    for name, result in results.items():
        assert result["status"] == "SUCCESS", (name, result, logs[name][-4000:])
    # As root each spider under a uid of its own, the two spiders of scrapy_shop under two.
    uids = {name: assert_default_identity(log) for name, log in logs.items()}
    assert len(set(uids.values())) == (len(uids) if DEFAULT_IDENTITY == "spider-uids" else 1), uids
    items = {name: await admin.get_items(t) for name, t in tasks.items()}
    expected = expected_products()
    skus = sorted(e["sku"] for e in expected)

    # Scrapy without the SDK: every product once (the feed alone; the pipelines ran: prices are numbers,
    # the spider middleware stamped each item), detail pages followed.
    assert sorted(i["sku"] for i in items["products"]) == skus
    by_sku = {i["sku"]: i for i in items["products"]}
    first = by_sku["SKU-0001"]
    assert first["price"] == 3.99 and first["crawled_by"] == "products"
    assert first["description"] == "Description of product 01."
    assert "scraped items also go to the task's items file" in logs["products"]
    assert sorted(i["sku"] for i in items["listing"]) == skus and items["listing"][0]["price"] == 3.99
    # The project's two spiders share one environment: the second found it ready.
    envs = [line for name in ("products", "listing") for line in logs[name].splitlines()
            if "dependencies installed (" in line or "dependencies cached (" in line]
    assert len(envs) == 2 and len({line.rsplit("(", 1)[1].split(")")[0] for line in envs}) == 1, envs
    assert sum("dependencies installed" in line for line in envs) == 1, envs

    # requests + bs4 + argparse, with a crawlerkeeper-sdk requirement the index does not have.
    assert [i["sku"] for i in items["script"]] == [e["sku"] for e in expected]
    assert "crawlerkeeper-sdk" in logs["script"] and "scraped 30 products from 5 pages" in logs["script"]

    if node is not None:
        assert [i["sku"] for i in items["node"]] == [e["sku"] for e in expected]
        assert "default command from package.json scripts.start" in logs["node"]
        assert "npm install" in logs["node"] and "(ESM)" in logs["node"]
    if browser is not None:
        assert sorted(i["sku"] for i in items["browser"]) == skus
        assert {i["page_title"] for i in items["browser"]} == {f"Demo shop – page {n}" for n in range(1, 6)}
