"""Agent overhead: CPU and memory of the agent process alone, idle and while running tasks.

The agent runs as ``python -m ckagent run -c FILE`` (default intervals: heartbeat 30 s, long poll
20 s) against a dev master subprocess; psutil reads the agent's own CPU times (its threads
included, its spiders not) and RSS.

- idle: CPU seconds over ``idle`` seconds (60; 5 with ``--quick``) → % of one core; peak RSS.
- busy: N ``python -c`` tasks over 4 spiders (``max_workers`` 2); agent CPU seconds per task,
  next to the spiders' own CPU per task (the agent's reaped children) as the baseline; peak RSS.
- the path per task (bench._census): the Trio tasks and thread hops of the agent's own per task,
  counted by a Trio instrument around an in-process agent running 10 ``python -c`` tasks (3 with
  ``--quick``) one after another; the table below it names where they come from.
- Scrapyd (unless ``--no-scrapyd``): the same figures for the Scrapyd daemon, idle and per job.

Targets (issue 26, item 7): agent CPU per task ≤ 6 ms and ≤ 0.20 × the spider's own (``python -c``),
at most 4 Trio tasks and 6 thread hops per task; (issue 18) idle CPU ≤ 0.05 % of one core, idle RSS
≤ 40 MB. The Scrapyd daemon's CPU per job is shown beside it (measured in the same run).
Run: ``python -m bench.overhead [--quick] [--no-scrapyd]``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio

from bench import _census, _scrapyd
from bench._harness import (
    STAMP_SPIDER,
    AgentProcess,
    DevMaster,
    check_success,
    create_spiders,
    markdown_table,
    module_main,
    stamp_command,
    wait_final,
    work_directory,
)
from ckagent.devmaster.client import zip_files

TARGET_TASK_CPU_MS = 6.0
"""Agent CPU per task (ms), at most (issue 26, item 7)."""
TARGET_TASK_CPU_RATIO = 0.20
"""Agent CPU per task ÷ the spider's own CPU per task (``python -c``), at most (issue 26, item 7)."""
TARGET_IDLE_CPU_PERCENT = 0.05
TARGET_IDLE_RSS_BYTES = 40 * 1024 * 1024
MB = 1024 * 1024


class Probe:
    """CPU and peak RSS of one process, sampled every ``interval`` seconds by :meth:`watch`."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        self.process = psutil.Process(pid)
        self.interval = interval
        self.peak_rss_bytes = 0

    def cpu(self) -> tuple[float, float]:
        """(own user+system seconds, reaped children's user+system seconds)."""
        t = self.process.cpu_times()
        return t.user + t.system, t.children_user + t.children_system

    def rss(self) -> int:
        """Current RSS in bytes (also updates the peak)."""
        value = int(self.process.memory_info().rss)
        self.peak_rss_bytes = max(self.peak_rss_bytes, value)
        return value

    async def watch(self) -> None:
        """Sample RSS until cancelled."""
        while True:
            self.rss()
            await trio.sleep(self.interval)


async def measure_window(probe: Probe, seconds: float) -> dict[str, float]:
    """Sleep ``seconds`` while sampling; returns CPU seconds used and % of one core."""
    probe.peak_rss_bytes = 0
    own0, _ = probe.cpu()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probe.watch)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    own1, _ = probe.cpu()
    return {"cpu_s": own1 - own0, "cpu_percent": (own1 - own0) / seconds * 100, "rss_mb": probe.peak_rss_bytes / MB}


async def agent_overhead(workdir: Path, idle_seconds: float, tasks: int) -> dict[str, float]:
    """Idle and busy figures of a real agent process (see module docstring)."""
    master = DevMaster(workdir / "master")
    await master.start()
    agent = AgentProcess(workdir / "agent", master, max_workers=2, name="bench-overhead")
    try:
        await agent.start()
        spiders = await create_spiders(master.admin, "cost", 4, stamp_command(), zip_files(STAMP_SPIDER),
                                       workdir / "stamps")
        (workdir / "stamps").mkdir()
        warm = [await master.admin.create_task(s) for s in spiders]  # virtualenvs, first-use imports
        check_success(await wait_final(master.admin, warm, 120))
        await trio.sleep(1.0)
        probe = Probe(agent.pid)
        idle = await measure_window(probe, idle_seconds)
        probe.peak_rss_bytes = 0
        own0, kids0 = probe.cpu()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe.watch)
            ids = [await master.admin.create_task(spiders[i % len(spiders)]) for i in range(tasks)]
            check_success(await wait_final(master.admin, ids, 300, interval=0.25))
            await trio.sleep(0.5)  # results are reported after finishedAt
            nursery.cancel_scope.cancel()
        own1, kids1 = probe.cpu()
        return {
            "idle_cpu_percent": idle["cpu_percent"], "idle_rss_mb": idle["rss_mb"],
            "task_cpu_ms": (own1 - own0) / tasks * 1000, "spider_cpu_ms": (kids1 - kids0) / tasks * 1000,
            "busy_rss_mb": probe.peak_rss_bytes / MB,
        }
    finally:
        await agent.stop()
        await master.stop()


