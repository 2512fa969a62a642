"""The README's `ckagent exec` recipe, line by line: every bundled example, started the way the README
shows (`--param start_url=`), against one reference master serving the demo shop; each line that
crawls gives items, `fail_demo` exits 1. Lines whose tools are missing here (node, Chromium) are
skipped by name, and a README line for an example that is not bundled (or an example the recipe
leaves out) fails the test."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

import ckagent
from ckagent.code.runtimes import find_chromedriver, find_chromium

REPO = Path(ckagent.__file__).resolve().parent.parent
EXAMPLES = REPO / "sdk" / "examples"
RUN_TIMEOUT = 900.0


def recipe() -> list[tuple[str, list[str], int]]:
    """(example, exec arguments after `ckagent exec`, expected exit code) for each README recipe line."""
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- exec-recipe:start -->", 1)[1].split("<!-- exec-recipe:end -->", 1)[0]
    lines = []
    for line in block.splitlines():
        if not line.startswith(".venv/bin/ckagent exec "):
            continue
        comment = line.split("#", 1)[1] if "#" in line else ""
        words = shlex.split(line, comments=True)[2:]
        expected = int(m.group(1)) if (m := re.search(r"exit (\d+)", comment)) else 0
        lines.append((Path(words[0]).name, words, expected))
    return lines


def test_the_recipe_names_every_bundled_example_once() -> None:
    named = [example for example, _, _ in recipe()]
    bundled = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
    assert sorted(named) == bundled and len(named) == 16
    for _example, words, _ in recipe():
        assert "--param" in words and words[words.index("--param") + 1] == "start_url=$URL"


def _missing(example: str) -> str | None:
    if example.startswith(("node", "crawlee")) and (shutil.which("node") is None or shutil.which("npm") is None):
        return "node/npm"
    if ("playwright" in example or "selenium" in example) and find_chromium() is None:
        return "Chromium"
    if "selenium" in example and find_chromedriver() is None:
        return "chromedriver"
    return None


@pytest.mark.slow
async def test_the_readme_exec_recipe_runs_every_example(dev_master: Any, tmp_path: Path) -> None:
    url = f"{dev_master.base_url}/demo-site/"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "CK_"))}
    env["AGENT_UV_SYNC_TIMEOUT"] = "600"
    failures, skipped = [], []
    for example, words, expected in recipe():
        why = _missing(example)
        if why is not None:
            skipped.append(f"{example} (no {why})")
            continue
        items = tmp_path / f"{example}.items.jsonl"
        argv = [sys.executable, "-m", "ckagent", "exec", str(REPO / words[0]),
                *[w.replace("$URL", url) for w in words[1:]], "--items", str(items),
                "--work-dir", str(tmp_path / "exec-work")]
        done = await trio.to_thread.run_sync(lambda argv=argv: subprocess.run(
            argv, capture_output=True, env=env, timeout=RUN_TIMEOUT, check=False, cwd=tmp_path))
        got = [json.loads(line) for line in items.read_text().splitlines()] if items.exists() else []
        if done.returncode != expected or (expected == 0 and not got):
            failures.append(f"{example}: exit {done.returncode} (expected {expected}), {len(got)} items\n"
                            f"{done.stderr.decode(errors='replace')[-2000:]}")
    assert not failures, "\n\n".join(failures)
    if skipped:
        pytest.skip(f"ran the rest; skipped: {', '.join(skipped)}")
