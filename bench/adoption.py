"""Tasks outlive the agent: what it costs per task, and how fast a restarted agent carries on.

Rows:

- ``monitor per task``: 64 (8 with ``--quick``) silent spiders (``sleep``) spawned as the agent spawns
  them (ckagent.containment.monitor.spawn_monitored, in a jail of the level ``auto`` picks); for each monitor (the
  ``/bin/sh`` that outlives the agent): its RSS, its PSS and private memory (``smaps_rollup``: what
  it really adds; its RSS is mostly the shared libc and dash pages) and its context switches over
  10 s (3 s quick) while the spider is silent (= wake-ups).
- ``re-adopt``: a real agent and dev master; 64 (16 quick) running tasks printing a line every 0.5 s;
  ``kill -9`` of the agent, 2 s down, a restart: seconds from the new agent's start to the first line
  the master gets from each task after the restart (p50, max). Then SIGINT (every task cancelled).

Targets (issue 27): per task ≤ 1 MB of memory (PSS) and 0 wake-ups while the spider is silent;
re-adopting 64 tasks ≤ 2 s from start to their first shipped line.
Run: ``python -m bench.adoption [--quick]``.
"""

from __future__ import annotations

import functools
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trio

from bench._harness import AgentProcess, DevMaster, markdown_table, summary, work_directory
from ckagent.containment import Limits, open_containment
from ckagent.containment.monitor import spawn_monitored
from ckagent.devmaster.client import zip_files

TARGET_MEMORY_BYTES = 1 << 20
TARGET_READOPT_SECONDS = 2.0
TICKER = ["sh", "-c", "i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.5; done"]


def _status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in (f"/proc/{pid}/status", f"/proc/{pid}/smaps_rollup"):
        with open(name) as fh:
            for line in fh:
                key, _, value = line.partition(":")
                parts = value.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0])
    return out


async def monitor_cost(quick: bool, directory: Path) -> dict[str, Any]:
    """Spawn silent spiders behind monitors; measure the monitors."""
    count, window = (8, 3.0) if quick else (64, 10.0)
    containment = open_containment("auto", directory)
    mons, jails = [], []
    try:
        for i in range(count):
            task_dir = directory / f"t{i}"
            task_dir.mkdir(parents=True)
            jail = containment.jail(f"bench-{i}", Limits())
            jails.append(jail)
            env = {"PATH": "/usr/bin:/bin", "CK_TASK_ID": f"bench-{i}"}
            mons.append(await trio.to_thread.run_sync(functools.partial(
                spawn_monitored, ["sleep", "600"], cwd=task_dir, env=env, task_id=f"bench-{i}", task_dir=task_dir,
                output_path=task_dir / "output.log", jail=jail, run_as=None, deadline_at=None, work=task_dir,
                stall_timeout=0.0)))
        await trio.sleep(0.5)  # every monitor has forked its spider and sleeps in wait
        before = [_status(m.pid) for m in mons]
        await trio.sleep(window)
        after = [_status(m.pid) for m in mons]
    finally:
        for jail in jails:
            await jail.kill_all()
            jail.close()
        for m in mons:
            if m.proc is not None:
                await m.proc.wait()
        containment.close()
    switches = [(a["voluntary_ctxt_switches"] + a["nonvoluntary_ctxt_switches"])
                - (b["voluntary_ctxt_switches"] + b["nonvoluntary_ctxt_switches"]) for a, b in zip(before, after, strict=True)]
    rss = [a["VmRSS"] * 1024 for a in after]
    pss = [a.get("Pss", 0) * 1024 for a in after]
    private = [(a.get("Private_Clean", 0) + a.get("Private_Dirty", 0)) * 1024 for a in after]
    return {"count": count, "window": window, "level": containment.level.value, "rss": summary(rss),
            "pss": summary(pss), "private": summary(private), "wakeups": max(switches)}


