"""One task's life on this node: queue → deploy → install → run → report, and who may run when.

Concurrency: a ``trio.CapacityLimiter(max_workers)`` for the node and one ``trio.Lock`` per spider
(same spider: serial; different spiders: parallel). The spider lock is taken first, then a
capacity token, so a queued task never holds a slot.

A task's stop has a reason: the master cancelled it, or the agent is terminating. Stopping is
idempotent; it interrupts deploy/install at once and ends a running process with TERM → grace →
KILL. Results:

====================  ==========  ============  =================================
outcome               status      errorCode     errorMessage
====================  ==========  ============  =================================
exit 0                SUCCESS     —             — (finishReason from the final stats)
exit 0, log cut       SUCCESS     LOG_BUDGET    how many bytes were dropped and why
exit ≠ 0              FAILED      EXIT_NONZERO  "exit code N" + the output's last lines
killed by a signal    FAILED      SIGNALED      "killed by SIGX (exit code -N)" + the output's last lines
timeout               FAILED      TIMEOUT       "执行超时"
stalled               FAILED      STALLED       how long nothing happened
stopped               CANCELLED   CANCELLED     the reason
code refused          FAILED      DEPLOY_FAILED the entry and the rule, or what the framework needs
install failed        FAILED      DEPS_FAILED   the installer's last whole lines
not startable         FAILED      EXIT_NONZERO  what could not be started (exitCode null)
OOM kill in the task  FAILED      OOM_KILLED    the limit and the peak (cgroup levels)
no jail / agent bug   FAILED      AGENT_ERROR   what failed (errno text and path kept)
filled the disk       FAILED      DISK_FULL     how fast it wrote, the free space and the floor
====================  ==========  ============  =================================

Setup failures are the TaskErrors of ckagent.node.errors (DeployError, DepsError, JailError, SpawnError),
each carrying its errorCode; :meth:`Supervisor._execute` collapses the phases' exception groups once
and ends in one ``except TaskError``; any other exception is the agent's own fault (AGENT_ERROR).

Each task runs in a private working copy of its code version (ckagent.code.workcopy), with its
spider's ``CK_DATA_DIR`` and ``HOME``; the copy is removed when the task ends. The result reports
the phases separately: ``deployMs`` (code + working copy), ``installMs`` (environment), ``runMs``
(the spider's process), and ``durationMs`` from the claim to the end (docs/protocol.md).

The full table (with OOM_KILLED, AGENT_LOST, BAD_TASK) is docs/protocol.md's "Outcomes".

Every task runs in a jail of the node's containment level (:mod:`ckagent.containment`), created
before its first installer and emptied and removed after its end; its resource figures (cpu
seconds, memory peak, ...) go into the result.

When the process has ended, the final result goes to the state store and the task's delivery
(its log and items streams, then the result, retried forever across restarts until acknowledged)
continues in the agent's outbox (``ckagent.delivery.Outbox``): the task leaves ``running`` and its
slot is free at once, so a master outage never holds worker slots.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import shlex
import shutil
import signal
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trio

from ckagent.code.deps import PYTHON_FRAMEWORKS, Dependencies, Prepared, spider_base_env
from ckagent.code.workcopy import make_working_copy, remove_tree, spider_dirs
from ckagent.code.workspace import Workspaces
from ckagent.containment import Containment, ContainmentError, Figures, Limits, TaskJail, format_bytes
from ckagent.containment.egress import Egress, EgressError, Refusal, TaskRules, report_refusals
from ckagent.containment.monitor import Monitored, spawn_monitored, supervise
from ckagent.containment.process import MARKER_VAR, ProcessOutcome, clock, sweep
from ckagent.containment.process_group import ProcessGroupJail
from ckagent.containment.tails import TailBuffer, last_lines
from ckagent.delivery import LogSink, Outbox
from ckagent.delivery.crawlstats import STATS_FILE
from ckagent.delivery.lines import secret_values
from ckagent.delivery.outputs import collect, kept_dir
from ckagent.master.client import MasterClient, MasterError, json_object
from ckagent.master.ids import api_path, safe_name
from ckagent.master.ids import task_dir as task_dir_of
from ckagent.master.protocol import ARTIFACTS, TIMEOUT_MESSAGE, Task, TaskResult, utc_iso
from ckagent.node.errors import (
    AGENT_ERROR,
    DeployError,
    DepsError,
    JailError,
    SpawnError,
    TaskError,
    collapsed_groups,
    describe_fault,
    os_error_text,
)
from ckagent.node.logs import Masker
from ckagent.node.runas import RunAs
from ckagent.node.state import AsyncStateStore, StateStoreError
from ckagent.task.commands import (
    DEFAULT_COMMANDS,
    default_command,
    resolve_command,
)
from ckagent.task.scrapyhook import scrapy_hook

log = logging.getLogger(__name__)

REPORT_RETRY_TIMEOUT = 300.0
"""Seconds a task that could not even be prepared keeps trying to report its failure."""

__all__ = ["DEFAULT_COMMANDS", "RunnerConfig", "RunningTask", "Supervisor", "SupervisorObserver", "TaskOutcome",
           "default_command", "result_from_json"]
STDERR_TAIL_CHARS = 1500
"""Characters of the spider's last stderr lines carried by an EXIT_NONZERO errorMessage."""


@dataclass
class TaskOutcome:
    """What happened, before it becomes a TaskResult."""

    status: str
    error_code: str | None = None
    error_message: str | None = None
    exit_code: int | None = None
    figures: Figures | None = None
    egress_refused: list[Refusal] | None = None


