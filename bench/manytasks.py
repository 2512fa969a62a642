"""Many tasks on one node: N concurrent tasks, each printing lines and saving items at a steady rate.

Setup: the dev master and the agent (``max_workers`` N) run as their own processes; N spiders (one
task each: the same spider's tasks run one at a time) start together. Each spider prints
``LINES_PER_S`` lines a second (one ``write`` of the lines due every 10 ms, each line carrying the
time it was written) and saves ``ITEMS_PER_S`` items a second with the SDK's ``save_item``, for
``seconds`` (60 full; 5 with ``--quick``, 8 tasks). Measured:

- the agent's CPU (user + system, psutil) over the run, as % of one core per 10 tasks, and its peak RSS;
- delivery lag: line written → stored at the master. The benchmark reads every task's
  ``storedLogLines`` from the master every ``POLL_INTERVAL`` s (one list request); a line counts as
  stored at the first read that covers it, so the lag is exact to within one read interval
  (a line's write time is in the line itself); p50/p99/max over every line of every task;
- the baseline: the spiders' own CPU (the agent's reaped children), for scale; the dev master's CPU
  (same 2 cores: its time per request is part of the lag);
- where the lag comes from: the agent's requests to the master over the run (its ``/metrics``:
  requests per task per second and mean latency per endpoint, log lines per logs request).

Checks that nothing is lost: every task ends SUCCESS with all of its lines (in order) and items.
Targets: agent CPU ≤ 5 % of a core per 10 tasks, RSS ≤ 80 MB, delivery lag p99 ≤ 1 s, nothing lost.

    .venv/bin/python -m bench.manytasks [--quick] [--tasks N] [--seconds S]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import httpx
import psutil
import trio
from prometheus_client.parser import text_string_to_metric_families

from bench._harness import (
    PYTHON,
    REPO,
    AgentProcess,
    DevMaster,
    markdown_table,
    summary,
    wait_final,
    work_directory,
)
from bench.flood import Sampler
from ckagent.devmaster.client import zip_files

FULL_TASKS, FULL_SECONDS = 64, 60.0
QUICK_TASKS, QUICK_SECONDS = 8, 5.0
LINES_PER_S = 100
ITEMS_PER_S = 10
POLL_INTERVAL = 0.1
TARGET_CPU_PER_10_TASKS = 5.0
TARGET_RSS_MB = 80.0
TARGET_LAG_P99_S = 1.0
MB = 1024 * 1024
SDK_DIR = REPO / "sdk" / "python" / "src"

SPIDER = r"""
import os, sys, time
sys.path.insert(0, os.environ["BENCH_SDK_DIR"])
from crawlerkeeper_sdk import save_item
seconds = float(os.environ["BENCH_SECONDS"])
lps, ips = int(os.environ["BENCH_LPS"]), int(os.environ["BENCH_IPS"])
start = time.time()
lines = items = 0
while True:
    now = time.time()
    elapsed = min(now - start, seconds)
    chunk = []
    while lines < int(elapsed * lps):
        chunk.append(b"L %d %.6f\n" % (lines, now))
        lines += 1
    if chunk:
        data = memoryview(b"".join(chunk))
        while data:
            data = data[os.write(1, data):]
    while items < int(elapsed * ips):
        save_item({"n": items, "title": "item %d" % items, "at": now})
        items += 1
    if elapsed >= seconds:
        break
    time.sleep(0.01)
"""


async def _requests(port: int) -> dict[str, tuple[float, float]]:
    """The agent's requests to the master so far: endpoint → (requests, seconds spent), from /metrics."""
    async with httpx.AsyncClient(timeout=10.0) as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    found: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "ckagent_master_request_duration_seconds":
            for sample in family.samples:
                endpoint = sample.labels.get("endpoint", "?")
                count, total = found.get(endpoint, (0.0, 0.0))
                if sample.name.endswith("_count"):
                    found[endpoint] = (sample.value, total)
                elif sample.name.endswith("_sum"):
                    found[endpoint] = (count, sample.value)
    return found


async def _watch_stored(admin: Any, task_ids: list[str], seen: dict[str, list[tuple[int, float]]]) -> None:
    """Every POLL_INTERVAL: each task's storedLogLines, recorded as (count, time) when it grows."""
    wanted = set(task_ids)
    while True:
        at = time.time()
        for task in await admin.list_tasks():
            if task["id"] in wanted:
                stored = int(task.get("storedLogLines") or 0)
                marks = seen[task["id"]]
                if not marks or stored > marks[-1][0]:
                    marks.append((stored, at))
        await trio.sleep(POLL_INTERVAL)


