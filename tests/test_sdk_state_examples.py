"""The resumable example spiders (sdk/examples/python_resume, node_resume): standalone, and a crawl killed
with SIGKILL after a checkpoint, resumed from the snapshot as the agent and the master would (the state
dir restored, the items before the snapshot's offset kept): each page's item once, the pages fetched twice
at most those crawled after the checkpoint. The test plays the agent (tests/harness/spiderstate.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import (
    SPIDER_TIMEOUT,
    TaskFiles,
    find_python,
    missing_python,
    page_sku,
    read_jsonl,
    sdk_env,
    serve_site,
)

from ckagent.devmaster.demosite import expected_products

EXAMPLES = Path(__file__).resolve().parents[1] / "sdk" / "examples"
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed")
PYTHON38 = find_python("3.8")


def argv(example: str, python: str = sys.executable) -> tuple[list[str], Path]:
    if example == "python_resume":
        return [python, "main.py"], EXAMPLES / example
    return [str(NODE), "index.js"], EXAMPLES / example


@pytest.fixture
def running() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=SPIDER_TIMEOUT)  # closes its stderr pipe


def start(running: list[subprocess.Popen[bytes]], example: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    words, cwd = argv(example)
    proc = subprocess.Popen(words, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    running.append(proc)
    return proc


def wait_items(task: TaskFiles, count: int, proc: subprocess.Popen[bytes]) -> None:
    """Until the spider saved ``count`` items (a file another process writes: looked at every 10 ms)."""
    deadline = time.monotonic() + SPIDER_TIMEOUT
    while len(read_jsonl(task.items)) < count:
        assert proc.poll() is None, f"the spider ended ({proc.returncode}) early"
        assert time.monotonic() < deadline, f"not {count} items in {SPIDER_TIMEOUT} s"
        time.sleep(0.01)


@pytest.mark.parametrize("example,python", [
    pytest.param("python_resume", sys.executable, id="python_resume"),
    pytest.param("python_resume", str(PYTHON38), id="python_resume-3.8",
                 marks=pytest.mark.skipif(PYTHON38 is None, reason=missing_python("3.8"))),
    pytest.param("node_resume", None, id="node_resume", marks=needs_node),
])
def test_standalone_the_example_crawls_the_demo_shop(example: str, python: str | None) -> None:
    with serve_site(0) as site:
        shop = site.base.replace("/site/", "/demo-site/")
        words, cwd = argv(example, python or sys.executable)
        done = subprocess.run(words, cwd=cwd, env=sdk_env(CK_PARAMS=json.dumps({"start_url": shop})),
                              capture_output=True, text=True, timeout=SPIDER_TIMEOUT)
    assert done.returncode == 0, done.stderr
    items = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [i["sku"] for i in items] == [p["sku"] for p in expected_products()]
    assert [i["page"] for i in items] == list(range(1, 31))
    assert "done: 30 items from 35 pages" in done.stdout


@pytest.mark.parametrize("example", ["python_resume", pytest.param("node_resume", marks=needs_node)])
def test_a_crawl_killed_after_a_checkpoint_resumes_with_each_page_once(
        tmp_path: Path, running: list[subprocess.Popen[bytes]], example: str) -> None:
    pages = 240
    with serve_site(pages, delay_seconds=0.003) as site:
        params = json.dumps({"start_url": site.base})
        first = TaskFiles(tmp_path / "attempt-1")
        proc = start(running, example, first.env(CK_PARAMS=params))
        wait_items(first, 50, proc)
        first.request(1, reason="interval")
        answer = first.wait_ack(1)
        kept = first.items_before(answer["itemsOffset"])
        wait_items(first, len(kept) + 30, proc)
        proc.kill()  # the node is lost: no goodbye
        proc.wait(timeout=SPIDER_TIMEOUT)
        lost = read_jsonl(first.items)[len(kept):]  # made after the checkpoint: the master drops them
        second = first.resume_into(tmp_path / "attempt-2", answer["snapshot"])
        resumed = start(running, example, second.env(CK_PARAMS=params))
        assert resumed.wait(timeout=SPIDER_TIMEOUT) == 0, resumed.communicate()[1]
        fetches = site.page_fetches()
    items = kept + read_jsonl(second.items)
    assert sorted(i["sku"] for i in items) == [page_sku(n) for n in range(1, pages + 1)]  # each page once
    assert [i["page"] for i in items] == list(range(1, pages + 1))  # the numbering goes on
    twice = sorted(n for n, count in fetches.items() if count > 1)
    assert max(fetches.values()) == 2 and len(twice) <= len(lost) + 1  # + the page in flight at the kill
    assert set(twice) >= {int(i["sku"][2:]) for i in lost}


@pytest.mark.parametrize("example", ["python_resume", pytest.param("node_resume", marks=needs_node)])
def test_on_migrating_the_example_starts_no_new_page(tmp_path: Path, running: list[subprocess.Popen[bytes]],
                                                     example: str) -> None:
    with serve_site(2000, delay_seconds=0.003) as site:
        task = TaskFiles(tmp_path / "task")
        proc = start(running, example, task.env(CK_PARAMS=json.dumps({"start_url": site.base})))
        wait_items(task, 20, proc)
        task.request(1, "migrating", reason="migrate", secondsLeft=20)
        answer = task.wait_ack(1)
        at_ack = sum(site.page_fetches().values())
        time.sleep(0.5)  # what must not happen is more fetches: nothing to wait on but time
        assert sum(site.page_fetches().values()) <= at_ack + 1  # the page in flight, at most
    assert len(task.items_before(answer["itemsOffset"])) >= 20
