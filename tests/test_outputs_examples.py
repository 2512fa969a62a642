"""The example projects shaped like public ones deliver their files' data with no code change, through
the agent and through ``ckagent exec``: a requests script writing results.json (declared
``outputs.items``) and crawlee's CheerioCrawler (its dataset, by convention). Real dev master, real
agent, real installs (PyPI / npm), the demo site."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import agent_settings, running_agent

import ckagent
from ckagent.devmaster.client import zip_directory
from ckagent.devmaster.demosite import expected_products

EXAMPLES = Path(ckagent.__file__).resolve().parent.parent / "sdk" / "examples"
RUN_TIMEOUT = 420.0
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
async def test_example_delivers_its_files(dev_master: Any, nursery: trio.Nursery, tmp_path: Path, example: str,
                                          framework: str, outputs: dict[str, Any] | None, said: str,
                                          artifacts: list[str]) -> None:
    admin = dev_master.admin
    spider_id = await admin.create_spider(name=example, framework=framework, outputs=outputs)
    await admin.upload_package(spider_id, await trio.to_thread.run_sync(zip_directory, EXAMPLES / example))
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_SYNC_TIMEOUT="400")
    async with running_agent(nursery, settings):
        task_id = await admin.create_task(spider_id, params={"start_url": f"{dev_master.base_url}/demo-site/"})
        task = await admin.wait_task_final(task_id, RUN_TIMEOUT)
    assert task["status"] == "SUCCESS", task
    assert products(await admin.get_items(task_id)) == expected_products()
    assert [a["path"] for a in await admin.list_artifacts(task_id)] == artifacts
    line = outputs_line(await admin.get_logs(task_id))
    assert said in line, line
    if artifacts:
        assert "pages/ (5 files, " in line and "→ artifacts" in line, line
    # The same through `ckagent exec` (its own private master), outputs declared on the command line.
    items, out_dir = tmp_path / "items.jsonl", tmp_path / "artifacts"
    argv = [sys.executable, "-m", "ckagent", "exec", str(EXAMPLES / example), "--framework", framework,
            "--param", f"start_url={dev_master.base_url}/demo-site/", "--items", str(items),
            "--work-dir", str(tmp_path / "exec-work"), "--artifacts", str(out_dir)]
    for glob in (outputs or {}).get("items", []):
        argv += ["--output-items", glob]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "CK_"))}
    env["AGENT_UV_SYNC_TIMEOUT"] = "400"
    done = await trio.to_thread.run_sync(lambda: subprocess.run(
        argv, capture_output=True, env=env, timeout=RUN_TIMEOUT, check=False, cwd=tmp_path))
    stdout, stderr = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    assert done.returncode == 0, stderr[-3000:]
    assert products([json.loads(x) for x in items.read_text().splitlines()]) == expected_products()
    assert said in outputs_line(stdout.splitlines())
    written = sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*") if p.is_file()) if out_dir.exists() else []
    assert written == artifacts
    if artifacts:
        assert f"[ckagent exec] artifacts: {len(artifacts)} file(s)" in stderr
        assert "Product 01" in (out_dir / "pages/page-1.html").read_text()


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
