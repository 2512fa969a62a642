"""Log flood: 1,000,000 lines (~100 MB) through a real task to the dev master, end to end.

Setup: the dev master and the agent run as their own processes (psutil measures the agent alone);
the task's spider copies a prepared file to its stdout as fast as it can, after one stamp line with
its start time. Measured:

- end-to-end MB/s: file bytes / (last line stored at the master − the spider's start);
- the agent's CPU seconds (user + system) and peak RSS during the run (sampled every 20 ms);
- the master's CPU seconds (it is on the same 2 cores, so it shares the budget);
- the baseline: the time ``cat`` takes to copy the same file (same machine, same run).

Checks that nothing is lost: every line ``<n> ...`` arrives at the master once, in order.
Targets: ≥ 50 MB/s end to end, agent peak RSS ≤ 80 MB. The full run floods 3 times (a fresh master
and agent each; the machine's speed drifts by tens of percent between minutes) and reports the run
with the median MB/s, the highest peak RSS of all runs, and a loss in any run as a loss.

    .venv/bin/python -m bench.flood [--quick]      # --quick: 50,000 lines
"""

from __future__ import annotations

import argparse
import subprocess
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
    wait_final,
    work_directory,
)
from ckagent.devmaster.client import zip_files

FULL_LINES = 1_000_000
QUICK_LINES = 50_000
FULL_ROUNDS = 3
TARGET_MB_S = 50.0
TARGET_RSS_MB = 80.0
MB = 1_000_000

SPIDER = r"""
import os, time
def write_all(data):
    view = memoryview(data)
    while view:  # a raw write may be cut short (a signal, a profiler attaching): finish it
        view = view[os.write(1, view):]
write_all(b"FLOOD-START %.6f\n" % time.time())
with open(os.environ["FLOOD_FILE"], "rb") as src:
    while True:
        chunk = src.read(1 << 20)
        if not chunk:
            break
        write_all(chunk)
"""


def write_flood_file(path: Path, lines: int) -> int:
    """Write ``lines`` numbered lines of 100 bytes (with the newline); returns the file size."""
    filler = "the quick brown fox jumps over the lazy dog; " * 3
    with path.open("wb") as fh:
        for start in range(0, lines, 10_000):
            block = "".join(f"{n:08d} {filler[:90]}\n" for n in range(start, min(lines, start + 10_000)))
            fh.write(block.encode())
    return path.stat().st_size


def cat_seconds(src: Path, dst: Path) -> float:
    """Seconds ``cat src > dst`` takes (the copy the agent's work is compared with)."""
    started = time.perf_counter()
    with dst.open("wb") as out:
        subprocess.run(["cat", str(src)], stdout=out, check=True)
    return time.perf_counter() - started


