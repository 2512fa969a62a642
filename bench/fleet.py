"""Fleet: many agents on one machine against one reference master (issue 39, item 6).

The scenario is tests/harness/fleet.py's (the suite runs it small in tests/test_fleet_one_machine.py):
``--agents`` real agent processes (default 16; each its own work dir, name and status port on
127.0.0.1, 8 slots) against ``ckagent dev-master`` (SQLite) in a process of its own; 2,000 short tasks
(``sh -c`` appending one item: the cheapest task there is, so what is measured is the platform) with
64 long resumable ones spread among them (the SDK's state API, a checkpoint every 2 s). Measured over
the short phase, from the master's own timestamps: tasks/s (first short task created → the last one
finished), created → started p50/p99 (all 2,000 are queued as fast as the admin API takes them: this is the queue's wait, not a
dispatch latency; claimed → started beside it), tasks per node (max/min); CPU seconds of the master,
the agents and their spiders (reaped descendants), and the master's share of them; a py-spy profile
of the master (when the bench venv has py-spy: ``python -m bench.proxy`` installs it). Then 200 more
short tasks are queued and half the fleet is stopped at once — half of it by ``ckagent stop --migrate
-c CONFIG``, half lost (every process of the node SIGKILLed, its work dir deleted); the long crawls
are released once none is left on a stopped node. Every task must end SUCCESS exactly once: one item
per short task, each long crawl's steps 0..n-1 once across its attempts.

The saturation sweep (``--sweep 4,8,16,32``: short tasks only, ``--sweep-tasks`` each) raises the
number of agents and reports tasks/s, the master's CPU per task and its share: where tasks/s stops
growing, and why (bench/results/fleet.md reads the figures).

Run: ``python -m bench.fleet [--quick] [--agents N] [--sweep N,N,...] [--sweep-tasks N]``, or
``python -m bench --only fleet --agents N``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio

from bench._harness import REPO, markdown_table, work_directory
from bench.proxy import Profile, _parse_py_spy

sys.path.insert(0, str(REPO / "tests"))
from harness.fleet import (
    Figures,
    Fleet,
    MasterProcess,
    Scenario,
    _epoch,
    _list,
    admin_client,
    fleet,
    percentile,
)

from ckagent.devmaster.client import zip_files
from ckagent.master.protocol import utc_now_iso

FULL = Scenario()
QUICK = Scenario(agents=4, short_tasks=60, long_tasks=4, short_during_stop=10, max_workers=4, short_spiders=4,
                 long_spiders=4, long_poll_wait=5.0, step_seconds=0.25, min_steps=8, checkpoint_interval=1.0,
                 node_lost_after=3.0, submitters=4)
BENCH_TIMINGS = {"heartbeat_interval": 2.0, "node_lost_after": 8.0}
"""The full run's heartbeats: every 2 s (the agents' default is 30 s; 32 agents beating every second
would be 32 requests/s of the master's), a node lost after 8 s without one."""
IDLE_LEAVES = ("WorkerThread._work ", "Condition.wait ", "Event.wait ")
"""Leaf frames of the master's threads waiting (a thread-cache worker waiting for a job, the WAL
checkpoint thread waiting for its next turn): py-spy samples them as active; left out of the profile
(as bench.proxy leaves out the loop's epoll wait)."""
MAX_SPREAD = 2.0
"""Target: the busiest node ran at most this many times the short tasks of the idlest."""


@dataclass
class SweepPoint:
    """One point of the saturation sweep."""

    agents: int
    figures: Figures


def _py_spy() -> str | None:
    venv = Path.home() / ".cache" / "ckagent-bench" / "scrapy-venv" / "bin" / "py-spy"
    return str(venv) if venv.exists() else shutil.which("py-spy")


