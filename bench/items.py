"""Items flood: N items saved with the SDK's ``save_item`` in a real task, end to end to the dev master.

Setup: the dev master and the agent run as their own processes (psutil measures the agent alone);
the task's spider imports the bundled SDK (``sdk/python/src``) and calls ``save_item`` once per item
(one JSON line, one ``write`` each, as a spider does), after a stamp line with its start time.
Measured:

- end-to-end items/s: N / (the task final at the master, every item stored − the spider's start);
- the baseline: the same spider alone (``CK_ITEMS_FILE`` to a temp file, no agent) — how fast the
  spider can produce items on this machine in this minute; the ratio says what the agent costs;
- the agent's CPU seconds and peak RSS (sampled every 20 ms), the master's CPU seconds.

Checks that nothing is lost: every item ``{"n": i}`` arrives at the master once, in order.
Targets: ≥ 100,000 items/s end to end, agent RSS ≤ 80 MB, nothing lost. The full run floods 3
times (fresh master and agent each) and reports the run with the median items/s, the highest
peak RSS and a loss in any run as a loss.

    .venv/bin/python -m bench.items [--quick]      # --quick: 20,000 items, once
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import trio

from bench._harness import PYTHON, REPO, AgentProcess, DevMaster, markdown_table, wait_final, work_directory
from bench.flood import Sampler, cpu_seconds
from ckagent.devmaster.client import zip_files

FULL_ITEMS = 500_000
QUICK_ITEMS = 20_000
FULL_ROUNDS = 3
TARGET_ITEMS_S = 100_000.0
TARGET_RSS_MB = 80.0
MB = 1024 * 1024
SDK_DIR = REPO / "sdk" / "python" / "src"

SPIDER = r"""
import os, sys, time
sys.path.insert(0, os.environ["BENCH_SDK_DIR"])
from crawlerkeeper_sdk import save_item
print("ITEMS-START %.6f" % time.time(), flush=True)
for n in range(int(os.environ["BENCH_ITEMS"])):
    save_item({"n": n, "title": "item %d" % n, "price": n * 0.01, "url": "https://example.com/p/%d" % n})
