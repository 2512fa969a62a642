"""Log flood: 1,000,000 lines (~100 MB) through a real task to the dev master, end to end.

Setup: the dev master and the agent run as their own processes (psutil measures the agent alone);
the task's spider copies a prepared file to its stdout as fast as it can, after one stamp line with
its start time. Two masters, each run on its own:

- **a master that keeps up** (``--discard-logs``): it checks every batch's ``seq`` and counts and
  hashes the lines (SHA-256) without storing them. Issue 18's flood targets are judged here ("when the
  master keeps up"): the reference master's SQLite storage costs more CPU per MB than the agent, and on
  2 cores the two share the budget;
- **the reference master**, storing every line in SQLite (what a demo gets; its MB/s is the master's).

Measured per run:

- end-to-end MB/s: file bytes / (last line acknowledged by the master − the spider's start);
- the agent's CPU seconds (user + system), per 100 MB, and peak RSS (sampled every 20 ms);
- the master's CPU seconds (same 2 cores);
- the baseline: the time ``cat`` takes to copy the same file (same machine, same run).

Nothing lost: every line ``<n> ...`` of the file is in the task's output.log once, in order, and the
master holds exactly output.log's lines (count and SHA-256 for the master that keeps up; every line,
once, in order, for the reference master).
Targets (issue 18): with the master that keeps up, ≥ 100 MB/s end to end and ≤ 0.5 s of agent CPU per
100 MB; nothing lost in any run. A full run floods 3 times with the master that keeps up (a fresh master
and agent each; the machine's speed drifts between minutes) and reports the median run by MB/s, the
highest RSS, and a loss in any run as a loss; then once with the reference master.

    .venv/bin/python -m bench.flood [--quick]      # --quick: 50,000 lines, one run each
"""

from __future__ import annotations

import argparse
import hashlib
import re
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
TARGET_MB_S = 100.0
TARGET_CPU_PER_100MB = 0.5
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


def spool_check(output_log: Path, lines: int) -> tuple[bool, int, str]:
    """(every flood line ``<n> ...`` is in ``output_log`` once and in order, its line count, the SHA-256
    of its bytes): what a master holding all of it must hold."""
    data = output_log.read_bytes()
    numbered = [line for line in data.split(b"\n") if line[:8].isdigit()]
    complete = len(numbered) == lines and all(int(line[:8]) == i for i, line in enumerate(numbered))
    return complete, data.count(b"\n"), hashlib.sha256(data).hexdigest()


async def _run(lines: int, keeps_up: bool = True) -> dict[str, Any]:
    with work_directory("ck-flood-") as tmp:
        flood = tmp / "flood.txt"
        size = await trio.to_thread.run_sync(write_flood_file, flood, lines)
        cat_s = min([await trio.to_thread.run_sync(cat_seconds, flood, tmp / "copy.txt") for _ in range(3)])
        (tmp / "copy.txt").unlink()
        master = DevMaster(tmp / "master", discard_logs=keeps_up)
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
            output_log = agent.config_path.parent / "data" / "tasks" / task_id / "output.log"
            complete, spool_lines, spool_sha = await trio.to_thread.run_sync(spool_check, output_log, lines)
            if keeps_up:
                digest = await master.admin.get_log_digest(task_id)
                at_master = lines if digest["count"] == spool_lines and digest["sha256"] == spool_sha else 0
                stamp = re.search(rb"^FLOOD-START ([0-9.]+)$", await trio.to_thread.run_sync(output_log.read_bytes),
                                  re.MULTILINE)
                assert stamp is not None, "the spider's start line is missing"
                started = float(stamp[1])
            else:
                stored = await master.admin.get_logs(task_id)
                numbered = [line for line in stored if line[:8].isdigit()]
                in_order = all(int(line[:8]) == i for i, line in enumerate(numbered))
                at_master = len(numbered) if in_order and len(stored) == spool_lines else 0
                start_line = next(line for line in stored if line.startswith("FLOOD-START "))
                started = float(start_line.split()[1])
        finally:
            await agent.stop()
            await master.stop()
    seconds = finished - started
    return {
        "master": "keeps up (acknowledges without storing)" if keeps_up else "reference master (SQLite)",
        "lines": lines,
        "bytes": size,
        "status": task["status"],
        "seconds": seconds,
        "mb_per_s": size / MB / seconds,
        "cat_seconds": cat_s,
        "cat_mb_per_s": size / MB / cat_s,
        "ratio_to_cat": seconds / cat_s,
        "agent_cpu_seconds": agent_cpu,
        "agent_cpu_per_100mb": agent_cpu / (size / (100 * MB)),
        "agent_peak_rss_mb": sampler.peak_rss / MB,
        "master_cpu_seconds": master_cpu,
        "lines_at_master": at_master,
        "lost_or_duplicated": not complete or at_master != lines,
    }