class MasterProfile:
    """py-spy recording the master around the short phase (:meth:`profiler`); ``result`` after it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.spy = _py_spy()
        self.result: Profile | None = None

    @asynccontextmanager
    async def profiler(self, pid: int) -> AsyncIterator[object]:
        if self.spy is None:
            yield None
            return
        raw = self.directory / "master-py-spy.txt"
        recorder = await trio.lowlevel.open_process(
            [self.spy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--output", str(raw),
             "--nonblocking"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            await trio.sleep(0.5)  # py-spy attaches
            yield recorder
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(30):
                recorder.send_signal(signal.SIGINT)
                await recorder.wait()
            if recorder.returncode is None:
                recorder.kill()
        if raw.exists():
            busy = [line for line in raw.read_text().splitlines()
                    if not line.rpartition(" ")[0].rsplit(";", 1)[-1].startswith(IDLE_LEAVES)]
            self.result = _parse_py_spy("the master over the short phase", "\n".join(busy), 0.0)


async def _main_run(directory: Path, scenario: Scenario, profile: MasterProfile) -> Figures:
    async with fleet(directory / "fleet", scenario) as running:
        return await running.run(profile.profiler)


async def _sweep_point(directory: Path, scenario: Scenario, tasks: int) -> Figures:
    async with fleet(directory, replace(scenario, long_tasks=0)) as running:
        await running.spiders()
        figures = Figures(agents=scenario.agents, cpus=running_cpus())
        await running.short_phase(figures, tasks, 0)
        await _check_short(running, figures)
        return figures


async def _check_short(running: Fleet, figures: Figures) -> None:
    tasks = await running.tasks()
    figures.problems = [f"task {t['id']}: {t['status']} {t.get('errorCode')}, {t.get('storedItems')} items"
                        for t in tasks.values() if t["status"] != "SUCCESS" or t.get("storedItems") != 1]


def running_cpus() -> int:
    import psutil

    return psutil.cpu_count() or 1


def run(quick: bool, agents: int = 16, sweep: tuple[int, ...] = (), sweep_tasks: int = 1000,
        alone: tuple[int, ...] = (), alone_tasks: int = 3000, herd: tuple[int, ...] = ()) -> dict[str, Any]:
    """The fleet run (module docstring) at ``agents`` agents, then the sweep, then the master alone
    against ``alone`` protocol nodes (counts; 8 slots each, ``alone_tasks`` backlog), then the herd (claim
    transactions per task with ``herd`` idle nodes, 200 tasks at 20/s); the report's figures."""
    scenario = QUICK if quick else replace(FULL, agents=agents, **BENCH_TIMINGS)
    points: list[SweepPoint] = []
    loads: list[LoadPoint] = []
    herds: list[HerdPoint] = []
    with work_directory("ckagent-bench-fleet-") as directory:
        profile = MasterProfile(directory)
        figures = trio.run(_main_run, directory, scenario, profile)
        for i, count in enumerate(sweep):
            point = replace(scenario, agents=count)
            points.append(SweepPoint(count, trio.run(_sweep_point, directory / f"sweep-{i}", point, sweep_tasks)))
        for i, count in enumerate(alone):
            loads.append(trio.run(_master_alone, directory / f"alone-{i}", count, 8, alone_tasks, 64,
                                  scenario.heartbeat_interval))
        for i, count in enumerate(herd):
            (directory / f"herd-{i}").mkdir()
            herds.append(trio.run(_herd, directory / f"herd-{i}", count, 200, 20.0))
    return report(scenario, figures, profile.result, points, loads, herds)


# ------------------------------------------------------------------ the master alone: protocol nodes

@dataclass
class LoadPoint:
    """One run of the protocol nodes against a backlog: the master's own ceiling without agents or spiders."""

    nodes: int
    slots: int
    tasks: int
    tasks_per_second: float
    master_cpu: float
    load_cpu: float
    """CPU seconds of this process (the protocol nodes) over the run."""
    wall: float
    created_to_started_p99: float
    spread: tuple[int, int]


@dataclass
class Tally:
    """Tasks the protocol nodes finished; ``all_done`` is set at ``target``."""

    target: int
    count: int = 0
    all_done: trio.Event = field(default_factory=trio.Event)

    def one(self) -> None:
        self.count += 1
        if self.count >= self.target:
            self.all_done.set()


