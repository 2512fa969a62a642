"""Every framework runs end to end: the example spider under sdk/examples/ is uploaded to the real dev
master, a real agent deploys it, installs its dependencies (uv / npm) and runs it; the spider crawls
the dev master's demo site and its 30 products arrive at the master as items.

scrapy is covered by tests/test_agent_e2e.py (the example project); here: python with httpx, node,
selenium (Debian's Chromium + chromedriver) and playwright (Python Playwright driving Debian's
Chromium through executable_path, never `playwright install`). Browser tests are skipped where
Chromium is not installed (CI installs it: `apt-get install chromium chromium-driver`). Python
packages come from the package index (PyPI, or the mirror the agent falls back to), through uv's cache.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import agent_settings, running_agent

import ckagent
from ckagent.code.runtimes import find_chromedriver, find_chromium
from ckagent.containment.process import find_marked
from ckagent.devmaster.client import zip_directory
from ckagent.devmaster.demosite import expected_products

EXAMPLES = Path(ckagent.__file__).resolve().parent.parent / "sdk" / "examples"
FRAMEWORK_TIMEOUT = 240.0
"""Seconds for one framework task, installs included (a cold uv cache downloads Playwright, ~40 MB)."""
CHROMIUM = find_chromium()
CHROMEDRIVER = find_chromedriver()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium chromium-driver)")
needs_chromedriver = pytest.mark.skipif(
    CHROMEDRIVER is None, reason="chromedriver is not installed (apt-get install chromium-driver)")
needs_node = pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                reason="node/npm are not installed (apt-get install nodejs npm)")


async def _run_example(dev_master: Any, nursery: trio.Nursery, tmp_path: Path, example: str, framework: str,
                       params: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """Upload sdk/examples/<example>, run one task on a fresh agent; returns (final task, its log)."""
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    admin = dev_master.admin
    spider_id = await admin.create_spider(name=example, framework=framework)
    await admin.upload_package(spider_id, await trio.to_thread.run_sync(zip_directory, EXAMPLES / example))
    async with running_agent(nursery, settings):
        task_id = await admin.create_task(
            spider_id, params={"start_url": f"{dev_master.base_url}/demo-site/", **(params or {})})
        with trio.fail_after(FRAMEWORK_TIMEOUT):
            task = await admin.wait_task_final(task_id, FRAMEWORK_TIMEOUT)
        # The runtime scan runs in the background at start and reaches the master with a heartbeat.
        for _ in range(100):
            nodes = await admin.list_nodes()
            if "python" in nodes[0]["runtimes"]:
                break
            await trio.sleep(0.1)
    log_text = "\n".join(await admin.get_logs(task_id))
    assert task["status"] == "SUCCESS", (task, log_text[-3000:])
    # Nothing the task started survives it (chromium, chromedriver, node, ...): the sweep saw to it.
    assert await trio.to_thread.run_sync(find_marked, task_id) == []
    task["_runtimes"] = nodes[0]["runtimes"]
    return task, log_text


async def _assert_products(dev_master: Any, task: dict[str, Any], absolute_urls: bool = True) -> list[dict[str, Any]]:
    items = await dev_master.admin.get_items(task["id"])
    expected = expected_products()
    assert [(i["title"], i["sku"]) for i in items] == [(e["title"], e["sku"]) for e in expected]
    assert [f"{i['price']:.2f}" for i in items] == [e["price"] for e in expected]
    if absolute_urls:
        assert [i["url"] for i in items] == [dev_master.base_url + e["url"] for e in expected]
    return items


@pytest.mark.slow
async def test_python_httpx_spider(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    task, log_text = await _run_example(dev_master, nursery, tmp_path, "httpx_demo", "python")
    items = await _assert_products(dev_master, task)
    assert items[0]["description"] == "Description of product 01."
    assert "with httpx" in log_text and "dependencies installed" in log_text


@needs_node
@pytest.mark.slow
async def test_node_spider(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    task, log_text = await _run_example(dev_master, nursery, tmp_path, "node_demo", "node")
    await _assert_products(dev_master, task)
    assert "npm ci" in log_text and "with node v" in log_text
    assert "warning" not in log_text  # engines.node ">=18" is satisfied by the system node
    runtimes = task["_runtimes"]
    assert runtimes["node"]["version"] and runtimes["npm"]["version"]


@needs_chromium
@needs_chromedriver
@pytest.mark.slow
async def test_selenium_spider_and_leftover_browser_swept(dev_master, nursery: trio.Nursery,
                                                          tmp_path: Path) -> None:
    # The spider exits without driver.quit(): chromedriver and Chromium are left behind on purpose.
    task, log_text = await _run_example(dev_master, nursery, tmp_path, "selenium_demo", "selenium",
                                        params={"leave_browser": True})
    await _assert_products(dev_master, task)
    assert "leaving the browser running" in log_text
    assert "leftover process" in log_text  # the sweep killed them (and find_marked saw none after)
    runtimes = task["_runtimes"]
    assert runtimes["chromium"]["version"] and runtimes["chromedriver"]["version"]


@needs_chromium
@pytest.mark.slow
async def test_playwright_spider_with_system_chromium(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    task, log_text = await _run_example(dev_master, nursery, tmp_path, "playwright_demo", "playwright")
    await _assert_products(dev_master, task)
    assert "with Chromium" in log_text
    assert "playwright install" not in log_text
