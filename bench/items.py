"""Items flood: N items saved with the SDK's ``save_item`` in a real task, end to end to the dev master.

Setup: the dev master and the agent run as their own processes (psutil measures the agent alone);
the task's spider imports the bundled SDK (``sdk/python/src``) and calls ``save_item`` once per item
(one JSON line, one ``write`` each, as a spider does), after a stamp line with its start time.
Measured:

- end-to-end items/s: N / (the task final at the master, every item stored − the spider's start);
- the baseline: the same spider alone (``CK_ITEMS_FILE`` to a temp file, no agent) — how fast the
  spider can produce items on this machine in this minute; the ratio says what the agent costs;
- the delivery stage alone: a second task appends the spider's lines, already written, in 1 MiB
  writes — the agent and the master without the SDK's cost (items/s, and their CPU);
- the agent's CPU seconds and peak RSS (sampled every 20 ms), the master's CPU seconds, and the
  CPU per 100k items of spider, agent and master: their sum × 100k items/s is the cores the target
  needs (the machine has 2, shared).

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
cpu = time.process_time()
for n in range(int(os.environ["BENCH_ITEMS"])):
    save_item({"n": n, "title": "item %d" % n, "price": n * 0.01, "url": "https://example.com/p/%d" % n})
print("ITEMS-CPU %.6f" % (time.process_time() - cpu), flush=True)
print("ITEMS-END %.6f" % time.time(), flush=True)
"""


COPIER = r"""
import os, shutil, sys, time
print("ITEMS-START %.6f" % time.time(), flush=True)
with open(os.environ["BENCH_ITEMS_SOURCE"], "rb") as source, open(os.environ["CK_ITEMS_FILE"], "ab") as target:
    shutil.copyfileobj(source, target, 1 << 20)
print("ITEMS-END %.6f" % time.time(), flush=True)
"""
"""The delivery stage alone: the same items, already encoded, appended to the items file in 1 MiB writes
(the spider costs next to nothing; what is measured is the agent and the master)."""


def spider_alone(items: int, items_file: Path) -> tuple[float, float]:
    """(seconds, CPU seconds of its save_item loop) the spider takes alone (its items to ``items_file``,
    no agent): the baseline."""
    env = {**os.environ, "BENCH_SDK_DIR": str(SDK_DIR), "BENCH_ITEMS": str(items), "CK_ITEMS_FILE": str(items_file)}
    done = subprocess.run([PYTHON, "-c", SPIDER], env=env, capture_output=True, text=True, check=True)
    stamps = {line.split()[0]: float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("ITEMS-")}
    return stamps["ITEMS-END"] - stamps["ITEMS-START"], stamps["ITEMS-CPU"]  # CPU: the save_item loop's own


async def _flood(master: DevMaster, agent: AgentProcess, command: list[str], env: dict[str, str],
                 items: int) -> dict[str, Any]:
    """One task flooding ``items`` items: seconds (spider start → every item stored), the agent's CPU
    and peak RSS, the master's CPU, and whether every item arrived once, in order."""
    agent_ps = psutil.Process(agent.pid)
    assert master.process is not None
    master_ps = psutil.Process(master.process.pid)
    spider = await master.admin.create_spider(name=f"items-{len(command[-1])}-{time.monotonic_ns()}",
                                              framework="python", command=command)
    await master.admin.upload_package(spider, zip_files({"main.py": "# runs its command\n"}))
    sampler = Sampler(agent.pid)
    cpu0, master_cpu0 = cpu_seconds(agent_ps), cpu_seconds(master_ps)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sampler.run)
        task_id = await master.admin.create_task(spider, env=env)
        (task,) = await wait_final(master.admin, [task_id], timeout=600, interval=0.02)
        finished = time.time()
        nursery.cancel_scope.cancel()
    agent_cpu = cpu_seconds(agent_ps) - cpu0
    master_cpu = cpu_seconds(master_ps) - master_cpu0
    stored = await master.admin.get_items(task_id)
    logs = await master.admin.get_logs(task_id)
    stamps = {line.split()[0]: float(line.split()[1]) for line in logs if line.startswith("ITEMS-")}
    started = stamps.get("ITEMS-START", float("nan"))
    return {
        "status": task["status"],
        "seconds": finished - started,
        "spider_seconds": stamps.get("ITEMS-END", float("nan")) - started,
        "agent_cpu_seconds": agent_cpu,
        "agent_peak_rss_mb": sampler.peak_rss / MB,
        "master_cpu_seconds": master_cpu,
        "items_at_master": len(stored),
        "lost_or_duplicated": not (len(stored) == items and all(item.get("n") == i for i, item in enumerate(stored))),
    }