async def scrapyd_overhead(workdir: Path, idle_seconds: float, jobs: int) -> dict[str, float]:
    """Idle and busy figures of the Scrapyd daemon (max_proc 2, poll_interval 0.2 s so jobs flow)."""
    python = await trio.to_thread.run_sync(_scrapyd.ensure_venv)
    project = _scrapyd.write_project(workdir / "scrapy-project")
    egg = await trio.to_thread.run_sync(_scrapyd.build_egg, project, python)
    daemon = _scrapyd.Scrapyd(workdir / "scrapyd", python, max_proc=2, poll_interval=0.2)
    try:
        await daemon.start()
        await daemon.deploy(egg)
        await daemon.wait_finished([await daemon.schedule()], 120)
        await trio.sleep(1.0)
        assert daemon.process is not None
        probe = Probe(daemon.process.pid)
        idle = await measure_window(probe, idle_seconds)
        probe.peak_rss_bytes = 0
        own0, kids0 = probe.cpu()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(probe.watch)
            ids = [await daemon.schedule() for _ in range(jobs)]
            await daemon.wait_finished(ids, 300)
            nursery.cancel_scope.cancel()
        own1, kids1 = probe.cpu()
        return {
            "idle_cpu_percent": idle["cpu_percent"], "idle_rss_mb": idle["rss_mb"],
            "task_cpu_ms": (own1 - own0) / jobs * 1000, "spider_cpu_ms": (kids1 - kids0) / jobs * 1000,
            "busy_rss_mb": probe.peak_rss_bytes / MB,
        }
    finally:
        await daemon.stop()


async def run_async(quick: bool, scrapyd: bool = True) -> dict[str, Any]:
    """Agent (and Scrapyd) overhead; returns ``{"rows", "table", "target_met", ...}``."""
    idle_seconds = 5.0 if quick else 60.0
    tasks = 6 if quick else 40
    with work_directory("bench-overhead-") as workdir:
        agent = await agent_overhead(workdir, idle_seconds, tasks)
        sides = [("ckagent (python -c tasks)", agent)]
        if scrapyd:
            try:
                sides.append(("scrapyd daemon (scrapy noop jobs)",
                              await scrapyd_overhead(workdir, idle_seconds, 6 if quick else 16)))
            except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:  # keep the agent's figures
                failed = f"{type(exc).__name__}: {exc}".replace("|", "/")[:200]
                sides.append((f"scrapyd daemon: FAILED ({failed})", dict.fromkeys(
                    ("idle_cpu_percent", "idle_rss_mb", "task_cpu_ms", "spider_cpu_ms", "busy_rss_mb"), math.nan)))
        census = await _census.agent_census(workdir / "census", 3 if quick else 10)
    rows = [
        [name, f["idle_cpu_percent"], f["idle_rss_mb"], f["task_cpu_ms"], f["spider_cpu_ms"],
         f["task_cpu_ms"] / f["spider_cpu_ms"] if f["spider_cpu_ms"] else math.nan, f["busy_rss_mb"]]
        for name, f in sides
    ]
    table = markdown_table(
        [f"overhead (idle {idle_seconds:g} s, {tasks} tasks)", "idle CPU % of a core", "idle RSS MB",
         "CPU ms / task", "spider CPU ms / task", "÷ spider", "busy peak RSS MB"], rows)
    table += "\n" + _census.census_table(census)
    scrapyd_ms = sides[1][1]["task_cpu_ms"] if len(sides) > 1 else math.nan
    spider_ratio = agent["task_cpu_ms"] / agent["spider_cpu_ms"] if agent["spider_cpu_ms"] else math.nan
    scrapyd_text = f"; Scrapyd's daemon {scrapyd_ms:.1f} ms/job" if not math.isnan(scrapyd_ms) else ""
    return {
        "name": "overhead",
        "table": table,
        "agent": agent,
        "census": census,
        "task_cpu_ratio": spider_ratio,
        "headline": f"{agent['task_cpu_ms']:.1f} ms CPU/task ({spider_ratio:.2f} × the spider's{scrapyd_text}), "
                    f"{census['tasks_per_task']:g} Trio tasks and {census['hops_per_task']:g} thread hops/task, "
                    f"idle {agent['idle_cpu_percent']:.3f} % CPU, idle RSS {agent['idle_rss_mb']:.0f} MB",
        "target": f"CPU/task ≤ {TARGET_TASK_CPU_MS:g} ms and ≤ {TARGET_TASK_CPU_RATIO} × the spider's, "
                  f"≤ {_census.TARGET_TASKS:g} Trio tasks and ≤ {_census.TARGET_HOPS:g} thread hops per task, "
                  f"idle CPU ≤ {TARGET_IDLE_CPU_PERCENT} % of a core, idle RSS ≤ {TARGET_IDLE_RSS_BYTES // MB} MB",
        "target_met": (agent["idle_cpu_percent"] <= TARGET_IDLE_CPU_PERCENT
                       and agent["idle_rss_mb"] * MB <= TARGET_IDLE_RSS_BYTES
                       and agent["task_cpu_ms"] <= TARGET_TASK_CPU_MS
                       and spider_ratio <= TARGET_TASK_CPU_RATIO
                       and census["tasks_per_task"] <= _census.TARGET_TASKS
                       and census["hops_per_task"] <= _census.TARGET_HOPS),
    }


def run(quick: bool, scrapyd: bool = True) -> dict[str, Any]:
    """Measure overhead (see module docstring); blocking (runs its own Trio loop)."""
    return trio.run(run_async, quick, scrapyd)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.overhead [--quick] [--no-scrapyd]``: print the table."""
    return module_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
