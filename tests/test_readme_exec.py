"""The README's `ckagent exec` recipe, line by line: every bundled example, started the way the README
shows (`--param start_url=`), against one reference master serving the demo shop; each line that
crawls gives the shop's every product once, `fail_demo` exits 1. The exec runs are at the `proxy`
egress level (tests/harness/examples.py): what a non-root node and a pod get. The Python clients
(Scrapy, requests, httpx, urllib, Selenium's) and Chromium go through the proxy, keeping connections
alive, and the task's log must say so; Node's fetch and got before Node 24.5 ignore proxy variables
(docs/operations.md, "The proxy level"). Lines whose tools are missing here (node, Chromium) are
skipped by name, and a README line for an example that is not bundled (or an example the recipe
leaves out) fails the test. As root every spider runs under a uid of its own (the default identity
level; the exec runs' work dir is reachable and their interpreter every uid's: tests/harness/examples.py).

Each line runs once in the session (tests/harness/examples.py): the tests that compare an example's exec
run with its run through an agent (tests/test_exec.py, tests/test_outputs_examples.py) read the run
of its README line, exactly these words, and this test reads theirs."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from harness import DEFAULT_IDENTITY, EXAMPLES, ExampleRuns, recipe, runs_as

from ckagent.code.runtimes import find_chromedriver, find_chromium
from ckagent.devmaster.demosite import expected_products

SHOP = sorted(product["sku"] for product in expected_products())
"""Every product of the demo shop: what each line that crawls must deliver, each once."""


def test_the_recipe_names_every_bundled_example_once() -> None:
    named = [line.example for line in recipe()]
    bundled = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    assert sorted(named) == bundled and len(named) == 19
    for line in recipe():
        words = line.words
        assert "--param" in words and words[words.index("--param") + 1] == "start_url=$URL"


def _ignores_proxies(example: str) -> bool:
    """Node's fetch and got (crawlee) before Node 24.5 ignore the proxy variables."""
    return example.startswith(("node", "crawlee"))


def _missing(example: str) -> str | None:
    if example.startswith(("node", "crawlee")) and (shutil.which("node") is None or shutil.which("npm") is None):
        return "node/npm"
    if ("playwright" in example or "selenium" in example) and find_chromium() is None:
        return "Chromium"
    if "selenium" in example and find_chromedriver() is None:
        return "chromedriver"
    return None


@pytest.mark.slow
async def test_the_readme_exec_recipe_runs_every_example(dev_master: Any, example_runs: ExampleRuns) -> None:
    failures, skipped = [], []
    for line in recipe():
        why = _missing(line.example)
        if why is not None:
            skipped.append(f"{line.example} (no {why})")
            continue
        done = await example_runs.exec(line.words, dev_master.base_url)
        name, uid, level = runs_as(done.stdout)  # as root: a uid of the spider's own, browsers included
        if level != DEFAULT_IDENTITY or (DEFAULT_IDENTITY == "spider-uids" and name != f"ck-{uid}"):
            failures.append(f"{line.example}: ran as {name} (uid {uid}, identity {level}), not at {DEFAULT_IDENTITY}")
        skus = sorted(str(item.get("sku")) for item in done.items)
        if done.returncode != line.expected or (line.expected == 0 and skus != SHOP):
            failures.append(f"{line.example}: exit {done.returncode} (expected {line.expected}), "
                            f"{len(done.items)} items (the shop has {len(SHOP)})\n{done.stderr[-2000:]}")
        elif line.expected == 0 and not _ignores_proxies(line.example) and " requests forwarded" not in done.stdout:
            failures.append(f"{line.example}: its requests did not go through the egress proxy:\n{done.stdout[-1500:]}")
    assert not failures, "\n\n".join(failures)
    if skipped:
        pytest.skip(f"ran the rest; skipped: {', '.join(skipped)}")
