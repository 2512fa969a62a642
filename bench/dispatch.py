"""Dispatch latency: task created → spider spawned → its first line ran, one task at a time.

Rows (each a fresh dev master + agent subprocess, or Scrapyd):

- ``bare spawn``: ``time.time()`` → spawn ``python -c <stamp>`` → the stamp: the interpreter's own
  start-up, the floor every launcher pays.
- ``ckagent long poll``: the agent with its default long poll and containment (``auto``: a cgroup
  level where the machine allows one); latency = stamp − the task's ``createdAt`` at the master
  (the same clock: both on this machine). With a master that offers ``claim-in-poll`` (the
  reference master does) the poll answer carries the claim.
- ``ckagent long poll, process-group``: the same with ``task.containment: process-group``: what the
  cgroup level adds to the spawn (the kernel's cgroup migration of the spawned process).
- ``ckagent interval poll``: ``long_poll_wait 0`` and ``poll_interval`` = Scrapyd's default (5 s;
  1 s with ``--quick``), the task submitted at a random phase of the poll cycle.
- ``scrapyd``: ``schedule.json`` → the job's interpreter start (stamped by a ``.pth`` hook in the
  bench venv, i.e. before any Scrapy import), Scrapyd's default poll interval (5 s).

The stamp is the first statement the spider's interpreter runs, in every row. Each task waits for
the previous one to finish, so the agent is idle when the task arrives. The phases table splits each
agent row: created → claimed (the master's long-poll wake-up and the claim, in the poll answer or by
its own request), claimed → taken (the answer's way to the agent and the task's admission: the
result's ``startedAt``), taken → spawned (the agent's preparation: task dir and state, jail, code,
working copy, environment; the spawn = the result's ``finishedAt − runMs``, ±1 ms) and spawned →
first line (exec, joining the jail, the interpreter's start-up).

Targets (issue 18): created → spawned p50 ≤ 4 ms with the long poll; created → first line p50 ≤ 1.3 ×
the bare spawn's p50. Run: ``python -m bench.dispatch [--quick] [--no-scrapyd]``.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from bench import _scrapyd
from bench._harness import (
    STAMP_DIR_VAR,
    STAMP_SPIDER,
    AgentProcess,
    DevMaster,
    create_spiders,
    markdown_table,
    module_main,
    now,
    parse_iso,
    read_stamp,
    stamp_command,
    summary,
    work_directory,
)
from ckagent.devmaster.client import zip_files

TARGET_SPAWNED_P50_SECONDS = 0.004
"""Created → spawned, p50, with the long poll (issue 18)."""
TARGET_FIRST_LINE_OVER_BARE = 1.3
"""Created → first line, p50, at most this many times the bare spawn's p50 (issue 18)."""
SCRAPYD_POLL_INTERVAL = 5.0
"""Scrapyd's default ``poll_interval`` (seconds); the interval-polling agent row uses the same."""


async def _wait_stamp(stamp_dir: Path, key: str, timeout: float) -> float:  # noqa: ASYNC109 - bounds a wait
    with trio.fail_after(timeout):
        while (stamp := read_stamp(stamp_dir, key)) is None:  # noqa: ASYNC110 - a file, no event to wait on
            await trio.sleep(0.01)
    return stamp


async def bare_latency(workdir: Path, count: int) -> list[float]:
    """Seconds from just before the spawn to the stamp of ``python -c <stamp>``, ``count`` times."""
    stamps = workdir / "stamps-bare"
    stamps.mkdir(parents=True, exist_ok=True)
    env = {**_scrapyd.minimal_env(), STAMP_DIR_VAR: str(stamps)}
    latencies = []
    for i in range(count):
        key = f"bare-{i}"
        started = now()
        await trio.run_process(stamp_command(), env={**env, "BENCH_ID": key}, stdout=subprocess.DEVNULL)
        stamp = read_stamp(stamps, key)
        assert stamp is not None, "the stamp process did not write its stamp"
        latencies.append(stamp - started)
    return latencies