def _lags(lines: list[str], marks: list[tuple[int, float]]) -> tuple[list[float], int]:
    """Lag of each spider line (index in the stored stream → first read covering it); and its count."""
    lags: list[float] = []
    numbered = 0
    k = 0
    for index, line in enumerate(lines):
        if not line.startswith("L "):
            continue
        _, n, written = line.split()
        if int(n) != numbered:
            return lags, -1  # out of order or a gap: counted as a loss
        numbered += 1
        while k < len(marks) and marks[k][0] <= index:
            k += 1
        if k < len(marks):
            lags.append(max(0.0, marks[k][1] - float(written)))
    return lags, numbered


async def _run(tasks: int, seconds: float) -> dict[str, Any]:
    with work_directory("ck-many-") as tmp:
        master = DevMaster(tmp / "master")
        await master.start()
        agent = AgentProcess(tmp / "agent", master, max_workers=tasks, name="many-node")
        try:
            await agent.start()
            agent_ps = psutil.Process(agent.pid)
            env = {"BENCH_SDK_DIR": str(SDK_DIR), "BENCH_SECONDS": str(seconds), "BENCH_LPS": str(LINES_PER_S),
                   "BENCH_IPS": str(ITEMS_PER_S)}
            spiders = []
            for i in range(tasks):
                spider = await master.admin.create_spider(name=f"many-{i}", framework="python",
                                                          command=[PYTHON, "-c", SPIDER])
                await master.admin.upload_package(spider, zip_files({"main.py": "# runs its command\n"}))
                spiders.append(spider)
            # Warm-up: one short task per spider (code downloads, environments), not measured.
            warm = [await master.admin.create_task(s, env={**env, "BENCH_SECONDS": "0"}) for s in spiders]
            await wait_final(master.admin, warm, 300, interval=0.25)
            await trio.sleep(1.0)
            sampler = Sampler(agent.pid, interval=0.1)
            assert master.process is not None
            master_ps = psutil.Process(master.process.pid)
            port = int(agent.config["agent"]["port"])
            requests0 = await _requests(port)
            master0 = master_ps.cpu_times()
            times0 = agent_ps.cpu_times()
            seen: dict[str, list[tuple[int, float]]] = {}
            started = time.time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sampler.run)
                ids = [await master.admin.create_task(s, env=env) for s in spiders]
                seen.update({task_id: [] for task_id in ids})
                nursery.start_soon(_watch_stored, master.admin, ids, seen)
                done = await wait_final(master.admin, ids, seconds + 300, interval=0.25)
                await trio.sleep(POLL_INTERVAL * 2)
                nursery.cancel_scope.cancel()
            elapsed = time.time() - started
            times1 = agent_ps.cpu_times()
            master1 = master_ps.cpu_times()
            requests1 = await _requests(port)
            stored = [(await master.admin.get_logs(task_id), await master.admin.get_items(task_id)) for task_id in ids]
        finally:
            await agent.stop()
            await master.stop()
    agent_cpu = (times1.user + times1.system) - (times0.user + times0.system)
    spider_cpu = (times1.children_user + times1.children_system) - (times0.children_user + times0.children_system)
    master_cpu = (master1.user + master1.system) - (master0.user + master0.system)
    calls = {endpoint: (count - requests0.get(endpoint, (0.0, 0.0))[0], total - requests0.get(endpoint, (0.0, 0.0))[1])
             for endpoint, (count, total) in requests1.items()}
    calls = {endpoint: figures for endpoint, figures in calls.items() if figures[0] > 0}
    expected_lines = int(seconds * LINES_PER_S)
    expected_items = int(seconds * ITEMS_PER_S)
    all_lags: list[float] = []
    lost = 0
    for task, (lines, items), task_id in zip(done, stored, ids, strict=True):
        lags, numbered = _lags(lines, seen[task_id])
        all_lags += lags
        good_items = len(items) == expected_items and all(item.get("n") == i for i, item in enumerate(items))
        if task["status"] != "SUCCESS" or numbered != expected_lines or not good_items:
            lost += 1
    lag = summary(sorted(all_lags))
    p99 = sorted(all_lags)[max(0, math.ceil(0.99 * len(all_lags)) - 1)] if all_lags else math.nan
    cpu_percent = agent_cpu / elapsed * 100
    return {
        "tasks": tasks, "seconds": seconds, "elapsed": elapsed,
        "agent_cpu_seconds": agent_cpu, "agent_cpu_percent": cpu_percent,
        "agent_cpu_percent_per_10_tasks": cpu_percent / tasks * 10,
        "spider_cpu_seconds": spider_cpu, "master_cpu_seconds": master_cpu,
        "requests": {endpoint: {"count": count, "per_task_s": count / tasks / seconds,
                                "mean_ms": total / count * 1000} for endpoint, (count, total) in calls.items()},
        # A node batch (POST /api/nodes/{id}/batches) carries several tasks' lines and items.
        "lines_per_logs_request": tasks * expected_lines / sum(calls.get(e, (0.0, 0.0))[0] for e in ("logs", "batches"))
        if calls.get("logs") or calls.get("batches") else math.nan,
        "agent_peak_rss_mb": sampler.peak_rss / MB,
        "lag_p50": lag["p50"], "lag_p99": p99, "lag_max": lag["max"], "lines_measured": len(all_lags),
        "tasks_incomplete": lost,
    }