class Sampler:
    """Samples a process's RSS every ``interval`` seconds; keeps the peak (bytes)."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.process = psutil.Process(pid)
        self.interval = interval
        self.peak_rss = 0

    async def run(self) -> None:
        while True:
            try:
                self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
            except psutil.Error:
                return
            await trio.sleep(self.interval)


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def _run(lines: int) -> dict[str, Any]:
    with work_directory("ck-flood-") as tmp:
        flood = tmp / "flood.txt"
        size = await trio.to_thread.run_sync(write_flood_file, flood, lines)
        cat_s = min([await trio.to_thread.run_sync(cat_seconds, flood, tmp / "copy.txt") for _ in range(3)])
        (tmp / "copy.txt").unlink()
        master = DevMaster(tmp / "master")
        await master.start()
        agent = AgentProcess(tmp / "agent", master, max_workers=2, name="flood-node",
                             long_poll_wait=5, poll_interval=0.5)
        try:
            await agent.start()
            agent_ps = psutil.Process(agent.pid)
            assert master.process is not None
            master_ps = psutil.Process(master.process.pid)
            spider = await master.admin.create_spider(name="flood", framework="python",
                                                      command=[PYTHON, "-c", SPIDER])
            await master.admin.upload_package(spider, zip_files({"main.py": "# runs its command\n"}))
            sampler = Sampler(agent.pid)
            cpu0, master_cpu0 = cpu_seconds(agent_ps), cpu_seconds(master_ps)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sampler.run)
                task_id = await master.admin.create_task(spider, env={"FLOOD_FILE": str(flood)})
                (task,) = await wait_final(master.admin, [task_id], timeout=600, interval=0.02)
                finished = time.time()
                nursery.cancel_scope.cancel()
            agent_cpu = cpu_seconds(agent_ps) - cpu0
            master_cpu = cpu_seconds(master_ps) - master_cpu0
            stored = await master.admin.get_logs(task_id)
        finally:
            await agent.stop()
            await master.stop()
    start_line = next(line for line in stored if line.startswith("FLOOD-START "))
    started = float(start_line.split()[1])
    numbered = [line for line in stored if line[:8].isdigit()]
    in_order = all(int(line[:8]) == i for i, line in enumerate(numbered))
    seconds = finished - started
    return {
        "lines": lines,
        "bytes": size,
        "status": task["status"],
        "seconds": seconds,
        "mb_per_s": size / MB / seconds,
        "cat_seconds": cat_s,
        "cat_mb_per_s": size / MB / cat_s,
        "ratio_to_cat": seconds / cat_s,
        "agent_cpu_seconds": agent_cpu,
        "agent_peak_rss_mb": sampler.peak_rss / MB,
        "master_cpu_seconds": master_cpu,
        "lines_at_master": len(numbered),
        "lost_or_duplicated": len(numbered) != lines or not in_order,
    }


def verdict(figures: dict[str, Any]) -> dict[str, Any]:
    """The summary keys of ``figures`` (``target``, ``target_met``, ``headline``) for ``python -m bench``."""
    mb_s, rss = figures["mb_per_s"], figures["agent_peak_rss_mb"]
    return {
        "target": f"≥ {TARGET_MB_S:g} MB/s end to end, agent RSS ≤ {TARGET_RSS_MB:g} MB, nothing lost",
        "target_met": (mb_s >= TARGET_MB_S and rss <= TARGET_RSS_MB and not figures["lost_or_duplicated"]
                       and figures["status"] == "SUCCESS"),
        "headline": f"{mb_s:.1f} MB/s, agent CPU {figures['agent_cpu_seconds']:.2f} s, RSS {rss:.1f} MB, "
                    f"{figures['lines_at_master']:,}/{figures['lines']:,} lines",
    }


def run(quick: bool) -> dict[str, Any]:
    """Flood ``FULL_ROUNDS`` times (``quick``: once, 50,000 lines, else 1,000,000); returns the figures of
    the median run (by MB/s) with the worst RSS and loss of all runs, and every run's MB/s."""
    runs = [trio.run(_run, QUICK_LINES if quick else FULL_LINES) for _ in range(1 if quick else FULL_ROUNDS)]
    figures = dict(sorted(runs, key=lambda r: r["mb_per_s"])[len(runs) // 2])
    figures["agent_peak_rss_mb"] = max(r["agent_peak_rss_mb"] for r in runs)
    figures["lost_or_duplicated"] = any(r["lost_or_duplicated"] for r in runs)
    if any(r["status"] != "SUCCESS" for r in runs):
        figures["status"] = next(r["status"] for r in runs if r["status"] != "SUCCESS")
    figures["runs_mb_per_s"] = [r["mb_per_s"] for r in runs]
    return {**figures, **verdict(figures)}


def report(figures: dict[str, Any]) -> str:
    """The figures as a Markdown table, with the targets."""
    rows = [
        ("lines / bytes", f"{figures['lines']:,} / {figures['bytes'] / MB:.1f} MB", ""),
        ("end to end", f"{figures['seconds']:.2f} s = {figures['mb_per_s']:.1f} MB/s", f"≥ {TARGET_MB_S:g} MB/s"),
        ("runs (MB/s)", ", ".join(f"{v:.1f}" for v in figures.get("runs_mb_per_s", [figures["mb_per_s"]])),
         "the median run is shown"),
        ("cat (baseline)", f"{figures['cat_seconds']:.3f} s = {figures['cat_mb_per_s']:.0f} MB/s",
         f"agent/cat = {figures['ratio_to_cat']:.1f}×"),
        ("agent CPU", f"{figures['agent_cpu_seconds']:.2f} s", ""),
        ("agent peak RSS", f"{figures['agent_peak_rss_mb']:.1f} MB", f"≤ {TARGET_RSS_MB:g} MB"),
        ("master CPU", f"{figures['master_cpu_seconds']:.2f} s", "(dev master, same machine)"),
        ("lines at the master", f"{figures['lines_at_master']:,}",
         "LOST/DUPLICATED" if figures["lost_or_duplicated"] else "all, once, in order"),
    ]
    return markdown_table(["figure", "value", "target / note"], rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.flood [--quick]``: print the table; exit 1 if a line was lost or duplicated."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_LINES:,} lines instead of {FULL_LINES:,}")
    args = parser.parse_args(argv)
    figures = run(args.quick)
    print(report(figures))
    return 1 if figures["lost_or_duplicated"] or figures["status"] != "SUCCESS" else 0


if __name__ == "__main__":
    sys.exit(main())