async def agent_latency(workdir: Path, count: int, *, long_poll_wait: float, poll_interval: float,
                        label: str, task_settings: dict[str, Any] | None = None) -> dict[str, list[float]]:
    """Run ``count`` tasks one at a time through a real agent; returns latency lists (seconds).

    Keys: ``total`` (createdAt → stamp), ``spawned`` (createdAt → the spawn), and the phases apart:
    ``claim`` (createdAt → claimedAt at the master: the long poll's wake-up, its answer and the claim),
    ``take`` (claimedAt → the final result's startedAt, when the agent's task began: the claim's answer
    and the admission), ``prepare`` (startedAt → the spawn: jail, deploy check, working copy,
    environment, state store; the spawn = the result's finishedAt − runMs) and ``interpreter`` (the
    spawn → stamp). The master's times have millisecond precision (the spawn: ±1 ms).
    """
    stamps = workdir / f"stamps-{label}"
    stamps.mkdir(parents=True, exist_ok=True)
    master = DevMaster(workdir / f"master-{label}")
    await master.start()
    agent = AgentProcess(workdir / f"agent-{label}", master, max_workers=2, name=f"bench-{label}",
                         long_poll_wait=long_poll_wait, poll_interval=poll_interval, **(task_settings or {}))
    out: dict[str, list[float]] = {"total": [], "spawned": [], "claim": [], "take": [], "prepare": [],
                                   "interpreter": []}
    try:
        await agent.start()
        (spider,) = await create_spiders(master.admin, "stamp", 1, stamp_command(), zip_files(STAMP_SPIDER), stamps)
        # Warm-up: the first task of a spider creates its virtualenv.
        warm = await master.admin.create_task(spider)
        await _wait_stamp(stamps, warm, 120)
        await master.admin.wait_task_final(warm, 60)
        for _ in range(count):
            await trio.sleep(random.uniform(0, poll_interval) if not long_poll_wait else random.uniform(0.05, 0.2))
            task_id = await master.admin.create_task(spider)
            stamp = await _wait_stamp(stamps, task_id, poll_interval + 60)
            task = await master.admin.wait_task_final(task_id, 60)
            created = parse_iso(task["createdAt"])
            claimed = parse_iso(task["claimedAt"])
            taken = parse_iso(task["startedAt"])
            spawned = parse_iso(task["finishedAt"]) - task["runMs"] / 1000
            out["total"].append(stamp - created)
            out["spawned"].append(spawned - created)
            out["claim"].append(claimed - created)
            out["take"].append(taken - claimed)
            out["prepare"].append(spawned - taken)
            out["interpreter"].append(stamp - spawned)
    finally:
        await agent.stop()
        await master.stop()
    return out


async def scrapyd_latency(workdir: Path, count: int, python: Path) -> list[float]:
    """``count`` jobs one at a time through Scrapyd (default poll interval); schedule.json → stamp (s)."""
    stamps = workdir / "stamps-scrapyd"
    stamps.mkdir(parents=True, exist_ok=True)
    project = _scrapyd.write_project(workdir / "scrapy-project")
    egg = await trio.to_thread.run_sync(_scrapyd.build_egg, project, python)
    daemon = _scrapyd.Scrapyd(workdir / "scrapyd-dispatch", python, max_proc=2, stamp_dir=stamps)
    latencies = []
    try:
        await daemon.start()
        await daemon.deploy(egg)
        warm = await daemon.schedule()
        await daemon.wait_finished([warm], 120)
        for _ in range(count):
            await trio.sleep(random.uniform(0, SCRAPYD_POLL_INTERVAL))
            started = now()
            job = await daemon.schedule()
            stamp = await _wait_stamp(stamps, job, SCRAPYD_POLL_INTERVAL + 60)
            latencies.append(stamp - started)
            await daemon.wait_finished([job], 120, interval=0.1)
    finally:
        await daemon.stop()
    return latencies