def run(quick: bool, tasks: int | None = None, seconds: float | None = None) -> dict[str, Any]:
    """Run once (see module docstring); ``tasks``/``seconds`` override the mode's figures."""
    n = tasks or (QUICK_TASKS if quick else FULL_TASKS)
    s = seconds or (QUICK_SECONDS if quick else FULL_SECONDS)
    figures = trio.run(_run, n, s)
    met = (figures["agent_cpu_percent_per_10_tasks"] <= TARGET_CPU_PER_10_TASKS
           and figures["agent_peak_rss_mb"] <= TARGET_RSS_MB and figures["lag_p99"] <= TARGET_LAG_P99_S
           and figures["tasks_incomplete"] == 0)
    return {
        **figures,
        "target": f"agent CPU ≤ {TARGET_CPU_PER_10_TASKS:g} % of a core per 10 tasks, RSS ≤ {TARGET_RSS_MB:g} MB, "
                  f"lag p99 ≤ {TARGET_LAG_P99_S:g} s, nothing lost",
        "target_met": met,
        "headline": f"{n} tasks × {s:g} s: agent {figures['agent_cpu_percent_per_10_tasks']:.2f} % CPU per 10 tasks, "
                    f"RSS {figures['agent_peak_rss_mb']:.0f} MB, lag p99 {figures['lag_p99']:.2f} s, "
                    f"{figures['tasks_incomplete']} incomplete",
    }


def report(figures: dict[str, Any]) -> str:
    """The figures as a Markdown table, with the targets."""
    rows = [
        ("tasks × duration", f"{figures['tasks']} × {figures['seconds']:g} s "
         f"({LINES_PER_S} lines/s + {ITEMS_PER_S} items/s each)", f"run took {figures['elapsed']:.1f} s"),
        ("agent CPU", f"{figures['agent_cpu_seconds']:.2f} s = {figures['agent_cpu_percent']:.1f} % of a core",
         f"{figures['agent_cpu_percent_per_10_tasks']:.2f} % per 10 tasks (≤ {TARGET_CPU_PER_10_TASKS:g})"),
        ("spiders' CPU (baseline)", f"{figures['spider_cpu_seconds']:.2f} s",
         f"agent ÷ spiders = {figures['agent_cpu_seconds'] / figures['spider_cpu_seconds']:.2f}×"
         if figures["spider_cpu_seconds"] else "–"),
        ("dev master's CPU (same cores)", f"{figures['master_cpu_seconds']:.2f} s",
         f"{figures['master_cpu_seconds'] / figures['elapsed'] * 100:.1f} % of a core"),
        ("agent → master requests", ", ".join(
            f"{endpoint} {r['per_task_s']:.2f}/task/s ({r['mean_ms']:.0f} ms)"
            for endpoint, r in sorted(figures["requests"].items(), key=lambda kv: -kv[1]["count"])),
         f"{figures['lines_per_logs_request']:.0f} lines per request carrying lines (logs or node batches); "
         "mean latency as the agent sees it"),
        ("agent peak RSS", f"{figures['agent_peak_rss_mb']:.1f} MB", f"≤ {TARGET_RSS_MB:g} MB"),
        ("delivery lag p50 / p99 / max", f"{figures['lag_p50']:.2f} / {figures['lag_p99']:.2f} / "
         f"{figures['lag_max']:.2f} s", f"p99 ≤ {TARGET_LAG_P99_S:g} s; ±{POLL_INTERVAL:g} s "
         f"(read interval), {figures['lines_measured']:,} lines"),
        ("tasks incomplete", str(figures["tasks_incomplete"]), "failed, or a line or item lost/duplicated"),
    ]
    return markdown_table(["figure", "value", "target / note"], rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.manytasks [--quick] [--tasks N] [--seconds S]``: print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_TASKS} tasks × {QUICK_SECONDS:g} s")
    parser.add_argument("--tasks", type=int, default=None, help=f"concurrent tasks (default {FULL_TASKS})")
    parser.add_argument("--seconds", type=float, default=None, help=f"each task's duration (default {FULL_SECONDS:g})")
    args = parser.parse_args(argv)
    figures = run(args.quick, args.tasks, args.seconds)
    print(report(figures))
    print(f"target {figures['target']}: {'met' if figures['target_met'] else 'MISSED'}")
    return 1 if figures["tasks_incomplete"] else 0


if __name__ == "__main__":
    sys.exit(main())