async def _protocol_node(http: httpx.AsyncClient, token: str, name: str, slots: int, wait: float,
                         heartbeat: float, stop: trio.Event, tally: Tally) -> Counter[str]:
    """One node speaking the protocol as an agent does for a task that writes one item and one log
    line: a long poll that claims (claim-in-poll) as many tasks as it has free slots, then per task a
    logs batch, an items batch and the final result; a heartbeat every ``heartbeat`` seconds. Until
    ``stop``; returns {"tasks": how many it ran}."""
    body = {"name": name, "ip": "127.0.0.1", "port": 9000, "version": "0.1.0", "os": "linux", "arch": "x86_64",
            "python": "3.11", "cpuCount": 2, "memoryTotalBytes": 2**33, "maxWorkers": slots}
    answer = (await http.post("/api/nodes/register", json=body, headers={"X-Registration-Token": token})).json()
    node_id, auth = answer["nodeId"], {"Authorization": f"Bearer {answer['apiKey']}"}
    done: Counter[str] = Counter()
    free = trio.Semaphore(slots)

    async def run_task(task: dict[str, Any]) -> None:
        try:
            path, attempt = f"/api/tasks/{task['id']}", task.get("attempt", 1)
            await http.post(f"{path}/logs", json={"seq": 0, "lines": ["done"], "attempt": attempt}, headers=auth)
            await http.post(f"{path}/items", json={"seq": 0, "items": [{"task": task["id"]}], "attempt": attempt},
                            headers=auth)
            now = utc_now_iso()
            await http.post(f"{path}/result", headers=auth, json={
                "status": "SUCCESS", "exitCode": 0, "startedAt": now, "finishedAt": now, "durationMs": 1,
                "itemCount": 1, "logLines": 1, "attempt": attempt})
            done["tasks"] += 1
            tally.one()
        finally:
            free.release()

    async def beat() -> None:
        while True:
            await trio.sleep(heartbeat)
            await http.post(f"/api/nodes/{node_id}/heartbeat", headers=auth, json={
                "status": "RUNNING", "cpuPercent": 1, "memoryPercent": 1, "diskPercent": 1, "memoryUsedBytes": 1,
                "diskFreeBytes": 2**30, "load1": 0, "runningTaskIds": [], "runningSpiderIds": [],
                "maxWorkers": slots, "freeSlots": free.value, "version": "0.1.0", "uptimeSeconds": 1})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(beat)

        async def until_stopped() -> None:
            await stop.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(until_stopped)
        for poll_id in itertools.count(1):
            await free.acquire()
            count = 1
            while free.value and count < slots:  # every free slot
                free.acquire_nowait()
                count += 1
            answer = (await http.get(f"/api/nodes/{node_id}/tasks/pending", headers=auth, params={
                "limit": count, "claim": count, "pollId": poll_id, "waitSeconds": wait})).json()
            tasks = answer.get("tasks", [])
            for task in tasks:
                nursery.start_soon(run_task, task)
            for _ in range(count - len(tasks)):
                free.release()
    return done


