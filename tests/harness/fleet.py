"""A fleet on one machine (issue 39, item 6): many real agents against one reference master, the master's
figures, and half the fleet stopped mid-run.

:class:`Fleet` starts the reference master as a process of its own (``python -m ckagent dev-master``,
SQLite, ``--node-lost-after`` short, in a session of its own so psutil measures it alone) and ``agents``
real agent processes (:class:`harness.core.AgentProcess`: each its own directory, work dir, name
``fleet-NN``, a free status port, all on 127.0.0.1), at the levels ``auto`` picks here. It lays out two
kinds of spiders:

- short ones (:data:`SHORT_COMMAND`): ``sh -c`` appends one item naming the task to ``CK_ITEMS_FILE``
  and exits — as cheap as a task can be, so what is measured is the platform;
- long ones (:data:`LONG_SPIDER`, the SDK's state API as sdk/examples/python_resume uses it): one item
  per step (``{"task", "step", "attempt"}``) under ``state_lock``, the next step the state that travels
  with the task; it checkpoints every ``checkpoint_interval`` seconds and ends once it made
  ``min_steps`` steps *and* the release file (:meth:`Fleet.release`) exists — so the test, not a
  clock, decides when the long crawls may end (after the half of the fleet that leaves has left).

:meth:`Fleet.run` is the whole scenario (:class:`Scenario` its sizes): the short tasks queued, the long
ones spread among them; every short one ends (the figures: :class:`Figures`); a few more short ones queued, then half the
fleet stopped while they and the long crawls run — a quarter by ``ckagent stop --migrate -c CONFIG``,
a quarter lost (the agent and every process of its tasks SIGKILLed, its work dir deleted:
harness.nodekill) —; the long crawls released once none is left on a stopped node; every task final.
:func:`problems` lists what broke "exactly once": a task not SUCCESS, a short task with other than one
item or an earlier attempt that ended other than by a disruption (NODE_LOST, MIGRATED), a long crawl
whose steps are not 0..n-1 each once.

Cleanup: :func:`fleet` is an async context manager that, whatever happens, SIGKILLs every process of
every node (harness.nodekill.kill_node: agents, monitors, spiders, cgroups) and the master's whole
process group, bounded; the work dirs go with the test's temp dir.
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio

from ckagent.devmaster.client import AdminClient, zip_files
from harness.core import AgentProcess
from harness.identities import spider_reachable
from harness.nodekill import kill_node

__all__ = ["LONG_SPIDER", "SHORT_COMMAND", "Figures", "Fleet", "Profiler", "Scenario", "fleet", "percentile",
           "problems"]

SHORT_COMMAND = ["sh", "-c", 'printf \'{"task":"%s"}\\n\' "$CK_TASK_ID" >>"$CK_ITEMS_FILE"']
"""A short task: one item naming its task, no interpreter started."""

LONG_SPIDER = '''\
"""A long, resumable task: one item per step; the next step is its state (the fleet harness)."""
import os, sys, time
import crawlerkeeper_sdk as ck

context = ck.task_context()
params = context.params
step_seconds = float(params.get("step_seconds", 0.2))
min_steps = int(params.get("min_steps", 10))
release = params["release_file"]
state = ck.load_state({"next": 0})
leaving = []
ck.on_persist(lambda: {"next": state["next"]})
ck.on_migrating(lambda seconds_left: leaving.append(time.monotonic()))
print(f"attempt {context.attempt}: from step {state['next']}", flush=True)
while state["next"] < min_steps or not os.path.exists(release):
    if leaving and time.monotonic() < leaving[-1] + 60:
        time.sleep(0.2)  # the agent stops us soon: no new step (the next attempt makes it)
        continue
    time.sleep(step_seconds)
    with ck.state_lock():  # the item and the state that accounts for it, never one without the other
        ck.save_item({"task": os.environ["CK_TASK_ID"], "step": state["next"], "attempt": context.attempt})
        state["next"] += 1
print(f"done: {state['next']} steps", flush=True)
'''
"""The long spider's main.py (task params: ``step_seconds``, ``min_steps``, ``release_file``)."""

FINAL = ("SUCCESS", "FAILED", "CANCELLED")