@dataclass
class RunningTask:
    """A task this node has claimed and not yet reported. Read by the heartbeat, /status and metrics."""

    task: Task
    claimed_at: float = field(default_factory=time.time)
    started_at: float | None = None
    pid: int | None = None
    phase: str = "queued"
    stop_reason: str | None = None
    stop_event: trio.Event = field(default_factory=trio.Event)
    prepare_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds spent per phase so far: ``deploy``, ``install``, ``run`` (the result's deployMs/installMs/runMs)."""
    stalled: bool = False
    disk_full: bool = False
    """Stopped because it filled the work dir's disk (ckagent.delivery.diskwatch): FAILED DISK_FULL."""
    delivery: Any = None
    """The task's ``ckagent.delivery.TaskDelivery`` once opened (live stats: ``delivery.stats.latest``)."""
    jail: TaskJail | None = None
    """The task's containment (from the deploy on); /status reads its live figures."""
    egress: TaskRules | None = None
    """The task's egress rules (nftables level: in the kernel); /status reads their counters."""
    handed_over: bool = False
    """The agent stopped and left this task's spider running for the next agent (ckagent.task.adoption)."""

    def request_stop(self, reason: str) -> bool:
        """Ask the task to stop (idempotent). Returns False when a stop was already requested."""
        if self.stop_reason is not None:
            return False
        self.stop_reason = reason
        self.prepare_scope.cancel()
        self.stop_event.set()
        return True


@dataclass(frozen=True)
class RunnerConfig:
    """What the supervisor needs from the settings (seconds; paths absolute)."""

    work_dir: Path
    execute_timeout: float
    kill_grace: float
    agent_secrets: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    run_as: RunAs | None = None
    """Spiders and installers run as this user (``task.run_as_user``); their directories are given to it."""
    stall_timeout: float = 0.0
    """Seconds without output, item or stats change before a task is stopped STALLED (0 = off)."""
    containment: Containment | None = None
    """The node's containment level; None = process groups only (no subreaper, no limits)."""
    default_limits: Limits = field(default_factory=Limits)
    """Limits of a task that names none (``task.memory_limit_bytes`` ...)."""
    egress: Egress | None = None
    """The node's egress level and policy (None = no network policy)."""
    max_artifact_bytes: int = 100 * 1024**2
    """Most bytes of a task's artifacts shipped to the master (``task.max_artifact_bytes``); over it, kept."""


TaskObserver = Callable[[RunningTask, TaskResult], None]


class SupervisorObserver:
    """Hooks into a task's life for metrics (``ckagent.port.metrics.AgentMetrics``); no-ops here.

    Called on the Trio thread at each step; an implementation must not block or raise.
    """

    def task_admitted(self, rt: RunningTask) -> None:
        """A claimed task was admitted (it is queued)."""

    def task_started(self, rt: RunningTask) -> None:
        """The task now holds a slot and its spider's lock (its queue wait is over)."""

    def deps_prepared(self, rt: RunningTask, prepared: Prepared) -> None:
        """The task's dependencies are ready (``prepared.cache_hit``, ``prepared.seconds``)."""

    def task_finished(self, rt: RunningTask, result: TaskResult) -> None:
        """The outcome is known; streams are not flushed and the result not sent yet."""


class Supervisor:
    """Admits claimed tasks and runs each one's life (see module docstring)."""

    def __init__(
        self,
        config: RunnerConfig,
        master: MasterClient,
        store: AsyncStateStore,
        workspaces: Workspaces,
        deps: Dependencies,
        max_workers: int,
        on_finished: TaskObserver | None = None,
        observer: SupervisorObserver | None = None,
        *,
        outbox: Outbox,
    ) -> None:
        self.config = config
        self._master = master
        self._store = store
        self._outbox = outbox
        self._workspaces = workspaces
        self._deps = deps
        self.max_workers = max_workers
        self.capacity = trio.CapacityLimiter(max_workers)
        self.running: dict[str, RunningTask] = {}
        self.claiming: set[str] = set()
        """Tasks whose claim is on the wire (the poller's; the heartbeat reports them)."""
        self.claim_polls: set[int] = set()
        """Claiming polls (``pollId``) not settled yet (the poller's; the heartbeat reports them)."""
        self.last_claim_poll: int | None = None
        """The newest claiming poll id the poller has sent (None: none yet)."""
        self._spider_locks: dict[str, trio.Lock] = {}
        self._slot_freed = trio.Event()
        self._on_finished = on_finished
        self._observer = observer or SupervisorObserver()
        self.handing_over = False
        """Set when the agent stops and leaves its running spiders to the next agent (not drain, not
        terminate): a cancelled task whose spider runs is then left alone, its state kept for re-adoption."""

    # ------------------------------------------------------------------ for re-adopted tasks

    @property
    def store(self) -> AsyncStateStore:
        """The state store (ckagent.task.adoption)."""
        return self._store

    @property
    def outbox(self) -> Outbox:
        """The outbox every task's delivery goes to (ckagent.task.adoption)."""
        return self._outbox

    @property
    def observer(self) -> SupervisorObserver:
        """The metrics hooks (ckagent.task.adoption)."""
        return self._observer

    def spider_lock(self, spider_id: str) -> trio.Lock:
        """The lock that keeps one spider's tasks serial (one per spider id ever seen)."""
        return self._spider_locks.setdefault(spider_id, trio.Lock())

    def task_left(self, task_id: str) -> None:
        """A task is no longer ours to run: its slot is free."""
        self.running.pop(task_id, None)
        self._slot_freed.set()

    # ------------------------------------------------------------------ admission

    def free_slots(self) -> int:
        """Slots not taken by a claimed, unfinished task (queued ones count: we must not over-claim)."""
        return max(0, self.max_workers - len(self.running))

    def running_spider_ids(self) -> list[str]:
        """Spiders with a claimed, unfinished task here: the poller excludes them."""
        return sorted({rt.task.spider_id for rt in self.running.values()})

    async def wait_for_free_slot(self) -> None:
        """Return when at least one slot is free. Cancellation: returns nothing, as usual."""
        while self.free_slots() <= 0:
            await self._slot_freed.wait()
            self._slot_freed = trio.Event()

    async def wait_idle(self) -> None:
        """Return once no claimed task is left (running or queued). Cancellation: as usual."""
        while self.running:
            freed = self._slot_freed
            await freed.wait()
            if self._slot_freed is freed:
                self._slot_freed = trio.Event()

    async def wait_spider_free(self, spider_ids: list[str]) -> None:
        """Return once a spider of ``spider_ids`` has no claimed task here any more (a long poll that
        excluded it has gone stale). Never returns for an empty list. Cancellation: as usual."""
        while set(spider_ids) <= set(self.running_spider_ids()):
            freed = self._slot_freed
            await freed.wait()
            if self._slot_freed is freed:
                self._slot_freed = trio.Event()

    def admit(self, task: Task) -> RunningTask:
        """Record a claimed task as ours (call before spawning :meth:`run_task`)."""
        rt = RunningTask(task=task)
        self.running[task.id] = rt
        self._observer.task_admitted(rt)
        return rt

    def cancel(self, task_id: str, reason: str) -> bool:
        """Stop a task of ours (idempotent). Returns True when this call requested the stop."""
        rt = self.running.get(task_id)
        if rt is None:
            return False
        if rt.request_stop(reason):
            log.info("task %s: stopping (%s)", task_id, reason)
            return True
        return False

    def stop_disk_full(self, task_id: str, reason: str) -> None:
        """Stop a task that fills the work dir's disk: it ends FAILED DISK_FULL with ``reason`` (also
        when it dies of the full disk on its own before the stop reaches it)."""
        rt = self.running.get(task_id)
        if rt is not None:
            rt.disk_full = True
            rt.request_stop(reason)

    def cancel_all(self, reason: str) -> None:
        """Stop every task (agent terminating)."""
        for task_id in list(self.running):
            self.cancel(task_id, reason)

    # ------------------------------------------------------------------ a task's life

    async def run_task(self, rt: RunningTask) -> None:
        """The whole life of one claimed task. Never raises for task trouble; reports it instead.

        Cancellation (the agent's hard stop) kills the process (shielded) and leaves the result
        and unsent streams in the state store for the next start.
        """
        task = rt.task
        task_dir = task_dir_of(self.config.work_dir, task.id)
        run_as = self.config.run_as
        try:
            started_wall = time.time()
            try:
                def open_task_dir() -> None:  # one thread hop: the task's directory, then its durable record
                    task_dir.mkdir(parents=True, exist_ok=True)
                    if run_as is not None:
                        run_as.chown_tree(task_dir)
                    self._store.sync.add_task(task.id, task.spider_id, task.to_json(), task_dir)

                await trio.to_thread.run_sync(open_task_dir)
                # Logs, items and the result are the outbox's: they outlive this slot (see ckagent.delivery).
                on_finished = self._on_finished
                delivery = await self._outbox.open_task(
                    task, task_dir,
                    on_delivered=None if on_finished is None else lambda final: on_finished(rt, final),
                )
            except (OSError, sqlite3.Error) as exc:
                # A full disk or a broken work dir fails this task, never the agent.
                await self._report_unprepared(rt, exc, started_wall)
                return
            rt.delivery = delivery
            sink = delivery.sink
            assert sink is not None
            outcome: TaskOutcome | None = None
            try:
                outcome = await self._execute(rt, task_dir, sink)
            except Exception as exc:  # a bug of ours must fail the task, not the agent (never BAD_TASK)
                log.exception("task %s: internal error", task.id)
                outcome = TaskOutcome("FAILED", AGENT_ERROR, _bounded(describe_fault(exc), 4000))
                with contextlib.suppress(Exception):
                    sink.write_line(f"[ckagent] task FAILED ({AGENT_ERROR}): {outcome.error_message}\n".encode())
            finally:
                if outcome is None and rt.handed_over:
                    if delivery.sink is not None:
                        delivery.sink.close()
                    log.info("task %s: left running for the next agent (spider %s)", task.id, rt.pid)
                elif outcome is None:
                    # The agent's hard stop (a Cancelled, maybe wrapped in an exception group from the
                    # process or installer nurseries): run_supervised has ended the processes
                    # (shielded). Store a CANCELLED result first, so it is delivered (now or at the
                    # next start) instead of AGENT_LOST; then sweep an interrupted installer's leftovers.
                    with trio.CancelScope(shield=True):
                        stopped = TaskOutcome("CANCELLED", "CANCELLED", rt.stop_reason or "agent terminating")
                        await delivery.finish(_result(rt, stopped, started_wall))
                        if rt.pid is None:
                            await sweep(task.id, None)
            if rt.pid is None and rt.phase == "installing":
                # The spider never ran, but an installer did (it carries the task's marker).
                with trio.CancelScope(shield=True):
                    await sweep(task.id, None)
            result = _result(rt, outcome, started_wall)
            self._observer.task_finished(rt, result)
            # Stores the result and hands the rest to the outbox; the slot is free when this returns.
            await delivery.finish(result)
        finally:
            self.running.pop(task.id, None)
            self._slot_freed.set()

    async def _report_unprepared(self, rt: RunningTask, exc: Exception, started_wall: float) -> None:
        """The task's directory or state could not be created: report FAILED straight to the master.

        Retried through master trouble for up to REPORT_RETRY_TIMEOUT seconds (there is no state
        store row to resume from); then the task is left to the master.
        """
        message = f"the node cannot prepare the task's directory or state: {type(exc).__name__}: {exc}"
        log.error("task %s: %s", rt.task.id, message)
        result = _result(rt, TaskOutcome("FAILED", "DEPLOY_FAILED", message), started_wall)
        try:
            await self._master.call_retrying(
                "result", "POST", api_path("/api/tasks/{task}/result", task=rt.task.id), json=result.to_json(),
                retry_timeout=REPORT_RETRY_TIMEOUT, answer=json_object,
            )
        except MasterError as report_exc:
            log.error("task %s: could not report the failure either (%s)", rt.task.id, report_exc)
        self._observer.task_finished(rt, result)

    async def _execute(self, rt: RunningTask, task_dir: Path, sink: LogSink) -> TaskOutcome:
        """Deploy → install → run one task; a TaskError of any phase becomes its FAILED outcome here.

        Exception groups out of the phases' nurseries are collapsed first (ckagent.node.errors), so a
        DeployError or DepsError raised inside one is still that error. Anything else propagates to
        :meth:`run_task` (reported AGENT_ERROR). Cancellation: as usual (the caller stores CANCELLED).
        """

        def notice(text: str) -> None:
            stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            sink.write_line(f"[ckagent {stamp}] {text}\n".encode())

        async with contextlib.AsyncExitStack() as held:
            try:
                with collapsed_groups():
                    return await self._phases(rt, task_dir, sink, held, notice)
            except TaskError as exc:
                return self._failed(rt, exc, notice)
        raise AssertionError("unreachable")  # pragma: no cover

    def _failed(self, rt: RunningTask, exc: TaskError, notice: Callable[[str], None]) -> TaskOutcome:
        """The FAILED outcome of a task whose phase raised ``exc`` (its jail not emptied yet: an
        installer the kernel's OOM killer ended is reported OOM_KILLED)."""
        text = str(exc)
        jail, figures = rt.jail, None
        if isinstance(exc, DeployError):
            notice(text if text.startswith(_NO_COPY) else f"deploy failed: {text}")
        elif isinstance(exc, DepsError):
            notice(f"dependency install failed: {text.splitlines()[0] if text else ''}")
            figures = jail.figures() if jail is not None else None
            if jail is not None and figures is not None and figures.oom_kills:
                return _oom_outcome(jail, figures, None, "the dependency installer")
        else:
            notice(f"task FAILED ({exc.error_code}): {text}")
        if isinstance(exc, DepsError):  # the installer's output may echo the task's secrets
            text = Masker(_secret_values(rt.task, self.config.agent_secrets))(text)
        return TaskOutcome("FAILED", exc.error_code, _bounded(text, 4000), figures=figures)

    async def _phases(self, rt: RunningTask, task_dir: Path, sink: LogSink, held: contextlib.AsyncExitStack,
                      notice: Callable[[str], None]) -> TaskOutcome:
        """The phases of :meth:`_execute`; ``held`` is the stack that outlives them (lock, slot, jail,
        working copy, environment). Raises TaskError (maybe inside an exception group)."""
        task = rt.task
        # One lock per spider id ever seen: a few bytes each, and never a window with two locks.
        lock = self._spider_locks.setdefault(task.spider_id, trio.Lock())
        # Waiting for the lock or a slot, deploying and installing are interrupted by a stop at once.
        with rt.prepare_scope:
            await held.enter_async_context(lock)
            await held.enter_async_context(self.capacity)
            rt.phase = "deploying"
            self._observer.task_started(rt)
            phase_started = trio.current_time()
            jails: list[TaskJail] = []

            async def open_jail() -> None:
                jail = await self._open_jail(rt, notice)
                held.push_async_callback(_empty_jail, jail, rt, self.egress_detach(rt))
                jails.append(jail)

            work = self._workspaces.runs / safe_name(task.id)
            # The jail is made while the code is deployed and copied (one thread hop less before the spawn).
            try:
                async with trio.open_nursery() as opening:
                    opening.start_soon(open_jail)
                    held.push_async_callback(_remove_shielded, work, rt)
                    code_dir, argv, how, copied = await self._deploy(task, work, held, notice)
            finally:
                rt.phase_seconds["deploy"] = trio.current_time() - phase_started
            [jail] = jails
            if how is not None:
                notice(how)
            notice(f"working copy of {code_dir.name}: {copied}")
            rt.phase = "installing"
            phase_started = trio.current_time()
            try:
                prepared = await self._deps.prepare(
                    task.framework, task.spider_id, work, sink.write, marker={MARKER_VAR: task.id},
                    spawn=jail.spawn, task_env={**self.config.extra_env, **task.env},
                    home=self.config.work_dir / "spider-home" / safe_name(task.spider_id),
                )
            finally:
                rt.phase_seconds.setdefault("install", trio.current_time() - phase_started)
            held.callback(self._deps.release, prepared)
            self._observer.deps_prepared(rt, prepared)
            for note in prepared.notes:
                notice(note)
            env_name = f" ({prepared.env_dir.name})" if prepared.env_dir is not None else ""
            notice(f"dependencies {'cached' if prepared.cache_hit else 'installed'}{env_name} in "
                   f"{prepared.seconds:.3f} s")
        if rt.stop_reason is not None:
            notice(f"stopped before the spider started: {rt.stop_reason}")
            return TaskOutcome("CANCELLED", "CANCELLED", rt.stop_reason)
        outcome = await self._run(rt, task_dir, work, argv, prepared, notice, sink, jail)
        if rt.egress is not None and self.config.egress is not None:
            outcome.egress_refused = await trio.to_thread.run_sync(self.config.egress.refusals, rt.egress)
            report_refusals(task.id, outcome.egress_refused, notice)
        if rt.started_at is not None and not rt.handed_over:  # its files → items, artifacts or kept ones
            await self.collect_outputs(rt, task_dir, work, code_dir, notice)
        return outcome

    async def _deploy(self, task: Task, work: Path, held: contextlib.AsyncExitStack,
                      notice: Callable[[str], None] | None = None) -> tuple[Path, list[str], str | None, str]:
        """The task's code version (deployed or found), its command and its working copy: ``(code dir,
        argv, how the command was chosen, what was copied)``. Raises DeployError (a file system error
        included, with its errno text and path)."""
        try:
            # A package deployed before (the usual case): one thread hop finds it, resolves the
            # command and makes the working copy.
            cached = None
            if task.code_package is not None:
                cached = await trio.to_thread.run_sync(self._reuse_and_copy, task, work)
            if cached is not None:
                code_dir, (argv, how), copied = cached
                self._workspaces.acquire(code_dir)
                held.callback(self._workspaces.release, code_dir)
                return code_dir, argv, how, copied
            if task.code_package is not None:
                code_dir = await self._workspaces.deploy_package(task.spider_id, task.code_version, task.code_package,
                                                                  notice)
            else:
                code_dir = await self._workspaces.deploy_files(task.spider_id, notice)
            self._workspaces.acquire(code_dir)
            held.callback(self._workspaces.release, code_dir)
            # One thread hop for the command and the working copy.
            (argv, how), copied = await trio.to_thread.run_sync(self._resolve_and_copy, task, code_dir, work)
            return code_dir, argv, how, copied
        except OSError as exc:
            raise DeployError(f"cannot deploy the spider's code: {os_error_text(exc)}") from exc

    def adopt_environment(self, env_dir: Path) -> Callable[[], None]:
        """A re-adopted task's dependency environment is in use again (collection skips it); call
        what this returns when the task has ended here."""
        prepared = self._deps.adopt(env_dir)
        return lambda: self._deps.release(prepared)

    def egress_detach(self, rt: RunningTask) -> Callable[[], None] | None:
        """What removes the task's egress rules at its end (blocking), or None without a policy."""
        egress = self.config.egress
        if egress is None:
            return None

        def detach() -> None:
            if rt.egress is not None:
                egress.detach(rt.egress, egress.refusals(rt.egress))

        return detach
    async def collect_outputs(self, rt: RunningTask, task_dir: Path, work: Path, version_dir: Path | None,
                              notice: Callable[[str], None]) -> None:
        """What the task wrote in its working copy → items, artifacts or kept on the node (ckagent.delivery.outputs),
        before the copy is removed; one ``outputs:`` line in the task log says what became of each file.
        ``version_dir`` None: the task's code version (what the copy was made of) is not known — a
        re-adopted task of a version gone meanwhile: the line says so. Never raises for the files."""
        task = rt.task
        if version_dir is None and task.code_package is not None:
            version_dir = await trio.to_thread.run_sync(
                self._workspaces.reuse_package, task.spider_id, task.code_version, task.code_package)
        if version_dir is None:
            notice("outputs: the task's code version is not on this node any more, so the files it wrote "
                   "cannot be told from its code; they are removed with the working copy")
            return
        keep = kept_dir(self.config.work_dir, safe_name(task.spider_id), safe_name(task.id))
        try:
            collected = await trio.to_thread.run_sync(functools.partial(
                collect, work=work, code_dir=version_dir, since=rt.started_at or 0.0, task_dir=task_dir,
                outputs=task.outputs, budget_bytes=self.config.max_artifact_bytes,
                master_takes_artifacts=ARTIFACTS in self._master.features, keep_dir=keep))
        except OSError as exc:
            notice(f"outputs: cannot collect the task's files ({exc.strerror or exc}); they are removed with "
                   "the working copy")
            return
        notice(collected.line())

    def _reuse_and_copy(self, task: Task, work: Path) -> tuple[Path, tuple[list[str], str | None], str] | None:
        """For a package deployed before: its version dir (touched: pruning keeps the newest), the
        command and the working copy (:meth:`_resolve_and_copy`); None when it must be deployed. Blocking."""
        assert task.code_package is not None
        code_dir = self._workspaces.reuse_package(task.spider_id, task.code_version, task.code_package)
        if code_dir is None:
            return None
        return code_dir, *self._resolve_and_copy(task, code_dir, work)

    def _resolve_and_copy(self, task: Task, code_dir: Path, work: Path) -> tuple[tuple[list[str], str | None], str]:
        """The task's command, then its working copy (:meth:`_working_copy`). Blocking. Raises
        DeployError (a copy that fails: its message starts with ``_NO_COPY``)."""
        resolved = resolve_command(task, code_dir)
        try:
            return resolved, self._working_copy(task, code_dir, work)
        except OSError as exc:
            raise DeployError(f"{_NO_COPY}: {exc}") from exc

    def _working_copy(self, task: Task, code_dir: Path, work: Path) -> str:
        """Make the task's private working copy and its spider's data/home dirs (blocking; see ckagent.code.workcopy)."""
        remove_tree(work)
        stats = make_working_copy(code_dir, work)
        run_as = self.config.run_as
        if run_as is not None:
            run_as.chown_tree(work)
        spider_dirs(self.config.work_dir, safe_name(task.spider_id), run_as)
        return stats.describe()

    async def _open_jail(self, rt: RunningTask, notice: Callable[[str], None]) -> TaskJail:
        """The task's jail at the node's level, with the task's limits (else the node's defaults)."""
        task, default = rt.task, self.config.default_limits
        wanted = Limits(
            memory_bytes=task.resources.memory_bytes if task.resources.memory_bytes is not None else default.memory_bytes,
            pids=task.resources.pids if task.resources.pids is not None else default.pids,
            cpus=task.resources.cpus if task.resources.cpus is not None else default.cpus,
        )
        containment = self.config.containment
        try:
            if containment is None:
                jail: TaskJail = ProcessGroupJail(task.id)
            else:
                jail = await trio.to_thread.run_sync(containment.jail, task.id, wanted)
        except ContainmentError as exc:
            level = "process-group" if containment is None else containment.level
            raise JailError(f"the node cannot contain the task ({level}): {exc}") from exc
        egress = self.config.egress
        if egress is not None:
            failed: EgressError | None = None
            try:  # before any process of the task starts: its installers are filtered too
                rt.egress = await trio.to_thread.run_sync(egress.attach, jail, task.id, task.egress)
            except EgressError as exc:
                failed = exc
            if failed is not None:  # the task must not run unprotected
                await _empty_jail(jail)
                raise JailError(str(failed)) from failed
            notice(f"egress ({egress.level}): {egress.effective(task.egress).describe()}")
        rt.jail = jail
        if wanted != Limits() and jail.limits != wanted:
            notice(f"limits asked: {wanted.describe()}; this node ({jail.level}) enforces: {jail.limits.describe()}")
        elif wanted != Limits():
            notice(f"limits: {wanted.describe()} ({jail.level})")
        return jail

    async def _run(
        self,
        rt: RunningTask,
        task_dir: Path,
        code_dir: Path,
        argv: list[str],
        prepared: Prepared,
        notice: Callable[[str], None],
        sink: LogSink,
        jail: TaskJail,
    ) -> TaskOutcome:
        task = rt.task
        items_file = task_dir / "items.jsonl"
        data_dir = self.config.work_dir / "spider-data" / safe_name(task.spider_id)
        home_dir = self.config.work_dir / "spider-home" / safe_name(task.spider_id)
        env = spider_base_env(prepared.path_prefix)
        if self.config.run_as is not None:
            env.update(self.config.run_as.env())
        env["HOME"] = str(home_dir)
        env.update(prepared.env)
        env.update(self.config.extra_env)
        env.update(task.env)
        if self.config.egress is not None:  # the proxy variables of the advisory level ({} otherwise)
            env.update(self.config.egress.task_env(rt.egress))
        env.update(
            {
                MARKER_VAR: task.id,
                "CK_SPIDER_ID": task.spider_id,
                "CK_SPIDER_NAME": task.spider_name,
                "CK_ITEMS_FILE": str(items_file),
                "CK_STATS_FILE": str(task_dir / STATS_FILE),
                "CK_TASK_DIR": str(task_dir),
                "CK_DATA_DIR": str(data_dir),
                "CK_PARAMS": json.dumps(task.params, ensure_ascii=False),
            }
        )
        if prepared.env_dir is not None and task.framework in PYTHON_FRAMEWORKS:
            hook_env, hook_note = await trio.to_thread.run_sync(
                scrapy_hook, task.framework, argv, env.get("PATH"), code_dir, prepared.env_dir)
            env.update(hook_env)
            if hook_note:
                notice(hook_note)
        timeout = self.config.execute_timeout if task.timeout_seconds is None else task.timeout_seconds
        stall = self.config.stall_timeout if task.stall_timeout_seconds is None else task.stall_timeout_seconds
        rt.phase = "running"
        rt.started_at = time.time()
        notice(f"running {shown_argv(argv, task)} (timeout {f'{timeout:g} s' if timeout else 'none'})")

        def on_stall(idle: float) -> None:
            if rt.request_stop(f"stalled: no output, items or stats for {idle:.0f} s (stall timeout {stall:g} s)"):
                rt.stalled = True
                log.warning("task %s: %s", task.id, rt.stop_reason)

        try:
            mon = await spawn_monitored(
                _resolve(argv, env), cwd=code_dir, env=env, task_id=task.id, task_dir=task_dir,
                output_path=sink.path, jail=jail, run_as=self.config.run_as,
                deadline_at=None if not timeout else rt.started_at + timeout, work=code_dir, stall_timeout=stall,
                env_dir=prepared.env_dir,
            )
        except OSError as exc:
            # No process ran, so no exit code (docs/protocol.md); the message says what failed.
            raise SpawnError(f"cannot start {argv[0]!r}: {os_error_text(exc)}") from exc
        except ContainmentError as exc:
            raise JailError(f"cannot put the spider into the task's {jail.level} jail: {exc}") from exc
        rt.pid = mon.pid
        if stall and rt.delivery is not None:
            rt.delivery.watch_stall(stall, on_stall)
        try:
            await self._store.set_process(task.id, mon.pid, mon.pid, mon.handle.to_json())
        except StateStoreError as exc:  # a full disk: the task runs on, unrecorded (a crash: AGENT_LOST)
            log.error("task %s: cannot record its process: %s", task.id, exc)
        return await self.finish_run(rt, mon, jail, sink, notice, timeout)

    async def finish_run(self, rt: RunningTask, mon: Monitored, jail: TaskJail, sink: LogSink,
                         notice: Callable[[str], None], timeout_seconds: float) -> TaskOutcome:
        """Supervise a spawned or re-adopted spider to its end and judge its outcome (ckagent.containment.monitor)."""
        task = rt.task
        outcome = await supervise(
            mon, jail=jail, sink=sink, grace=self.config.kill_grace, stop=rt.stop_event, notice=notice,
            stop_signal=task.stop_signal_number, leave_running=lambda: self._hand_over(rt),
        )
        stderr_tail = TailBuffer(16384)
        stderr_tail.write(await trio.to_thread.run_sync(_output_tail, sink.path))
        figures = jail.figures()  # into the result (cpuSeconds, memoryPeakBytes, ...), not the log
        if figures.oom_kills and not outcome.stopped:
            verdict = _oom_outcome(jail, figures, outcome.returncode, "the spider")
            notice(f"{verdict.error_message}; task FAILED (OOM_KILLED)")
            return verdict
        judged = self._judge_exit(rt, outcome, timeout_seconds, notice, stderr_tail, sink)
        judged.figures = figures
        return judged

    def _hand_over(self, rt: RunningTask) -> bool:
        """True (and the task marked handed over) when the agent leaves this task's spider running."""
        if self.handing_over and not rt.handed_over and rt.stop_reason in (None, "agent terminating"):
            rt.handed_over = True
        return rt.handed_over

    def _judge_exit(self, rt: RunningTask, outcome: ProcessOutcome, timeout: float, notice: Callable[[str], None],
                    stderr_tail: TailBuffer, sink: LogSink) -> TaskOutcome:
        """TIMEOUT / CANCELLED / exit status (a death by signal names the signal)."""
        task = rt.task
        if outcome.timed_out:
            notice(_ended_by_agent(f"timed out after {timeout:g} s", outcome) + "; task FAILED (TIMEOUT)")
            return TaskOutcome("FAILED", "TIMEOUT", TIMEOUT_MESSAGE, outcome.returncode)
        if rt.disk_full and (outcome.stopped or outcome.returncode != 0):
            notice(_ended_by_agent(rt.stop_reason or "disk full", outcome) + "; task FAILED (DISK_FULL)")
            return TaskOutcome("FAILED", "DISK_FULL", rt.stop_reason, outcome.returncode)
        if outcome.stopped and rt.stalled:
            notice(_ended_by_agent(rt.stop_reason or "stalled", outcome) + "; task FAILED (STALLED)")
            return TaskOutcome("FAILED", "STALLED", rt.stop_reason, outcome.returncode)
        if outcome.stopped:
            reason = rt.stop_reason or "cancelled"
            notice(_ended_by_agent(f"stopped ({reason})", outcome) + "; task CANCELLED")
            return TaskOutcome("CANCELLED", "CANCELLED", reason, outcome.returncode)
        notice(f"process exited with code {outcome.returncode}")
        if outcome.returncode == 0:
            if sink.truncated is not None:
                return TaskOutcome("SUCCESS", "LOG_BUDGET", f"output truncated: {sink.dropped_bytes} bytes "
                                   f"dropped because {sink.truncated}", 0)
            return TaskOutcome("SUCCESS", exit_code=0)
        # A signal the agent did not send (it sent none: not stopped, not timed out): a crash, a kill.
        code = "SIGNALED" if outcome.returncode is not None and outcome.returncode < 0 else "EXIT_NONZERO"
        return TaskOutcome("FAILED", code, self._exit_message(outcome.returncode, stderr_tail, task),
                           outcome.returncode)

    def _exit_message(self, returncode: int | None, stderr_tail: TailBuffer, task: Task) -> str:
        """``exit code N`` / ``killed by SIGX``, then the last lines of the spider's output (bounded, masked)."""
        head = f"exit code {returncode}"
        if returncode is not None and returncode < 0:
            with contextlib.suppress(ValueError):
                head = f"killed by {signal.Signals(-returncode).name} (exit code {returncode})"
        masker = Masker(_secret_values(task, self.config.agent_secrets))
        tail = last_lines(masker(stderr_tail.text()), STDERR_TAIL_CHARS)
        return f"{head}; last lines of output:\n{tail}" if tail else f"{head} (no output)"


_NO_COPY = "cannot make the task's working copy"


def _oom_outcome(jail: TaskJail, figures: Figures, returncode: int | None, what: str) -> TaskOutcome:
    """FAILED/OOM_KILLED naming the limit and the peak."""
    limit = jail.limits.memory_bytes
    peak = figures.memory_peak_bytes
    message = (f"{what} was killed by the kernel's OOM killer ({figures.oom_kills} process(es)): memory limit "
               f"{format_bytes(limit) if limit is not None else 'none (node memory ran out)'}, peak "
               f"{format_bytes(peak) if peak is not None else 'unknown'}")
    return TaskOutcome("FAILED", "OOM_KILLED", message, returncode, figures=figures)


async def _empty_jail(jail: TaskJail, rt: RunningTask | None = None,
                      detach: Callable[[], None] | None = None) -> None:
    """At the end of a task: kill what is left in its jail (an interrupted installer), remove its
    egress rules (``detach``, blocking: after the kill, before the cgroup goes) and the jail (not
    when the task was handed over to the next agent: its spider runs on in it)."""
    if rt is not None and rt.handed_over:
        return
    with trio.CancelScope(shield=True):
        await jail.kill_all()
        if detach is not None:
            await trio.to_thread.run_sync(detach)
        jail.close()


def _result(rt: RunningTask, outcome: TaskOutcome, started_wall: float) -> TaskResult:
    """The final result of a task that ends now: ``startedAt`` when the agent took it, the phases apart."""
    finished_wall = time.time()
    started = started_wall
    phases = rt.phase_seconds

    def ms(name: str) -> int | None:
        return None if name not in phases else max(0, int(phases[name] * 1000))

    run_ms = None if rt.started_at is None else max(0, int((finished_wall - rt.started_at) * 1000))
    return TaskResult(
        status=outcome.status,
        exit_code=outcome.exit_code,
        error_code=outcome.error_code,
        error_message=outcome.error_message,
        started_at=utc_iso(datetime.fromtimestamp(started, timezone.utc)),
        finished_at=utc_iso(datetime.fromtimestamp(finished_wall, timezone.utc)),
        duration_ms=max(0, int((finished_wall - started) * 1000)),
        deploy_ms=ms("deploy"),
        install_ms=ms("install"),
        run_ms=run_ms,
        **_figure_fields(outcome.figures),
        egress_refused=[{"address": r.address, "port": r.port, "count": r.count}
                        for r in outcome.egress_refused] if outcome.egress_refused else None,
    )


def _figure_fields(figures: Figures | None) -> dict[str, Any]:
    """TaskResult keyword arguments of the resource figures (none at the process-group level)."""
    if figures is None:
        return {}
    return {"cpu_seconds": None if figures.cpu_seconds is None else round(figures.cpu_seconds, 3),
            "memory_peak_bytes": figures.memory_peak_bytes, "pids_peak": figures.pids_peak,
            "io_read_bytes": figures.io_read_bytes, "io_write_bytes": figures.io_write_bytes}


def _ended_by_agent(why: str, outcome: ProcessOutcome) -> str:
    """One line saying what the agent did to end a task's processes, and when (UTC)."""
    parts = [why]
    if outcome.term_sent_at is not None:
        parts.append(f"stop signal to the main process at {clock(outcome.term_sent_at)}")
    if outcome.kill_sent_at is not None:
        parts.append(f"every process killed at {clock(outcome.kill_sent_at)}")
    elif outcome.workers_left:
        parts.append(f"the launcher exited, {outcome.workers_left} process(es) it ran outlived the grace period "
                     "and were killed")
    elif outcome.term_sent_at is not None:
        parts.append("the spider exited within the grace period")
    if outcome.killed_leftovers:
        parts.append(f"{outcome.killed_leftovers} leftover process(es) killed")
    return "; ".join(parts)


async def _remove_shielded(path: Path, rt: RunningTask | None = None) -> None:
    """Remove a task's working copy when the task ends, even when it ends by cancellation (not when
    it was handed over to the next agent, which removes it at the task's end)."""
    if rt is not None and rt.handed_over:
        return
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(remove_tree, path)


def _bounded(text: str, max_chars: int) -> str:
    """``text`` within ``max_chars``: its first line and its last whole lines (never a line cut in the middle)."""
    if len(text) <= max_chars:
        return text
    first, _, rest = text.partition("\n")
    first = first[:300]
    return f"{first}\n{last_lines(rest, max_chars - len(first) - 1, max_lines=60)}"


def _secret_values(task: Task, agent_secrets: tuple[str, ...]) -> list[str]:
    return list(secret_values(task.env, agent_secrets, task_words(task)))


def task_words(task: Task) -> list[str]:
    """The words of a task's command line that came from the task (``command``, then ``args``)."""
    return [*(task.command or ()), *task.args]


def shown_argv(argv: list[str], task: Task) -> str:
    """The command line for the ``running`` line: the program and the agent's own words; every word
    the task supplied (its ``args``, its ``command`` after the program) is ``***`` — a task's
    arguments may hold secrets and are never shown (docs/protocol.md, "Environment")."""
    from_task = set(task.args) | set((task.command or [])[1:])
    return shlex.join(argv[:1] + ["***" if word in from_task else word for word in argv[1:]])


def _output_tail(path: Path, size: int = 16384) -> bytes:
    """The last ``size`` bytes of the task's output (stdout and stderr are one file), without the
    agent's own notices. Blocking (one small read)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - size))
            data = fh.read()
    except OSError:
        return b""
    return b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(b"[ckagent "))


def _resolve(argv: list[str], env: dict[str, str]) -> list[str]:
    """Resolve argv[0] on the spider's PATH (not the agent's), so the venv's python/scrapy win."""
    if "/" in argv[0]:
        return argv
    found = shutil.which(argv[0], path=env.get("PATH"))
    return [found, *argv[1:]] if found else argv


def result_from_json(data: dict[str, Any]) -> TaskResult:
    """Rebuild a stored result (state store JSON)."""
    return TaskResult.from_json(data)