async def _run(items: int) -> dict[str, Any]:
    with work_directory("ck-items-") as tmp:
        alone = min([await trio.to_thread.run_sync(spider_alone, items, tmp / f"alone{i}.jsonl") for i in range(2)])
        alone_s, alone_cpu = alone
        source = tmp / "alone0.jsonl"  # the delivery stage's input: the spider's own lines
        for extra in tmp.glob("alone[1-9].jsonl"):
            extra.unlink()
        master = DevMaster(tmp / "master")
        await master.start()
        agent = AgentProcess(tmp / "agent", master, max_workers=2, name="items-node",
                             long_poll_wait=5, poll_interval=0.5)
        try:
            await agent.start()
            env = {"BENCH_SDK_DIR": str(SDK_DIR), "BENCH_ITEMS": str(items), "BENCH_ITEMS_SOURCE": str(source)}
            end_to_end = await _flood(master, agent, [PYTHON, "-c", SPIDER], env, items)
            delivery = await _flood(master, agent, [PYTHON, "-c", COPIER], env, items)
        finally:
            await agent.stop()
            await master.stop()
    per_100k = 100_000 / items
    figures = {
        "items": items,
        **end_to_end,
        "items_per_s": items / end_to_end["seconds"],
        "alone_seconds": alone_s,
        "alone_items_per_s": items / alone_s,
        "ratio_to_alone": end_to_end["seconds"] / alone_s,
        "delivery_seconds": delivery["seconds"],
        "delivery_items_per_s": items / delivery["seconds"],
        "delivery_agent_cpu_seconds": delivery["agent_cpu_seconds"],
        "delivery_master_cpu_seconds": delivery["master_cpu_seconds"],
        "spider_cpu_per_100k": alone_cpu * per_100k,
        "agent_cpu_per_100k": end_to_end["agent_cpu_seconds"] * per_100k,
        "master_cpu_per_100k": end_to_end["master_cpu_seconds"] * per_100k,
    }
    figures["agent_peak_rss_mb"] = max(end_to_end["agent_peak_rss_mb"], delivery["agent_peak_rss_mb"])
    figures["lost_or_duplicated"] = end_to_end["lost_or_duplicated"] or delivery["lost_or_duplicated"]
    if delivery["status"] != "SUCCESS":
        figures["status"] = delivery["status"]
    # CPU the three processes need for TARGET_ITEMS_S items a second, in cores (this machine has
    # os.cpu_count() of them, shared with whatever else runs).
    figures["cores_at_target"] = (figures["spider_cpu_per_100k"] + figures["agent_cpu_per_100k"]
                                  + figures["master_cpu_per_100k"]) * TARGET_ITEMS_S / 100_000
    return figures


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
        ("delivery alone (agent → master)", f"{figures['delivery_seconds']:.2f} s = "
         f"{figures['delivery_items_per_s']:,.0f} items/s", "the same lines appended in 1 MiB writes (no SDK): "
         f"agent CPU {figures['delivery_agent_cpu_seconds']:.2f} s, master CPU "
         f"{figures['delivery_master_cpu_seconds']:.2f} s"),
        ("agent CPU", f"{figures['agent_cpu_seconds']:.2f} s", "end to end"),
        ("agent peak RSS", f"{figures['agent_peak_rss_mb']:.1f} MB", f"≤ {TARGET_RSS_MB:g} MB"),
        ("master CPU", f"{figures['master_cpu_seconds']:.2f} s", "(dev master, same machine)"),
        ("CPU per 100k items", f"spider {figures['spider_cpu_per_100k']:.2f} s + agent "
         f"{figures['agent_cpu_per_100k']:.2f} s + master {figures['master_cpu_per_100k']:.2f} s",
         f"at {TARGET_ITEMS_S:,.0f} items/s: {figures['cores_at_target']:.2f} of this machine's "
         f"{os.cpu_count()} cores (shared)"),
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