Profiler = Callable[[int], AbstractAsyncContextManager[object]]
"""A profiler of the master's process (its pid), entered around the short phase (:meth:`Fleet.run`)."""


@dataclass(frozen=True)
class Scenario:
    """The sizes of one fleet run (the issue's: 16 agents, 2,000 short and 64 long tasks)."""

    agents: int = 16
    short_tasks: int = 2000
    long_tasks: int = 64
    short_during_stop: int = 200
    """Short tasks queued just before half the fleet stops (they run while it leaves)."""
    max_workers: int = 8
    short_spiders: int = 8
    long_spiders: int = 16
    long_poll_wait: float = 20.0
    step_seconds: float = 0.5
    min_steps: int = 10
    checkpoint_interval: float = 2.0
    heartbeat_interval: float = 1.0
    """The agents' heartbeat interval (their default is 30 s; a lost node is noticed after node_lost_after)."""
    node_lost_after: float = 4.0
    memory_limit_bytes: int = 256 * 2**20
    """Each task's memory bound (enforced at the cgroup levels)."""
    submitters: int = 8
    """Concurrent task submissions (the admin API)."""


@dataclass
class Figures:
    """What one run measured (times in seconds; ``cpu`` in CPU seconds)."""

    agents: int = 0
    short_tasks: int = 0
    short_span: float = 0.0
    """First short task created → the last one finished (the master's timestamps)."""
    tasks_per_second: float = 0.0
    submit_span: float = 0.0
    created_to_started: dict[str, float] = field(default_factory=dict)
    """p50/p99/max of created → started of the short tasks' first attempts (the master's timestamps)."""
    claimed_to_started: dict[str, float] = field(default_factory=dict)
    per_node: dict[str, int] = field(default_factory=dict)
    """Short tasks (first attempts, before the stop) per node name."""
    master_cpu: float = 0.0
    agents_cpu: float = 0.0
    spiders_cpu: float = 0.0
    """CPU seconds of the agents' reaped descendants (spiders, monitors, installers) over the short phase."""
    machine_cpu: float = 0.0
    """Busy CPU seconds of the whole machine (every core, every user) over the short phase."""
    phase_wall: float = 0.0
    """Seconds from the first submission until every short task was seen final."""
    cpus: int = 0
    stopped_migrate: list[str] = field(default_factory=list)
    stopped_lost: list[str] = field(default_factory=list)
    migrate_codes: list[tuple[int, int]] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    """{"short"/"long"/"stop-wave": number of tasks with more than one attempt}. A short task queued before
    the stop runs twice only when the master gave its node up while it ran (a late heartbeat: the
    machine starved of CPU past ``node_lost_after``): :attr:`reruns` says why, :func:`problems` holds it."""
    long_steps: dict[str, int] = field(default_factory=dict)
    reruns: dict[str, int] = field(default_factory=dict)
    """How the earlier attempts of short tasks run twice ended ({errorCode: count}: disruptions only)."""
    long_on_stopped: dict[str, int] = field(default_factory=dict)
    """Long crawls running on each stopped node when it was stopped."""
    long_resumed: int = 0
    """Long crawls that ended on another node than they started on."""
    moved: dict[str, int] = field(default_factory=dict)
    """How the earlier attempts of the long crawls ended ({errorCode: count}: MIGRATED, NODE_LOST)."""
    stop_to_done: float = 0.0
    """Half the fleet stopped → every task final (the release waits for the resumptions)."""
    problems: list[str] = field(default_factory=list)

    @property
    def spread(self) -> tuple[int, int]:
        """(max, min) short tasks per node over the nodes that ran any (a node that ran none counts 0)."""
        counts = list(self.per_node.values()) or [0]
        return max(counts), min(counts)

    @property
    def fleet_cpu(self) -> float:
        """CPU seconds of the master, the agents and their spiders over the short phase."""
        return self.master_cpu + self.agents_cpu + self.spiders_cpu

    @property
    def master_share(self) -> float:
        """The master's share of the fleet's CPU over the short phase (0..1)."""
        return self.master_cpu / self.fleet_cpu if self.fleet_cpu else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q ≤ 100) of ``values``; nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def admin_client(base_url: str, admin_token: str) -> AdminClient:
    """An AdminClient whose idle connections expire after 1 s: hypercorn closes a connection idle for 5 s,
    and a request sent on one at that moment fails with "connection reset" (the fleet's admin client
    idles while half the fleet stops)."""
    admin = AdminClient(base_url, admin_token)
    original = admin._http
    admin._http = httpx.AsyncClient(base_url=original.base_url, headers=original.headers, timeout=original.timeout,
                                    limits=httpx.Limits(keepalive_expiry=1.0))
    return admin


