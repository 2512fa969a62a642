"""Makespan: N short tasks of different spiders with ``max_workers`` = 2 and 4, side by side.

Workloads:

- ``python -c`` (``python -c pass`` plus the start stamp): the per-task cost of the launcher at its
  most visible.
- ``scrapy noop`` (a Scrapy spider that starts and closes, from the bench venv; needs Scrapy, so
  only with Scrapyd enabled).

Sides, each with the same parallelism and the same command lines:

- ``bare``: a Trio spawner (``CapacityLimiter(max_workers)`` + ``trio.run_process``, output to
  /dev/null): the physical limit.
- ``ckagent``: a dev master + ``python -m ckagent run`` subprocess; N tasks of N spiders are
  submitted at once; makespan = first submission → the last task's ``finishedAt``.
- ``scrapyd``: ``max_proc`` = max_workers, default ``poll_interval`` (5 s); N ``schedule.json``
  at once; makespan = first schedule → the last job's ``end_time``.

Each side runs a warm-up round (virtualenvs, caches), then 5 timed rounds (1 with ``--quick``), the sides
taking turns within a round (the machine's noise then hits all of them); the table shows the
median span and the median over rounds of the span ÷ the same round's bare span. Target: ckagent ≤ 1.10 × bare.

Where the time goes: every process on the machine shares its cores, so each round also records CPU
seconds per task (psutil / getrusage deltas over the round): the spiders' own, the launcher's (the
bare spawner, the agent or the Scrapyd daemon) and the rest of the platform's (the dev master and
this benchmark submitting and waiting). With every core busy running spiders, a side cannot finish
before ``(bare spider + its launcher + platform CPU) ÷ (bare spider + bare spawner CPU)`` × the bare
span: the ``CPU floor`` column (per task, medians over rounds). When the floor is above the target, the target is out of reach on this machine whatever the
agent's latency (the dev master and the submitter would have to run elsewhere).
Run: ``python -m bench.makespan [--quick] [--no-scrapyd]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import resource
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import trio

from bench import _scrapyd
from bench._harness import (
    STAMP_DIR_VAR,
    STAMP_SPIDER,
    AgentProcess,
    DevMaster,
    check_success,
    create_spiders,
    gather,
    markdown_table,
    module_main,
    now,
    parse_iso,
    stamp_command,
    wait_final,
    work_directory,
)
from ckagent.devmaster.client import zip_directory, zip_files

TARGET_RATIO = 1.10
WORKER_COUNTS = (2, 4)


@dataclasses.dataclass
class Cpu:
    """CPU seconds (user + system) spent during one round, by role."""

    spiders: float = 0.0
    launcher: float = 0.0
    platform: float = 0.0

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(self.spiders - other.spiders, self.launcher - other.launcher, self.platform - other.platform)


def _own(process: psutil.Process | None) -> float:
    """User + system CPU seconds of ``process`` itself (0 when it is gone or None)."""
    try:
        return 0.0 if process is None else sum(process.cpu_times()[:2])
    except psutil.Error:
        return 0.0


def _reaped_children(process: psutil.Process | None) -> float:
    """User + system CPU seconds of the children ``process`` has reaped (its spiders)."""
    try:
        if process is None:
            return 0.0
        times = process.cpu_times()
        return float(times.children_user + times.children_system)
    except psutil.Error:
        return 0.0


def _bench_process() -> float:
    """CPU seconds of this benchmark process (spawner, submitter, waiting loops)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _bench_children() -> float:
    """CPU seconds of this process's reaped children (the bare spawner's commands)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Workload:
    """A command line run from ``cwd``, packaged for the agent as ``package`` (zip bytes)."""

    def __init__(self, name: str, command: list[str], cwd: Path, package: bytes, count: int,
                 framework: str = "python") -> None:
        self.name = name
        self.command = command
        self.cwd = cwd
        self.package = package
        self.count = count
        self.framework = framework


class BareSide:
    """A Trio spawner (``CapacityLimiter(max_workers)`` + ``trio.run_process``, output to /dev/null)."""

    name = "bare"

    def __init__(self, work: Workload, max_workers: int, stamps: Path) -> None:
        self.work = work
        self.max_workers = max_workers
        self.env = {**_scrapyd.minimal_env(), STAMP_DIR_VAR: str(stamps)}

    async def start(self) -> None:
        """Nothing to start."""

    async def stop(self) -> None:
        """Nothing to stop."""

    def cpu(self) -> Cpu:
        """Cumulative CPU: the commands (reaped children) and this spawner (the benchmark process)."""
        return Cpu(spiders=_bench_children(), launcher=_bench_process())

    async def round(self) -> float:
        """Seconds to run ``work.count`` commands, ``max_workers`` at a time, with nothing else."""
        limiter = trio.CapacityLimiter(self.max_workers)
        work = self.work

        async def one(i: int) -> None:
            async with limiter:
                done = await trio.run_process(
                    work.command, cwd=str(work.cwd), env={**self.env, "BENCH_ID": f"bare-{i}"},
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{work.command} exited {done.returncode}")

        started = now()
        async with trio.open_nursery() as nursery:
            for i in range(work.count):
                nursery.start_soon(one, i)
        return now() - started


class AgentSide:
    """A dev master + ``python -m ckagent run`` with ``max_workers``; ``work.count`` spiders."""

    name = "ckagent"

    def __init__(self, workdir: Path, work: Workload, max_workers: int, stamps: Path) -> None:
        self.work = work
        self.stamps = stamps
        label = f"{work.name.split()[0]}-{max_workers}"
        self.master = DevMaster(workdir / f"master-{label}")
        self.agent = AgentProcess(workdir / f"agent-{label}", self.master, max_workers=max_workers,
                                  name=f"bench-{label}")
        self.spiders: list[str] = []

    async def start(self) -> None:
        """Start the master and the agent; create the spiders."""
        await self.master.start()
        await self.agent.start()
        self.spiders = await create_spiders(self.master.admin, self.agent.name, self.work.count, self.work.command,
                                            self.work.package, self.stamps, framework=self.work.framework)

    async def stop(self) -> None:
        """Stop the agent and the master."""
        await self.agent.stop()
        await self.master.stop()

    def cpu(self) -> Cpu:
        """Cumulative CPU: the spiders (reaped by the agent), the agent, the dev master + this submitter."""
        agent = psutil.Process(self.agent.pid)
        master = None if self.master.process is None else psutil.Process(self.master.process.pid)
        return Cpu(spiders=_reaped_children(agent), launcher=_own(agent), platform=_own(master) + _bench_process())

    async def round(self) -> float:
        """Submit one task per spider at once; seconds until the last task's ``finishedAt``."""
        admin = self.master.admin
        started = now()
        ids = await gather([partial(admin.create_task, spider) for spider in self.spiders])
        tasks = await wait_final(admin, ids, 600, interval=0.25)
        check_success(tasks)
        return max(parse_iso(t["finishedAt"]) for t in tasks) - started