def verdict(figures: dict[str, Any]) -> dict[str, Any]:
    """The summary keys of ``figures`` (``target``, ``target_met``, ``headline``) for ``python -m bench``."""
    mb_s, cpu = figures["mb_per_s"], figures["agent_cpu_per_100mb"]
    return {
        "target": f"master keeping up: ≥ {TARGET_MB_S:g} MB/s end to end, ≤ {TARGET_CPU_PER_100MB:g} s agent CPU "
                  "per 100 MB, nothing lost",
        "target_met": (mb_s >= TARGET_MB_S and cpu <= TARGET_CPU_PER_100MB and not figures["lost_or_duplicated"]
                       and figures["status"] == "SUCCESS"),
        "headline": f"{mb_s:.1f} MB/s, agent CPU {cpu:.2f} s/100 MB, RSS {figures['agent_peak_rss_mb']:.1f} MB, "
                    f"{figures['lines_at_master']:,}/{figures['lines']:,} lines",
    }


def run(quick: bool) -> dict[str, Any]:
    """Flood ``FULL_ROUNDS`` times against a master that keeps up (``quick``: once, 50,000 lines, else
    1,000,000), then once against the reference master; returns the figures of the median run of the
    first kind (by MB/s) with the worst RSS and loss of all runs, every run's MB/s, and the reference
    master's run under ``"storing"``."""
    lines = QUICK_LINES if quick else FULL_LINES
    runs = [trio.run(_run, lines, True) for _ in range(1 if quick else FULL_ROUNDS)]
    storing = trio.run(_run, lines, False)
    figures = dict(sorted(runs, key=lambda r: r["mb_per_s"])[len(runs) // 2])
    figures["agent_peak_rss_mb"] = max(r["agent_peak_rss_mb"] for r in [*runs, storing])
    figures["lost_or_duplicated"] = any(r["lost_or_duplicated"] for r in [*runs, storing])
    if any(r["status"] != "SUCCESS" for r in [*runs, storing]):
        figures["status"] = next(r["status"] for r in [*runs, storing] if r["status"] != "SUCCESS")
    figures["runs_mb_per_s"] = [r["mb_per_s"] for r in runs]
    figures["storing"] = storing
    return {**figures, **verdict(figures)}


def report(figures: dict[str, Any]) -> str:
    """The figures as a Markdown table, with the targets."""
    storing = figures.get("storing")
    sides = [figures, *([storing] if storing else [])]

    def row(name: str, cell: Any, note: str = "") -> list[str]:
        return [name, *(cell(f) for f in sides), note]

    rows = [
        row("lines / bytes", lambda f: f"{f['lines']:,} / {f['bytes'] / MB:.1f} MB"),
        row("end to end", lambda f: f"{f['seconds']:.2f} s = {f['mb_per_s']:.1f} MB/s", f"≥ {TARGET_MB_S:g} MB/s"),
        row("runs (MB/s)", lambda f: ", ".join(f"{v:.1f}" for v in f.get("runs_mb_per_s", [f["mb_per_s"]])),
            "the median run is shown"),
        row("cat (baseline)", lambda f: f"{f['cat_seconds']:.3f} s = {f['cat_mb_per_s']:.0f} MB/s (agent/cat "
            f"{f['ratio_to_cat']:.1f}×)"),
        row("agent CPU", lambda f: f"{f['agent_cpu_seconds']:.2f} s = {f['agent_cpu_per_100mb']:.2f} s per 100 MB",
            f"≤ {TARGET_CPU_PER_100MB:g} s per 100 MB"),
        row("agent peak RSS", lambda f: f"{f['agent_peak_rss_mb']:.1f} MB", "highest of all runs"),
        row("master CPU", lambda f: f"{f['master_cpu_seconds']:.2f} s", "same 2 cores"),
        row("lines at the master", lambda f: f"{f['lines_at_master']:,}"
            + (" LOST/DUPLICATED" if f["lost_or_duplicated"] else " all, once, in order")),
    ]
    return markdown_table(["figure", *(f"master: {f['master']}" for f in sides), "target / note"], rows)


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