async def _list(admin: AdminClient, **query: Any) -> list[dict[str, Any]]:
    """``GET /api/tasks`` with ``query`` (status, limit: the AdminClient's list stops at the default 1,000)."""
    tasks: list[dict[str, Any]] = (await admin._call("GET", "/api/tasks", params=query)).json()
    return tasks


def _busy() -> float:
    """Busy CPU seconds of the whole machine so far (every core; idle and iowait left out)."""
    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


def _epoch(text: str | None) -> float:
    assert text, "a timestamp the master should have set"
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class MasterProcess:
    """``python -m ckagent dev-master`` on 127.0.0.1, a free port, SQLite in ``directory``; its own session."""

    def __init__(self, directory: Path, node_lost_after: float) -> None:
        self.directory = directory
        self.node_lost_after = node_lost_after
        self.registration_token = secrets.token_urlsafe(16)
        self.admin_token = secrets.token_urlsafe(16)
        self.base_url = ""
        self.process: trio.Process | None = None

    async def start(self) -> str:
        """Start it and wait (≤ 30 s) for its "listening on URL" line; returns the URL."""
        self.directory.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "DEVMASTER_"))}
        env.update(DEVMASTER_REGISTRATION_TOKEN=self.registration_token, DEVMASTER_ADMIN_TOKEN=self.admin_token)
        with (self.directory / "master.log").open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "ckagent", "dev-master", "--db", str(self.directory / "master.sqlite"),
                 "--port", "0", "--node-lost-after", str(self.node_lost_after)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        assert self.process.stdout is not None
        line = b""
        with trio.move_on_after(30):
            while True:
                chunk = await self.process.stdout.receive_some(4096)
                line += chunk
                if not chunk or b"\n" in line:
                    break
        text = line.decode(errors="replace")
        if "listening on " not in text:
            raise RuntimeError(f"the dev master did not start: {text!r}; see {self.directory / 'master.log'}")
        self.base_url = text.split("listening on ", 1)[1].split()[0]
        return self.base_url

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the master has used so far."""
        assert self.process is not None
        times = psutil.Process(self.process.pid).cpu_times()
        return float(times.user + times.system)

    async def close(self) -> None:
        """SIGKILL its process group and reap it (idempotent, bounded)."""
        if self.process is None:
            return
        if self.process.returncode is None:
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        with trio.move_on_after(10):
            await self.process.wait()
        if self.process.stdout is not None:
            await self.process.stdout.aclose()


@dataclass
class FleetNode:
    """One agent of the fleet."""

    name: str
    agent: AgentProcess

    @property
    def work_dir(self) -> Path:
        return self.agent.directory / "data"


async def _bounded(calls: Sequence[Callable[[], Awaitable[Any]]], limit: int) -> list[Any]:
    """Run the calls with at most ``limit`` at a time; their results in order (the first error cancels the rest)."""
    results: list[Any] = [None] * len(calls)
    limiter = trio.CapacityLimiter(limit)

    async def one(i: int) -> None:
        async with limiter:
            results[i] = await calls[i]()

    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(one, i)
    return results


class Fleet:
    """A master and ``scenario.agents`` nodes in ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path, scenario: Scenario) -> None:
        self.directory = spider_reachable(directory)
        self.scenario = scenario
        self.master = MasterProcess(directory / "master", scenario.node_lost_after)
        self.nodes: list[FleetNode] = []
        self.admin: AdminClient | None = None
        self.release_file = directory / "release"
        self.short_spiders: list[str] = []
        self.long_spiders: list[str] = []
        self.node_names: dict[str, str] = {}
        """The master's node id → the node's name."""

    async def start(self) -> None:
        """Start the master and every agent; return once every node registered and beat (bounded)."""
        s = self.scenario
        base_url = await self.master.start()
        self.admin = admin_client(base_url, self.master.admin_token)
        for i in range(s.agents):
            name = f"fleet-{i:02d}"
            directory = self.directory / name
            directory.mkdir()
            agent = AgentProcess(directory, base_url, self.master.registration_token, agent__name=name,
                                 agent__max_workers=s.max_workers, task__long_poll_wait=s.long_poll_wait,
                                 task__memory_limit_bytes=s.memory_limit_bytes,
                                 heartbeat__interval=s.heartbeat_interval,
                                 deps__uv_index_url="http://127.0.0.1:9/simple")
            self.nodes.append(FleetNode(name, agent))
        for node in self.nodes:
            await node.agent.start()
        wanted = {node.name for node in self.nodes}
        with trio.fail_after(60 + 3 * s.agents):
            while True:
                for node in self.nodes:
                    assert node.agent.process is not None
                    if node.agent.process.returncode is not None:
                        raise AssertionError(f"{node.name} exited with {node.agent.process.returncode}:\n"
                                             + node.agent.log_text()[-3000:])
                listed = await self.admin.list_nodes()
                beating = {n["name"] for n in listed if n.get("lastHeartbeat")}
                if wanted <= beating:
                    self.node_names = {str(n["id"]): str(n["name"]) for n in listed}
                    return
                await trio.sleep(0.2)

    async def spiders(self) -> None:
        """Create the short and the long spiders and upload their packages."""
        admin = self.require_admin()
        short = zip_files({"main.py": "# the task runs its command (sh -c)\n"})
        long = zip_files({"main.py": LONG_SPIDER})
        for i in range(self.scenario.short_spiders):
            spider = await admin.create_spider(name=f"short-{i}", framework="python", command=SHORT_COMMAND)
            await admin.upload_package(spider, short)
            self.short_spiders.append(str(spider))
        for i in range(self.scenario.long_spiders):
            spider = await admin.create_spider(name=f"long-{i}", framework="python", command=["python", "main.py"])
            await admin.upload_package(spider, long)
            self.long_spiders.append(str(spider))

    def require_admin(self) -> AdminClient:
        assert self.admin is not None, "start() first"
        return self.admin

    async def submit(self, short: int, long: int = 0) -> tuple[list[str], list[str]]:
        """Queue ``short`` short tasks and ``long`` long ones (each kind round robin over its spiders), the
        long ones spread evenly among the short ones: a node claims as many tasks as it has free slots in
        one poll answer, so long tasks queued in a row would fill the first nodes' slots. Returns
        (short ids, long ids)."""
        admin = self.require_admin()
        s = self.scenario
        params = {"step_seconds": s.step_seconds, "min_steps": s.min_steps, "release_file": str(self.release_file)}

        def short_task(i: int) -> Callable[[], Awaitable[str]]:
            return lambda: admin.create_task(self.short_spiders[i % len(self.short_spiders)])

        def long_task(i: int) -> Callable[[], Awaitable[str]]:
            return lambda: admin.create_task(self.long_spiders[i % len(self.long_spiders)], params=params,
                                             checkpoint_interval_seconds=s.checkpoint_interval)

        order: list[tuple[str, Callable[[], Awaitable[str]]]] = [("short", short_task(i)) for i in range(short)]
        for i in reversed(range(long)):
            order.insert(i * (short + long) // max(1, long), ("long", long_task(i)))
        ids = await _bounded([call for _, call in order], s.submitters)
        kinds = [kind for kind, _ in order]
        return ([str(t) for t, k in zip(ids, kinds, strict=True) if k == "short"],
                [str(t) for t, k in zip(ids, kinds, strict=True) if k == "long"])

    async def tasks(self) -> dict[str, dict[str, Any]]:
        """Every task at the master, by id."""
        return {str(t["id"]): t for t in await _list(self.require_admin(), limit=100_000)}

    async def wait_final(self, ids: Sequence[str], bound: float, what: str) -> dict[str, dict[str, Any]]:
        """Wait until every task of ``ids`` is final; returns every task. Polls once a second what costs the
        master little: one PENDING task (any is the fleet's), then the RUNNING ones (at most the fleet's slots)."""
        admin = self.require_admin()
        wanted = set(ids)
        left: set[str] = wanted
        with trio.move_on_after(bound):
            while True:
                pending = await _list(admin, status="PENDING", limit=1)
                if not pending:
                    left = wanted & {str(t["id"]) for t in await _list(admin, status="RUNNING", limit=100_000)}
                    if not left:
                        return await self.tasks()
                await trio.sleep(1)
        raise AssertionError(f"{what}: tasks not final after {bound:g} s (pending left: {bool(pending)}, "
                             f"running: {len(left)})")

    def agents_cpu(self) -> tuple[float, float]:
        """CPU seconds used so far by the live agent processes: (their own, their reaped descendants': the
        spiders, monitors and installers)."""
        own = children = 0.0
        for node in self.nodes:
            process = node.agent.process
            if process is not None and process.returncode is None:
                try:
                    times = psutil.Process(process.pid).cpu_times()
                except psutil.Error:
                    continue
                own += times.user + times.system
                children += times.children_user + times.children_system
        return own, children

    async def release(self) -> None:
        """Let the long crawls end (once each has made its ``min_steps``)."""
        self.release_file.write_text("go\n")
        self.release_file.chmod(0o644)

    async def migrate(self, node: FleetNode) -> tuple[int, int]:
        """``ckagent stop --migrate -c <config>``; (its exit code, the agent's), bounded."""
        with trio.fail_after(120):
            done = await trio.run_process(
                [sys.executable, "-m", "ckagent", "stop", "--migrate", "-c", str(node.agent.config_path)],
                stdin=subprocess.DEVNULL, capture_stdout=True, stderr=subprocess.STDOUT, check=False,
                env={k: v for k, v in os.environ.items() if not k.startswith("AGENT_")})
            return done.returncode, await node.agent.wait()

    async def lose(self, node: FleetNode) -> None:
        """Everything of the node SIGKILLed at once, its work dir deleted."""
        await kill_node(node.agent.process, node.work_dir)

    async def close(self) -> None:
        """Kill whatever of the fleet still runs (shielded, bounded): every node, then the master."""
        with trio.CancelScope(shield=True), trio.move_on_after(60):
            async with trio.open_nursery() as nursery:
                for node in self.nodes:
                    nursery.start_soon(lambda n=node: kill_node(n.agent.process, n.work_dir, delete=False))
            if self.admin is not None:
                await self.admin.aclose()
            await self.master.close()

    async def run(self, profile: Profiler | None = None) -> Figures:
        """The scenario of the module docstring; returns its figures (:func:`problems` lists what broke).
        ``profile(master_pid)``, when given, is entered around the short phase (a profiler of the master)."""
        s = self.scenario
        figures = Figures(agents=s.agents, short_tasks=s.short_tasks, cpus=psutil.cpu_count() or 1)
        await self.spiders()
        short_ids, long_ids = await self.short_phase(figures, s.short_tasks, s.long_tasks, profile)
        await self._wait_checkpointed(long_ids)
        wave, _ = await self.submit(s.short_during_stop)
        await self._stop_half(figures, long_ids)
        stopped_at = time.monotonic()
        await self._release_when_moved(long_ids, figures)
        tasks = await self.wait_final([*short_ids, *long_ids, *wave], 120 + 2 * s.long_tasks, "after the stop")
        figures.stop_to_done = time.monotonic() - stopped_at
        figures.problems = await problems(self.require_admin(), tasks, short_ids, long_ids, wave, figures)
        return figures

    async def short_phase(self, figures: Figures, short: int, long: int,
                          profile: Profiler | None = None) -> tuple[list[str], list[str]]:
        """Queue ``short`` short tasks and ``long`` long ones (spread among them), wait until every short
        one is final and fill ``figures`` with what the phase measured; (short ids, long ids)."""
        async with AsyncExitStack() as stack:
            if profile is not None:
                assert self.master.process is not None
                await stack.enter_async_context(profile(self.master.process.pid))
            machine0, master0, (agents0, spiders0) = _busy(), self.master.cpu_seconds(), self.agents_cpu()
            began = time.monotonic()
            short_ids, long_ids = await self.submit(short, long)
            figures.submit_span = time.monotonic() - began
            tasks = await self.wait_final(short_ids, 60 + short, "the short tasks")
            figures.phase_wall = time.monotonic() - began
            figures.machine_cpu = _busy() - machine0
            figures.master_cpu = self.master.cpu_seconds() - master0
            agents1, spiders1 = self.agents_cpu()
            figures.agents_cpu, figures.spiders_cpu = agents1 - agents0, spiders1 - spiders0
        figures.short_tasks = short
        self._short_figures(figures, [tasks[t] for t in short_ids])
        return short_ids, long_ids

    def _short_figures(self, figures: Figures, short: list[dict[str, Any]]) -> None:
        created = [_epoch(t["createdAt"]) for t in short]
        finished = [_epoch(t["finishedAt"]) for t in short if t.get("finishedAt")]
        figures.short_span = max(finished) - min(created) if finished else math.nan
        figures.tasks_per_second = len(finished) / figures.short_span if figures.short_span else math.nan
        first = [t for t in short if t.get("startedAt") and t.get("attempt") == 1]
        waits = [_epoch(t["startedAt"]) - _epoch(t["createdAt"]) for t in first]
        claims = [_epoch(t["startedAt"]) - _epoch(t["claimedAt"]) for t in first if t.get("claimedAt")]
        figures.created_to_started = {"p50": percentile(waits, 50), "p99": percentile(waits, 99),
                                      "max": max(waits, default=math.nan)}
        figures.claimed_to_started = {"p50": percentile(claims, 50), "p99": percentile(claims, 99)}
        counts = Counter(self.node_names.get(str(t.get("nodeId")), str(t.get("nodeId"))) for t in first)
        figures.per_node = {node.name: counts.get(node.name, 0) for node in self.nodes}

    async def _wait_checkpointed(self, long_ids: list[str]) -> None:
        """Wait until every long crawl runs and has a checkpoint at the master (a lost node's crawl then
        resumes from one)."""
        admin = self.require_admin()
        with trio.fail_after(120 + self.scenario.long_tasks):
            waiting = set(long_ids)
            while True:
                views = await _bounded([lambda t=t: admin.get_task(t) for t in sorted(waiting)], 4)
                waiting = {str(v["id"]) for v in views if v.get("status") != "RUNNING" or not v.get("checkpoint")}
                if not waiting:
                    return
                await trio.sleep(1)

    async def _stop_half(self, figures: Figures, long_ids: list[str]) -> None:
        """Half the fleet stopped at the same moment: half of that half migrated (``ckagent stop --migrate``;
        an odd half migrates one more), the rest lost. The nodes running the most long crawls are chosen,
        by turns (lost, migrated, lost, ...), so that both roads move crawls."""
        half = max(2, self.scenario.agents // 2)
        quota = {"migrate": half - half // 2, "lost": half // 2}
        tasks = await self.tasks()
        await self._learn_nodes(self.require_admin())
        running = Counter(self.node_names.get(str(tasks[t]["nodeId"])) for t in long_ids
                          if tasks[t]["status"] == "RUNNING")
        ranked = sorted(self.nodes, key=lambda n: -running[n.name])  # (stable: by index among equals)
        chosen: dict[str, list[FleetNode]] = {"migrate": [], "lost": []}
        turn = ["lost", "migrate"]
        for node in ranked:
            way = turn[0] if len(chosen[turn[0]]) < quota[turn[0]] else turn[1]
            if len(chosen[way]) < quota[way]:
                chosen[way].append(node)
                turn.reverse()
        migrating, lost = chosen["migrate"], chosen["lost"]
        figures.stopped_migrate = [n.name for n in migrating]
        figures.stopped_lost = [n.name for n in lost]
        figures.long_on_stopped = {n.name: running[n.name] for n in [*migrating, *lost]}
        codes: list[tuple[int, int]] = []

        async def migrate(node: FleetNode) -> None:
            codes.append(await self.migrate(node))

        async with trio.open_nursery() as nursery:
            for node in migrating:
                nursery.start_soon(migrate, node)
            for node in lost:
                nursery.start_soon(self.lose, node)
        figures.migrate_codes = codes

    async def _release_when_moved(self, long_ids: list[str], figures: Figures) -> None:
        """Release the long crawls once none is left on a stopped node (each has a new attempt)."""
        stopped = set(figures.stopped_migrate) | set(figures.stopped_lost)
        admin = self.require_admin()
        with trio.fail_after(120 + 4 * self.scenario.node_lost_after):
            while True:
                tasks = await self.tasks()
                await self._learn_nodes(admin)
                left = [t for t in long_ids if tasks[t]["status"] == "RUNNING"
                        and self.node_names.get(str(tasks[t]["nodeId"])) in stopped]
                if not left:
                    break
                await trio.sleep(0.5)
        await self.release()

    async def _learn_nodes(self, admin: AdminClient) -> None:
        self.node_names.update({str(n["id"]): str(n["name"]) for n in await admin.list_nodes()})


async def problems(admin: AdminClient, tasks: dict[str, dict[str, Any]], short_ids: list[str],
                   long_ids: list[str], wave: list[str], figures: Figures) -> list[str]:
    """What broke "exactly once" (module docstring); fills ``figures.attempts``/``long_steps``/``long_resumed``."""
    found: list[str] = []
    for task_id in [*short_ids, *long_ids, *wave]:
        task = tasks[task_id]
        if task["status"] != "SUCCESS":
            found.append(f"task {task_id} ended {task['status']} {task.get('errorCode')}: {task.get('errorMessage')}")
    for task_id in [*short_ids, *wave]:
        task = tasks[task_id]
        if task.get("storedItems") != 1:
            found.append(f"short task {task_id}: {task.get('storedItems')} items stored (attempt {task.get('attempt')})")
    again = {"short": sum(tasks[t].get("attempt", 1) > 1 for t in short_ids),
             "stop-wave": sum(tasks[t].get("attempt", 1) > 1 for t in wave),
             "long": sum(tasks[t].get("attempt", 1) > 1 for t in long_ids)}
    figures.attempts = again
    # A short task runs again only after a disruption the master decided (its node lost: silent past the
    # grace — also a live node starved of CPU that long —, or migrated), never for another reason.
    again_ids = [t for t in [*short_ids, *wave] if tasks[t].get("attempt", 1) > 1]
    for task_id, view in zip(again_ids, await _bounded([lambda t=t: admin.get_task(t) for t in again_ids], 4),
                             strict=True):
        for attempt in (view.get("attempts") or [])[:-1]:
            cause = str(attempt.get("errorCode"))
            figures.reruns[cause] = figures.reruns.get(cause, 0) + 1
            if cause not in ("NODE_LOST", "MIGRATED"):
                found.append(f"short task {task_id}: an attempt ended {cause} ({attempt.get('errorMessage')})")
    stopped = set(figures.stopped_lost) | set(figures.stopped_migrate)
    views = await _bounded([lambda t=t: admin.get_task(t) for t in long_ids], 4)
    items = await _bounded([lambda t=t: admin.get_items(t) for t in long_ids], 4)
    names = {str(n["id"]): str(n["name"]) for n in await admin.list_nodes()}
    for task_id, view, got in zip(long_ids, views, items, strict=True):
        steps = [item.get("step") for item in got]
        figures.long_steps[task_id] = len(steps)
        if steps != list(range(len(steps))):
            dupes = sorted(s for s, n in Counter(steps).items() if n > 1)
            found.append(f"long task {task_id}: steps not 0..{len(steps) - 1} once each (twice: {dupes[:10]}; "
                         f"{len(steps)} items)")
        if len(steps) < (min_steps := int(view["params"].get("min_steps", 0))):
            found.append(f"long task {task_id}: {len(steps)} steps < min_steps {min_steps}")
        attempts = view.get("attempts") or []
        nodes = [names.get(str(a.get("nodeId"))) for a in attempts]
        if nodes and nodes[-1] in stopped:
            found.append(f"long task {task_id} ended on a stopped node {nodes[-1]}: {attempts}")
        if len(set(nodes)) > 1:
            figures.long_resumed += 1
        for attempt in attempts[:-1]:
            figures.moved[str(attempt.get("errorCode"))] = figures.moved.get(str(attempt.get("errorCode")), 0) + 1
    return found


@asynccontextmanager
async def fleet(directory: Path, scenario: Scenario) -> AsyncIterator[Fleet]:
    """A started :class:`Fleet`; at the block's end every process of it is killed (also on failure)."""
    running = Fleet(directory, scenario)
    try:
        await running.start()
        yield running
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(90):
            await running.close()
