"""``ckagent demo`` checks what it promises (ckagent/cli/demo.py): each spider's items against the demo
shop (ckagent/devmaster/demosite.py), its status against what it was written to do; and its agent takes
the ``AGENT_*`` settings except those that make it the demo's. The demo run end to end at each
containment and egress level this machine gives is tests/test_demo_levels.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ckagent.cli.demo import (
    DEMO_OWNED,
    SPIDERS,
    DemoResult,
    check_result,
    demo_agent_env,
    first_difference,
    verdict_lines,
)
from ckagent.devmaster.demosite import PRODUCTS, expected_products

BASE = "http://127.0.0.1:8123"


def _items(n: int, *, base: str = BASE) -> list[dict[str, Any]]:
    """The first ``n`` products as the demo's spiders yield them: price a number, URL absolute."""
    return [{"title": p["title"], "price": float(p["price"]), "sku": p["sku"], "url": base + p["url"], "page": 1}
            for p in expected_products()[:n]]


def _result(name: str, status: str, items: list[Any], error: str | None = None, **record: Any) -> DemoResult:
    (spider,) = [s for s in SPIDERS if s.name == name]
    return DemoResult(spider, "t-1", {"status": status, "errorCode": error, **record}, items)


def test_the_shop_as_the_spiders_deliver_it_is_no_difference() -> None:
    expected = expected_products()
    assert first_difference(_items(len(expected)), expected) is None
    as_text = [{**item, "price": f"{item['price']:.2f}"} for item in _items(len(expected))]  # scrapy_shop's way
    assert first_difference(as_text, expected) is None
    assert first_difference([], []) is None


def test_the_first_difference_is_named_with_the_product() -> None:
    expected = expected_products()
    assert first_difference(_items(6), expected) == "item 7 missing: expected 'Product 07' (SKU-0007)"
    assert first_difference(_items(len(expected)) + _items(1), expected) == (
        f"item {len(expected) + 1} is one too many: 'Product 01' (SKU-0001)")
    swapped = _items(len(expected))
    swapped[2], swapped[3] = swapped[3], swapped[2]
    assert first_difference(swapped, expected) == "item 3 title is 'Product 04', expected 'Product 03' ('Product 03' (SKU-0003))"
    cheaper = _items(len(expected))
    cheaper[0]["price"] = 1.0
    assert first_difference(cheaper, expected) == "item 1 price is '1.00', expected '3.99' ('Product 01' (SKU-0001))"
    elsewhere = _items(len(expected))
    elsewhere[4]["url"] = BASE + "/demo-site/page/2/"
    assert "item 5 url is '/demo-site/page/2/'" in (first_difference(elsewhere, expected) or "")
    assert first_difference(["not a dict"], expected) == "item 1 is not a product: 'not a dict'"
    assert first_difference([{"title": "x"}], []) == "item 1 is one too many: 'x' ()"


def test_a_spider_that_delivers_part_of_the_shop_is_named_with_the_counts() -> None:
    """The demo's Scrapy spider at the proxy level of before issue 34: 6 of 30, and SUCCESS."""
    expected = expected_products()
    problems, lines = verdict_lines([
        _result("products", "SUCCESS", _items(6)),
        _result("python_demo", "SUCCESS", _items(len(expected))),
        _result("fail_demo", "FAILED", [], "EXIT_NONZERO"),
    ], expected, "process-group", "proxy")
    assert problems == [f"products: SUCCESS with 6 items of the shop's {PRODUCTS} (first difference: "
                        "item 7 missing: expected 'Product 07' (SKU-0007))"]
    text = "\n".join(lines)
    assert f"products     NOT as expected: SUCCESS with 6 items of the shop's {PRODUCTS}" in text
    assert f"python_demo  ok: SUCCESS, all {PRODUCTS} products in order" in text
    assert "fail_demo    ok: FAILED/EXIT_NONZERO as it should" in text
    assert "containment process-group and egress proxy" in text


