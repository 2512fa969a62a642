"""Task outputs: a large JSON Lines output file into the items stream, and a large artifact folder.

Setup: the dev master and the agent as their own processes (psutil measures the agent alone).

1. **Item file.** The spider writes ``out.jsonl`` (~100 MB, ~1,000,000 items; 5 MB quick) into its
   working directory — a copy of a file made beforehand, so the spider costs next to nothing — and the
   task declares ``outputs: {"items": ["out.jsonl"]}``. Measured: items / (the task final at the
   master with every item stored − the spider's end); the agent's peak RSS (sampled every 20 ms) and
   CPU seconds. Checked: every item ``{"n": i}`` at the master once, in order.
2. **Artifact folder.** The spider writes 10,000 files of 1 KiB (500 quick) under ``images/``;
   a baseline task writes the same files under ``$CK_DATA_DIR`` (never collected). Measured: what
   the collection adds to the task's end — (``finishedAt`` − the spider's end) of the first minus the
   same of the baseline — and, beside it, how long the 10,000 uploads take before the final result
   (the task final at the master − ``finishedAt``). Checked: every file at the master, sha256-identical.

Targets: ≥ 100,000 items/s with agent RSS ≤ 80 MB; the artifact folder adds ≤ 2 s to the task's end.

    .venv/bin/python -m bench.outputs [--quick]
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import trio

from bench._harness import (
    PYTHON,
    AgentProcess,
    DevMaster,
    markdown_table,
    module_main,
    parse_iso,
    wait_final,
    work_directory,
)
from bench.flood import Sampler, cpu_seconds
from ckagent.devmaster.client import zip_files

TARGET_ITEMS_S = 100_000.0
TARGET_RSS_MB = 80.0
TARGET_ADDED_S = 2.0
FULL_BYTES, QUICK_BYTES = 100 * 1024 * 1024, 5 * 1024 * 1024
FULL_FILES, QUICK_FILES = 10_000, 500
MB = 1024 * 1024

COPY_SPIDER = r"""
import os, shutil, time
shutil.copyfile(os.environ["BENCH_SOURCE"], "out.jsonl")
print("OUT-END %.6f" % time.time(), flush=True)
"""

FILES_SPIDER = r"""
import os, time
root = os.environ.get("BENCH_ROOT") or "images"
root = os.path.join(os.environ["CK_DATA_DIR"], root) if os.environ.get("BENCH_IN_DATA_DIR") else root
for i in range(int(os.environ["BENCH_FILES"])):
    folder = os.path.join(root, "%02d" % (i % 100))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "%05d.bin" % i), "wb") as f:
        f.write(i.to_bytes(4, "big") * 256)
print("OUT-END %.6f" % time.time(), flush=True)
"""


def make_source(path: Path, size_bytes: int) -> int:
    """Write a JSON Lines file of about ``size_bytes`` (items ``{"n": i, ...}``); returns the item count."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        written = 0
        while written < size_bytes:
            line = json.dumps({"n": count, "title": f"item {count}", "price": count * 0.01,
                               "url": f"https://example.com/p/{count}"}, separators=(",", ":")) + "\n"
            out.write(line)
            written += len(line)
            count += 1
    return count


def _stamp(logs: list[str]) -> float:
    for line in logs:
        if line.startswith("OUT-END "):
            return float(line.split()[1])
    return float("nan")


async def _task(master: DevMaster, name: str, command: list[str], env: dict[str, str],
                outputs: dict[str, Any] | None) -> tuple[str, dict[str, Any], float]:
    """Run one task; (task id, the final task, when the master had it final)."""
    spider = await master.admin.create_spider(name=f"{name}-{time.monotonic_ns()}", framework="python",
                                              command=command, outputs=outputs)
    await master.admin.upload_package(spider, zip_files({"main.py": "# runs its command\n"}))
    task_id = await master.admin.create_task(spider, env=env)
    (task,) = await wait_final(master.admin, [task_id], timeout=900, interval=0.02)
    return task_id, task, time.time()


