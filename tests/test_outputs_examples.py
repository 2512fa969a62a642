"""The example projects shaped like public ones deliver their files' data with no code change, through
the agent and through ``ckagent exec``: a requests script writing results.json (declared
``outputs.items``) and crawlee's CheerioCrawler (its dataset, by convention). Real dev master, real
agent, real installs (PyPI / npm), the demo site."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import ExampleRuns, assert_default_identity, recipe_words

from ckagent.devmaster.demosite import expected_products

PAGES = [f"pages/page-{n}.html" for n in range(1, 6)]

CASES = [
    pytest.param("requests_results", "python", {"items": ["results.json"]}, "results.json → 30 items",
                 PAGES, id="requests_results"),
    pytest.param("crawlee_cheerio", "node", None, "storage/datasets/ (30 files) → 30 items", [],
                 id="crawlee_cheerio", marks=[pytest.mark.slow, pytest.mark.skipif(
                     shutil.which("node") is None or shutil.which("npm") is None, reason="node/npm are not installed")]),
]


def products(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items as the demo site's expected products (price as shown, url as a path)."""
    return [{"title": i["title"], "price": f"{float(i['price']):.2f}", "sku": i["sku"],
             "url": "/" + i["url"].split("/", 3)[3]} for i in items]


def outputs_line(lines: list[str]) -> str:
    found = [line for line in lines if "] outputs: " in line]
    assert len(found) == 1, lines[-20:]
    return found[0]


@pytest.mark.parametrize(("example", "framework", "outputs", "said", "artifacts"), CASES)
async def test_example_delivers_its_files(dev_master: Any, nursery: trio.Nursery, example_runs: ExampleRuns,
                                          example: str, framework: str, outputs: dict[str, Any] | None, said: str,
                                          artifacts: list[str]) -> None:
    run = await example_runs.agent(dev_master, nursery, example, framework, outputs=outputs)
    assert run.task["status"] == "SUCCESS", run.task
    assert_default_identity("\n".join(run.logs))  # crawlee's storage/ written as the spider's own uid
    assert products(run.items) == expected_products()
    assert run.artifacts == artifacts
    line = outputs_line(run.logs)
    assert said in line, line
    if artifacts:
        assert "pages/ (5 files, " in line and "→ artifacts" in line, line
    # The same through `ckagent exec` (its own private master), outputs declared on the command line:
    # the README's line for the example (its run is the recipe test's).
    words = recipe_words(example)
    assert [w for i, w in enumerate(words) if i and words[i - 1] == "--output-items"] == (outputs or {}).get("items", [])
    done = await example_runs.exec(words, dev_master.base_url)
    assert done.returncode == 0, done.stderr[-3000:]
    assert products(done.items) == expected_products()
    assert said in outputs_line(done.stdout.splitlines())
    assert sorted(done.artifacts) == artifacts
    if artifacts:
        assert f"[ckagent exec] artifacts: {len(artifacts)} file(s)" in done.stderr
        assert b"Product 01" in done.artifacts["pages/page-1.html"]


async def test_exec_args_reach_the_command(tmp_path: Path) -> None:
    """``--args`` are appended to the command like a task's args (shell-split)."""
    spider = tmp_path / "argspider"
    spider.mkdir()
    (spider / "main.py").write_text("import sys\nprint('argv', sys.argv[1:])\nopen('seen.txt', 'w').write(' '.join(sys.argv[1:]))\n")
    argv = [sys.executable, "-m", "ckagent", "exec", str(spider), "--args=--max-pages 2 'two words'",
            "--work-dir", str(tmp_path / "w"), "--items", str(tmp_path / "i.jsonl"),
            "--artifacts", str(tmp_path / "arts")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "CK_"))}
    done = await trio.to_thread.run_sync(lambda: subprocess.run(argv, capture_output=True, env=env, timeout=180,
                                                                check=False, cwd=tmp_path))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert "argv ['--max-pages', '2', 'two words']" in done.stdout.decode()
    assert (tmp_path / "arts" / "seen.txt").read_text() == "--max-pages 2 two words"