async def _master_alone(directory: Path, nodes: int, slots: int, tasks: int, spiders: int,
                        heartbeat: float) -> LoadPoint:
    """A backlog of ``tasks`` (``spiders`` spiders: a poll claims one task per spider) drained by
    ``nodes`` protocol nodes of ``slots`` slots each, in this process, against a master process."""
    master = MasterProcess(directory, 600.0)
    try:
        base_url = await master.start()
        async with admin_client(base_url, master.admin_token) as admin:
            ids = []
            for i in range(spiders):
                spider = await admin.create_spider(name=f"load-{i}", framework="python", command=["true"])
                await admin.upload_package(spider, zip_files({"main.py": "# runs its command\n"}))
                ids.append(spider)
            limiter = trio.CapacityLimiter(8)

            async def create(i: int) -> None:
                async with limiter:
                    await admin.create_task(ids[i % spiders])

            async with trio.open_nursery() as nursery:
                for i in range(tasks):
                    nursery.start_soon(create, i)
            me = psutil.Process()
            cpu0, master0, began = sum(me.cpu_times()[:2]), master.cpu_seconds(), time.monotonic()
            stop, tally = trio.Event(), Tally(tasks)
            # (idle connections expire before hypercorn's 5 s keep-alive closes them: no reset on reuse)
            limits = httpx.Limits(max_connections=nodes * (slots + 2), max_keepalive_connections=nodes * (slots + 2),
                                  keepalive_expiry=1.0)
            async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as http, \
                    trio.open_nursery() as nursery:
                counts: list[Counter[str]] = []

                async def node(i: int) -> None:
                    counts.append(await _protocol_node(http, master.registration_token, f"load-{i:03d}", slots,
                                                       20.0, heartbeat, stop, tally))

                for i in range(nodes):
                    nursery.start_soon(node, i)
                with trio.fail_after(120 + tasks):
                    await tally.all_done.wait()
                stop.set()
            wall = time.monotonic() - began
            load_cpu, master_cpu = sum(me.cpu_times()[:2]) - cpu0, master.cpu_seconds() - master0
            done = await _list(admin, limit=100_000)
        claimed = [_epoch(t["claimedAt"]) for t in done if t.get("claimedAt")]
        finished = [_epoch(t["finishedAt"]) for t in done if t.get("finishedAt")]
        waits = [_epoch(t["startedAt"]) - _epoch(t["createdAt"]) for t in done if t.get("startedAt")]
        per_node = Counter(str(t.get("nodeId")) for t in done)
        bad = [t for t in done if t["status"] != "SUCCESS" or t.get("storedItems") != 1]
        if bad:
            raise RuntimeError(f"{len(bad)} tasks did not end SUCCESS with one item: {bad[0]}")
        span = max(finished) - min(claimed)
        return LoadPoint(nodes, slots, len(done), len(done) / span, master_cpu, load_cpu, wall,
                         percentile(waits, 99), (max(per_node.values()), min(per_node.values())))
    finally:
        await master.close()


@dataclass
class HerdPoint:
    """Claim transactions per task with ``nodes`` idle protocol nodes and tasks arriving one by one."""

    nodes: int
    rate: float
    tasks: int
    claims_per_task: float


async def _herd(directory: Path, nodes: int, tasks: int, rate: float) -> HerdPoint:
    """The dev master in this process (its Store's ``claim_pending`` counted; SQLite in ``directory``, which
    exists), ``nodes`` protocol nodes of 8 slots holding their long polls, ``tasks`` tasks created one by
    one at ``rate`` per second."""
    from ckagent.devmaster.server import DevMasterConfig, serve
    from ckagent.devmaster.store import Store

    counted = [0]
    original = Store.claim_pending

    def counting(self: Store, *args: Any, **kwargs: Any) -> Any:
        counted[0] += 1
        return original(self, *args, **kwargs)

    config = DevMasterConfig(db_path=directory / "master.sqlite", registration_token=secrets.token_urlsafe(16),
                             admin_token=secrets.token_urlsafe(16), port=0)
    Store.claim_pending = counting  # type: ignore[method-assign]
    try:
        async with trio.open_nursery() as nursery:
            base_url = await nursery.start(serve, config)
            limits = httpx.Limits(max_connections=nodes * 10, keepalive_expiry=1.0)
            async with admin_client(base_url, config.admin_token) as admin, \
                    httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as http:
                spiders = []
                for i in range(16):
                    spider = await admin.create_spider(name=f"herd-{i}", framework="python", command=["true"])
                    await admin.upload_package(spider, zip_files({"main.py": "# runs its command\n"}))
                    spiders.append(spider)
                stop, tally = trio.Event(), Tally(tasks)
                async with trio.open_nursery() as load:
                    for i in range(nodes):
                        load.start_soon(_protocol_node, http, config.registration_token, f"herd-{i:03d}", 8, 20.0,
                                        2.0, stop, tally)
                    await trio.sleep(2.0)  # registered, polls held
                    counted[0] = 0
                    for i in range(tasks):
                        await admin.create_task(spiders[i % len(spiders)])
                        await trio.sleep(1 / rate)
                    with trio.fail_after(60 + tasks):
                        await tally.all_done.wait()
                    claims = counted[0]
                    stop.set()
            nursery.cancel_scope.cancel()
    finally:
        Store.claim_pending = original  # type: ignore[method-assign]
    return HerdPoint(nodes, rate, tasks, claims / tasks)