async def _run(quick: bool) -> dict[str, Any]:
    size, files = (QUICK_BYTES, QUICK_FILES) if quick else (FULL_BYTES, FULL_FILES)
    with work_directory("ck-outputs-") as tmp:
        source = tmp / "source.jsonl"
        items = await trio.to_thread.run_sync(make_source, source, size)
        master = DevMaster(tmp / "master")
        await master.start()
        agent = AgentProcess(tmp / "agent", master, max_workers=2, name="outputs-node",
                             long_poll_wait=5, poll_interval=0.5)
        try:
            await agent.start()
            agent_ps = psutil.Process(agent.pid)
            sampler = Sampler(agent.pid)
            cpu0 = cpu_seconds(agent_ps)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sampler.run)
                task_id, task, final_at = await _task(master, "itemfile", [PYTHON, "-c", COPY_SPIDER],
                                                      {"BENCH_SOURCE": str(source)}, {"items": ["out.jsonl"]})
                nursery.cancel_scope.cancel()
            agent_cpu = cpu_seconds(agent_ps) - cpu0
            logs = await master.admin.get_logs(task_id)
            spider_end = _stamp(logs)
            stored = await master.admin.get_items(task_id)
            lost = not (len(stored) == items and all(item.get("n") == i for i, item in enumerate(stored)))
            del stored
            env = {"BENCH_FILES": str(files)}
            base_id, base, _ = await _task(master, "files-base", [PYTHON, "-c", FILES_SPIDER],
                                           {**env, "BENCH_IN_DATA_DIR": "1"}, None)
            art_id, art, art_final = await _task(master, "files", [PYTHON, "-c", FILES_SPIDER], env, None)
            base_tail = parse_iso(base["finishedAt"]) - _stamp(await master.admin.get_logs(base_id))
            art_logs = await master.admin.get_logs(art_id)
            art_tail = parse_iso(art["finishedAt"]) - _stamp(art_logs)
            listed = await master.admin.list_artifacts(art_id)
            want = {f"images/{i % 100:02d}/{i:05d}.bin": hashlib.sha256(i.to_bytes(4, "big") * 256).hexdigest()
                    for i in range(files)}
            artifacts_ok = {a["path"]: a["sha256"] for a in listed} == want
            outputs_line = next((line for line in art_logs if "] outputs: " in line), "")
        finally:
            await agent.stop()
            await master.stop()
    seconds = final_at - spider_end
    return {
        "status": task["status"] if task["status"] != "SUCCESS" else art["status"],
        "items": items,
        "file_mb": size / MB,
        "seconds": seconds,
        "items_per_s": items / seconds,
        "agent_peak_rss_mb": sampler.peak_rss / MB,
        "agent_cpu_seconds": agent_cpu,
        "lost_or_duplicated": lost,
        "files": files,
        "added_seconds": art_tail - base_tail,
        "base_tail_seconds": base_tail,
        "upload_seconds": art_final - parse_iso(art["finishedAt"]),
        "artifacts_ok": artifacts_ok,
        "outputs_line": outputs_line.split("] ", 1)[-1][:160],
    }


def run(quick: bool) -> dict[str, Any]:
    """One run (quick: a 5 MB file and 500 files); the figures, the table and the verdict."""
    figures = trio.run(_run, quick)
    met = (figures["items_per_s"] >= TARGET_ITEMS_S and figures["agent_peak_rss_mb"] <= TARGET_RSS_MB
           and figures["added_seconds"] <= TARGET_ADDED_S and not figures["lost_or_duplicated"]
           and figures["artifacts_ok"] and figures["status"] == "SUCCESS")
    figures.update({
        "target": f"item file ≥ {TARGET_ITEMS_S:,.0f} items/s, agent RSS ≤ {TARGET_RSS_MB:g} MB; "
                  f"{FULL_FILES:,} artifacts add ≤ {TARGET_ADDED_S:g} s",
        "target_met": met,
        "headline": f"{figures['items_per_s']:,.0f} items/s, RSS {figures['agent_peak_rss_mb']:.1f} MB; "
                    f"{figures['files']:,} files add {figures['added_seconds']:.2f} s",
    })
    figures["table"] = report(figures)
    return figures


def report(figures: dict[str, Any]) -> str:
    """The figures as a Markdown table, with the targets."""
    rows = [
        ("item file", f"{figures['file_mb']:.0f} MB, {figures['items']:,} items (outputs.items)", ""),
        ("spider end → every item stored", f"{figures['seconds']:.2f} s = {figures['items_per_s']:,.0f} items/s",
         f"≥ {TARGET_ITEMS_S:,.0f} items/s"),
        ("agent peak RSS", f"{figures['agent_peak_rss_mb']:.1f} MB", f"≤ {TARGET_RSS_MB:g} MB"),
        ("agent CPU", f"{figures['agent_cpu_seconds']:.2f} s", "item-file task"),
        ("items at the master", f"{figures['items']:,}",
         "LOST/DUPLICATED" if figures["lost_or_duplicated"] else "all, once, in order"),
        ("artifact folder", f"{figures['files']:,} files of 1 KiB", ""),
        ("added to the task's end", f"{figures['added_seconds']:.2f} s",
         f"≤ {TARGET_ADDED_S:g} s (baseline: spider end → finishedAt {figures['base_tail_seconds']:.2f} s)"),
        ("uploads before the final result", f"{figures['upload_seconds']:.1f} s", "one PUT per file"),
        ("artifacts at the master", "all, sha256-identical" if figures["artifacts_ok"] else "MISMATCH", ""),
        ("the log's line", figures["outputs_line"], ""),
    ]
    return markdown_table(["figure", "value", "target / note"], rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.outputs [--quick]``."""
    return module_main(lambda quick, _scrapyd: run(quick), argv)


if __name__ == "__main__":
    sys.exit(main())