print("ITEMS-END %.6f" % time.time(), flush=True)
"""


def spider_alone_seconds(items: int, items_file: Path) -> float:
    """Seconds the spider takes alone (its items to ``items_file``, no agent): the baseline."""
    env = {**os.environ, "BENCH_SDK_DIR": str(SDK_DIR), "BENCH_ITEMS": str(items), "CK_ITEMS_FILE": str(items_file)}
    done = subprocess.run([PYTHON, "-c", SPIDER], env=env, capture_output=True, text=True, check=True)
    stamps = {line.split()[0]: float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("ITEMS-")}
    items_file.unlink()
    return stamps["ITEMS-END"] - stamps["ITEMS-START"]


async def _run(items: int) -> dict[str, Any]:
    with work_directory("ck-items-") as tmp:
        alone_s = min([await trio.to_thread.run_sync(spider_alone_seconds, items, tmp / "alone.jsonl")
                       for _ in range(2)])
        master = DevMaster(tmp / "master")
        await master.start()
        agent = AgentProcess(tmp / "agent", master, max_workers=2, name="items-node",
                             long_poll_wait=5, poll_interval=0.5)
        try:
            await agent.start()
            agent_ps = psutil.Process(agent.pid)
            assert master.process is not None
            master_ps = psutil.Process(master.process.pid)
            spider = await master.admin.create_spider(name="items", framework="python",
                                                      command=[PYTHON, "-c", SPIDER])
            await master.admin.upload_package(spider, zip_files({"main.py": "# runs its command\n"}))
            sampler = Sampler(agent.pid)
            cpu0, master_cpu0 = cpu_seconds(agent_ps), cpu_seconds(master_ps)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sampler.run)
                task_id = await master.admin.create_task(
                    spider, env={"BENCH_SDK_DIR": str(SDK_DIR), "BENCH_ITEMS": str(items)})
                (task,) = await wait_final(master.admin, [task_id], timeout=600, interval=0.02)
                finished = time.time()
                nursery.cancel_scope.cancel()
            agent_cpu = cpu_seconds(agent_ps) - cpu0
            master_cpu = cpu_seconds(master_ps) - master_cpu0
            stored = await master.admin.get_items(task_id)
            logs = await master.admin.get_logs(task_id)
        finally:
            await agent.stop()
            await master.stop()
    stamps = {line.split()[0]: float(line.split()[1]) for line in logs if line.startswith("ITEMS-")}
    started = stamps.get("ITEMS-START", float("nan"))
    in_order = len(stored) == items and all(item.get("n") == i for i, item in enumerate(stored))
    seconds = finished - started
    return {
        "items": items,
        "status": task["status"],
        "seconds": seconds,
        "items_per_s": items / seconds,
        "spider_seconds": stamps.get("ITEMS-END", float("nan")) - started,
        "alone_seconds": alone_s,
        "alone_items_per_s": items / alone_s,
        "ratio_to_alone": seconds / alone_s,
        "agent_cpu_seconds": agent_cpu,
        "agent_peak_rss_mb": sampler.peak_rss / MB,
        "master_cpu_seconds": master_cpu,
        "items_at_master": len(stored),
        "lost_or_duplicated": not in_order,
    }


def verdict(figures: dict[str, Any]) -> dict[str, Any]:
    """The summary keys (``target``, ``target_met``, ``headline``) for ``python -m bench``."""
    rate, rss = figures["items_per_s"], figures["agent_peak_rss_mb"]
    return {
        "target": f"≥ {TARGET_ITEMS_S:,.0f} items/s end to end, agent RSS ≤ {TARGET_RSS_MB:g} MB, nothing lost",
        "target_met": (rate >= TARGET_ITEMS_S and rss <= TARGET_RSS_MB and not figures["lost_or_duplicated"]
                       and figures["status"] == "SUCCESS"),
        "headline": f"{rate:,.0f} items/s (spider alone {figures['alone_items_per_s']:,.0f}/s), agent CPU "
                    f"{figures['agent_cpu_seconds']:.2f} s, RSS {rss:.1f} MB, "
                    f"{figures['items_at_master']:,}/{figures['items']:,} items",
    }


def run(quick: bool) -> dict[str, Any]:
    """Flood ``FULL_ROUNDS`` times (``quick``: once, QUICK_ITEMS); the median run (by items/s) with the
    worst RSS and loss of all runs, and every run's items/s."""
    runs = [trio.run(_run, QUICK_ITEMS if quick else FULL_ITEMS) for _ in range(1 if quick else FULL_ROUNDS)]
    figures = dict(sorted(runs, key=lambda r: r["items_per_s"])[len(runs) // 2])
    figures["agent_peak_rss_mb"] = max(r["agent_peak_rss_mb"] for r in runs)
    figures["lost_or_duplicated"] = any(r["lost_or_duplicated"] for r in runs)
    if any(r["status"] != "SUCCESS" for r in runs):
        figures["status"] = next(r["status"] for r in runs if r["status"] != "SUCCESS")
    figures["runs_items_per_s"] = [r["items_per_s"] for r in runs]
    return {**figures, **verdict(figures)}


def report(figures: dict[str, Any]) -> str:
    """The figures as a Markdown table, with the targets."""
    rows = [
        ("items", f"{figures['items']:,}", "save_item, one write each"),
        ("end to end", f"{figures['seconds']:.2f} s = {figures['items_per_s']:,.0f} items/s",
         f"≥ {TARGET_ITEMS_S:,.0f} items/s"),
        ("runs (items/s)", ", ".join(f"{v:,.0f}" for v in figures.get("runs_items_per_s", [figures["items_per_s"]])),
         "the median run is shown"),
        ("the spider under the agent", f"{figures['spider_seconds']:.2f} s", "its own start → its last save_item"),
        ("the spider alone (baseline)", f"{figures['alone_seconds']:.2f} s = {figures['alone_items_per_s']:,.0f} "
         "items/s", f"end to end ÷ alone = {figures['ratio_to_alone']:.2f}×"),
        ("agent CPU", f"{figures['agent_cpu_seconds']:.2f} s", ""),
        ("agent peak RSS", f"{figures['agent_peak_rss_mb']:.1f} MB", f"≤ {TARGET_RSS_MB:g} MB"),
        ("master CPU", f"{figures['master_cpu_seconds']:.2f} s", "(dev master, same machine)"),
        ("items at the master", f"{figures['items_at_master']:,}",
         "LOST/DUPLICATED" if figures["lost_or_duplicated"] else "all, once, in order"),
    ]
    return markdown_table(["figure", "value", "target / note"], rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.items [--quick]``: print the table; exit 1 if an item was lost or duplicated."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ITEMS:,} items instead of {FULL_ITEMS:,}")
    args = parser.parse_args(argv)
    figures = run(args.quick)
    print(report(figures))
    return 1 if figures["lost_or_duplicated"] or figures["status"] != "SUCCESS" else 0


if __name__ == "__main__":
    sys.exit(main())
