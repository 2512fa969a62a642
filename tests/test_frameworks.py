"""Every framework runs end to end: the example spider under sdk/examples/ is uploaded to the real dev
master, a real agent deploys it, installs its dependencies (uv / npm) and runs it; the spider crawls
the dev master's demo site and its 30 products arrive at the master as items. As root each spider
runs under a uid of its own (the default ``spider-uids`` identity level, its log says so).

scrapy is covered by tests/test_agent_e2e.py (the example project); here: python with httpx, node,
selenium (Debian's Chromium + chromedriver) and playwright (Python Playwright driving Debian's
Chromium through executable_path, never `playwright install`). Browser tests are skipped where
Chromium is not installed (CI installs it: `apt-get install chromium chromium-driver`); the examples
launch it with its own sandbox where the agent says it works (``CK_CHROMIUM_SANDBOX``; the sandboxed
renderers themselves are looked at in tests/test_private_tmp.py). Python
packages come from the package index (PyPI, or the mirror the agent falls back to), through uv's cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import AgentRun, ExampleRuns, assert_default_identity, chromium_sandbox_expected

import ckagent
from ckagent.code.browsers import CHROMIUM_SANDBOX_VAR
from ckagent.code.browsers import decide as chromium_sandbox
from ckagent.code.runtimes import find_chromedriver, find_chromium
from ckagent.devmaster.demosite import expected_products
from ckagent.node.runas import RunAs

SDK_SRC = Path(ckagent.__file__).resolve().parent.parent / "sdk" / "python" / "src"

CHROMIUM = find_chromium()
CHROMEDRIVER = find_chromedriver()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium chromium-driver)")
needs_chromedriver = pytest.mark.skipif(
    CHROMEDRIVER is None, reason="chromedriver is not installed (apt-get install chromium-driver)")
needs_node = pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                reason="node/npm are not installed (apt-get install nodejs npm)")


async def _run_example(dev_master: Any, nursery: trio.Nursery, example_runs: ExampleRuns, example: str,
                       framework: str, params: dict[str, Any] | None = None) -> tuple[AgentRun, str]:
    """sdk/examples/<example> uploaded, one task on a fresh agent (the session's run of it, see
    tests/harness/examples.py: tests/test_exec.py compares the same run with `ckagent exec`'s); returns
    (the run, its log)."""
    run = await example_runs.agent(dev_master, nursery, example, framework, params=params)
    log_text = "\n".join(run.logs)
    assert run.task["status"] == "SUCCESS", (run.task, log_text[-3000:])
    assert_default_identity(log_text)  # as root: a uid of the spider's own (spider-uids), browsers included
    # Nothing the task started survives it (chromium, chromedriver, node, ...): the sweep saw to it.
    assert run.leftovers == []
    return run, log_text


def _assert_products(dev_master: Any, run: AgentRun) -> list[dict[str, Any]]:
    items = run.items
    expected = expected_products()
    assert [(i["title"], i["sku"]) for i in items] == [(e["title"], e["sku"]) for e in expected]
    assert [f"{i['price']:.2f}" for i in items] == [e["price"] for e in expected]
    assert [i["url"] for i in items] == [dev_master.base_url + e["url"] for e in expected]
    return items


@pytest.mark.slow
async def test_python_httpx_spider(dev_master, nursery: trio.Nursery, example_runs: ExampleRuns) -> None:
    run, log_text = await _run_example(dev_master, nursery, example_runs, "httpx_demo", "python")
    items = _assert_products(dev_master, run)
    assert items[0]["description"] == "Description of product 01."
    assert "with httpx" in log_text and "dependencies installed" in log_text


@needs_node
@pytest.mark.slow
async def test_node_spider(dev_master, nursery: trio.Nursery, example_runs: ExampleRuns) -> None:
    run, log_text = await _run_example(dev_master, nursery, example_runs, "node_demo", "node")
    _assert_products(dev_master, run)
    assert "npm ci" in log_text and "with node v" in log_text
    assert "warning" not in log_text  # engines.node ">=18" is satisfied by the system node
    assert run.runtimes["node"]["version"] and run.runtimes["npm"]["version"]


@needs_chromium
@needs_chromedriver
@pytest.mark.slow
async def test_selenium_spider_and_leftover_browser_swept(dev_master, nursery: trio.Nursery,
                                                          example_runs: ExampleRuns) -> None:
    # The spider exits without driver.quit(): chromedriver and Chromium are left behind on purpose.
    run, log_text = await _run_example(dev_master, nursery, example_runs, "selenium_demo", "selenium",
                                       params={"leave_browser": True})
    _assert_products(dev_master, run)
    assert "leaving the browser running" in log_text
    assert "leftover process" in log_text  # the sweep killed them (and find_marked saw none after)
    assert run.runtimes["chromium"]["version"] and run.runtimes["chromedriver"]["version"]


@needs_chromium
@pytest.mark.slow
async def test_playwright_spider_with_system_chromium(dev_master, nursery: trio.Nursery,
                                                      example_runs: ExampleRuns) -> None:
    run, log_text = await _run_example(dev_master, nursery, example_runs, "playwright_demo", "playwright")
    _assert_products(dev_master, run)
    assert "with Chromium" in log_text
    assert "playwright install" not in log_text


def test_chromium_sandbox_is_decided_by_whom_spiders_run_as() -> None:
    """Never for spiders that are root (Chromium refuses it); for others, when an unprivileged process may
    make user namespaces here (no setuid chrome-sandbox in Debian's Chromium) — and the SDK follows
    ``CK_CHROMIUM_SANDBOX`` (outside an agent: on unless root)."""
    as_root = chromium_sandbox(True, None)
    assert not as_root.on and "root" in as_root.why and as_root.env() == {CHROMIUM_SANDBOX_VAR: "0"}
    probe_as = RunAs.of_uid(65534, "/nonexistent") if os.geteuid() == 0 else None
    spiders = chromium_sandbox(False, probe_as)
    assert spiders.on == chromium_sandbox_expected(), spiders
    assert spiders.env() == {CHROMIUM_SANDBOX_VAR: "1" if spiders.on else "0"}
    code = "import crawlerkeeper_sdk as ck; print(ck.chromium_sandbox(), ck.chromium_args())"
    said = {}
    for value in ("1", "0", None):
        env = {k: v for k, v in os.environ.items() if k != CHROMIUM_SANDBOX_VAR}
        env.update({"PYTHONPATH": str(SDK_SRC)}, **({CHROMIUM_SANDBOX_VAR: value} if value else {}))
        said[value] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     timeout=60, check=True).stdout.strip()
    assert said == {"1": "True []", "0": "False ['--no-sandbox']",
                    None: "False ['--no-sandbox']" if os.geteuid() == 0 else "True []"}
    node = shutil.which("node")
    if node is None:
        return
    helper = Path(ckagent.__file__).resolve().parent.parent / "sdk" / "node" / "crawlerkeeper-sdk.cjs"
    js = f"const ck = require({str(helper)!r}); console.log(JSON.stringify([ck.chromiumSandbox(), ck.chromiumArgs()]))"
    for value, expected in (("1", "[true,[]]"), ("0", '[false,["--no-sandbox"]]')):
        env = {**os.environ, CHROMIUM_SANDBOX_VAR: value}
        assert subprocess.run([node, "-e", js], env=env, capture_output=True, text=True, timeout=60,
                              check=True).stdout.strip() == expected