async def readopt(quick: bool, directory: Path) -> dict[str, Any]:
    """kill -9 an agent with running tasks, restart it, time the first shipped line of each task."""
    count = 16 if quick else 64
    master = DevMaster(directory / "master")
    await master.start()
    agent = AgentProcess(directory / "agent", master, max_workers=count, name="bench-adopt",
                         long_poll_wait=2, poll_interval=0.5)
    try:
        await agent.start()
        admin = master.admin
        package = zip_files({"main.py": "# the command is the spider's\n"})
        tasks = []
        for i in range(count):
            spider = await admin.create_spider(name=f"ticker-{i}", framework="python", command=TICKER)
            await admin.upload_package(spider, package)
            tasks.append(await admin.create_task(spider))
        with trio.fail_after(300):
            while True:
                lines = [len(await admin.get_logs(t)) for t in tasks]
                if all(n >= 3 for n in lines):
                    break
                await trio.sleep(0.5)
        assert agent.process is not None
        agent.process.send_signal(signal.SIGKILL)
        await agent.process.wait()
        await trio.sleep(2.0)
        seen = [len(await admin.get_logs(t)) for t in tasks]
        started = trio.current_time()
        first: dict[str, float] = {}
        wall: dict[str, float] = {}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent.start)
            with trio.fail_after(120):
                while len(first) < count:
                    for task_id, before in zip(tasks, seen, strict=True):
                        if task_id not in first and len(await admin.get_logs(task_id)) > before:
                            first[task_id] = trio.current_time() - started
                            wall[task_id] = time.time()
                    await trio.sleep(0.05)
        began = _agent_began(agent.log_path)
        statuses = {t["status"] for t in await admin.list_tasks()}
    finally:
        await agent.stop()
        await master.stop()
    since_began = [wall[t] - began for t in tasks] if began is not None else []
    return {"count": count, "first_line": summary(list(first.values())), "since_began": summary(since_began),
            "statuses": sorted(statuses)}


def _agent_began(log_path: Path) -> float | None:
    """Epoch seconds of the last "ckagent ... starting" line of the agent's log (its own start, after
    the interpreter's start-up and imports), None when there is none."""
    began = None
    for line in log_path.read_text(errors="replace").splitlines():
        if " ckagent.agent: ckagent " in line and " starting: " in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=timezone.utc)
            began = stamp.timestamp()
    return began


async def run_async(quick: bool) -> dict[str, Any]:
    """Both rows; see the module docstring."""
    with work_directory("ck-bench-adoption-") as directory:
        cost = await monitor_cost(quick, directory / "cost")
        adopt = await readopt(quick, directory / "adopt")
    mib = 1024 * 1024
    rows = [
        [f"monitor per task ({cost['count']} silent spiders, {cost['level']})",
         f"RSS p50 {cost['rss']['p50'] / mib:.2f} MiB; PSS p50 {cost['pss']['p50'] / mib:.3f} MiB; "
         f"private p50 {cost['private']['p50'] / mib:.3f} MiB",
         f"{cost['wakeups']} context switches in {cost['window']:g} s (max over monitors)"],
        [f"re-adopt {adopt['count']} running tasks after kill -9",
         f"process start → first shipped line: p50 {adopt['first_line']['p50']:.2f} s, max "
         f"{adopt['first_line']['max']:.2f} s; the agent's start (its log's 'starting' line, after the "
         f"interpreter's start-up) → first shipped line: p50 {adopt['since_began']['p50']:.2f} s, max "
         f"{adopt['since_began']['max']:.2f} s", ""],
    ]
    met = (cost["pss"]["max"] <= TARGET_MEMORY_BYTES and cost["wakeups"] == 0
           and adopt["since_began"]["max"] <= TARGET_READOPT_SECONDS)
    return {
        "table": markdown_table(["row", "figure", "wake-ups"], rows),
        "target": "per task ≤ 1 MB (PSS) and 0 wake-ups while silent; 64 re-adopted ≤ 2 s to the first shipped line",
        "target_met": met,
        "headline": f"monitor PSS {cost['pss']['p50'] / mib:.3f} MiB, {cost['wakeups']} wake-ups; "
                    f"re-adopt max {adopt['since_began']['max']:.2f} s from the agent's start",
        "cost": cost, "adopt": adopt,
    }


def run(quick: bool, scrapyd: bool = False) -> dict[str, Any]:
    """Measure (see module docstring); blocking (runs its own Trio loop)."""
    return trio.run(run_async, quick)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.adoption [--quick]``: print the table."""
    args = sys.argv[1:] if argv is None else argv
    result = run("--quick" in args)
    print(result["table"])
    print(f"target {result['target']}: {'met' if result['target_met'] else 'MISSED'} ({result['headline']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