class ScrapydSide:
    """Scrapyd with ``max_proc`` = max_workers and the default poll interval; the project's egg deployed."""

    name = "scrapyd"

    def __init__(self, workdir: Path, python: Path, egg: bytes, count: int, max_workers: int) -> None:
        self.egg = egg
        self.count = count
        self.daemon = _scrapyd.Scrapyd(workdir / f"scrapyd-{max_workers}", python, max_proc=max_workers)

    async def start(self) -> None:
        """Start the daemon and deploy the egg."""
        await self.daemon.start()
        await self.daemon.deploy(self.egg)

    async def stop(self) -> None:
        """Stop the daemon."""
        await self.daemon.stop()

    def cpu(self) -> Cpu:
        """Cumulative CPU: the jobs (reaped by the daemon), the daemon, this submitter."""
        daemon = None if self.daemon.process is None else psutil.Process(self.daemon.process.pid)
        return Cpu(spiders=_reaped_children(daemon), launcher=_own(daemon), platform=_bench_process())

    async def round(self) -> float:
        """Schedule ``count`` jobs at once; seconds until the last job's ``end_time``."""
        started = now()
        ids = await gather([self.daemon.schedule] * self.count)
        jobs = await self.daemon.wait_finished(ids, 600)
        return max(j["end"] for j in jobs) - started


Side = BareSide | AgentSide | ScrapydSide


async def timed_round(side: Side) -> tuple[float, Cpu]:
    """One round of ``side``: (span in seconds, CPU seconds spent by role during it)."""
    before = side.cpu()
    span = await side.round()
    return span, side.cpu() - before