def _ms(seconds: float) -> str:
    return "–" if math.isnan(seconds) else f"{seconds * 1e3:,.0f} ms"


def _s(seconds: float) -> str:
    return "–" if math.isnan(seconds) else f"{seconds:,.2f} s"


def report(scenario: Scenario, figures: Figures, profile: Profile | None,
           points: list[SweepPoint], loads: Sequence[LoadPoint] = (), herds: Sequence[HerdPoint] = ()) -> dict[str, Any]:
    """The module's result: ``table`` (Markdown), ``target``, ``target_met``, ``headline`` and the figures."""
    most, least = figures.spread
    spread_ok = least > 0 and most / least <= MAX_SPREAD
    once = not figures.problems
    per_task = figures.master_cpu / figures.short_tasks if figures.short_tasks else math.nan
    rows: list[list[Any]] = [
        ["agents × slots", f"{scenario.agents} × {scenario.max_workers} (heartbeat {scenario.heartbeat_interval:g} s, "
                           f"long poll {scenario.long_poll_wait:g} s)"],
        ["tasks", f"{figures.short_tasks:,} short ({scenario.short_spiders} spiders, `sh -c` one item) + "
                  f"{scenario.long_tasks} long (resumable, checkpoint every {scenario.checkpoint_interval:g} s), "
                  f"queued in {figures.submit_span:.1f} s"],
        ["master tasks/s (first created → last finished)", f"{figures.tasks_per_second:.1f} "
                                                           f"({figures.short_tasks:,} in {figures.short_span:.1f} s)"],
        ["created → started p50 / p99 / max (the queue's wait: queued as fast as the admin API takes them)",
         f"{_s(figures.created_to_started['p50'])} / {_s(figures.created_to_started['p99'])} / "
         f"{_s(figures.created_to_started['max'])}"],
        ["claimed → started p50 / p99", f"{_ms(figures.claimed_to_started['p50'])} / "
                                        f"{_ms(figures.claimed_to_started['p99'])}"],
        ["short tasks per node max / min", f"{most} / {least} ({'met' if spread_ok else 'MISSED'}: ≤ {MAX_SPREAD:g}×)"],
        ["CPU over the short phase: master / agents / spiders (s)",
         f"{figures.master_cpu:.1f} / {figures.agents_cpu:.1f} / {figures.spiders_cpu:.1f} "
         f"(machine busy {figures.machine_cpu:.1f} of {figures.phase_wall * figures.cpus:.1f} core-s)"],
        ["master CPU per task; master's share of the fleet's CPU",
         f"{per_task * 1e3:.1f} ms; {figures.master_share:.0%} "
         f"(master at {figures.master_cpu / figures.phase_wall if figures.phase_wall else math.nan:.0%} of one core)"],
        ["half the fleet stopped", f"migrated {', '.join(figures.stopped_migrate)}; lost {', '.join(figures.stopped_lost)} "
                                   f"(long crawls on them: {sum(figures.long_on_stopped.values())})"],
        ["`ckagent stop --migrate` exit codes (command, agent)", ", ".join(f"{a}/{b}" for a, b in figures.migrate_codes)],
        ["long crawls moved (earlier attempts' end)", ", ".join(f"{k} {v}" for k, v in sorted(figures.moved.items()))
         or "none"],
        ["tasks with a second attempt: short before the stop / queued at the stop / long",
         f"{figures.attempts.get('short', 0)} / {figures.attempts.get('stop-wave', 0)} / {figures.attempts.get('long', 0)}"],
        ["stop → every task final (long crawls released once moved)", _s(figures.stop_to_done)],
        ["exactly once (SUCCESS; 1 item per short task; long steps 0..n-1 once)",
         "yes" if once else f"NO: {len(figures.problems)} problems: " + "; ".join(figures.problems[:3])],
    ]
    table = markdown_table(["figure", "value"], rows)
    if points:
        sweep_rows = [[p.agents, f"{p.figures.short_tasks:,}", f"{p.figures.tasks_per_second:.1f}",
                       _s(p.figures.created_to_started["p99"]),
                       f"{p.figures.master_cpu / p.figures.short_tasks * 1e3:.1f}",
                       f"{p.figures.master_cpu / p.figures.phase_wall:.0%}" if p.figures.phase_wall else "–",
                       f"{p.figures.master_share:.0%}",
                       f"{p.figures.machine_cpu / (p.figures.phase_wall * p.figures.cpus):.0%}"
                       if p.figures.phase_wall else "–",
                       "/".join(map(str, p.figures.spread)), "yes" if not p.figures.problems else "NO"]
                      for p in points]
        table += "\nSaturation sweep (short tasks only, queued as fast as the admin API takes them):\n\n" + markdown_table(
            ["agents", "tasks", "tasks/s", "created → started p99", "master CPU ms/task", "master % of a core",
             "master share of fleet CPU", "machine busy", "max/min per node", "exactly once"], sweep_rows)
    if loads:
        load_rows = [[p.nodes, p.slots, f"{p.tasks:,}", f"{p.tasks_per_second:.0f}", _s(p.created_to_started_p99),
                      f"{p.master_cpu / p.tasks * 1e3:.1f}", f"{p.master_cpu / p.wall:.0%}",
                      f"{p.load_cpu / p.tasks * 1e3:.1f}", "/".join(map(str, p.spread))] for p in loads]
        table += ("\nThe master alone (protocol nodes in the benchmark's process: a poll that claims, a logs batch,"
                  " an items batch and the result per task; a backlog queued first):\n\n" + markdown_table(
                      ["nodes", "slots", "tasks", "tasks/s", "created → started p99", "master CPU ms/task",
                       "master % of a core", "nodes' CPU ms/task", "max/min per node"], load_rows))
    if herds:
        table += ("\nThe long polls' herd (the dev master in the benchmark's process, its claim transactions counted;"
                  " idle protocol nodes, tasks created one by one):\n\n" + markdown_table(
                      ["nodes", "tasks", "rate /s", "claim transactions per task"],
                      [[h.nodes, h.tasks, f"{h.rate:g}", f"{h.claims_per_task:.1f}"] for h in herds]))
    if profile is not None:
        table += (f"\nWhere the master's CPU went (py-spy, {profile.samples:,} samples; self %, inclusive %):\n\n"
                  + markdown_table(["function", "self %", "incl. %"], profile.rows[:15])
                  + "\nBy package (self %):\n\n" + markdown_table(["package", "self %"], profile.packages))
    return {
        "table": table,
        "target": f"every task exactly once after half the fleet stopped; max/min per node ≤ {MAX_SPREAD:g}",
        "target_met": once and spread_ok,
        "headline": f"{figures.tasks_per_second:.1f} tasks/s, p99 created→started {_s(figures.created_to_started['p99'])}, "
                    f"max/min {most}/{least}, master {figures.master_share:.0%} of fleet CPU",
        "tasks_per_second": figures.tasks_per_second,
        "created_to_started": figures.created_to_started,
        "per_node": figures.per_node,
        "problems": figures.problems,
        "sweep": {p.agents: p.figures.tasks_per_second for p in points},
        "alone": {p.nodes: p.tasks_per_second for p in loads},
        "herd": {h.nodes: h.claims_per_task for h in herds},
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.fleet``: run and print the table."""
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-scrapyd", action="store_true", help="(ignored: no Scrapy here)")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--sweep", default="", help="comma-separated agent counts for the saturation sweep")
    parser.add_argument("--sweep-tasks", type=int, default=1000)
    parser.add_argument("--alone", default="", help="comma-separated protocol-node counts: the master alone")
    parser.add_argument("--alone-tasks", type=int, default=3000)
    parser.add_argument("--herd", default="", help="comma-separated idle-node counts: claim transactions per task")
    args = parser.parse_args(argv)
    sweep = tuple(int(n) for n in args.sweep.split(",") if n)
    alone = tuple(int(n) for n in args.alone.split(",") if n)
    herd = tuple(int(n) for n in args.herd.split(",") if n)
    result = run(args.quick, args.agents, sweep, args.sweep_tasks, alone, args.alone_tasks, herd)
    print(result["table"])
    print(f"target {result['target']}: {'met' if result['target_met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