def test_every_spider_as_promised_is_no_problem() -> None:
    expected = expected_products()
    problems, _ = verdict_lines([
        _result("products", "SUCCESS", _items(len(expected))),
        _result("python_demo", "SUCCESS", _items(len(expected))),
        _result("fail_demo", "FAILED", [], "EXIT_NONZERO"),
    ], expected, "cgroup-v1", "nftables")
    assert problems == []


def test_the_failing_spider_must_fail_as_written_and_deliver_nothing() -> None:
    expected = expected_products()
    assert check_result(_result("fail_demo", "SUCCESS", []), expected) == "SUCCESS, expected FAILED/EXIT_NONZERO"
    assert check_result(_result("fail_demo", "FAILED", [], "TIMEOUT"), expected) == (
        "FAILED/TIMEOUT, expected FAILED/EXIT_NONZERO")
    assert check_result(_result("fail_demo", "FAILED", _items(1), "EXIT_NONZERO"), expected) == (
        "FAILED with 1 item, expected none (first difference: item 1 is one too many: 'Product 01' (SKU-0001))")


def test_a_failed_crawl_says_why_on_one_line() -> None:
    message = "uv pip install failed with exit code 2:\nerror: Request failed\n  cause: dns error"
    problem = check_result(_result("products", "FAILED", [], "DEPS_FAILED", errorMessage=message), expected_products())
    assert problem == ("FAILED/DEPS_FAILED: uv pip install failed with exit code 2: error: Request failed "
                       "cause: dns error, expected SUCCESS")


def test_the_agent_takes_the_agent_settings_but_not_those_that_make_it_the_demos(tmp_path: Path) -> None:
    environ = {
        "AGENT_TASK_EGRESS": "proxy", "AGENT_TASK_CONTAINMENT": "process-group", "AGENT_HEARTBEAT_INTERVAL": "5",
        "AGENT_SERVER_URL": "https://master.example", "AGENT_REGISTRATION_TOKEN": "real-token",
        "AGENT_WORK_DIR": "/var/lib/ckagent", "AGENT_PORT": "9000", "AGENT_BIND": "0.0.0.0",
        "AGENT_LOG_FILE": "/var/log/ckagent.log", "AGENT_NAME": "prod-1", "AGENT_IP": "10.0.0.1",
        "AGENT_MAX_WORKERS": "", "HOME": "/root",
    }
    env = demo_agent_env(environ, BASE, "demo-token", tmp_path)
    assert env["AGENT_TASK_EGRESS"] == "proxy" and env["AGENT_TASK_CONTAINMENT"] == "process-group"
    assert env["AGENT_HEARTBEAT_INTERVAL"] == "5"  # the demo's default (2) gives way
    assert env["AGENT_TASK_LONG_POLL_WAIT"] == "10"  # the demo's default where nothing is set
    assert {k: env[k] for k in DEMO_OWNED} == {
        "AGENT_SERVER_URL": BASE, "AGENT_REGISTRATION_TOKEN": "demo-token", "AGENT_WORK_DIR": str(tmp_path / "agent"),
        "AGENT_NAME": "demo-node", "AGENT_IP": "127.0.0.1", "AGENT_BIND": "127.0.0.1", "AGENT_PORT": "0",
        "AGENT_LOG_FILE": str(tmp_path / "agent.log"),
    }
    assert "HOME" not in env and "AGENT_MAX_WORKERS" not in env


def test_a_bad_agent_setting_stops_the_demo_before_anything_starts(tmp_path: Path) -> None:
    env = {**os.environ, "AGENT_TASK_EGRESS": "kernel"}
    done = subprocess.run([sys.executable, "-m", "ckagent", "demo", "--work-dir", str(tmp_path / "demo")],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 2, done
    assert "config error: AGENT_TASK_EGRESS" in done.stderr
    assert done.stdout == "" and not (tmp_path / "demo").exists()