async def compare(sides: list[Side], rounds: int) -> tuple[dict[str, list[float]], dict[str, list[Cpu]]]:
    """Start every side, run one warm-up round each, then ``rounds`` rounds taking the sides in
    turn, the order rotating (so a noisy minute hits all of them); returns the timed spans (seconds)
    and the CPU spent in each (by role), by side name, in round order."""
    spans: dict[str, list[float]] = {side.name: [] for side in sides}
    cpus: dict[str, list[Cpu]] = {side.name: [] for side in sides}
    async with contextlib.AsyncExitStack() as stack:
        for side in sides:
            await side.start()
            stack.push_async_callback(side.stop)
        for side in sides:
            await side.round()
        for round_no in range(rounds):
            for i in range(len(sides)):  # the order rotates from round to round
                side = sides[(i + round_no) % len(sides)]
                span, cpu = await timed_round(side)
                spans[side.name].append(span)
                cpus[side.name].append(cpu)
    return spans, cpus


async def run_async(quick: bool, scrapyd: bool = True) -> dict[str, Any]:
    """Every workload × max_workers × side; returns ``{"rows", "table", "target_met", ...}``."""
    rounds = 1 if quick else 5
    rows: list[list[Any]] = []
    worst_ratio = 0.0
    with work_directory("bench-makespan-") as workdir:
        stamps = workdir / "stamps"
        stamps.mkdir()
        empty = workdir / "empty"
        empty.mkdir()
        workloads = [Workload("python -c pass", stamp_command(), empty, zip_files(STAMP_SPIDER), 4 if quick else 16)]
        python: Path | None = None
        egg = b""
        if scrapyd:
            python = await trio.to_thread.run_sync(_scrapyd.ensure_venv)
            project = _scrapyd.write_project(workdir / "scrapy-project")
            egg = await trio.to_thread.run_sync(_scrapyd.build_egg, project, python)
            package = await trio.to_thread.run_sync(zip_directory, project)
            workloads.append(Workload("scrapy noop", _scrapyd.scrapy_command(python), project, package, 8,
                                      framework="scrapy"))
        for work in workloads:
            for workers in WORKER_COUNTS:
                sides: list[Side] = [BareSide(work, workers, stamps), AgentSide(workdir, work, workers, stamps)]
                if python is not None and work.framework == "scrapy":
                    sides.append(ScrapydSide(workdir, python, egg, work.count, workers))
                spans, cpus = await compare(sides, rounds)
                bare_spider = statistics.median(c.spiders for c in cpus["bare"]) / work.count * 1000
                bare_total = bare_spider + statistics.median(c.launcher + c.platform for c in cpus["bare"]) \
                    / work.count * 1000
                for side in sides:
                    mine = spans[side.name]
                    ratio = statistics.median(m / b for m, b in zip(mine, spans["bare"], strict=True))
                    if side.name == "ckagent":
                        worst_ratio = max(worst_ratio, ratio)
                    per_task = [statistics.median(getattr(c, role) for c in cpus[side.name]) / work.count * 1000
                                for role in ("spiders", "launcher", "platform")]
                    floor = (bare_spider + per_task[1] + per_task[2]) / bare_total if bare_total > 0 else math.nan
                    rows.append([work.name, work.count, workers, side.name, statistics.median(mine), min(mine),
                                 max(mine), ratio, *per_task, floor])
    table = markdown_table(["makespan", "tasks", "workers", "side", "median s", "min s", "max s",
                            "× bare (median of rounds)", "spider CPU ms/task", "launcher CPU ms/task",
                            "master+submitter CPU ms/task", "CPU floor ×"], rows)
    return {
        "name": "makespan",
        "table": table,
        "rows": [dict(zip(["workload", "tasks", "workers", "side", "median_s", "min_s", "max_s", "ratio",
                           "spider_cpu_ms", "launcher_cpu_ms", "platform_cpu_ms", "cpu_floor"], r, strict=True))
                 for r in rows],
        "worst_ckagent_ratio": worst_ratio,
        "headline": f"worst ckagent/bare {worst_ratio:.2f}" + "".join(
            f"; {r[0]} ×{r[2]} {r[7]:.2f} (CPU floor {r[11]:.2f})" for r in rows if r[3] == "ckagent"),
        "target": f"ckagent ≤ {TARGET_RATIO:.2f} × bare",
        "target_met": worst_ratio <= TARGET_RATIO,
    }


def run(quick: bool, scrapyd: bool = True) -> dict[str, Any]:
    """Measure makespans (see module docstring); blocking (runs its own Trio loop)."""
    return trio.run(run_async, quick, scrapyd)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.makespan [--quick] [--no-scrapyd]``: print the table."""
    return module_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