def _phases(latencies: dict[str, list[float]]) -> str:
    p50 = {k: summary(v)["p50"] * 1000 for k, v in latencies.items()}
    return f"created → spawned p50 {p50['spawned']:.1f} ms"


async def run_async(quick: bool, scrapyd: bool = True) -> dict[str, Any]:
    """All rows; returns ``{"rows": [...], "table": markdown, "target_met": bool, ...}`` (seconds)."""
    count = 5 if quick else 30
    interval = 1.0 if quick else SCRAPYD_POLL_INTERVAL
    with work_directory("bench-dispatch-") as workdir:
        bare = summary(await bare_latency(workdir, count))
        long_poll = await agent_latency(workdir, count, long_poll_wait=20.0, poll_interval=interval, label="long")
        grouped = await agent_latency(workdir, count, long_poll_wait=20.0, poll_interval=interval, label="pgroup",
                                      task_settings={"containment": "process-group"})
        polled = await agent_latency(workdir, count, long_poll_wait=0.0, poll_interval=interval, label="interval")
        agents = [("ckagent long poll", long_poll), ("ckagent long poll, process-group", grouped),
                  (f"ckagent interval poll {interval:g} s", polled)]
        sides: list[tuple[str, dict[str, float], str]] = [("bare spawn (python start-up)", bare, "–")]
        sides += [(name, summary(lat["total"]), _phases(lat)) for name, lat in agents]
        if scrapyd:
            python = await trio.to_thread.run_sync(_scrapyd.ensure_venv)
            sides.append((f"scrapyd (poll_interval {SCRAPYD_POLL_INTERVAL:g} s)",
                          summary(await scrapyd_latency(workdir, count, python)), "–"))
    rows = [
        [name, int(s["n"]), s["p50"] * 1000, s["p95"] * 1000, s["max"] * 1000, s["p50"] / bare["p50"], note]
        for name, s, note in sides
    ]
    table = markdown_table(["dispatch: created → first line", "n", "p50 ms", "p95 ms", "max ms",
                            "p50 / bare", "note"], rows)
    phase_keys = ("claim", "take", "prepare", "spawned", "interpreter", "total")
    phase_rows = [[name, *(summary(lat[k])["p50"] * 1000 for k in phase_keys)] for name, lat in agents]
    table += "\n\n" + markdown_table(
        ["phases, p50 ms", "created → claimed", "claimed → taken", "taken → spawned", "created → spawned",
         "spawned → first line", "created → first line"], phase_rows)
    lp50 = summary(long_poll["total"])["p50"]
    spawned50 = summary(long_poll["spawned"])["p50"]
    ratio = lp50 / bare["p50"]
    return {
        "name": "dispatch",
        "table": table,
        "rows": [dict(zip(["side", "n", "p50_ms", "p95_ms", "max_ms", "p50_over_bare", "note"], r, strict=True))
                 for r in rows],
        "long_poll_p50_seconds": lp50,
        "long_poll_spawned_p50_seconds": spawned50,
        "headline": f"created → spawned p50 {spawned50 * 1000:.1f} ms; created → first line p50 "
                    f"{lp50 * 1000:.1f} ms = {ratio:.2f} × bare ({bare['p50'] * 1000:.1f} ms)",
        "long_poll_phases_p50_seconds": {k: summary(v)["p50"] for k, v in long_poll.items()},
        "target": f"created → spawned p50 ≤ {TARGET_SPAWNED_P50_SECONDS * 1000:.0f} ms; created → first line "
                  f"p50 ≤ {TARGET_FIRST_LINE_OVER_BARE:g} × bare spawn (long poll)",
        "target_met": spawned50 <= TARGET_SPAWNED_P50_SECONDS and ratio <= TARGET_FIRST_LINE_OVER_BARE,
    }


def run(quick: bool, scrapyd: bool = True) -> dict[str, Any]:
    """Measure dispatch latency (see module docstring); blocking (runs its own Trio loop)."""
    return trio.run(run_async, quick, scrapyd)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.dispatch [--quick] [--no-scrapyd]``: print the table."""
    return module_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
