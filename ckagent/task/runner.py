"""The phase runner: one claimed task's life — open its dir → slot → deploy + jail → install → run → judge.

Each phase is an ``async with`` step that holds what it made until the task ends (the spider lock and slot,
the code version, working copy and jail, the environment), entered in that order and left in the reverse
one; a stop interrupts waiting, deploying and installing at once (the task's
:class:`~ckagent.task.stop.TaskStop`, which also says what each stop becomes) and ends a running process
with its stop signal → its stop grace (ckagent.task.stop.stop_grace) → KILL; the run-time and stall limits
are the runner's (:class:`~ckagent.task.stop.Watchdog`), the delivery only records signs of life.

The path is short on purpose (bench._census counts it; tests/test_shortpath.py holds it): the task's own
Trio task does all of it — no task beside it, its spider's supervision included (the wait is one epoll over
the monitor's pidfd and output.log's watch, in a scope the stop cancels: ckagent.containment.monitor) — and
each phase's blocking work is one thread hop: the prepare hop
(jail and egress rules, code version, working copy, the environment's look: ckagent.task.deploy),
the spawn hop (spawn hooks, the spawn, the process's record) and the end hop (the end's reads, the
outputs' collection, the jail and working copy removed).

Setup failures are the TaskErrors of ckagent.node.errors (DeployError, DepsError, JailError,
SpawnError), each carrying its errorCode; :meth:`TaskRunner._execute` collapses the phases'
exception groups once and ends in one ``except TaskError``; any other exception is the agent's own
fault (AGENT_ERROR). What each ending becomes is ckagent.task.outcome's.

The result reports the phases separately: ``deployMs`` (code + working copy), ``installMs``
(environment), ``runMs`` (the spider's process), and ``durationMs`` from the claim to the end
(docs/protocol.md); the jail's resource figures (cpu seconds, memory peak, ...) go into it too.

When the process has ended, the final result goes to the state store and the task's delivery
(its log and items streams, then the result, retried forever across restarts until acknowledged)
continues in the agent's outbox (``ckagent.delivery.Outbox``): the task leaves ``running`` and its
slot is free at once, so a master outage never holds worker slots.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trio

from ckagent.code import frameworks
from ckagent.code.deps import Checked, Dependencies, Prepared
from ckagent.code.workspace import Workspaces
from ckagent.containment import ContainmentError, Figures, TaskJail
from ckagent.containment.egress import Refusal, report_refusals
from ckagent.containment.monitor import Monitored, spawn_monitored
from ckagent.containment.private import make_task_tmp, remove_task_tmp
from ckagent.containment.process import MARKER_VAR, sweep
from ckagent.containment.supervision import supervise
from ckagent.containment.tails import TailBuffer
from ckagent.delivery import LogSink, Outbox
from ckagent.delivery.lifecycle import DepsPrepared, TaskFinished, TaskStarted
from ckagent.master.client import MasterClient, MasterError
from ckagent.master.endpoints import Retry
from ckagent.master.ids import safe_name
from ckagent.master.ids import task_dir as task_dir_of
from ckagent.master.protocol import ARTIFACTS, Task
from ckagent.node.errors import (
    AGENT_ERROR,
    JailError,
    SpawnError,
    TaskError,
    collapsed_groups,
    describe_fault,
    os_error_text,
)
from ckagent.node.identity import IdentityError, runs_as_text
from ckagent.node.state import AsyncStateStore, StateStoreError
from ckagent.node.workmodes import PRIVATE_DIR_MODE
from ckagent.task import diskshare
from ckagent.task.admission import Admission, RunningTask
from ckagent.task.attempts import retire_earlier_attempt, wait_earlier_delivery
from ckagent.task.checkpoints import checkpointing, checkpoints_for
from ckagent.task.commands import resolve_on_path
from ckagent.task.deploy import Clearing, Deployer
from ckagent.task.execlimits import check_exec_size
from ckagent.task.outcome import (
    MESSAGE_CHARS,
    Notice,
    TaskOutcome,
    bounded,
    failed_outcome,
    judge_exit,
    oom_outcome,
    output_tail,
    shown_argv,
    task_result,
)
from ckagent.task.runconfig import RunnerConfig
from ckagent.task.stop import StopReason, Watchdog, stop_grace, stopped_outcome
from ckagent.task.taskenv import make_resume_files, spider_env

log = logging.getLogger(__name__)

REPORT_RETRY_TIMEOUT = 300.0
"""Seconds a task that could not even be prepared keeps trying to report its failure."""


@dataclass(frozen=True)
class Code:
    """What the deploy phase holds: the version dir, the command, the working copy and the jail."""

    code_dir: Path
    argv: list[str]
    work: Path
    jail: TaskJail
    clearing: Clearing
    checked: Checked | None = None
    """What the prepare hop found of the dependencies' environment (None: the install phase looks)."""


class TaskRunner:
    """Runs each admitted task's life (see module docstring); ``admission`` owns the slots and locks."""

    def __init__(self, config: RunnerConfig, master: MasterClient, store: AsyncStateStore, workspaces: Workspaces,
                 deps: Dependencies, admission: Admission, outbox: Outbox) -> None:
        self.config = config
        self._master = master
        self._store = store
        self._outbox = outbox
        self._deps = deps
        self._admission = admission
        self.deployer = Deployer(config, workspaces, lambda: ARTIFACTS in master.features)

    async def run_task(self, rt: RunningTask) -> None:
        """The whole life of one admitted task. Never raises for task trouble; reports it instead.

        Cancellation (the agent's hard stop) kills the process (shielded) and leaves the result
        and unsent streams in the state store for the next start. The task leaves the running set
        when this returns, however it returns.
        """
        task = rt.task
        task_dir = task_dir_of(self.config.work_dir, task.id)
        try:
            started_wall = time.time()
            try:
                await wait_earlier_delivery(self._outbox.deliveries, task)  # (ckagent.task.attempts)

                def make_task_dir() -> None:  # in the outbox's hop, before the task's durable record
                    retire_earlier_attempt(self._store.sync, task, task_dir)  # a retry on this node starts empty
                    # 0700 from the start (not the umask's 0755 until the next start's seal_work_dir): its
                    # items, stats and exit status are no other spider's to read.
                    task_dir.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
                    rt.run_as = self.config.identity_of(task.spider_id)  # a new spider's uid: recorded now
                    if rt.run_as is not None:
                        rt.run_as.chown_tree(task_dir)

                # Logs, items and the result are the outbox's: they outlive this slot (see ckagent.delivery).
                delivery = await self._outbox.open_task(task, task_dir, claimed_at=rt.claimed_at,
                                                        make_dir=make_task_dir)
            except (OSError, sqlite3.Error, IdentityError, StateStoreError) as exc:
                # A full disk or a broken work dir fails this task, never the agent.
                await self._report_unprepared(rt, exc, started_wall)
                return
            rt.delivery = delivery
            delivery.on_superseded = rt.mark_superseded
            sink = delivery.sink
            assert sink is not None
            outcome: TaskOutcome | None = None
            try:
                outcome = await self._execute(rt, task_dir, sink)
            except Exception as exc:  # a bug of ours must fail the task, not the agent (never BAD_TASK)
                log.exception("task %s: internal error", task.id)
                outcome = TaskOutcome("FAILED", AGENT_ERROR, bounded(describe_fault(exc), MESSAGE_CHARS))
                with contextlib.suppress(Exception):
                    sink.write_line(f"[ckagent] task FAILED ({AGENT_ERROR}): {outcome.error_message}\n".encode())
            finally:
                if outcome is None and rt.handed_over:
                    if delivery.sink is not None:
                        delivery.sink.close()
                    log.info("task %s: left running for the next agent (spider %s)", task.id, rt.pid)
                elif outcome is None:
                    # The agent's hard stop (a Cancelled, maybe wrapped in an exception group from the
                    # process or installer nurseries): the supervisors have ended the processes
                    # (shielded). Store the stop's result first (CANCELLED unless an earlier stop said
                    # otherwise), so it is delivered (now or at the next start) instead of AGENT_LOST;
                    # then sweep an interrupted installer's leftovers.
                    with trio.CancelScope(shield=True):
                        rt.stop.request(StopReason.TERMINATING)
                        await delivery.finish(task_result(rt, TaskOutcome(*stopped_outcome(rt.stop)), started_wall))
                        if rt.pid is None:
                            await sweep(task.id, None)
            if rt.pid is None and rt.phase == "installing":
                # The spider never ran, but an installer did (it carries the task's marker).
                with trio.CancelScope(shield=True):
                    await sweep(task.id, None)
            result = task_result(rt, outcome, started_wall)
            self._admission.lifecycle.emit(TaskFinished(task.id, result))
            # Stores the result and hands the rest to the outbox; the slot is free when this returns.
            await delivery.finish(result)
            await self.reclaim_if_blamed(rt)
        finally:
            self._admission.task_left(task.id)

    async def reclaim_if_blamed(self, rt: RunningTask) -> None:
        """After its result is recorded: a task blamed for a full disk loses its scratch
        (ckagent.task.diskshare.reclaim_if_blamed); nothing for any other task."""
        await diskshare.reclaim_if_blamed(self._outbox.disk, self.config, self.deployer.work_of(rt.task), rt)

    def adopt_environment(self, env_dir: Path) -> Callable[[], None]:
        """A re-adopted task's dependency environment is in use again (collection skips it); call
        what this returns when the task has ended here."""
        prepared = self._deps.adopt(env_dir)
        return lambda: self._deps.release(prepared)

    async def _report_unprepared(self, rt: RunningTask, exc: Exception, started_wall: float) -> None:
        """The task's directory or state could not be created: report FAILED straight to the master.

        Retried through master trouble for up to REPORT_RETRY_TIMEOUT seconds (there is no state
        store row to resume from); then the task is left to the master.
        """
        if isinstance(exc, IdentityError):  # no uid left for a new spider: the message says how to widen the range
            message = f"the node cannot give the spider an identity: {exc}"
        else:
            message = f"the node cannot prepare the task's directory or state: {type(exc).__name__}: {exc}"
        log.error("task %s: %s", rt.task.id, message)
        result = task_result(rt, TaskOutcome("FAILED", "DEPLOY_FAILED", message), started_wall)
        try:
            await self._master.report_result(rt.task.id, result, retry=Retry(timeout=REPORT_RETRY_TIMEOUT))
        except MasterError as report_exc:
            log.error("task %s: could not report the failure either (%s)", rt.task.id, report_exc)
        self._admission.lifecycle.emit(TaskFinished(rt.task.id, result))

    async def _execute(self, rt: RunningTask, task_dir: Path, sink: LogSink) -> TaskOutcome:
        """Slot → deploy → install → run one task; a TaskError of any phase becomes its FAILED outcome here.

        Exception groups out of the phases' nurseries are collapsed first (ckagent.node.errors), so a
        DeployError or DepsError raised inside one is still that error. Anything else propagates to
        :meth:`run_task` (reported AGENT_ERROR). Cancellation: as usual (the caller stores CANCELLED).
        """

        def notice(text: str) -> None:
            stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            sink.write_line(f"[ckagent {stamp}] {text}\n".encode())

        async with contextlib.AsyncExitStack() as held:  # the phases' holdings, until the outcome is known
            try:
                with collapsed_groups():
                    # Waiting for the lock or a slot, deploying and installing are interrupted by a stop at once.
                    with rt.stop.prepare_scope:
                        await held.enter_async_context(self._slot(rt))
                        code = await held.enter_async_context(self._deployed(rt, notice))
                        prepared = await held.enter_async_context(self._installed(rt, code, sink, notice))
                    if rt.stop.is_set():
                        notice(f"stopped before the spider started: {rt.stop.describe()}")
                        return TaskOutcome(*stopped_outcome(rt.stop))
                    return await self._run(rt, task_dir, code, prepared, notice, sink)
            except TaskError as exc:
                return failed_outcome(rt, exc, notice, self.config.agent_secrets)
        raise AssertionError("unreachable")  # pragma: no cover

    @contextlib.asynccontextmanager
    async def _slot(self, rt: RunningTask) -> AsyncIterator[None]:
        """The spider's lock, then a capacity token (a queued task never holds a slot)."""
        async with self._admission.spider_lock(rt.task.spider_id), self._admission.capacity:
            rt.phase = "deploying"
            self._admission.lifecycle.emit(TaskStarted(rt.task.id, rt.claimed_at, time.time()))
            yield

    @contextlib.asynccontextmanager
    async def _deployed(self, rt: RunningTask, notice: Notice) -> AsyncIterator[Code]:
        """The jail, the code version, command and working copy, and the dependencies' look (what the
        install phase begins with): one thread hop for a package deployed before. Raises DeployError,
        JailError."""
        task = rt.task
        started = trio.current_time()
        checks: list[Checked | None] = []
        async with contextlib.AsyncExitStack() as held:
            work = self.deployer.work_of(task)
            # At the end: the jail emptied and removed (once made), the working copy removed — in the
            # end hop of a spider that ran (its supervisor emptied the jail), else here in one hop.
            clearing = Clearing(work, rt, self.deployer.egress_detach(rt))
            held.push_async_callback(clearing)
            jails = clearing.jails

            def check(work: Path) -> None:  # in the prepare hop, once the working copy is there
                checks.append(self._deps.check(task.framework, work, **self._install_args(task)))

            def drop_unused() -> None:  # the task ended before its install took the environment
                for checked in checks:
                    if checked is not None:
                        checked.drop()

            held.callback(drop_unused)
            held.callback(self.deployer.notes.pop, task.id, None)

            try:
                code_dir, argv, how, copied = await self.deployer.deploy(rt, work, held, notice, jails, check)
            finally:
                rt.phase_seconds["deploy"] = trio.current_time() - started
            [jail] = jails
            if how is not None:
                notice(how)
            notice(f"working copy of {code_dir.name}: {copied}")
            for line in self.deployer.notes.pop(task.id, []):
                notice(line)
            notice(self._identity_line(rt))
            yield Code(code_dir, argv, work, jail, clearing, checks[-1] if checks else None)

    def _identity_line(self, rt: RunningTask) -> str:
        """The task log's line saying whom the spider runs as (its identity and the node's level)."""
        level = self.config.identities.level if self.config.identities is not None else "agent-user"
        return runs_as_text(rt.run_as, level)

    def _install_args(self, task: Task) -> dict[str, Any]:
        """What :meth:`Dependencies.check <ckagent.code.deps.Dependencies.check>` and ``prepare`` take of a task."""
        return {"marker": {MARKER_VAR: task.id}, "task_env": {**self.config.extra_env, **task.env},
                "home": self.config.work_dir / "spider-home" / safe_name(task.spider_id)}

    @contextlib.asynccontextmanager
    async def _installed(self, rt: RunningTask, code: Code, sink: LogSink, notice: Notice) -> AsyncIterator[Prepared]:
        """The task's environment (uv / npm, in its jail), released at the end. Raises DepsError."""
        task = rt.task
        rt.phase = "installing"
        started = trio.current_time()
        try:
            prepared = await self._deps.prepare(task.framework, task.spider_id, code.work, sink.write, jail=code.jail,
                                                checked=code.checked, **self._install_args(task))
        finally:
            rt.phase_seconds.setdefault("install", trio.current_time() - started)
        try:
            self._admission.lifecycle.emit(DepsPrepared(task.id, float(prepared.seconds), bool(prepared.cache_hit)))
            for note in prepared.notes:
                notice(note)
            env_name = f" ({prepared.env_dir.name})" if prepared.env_dir is not None else ""
            notice(f"dependencies {'cached' if prepared.cache_hit else 'installed'}{env_name} in "
                   f"{prepared.seconds:.3f} s")
            yield prepared
        finally:
            self._deps.release(prepared)

    async def _run(self, rt: RunningTask, task_dir: Path, code: Code, prepared: Prepared, notice: Notice,
                   sink: LogSink) -> TaskOutcome:
        """Spawn the spider in its jail, record its process, supervise it to its end. Raises SpawnError,
        JailError, BadTaskError (the task's args/env/params over the kernel's exec limits: ckagent.task.execlimits)."""
        task, jail, argv, c = rt.task, code.jail, code.argv, self.config
        env = spider_env(c, rt, task_dir, prepared, notice)
        privacy = c.containment.privacy if c.containment is not None else None
        timeout = self.config.execute_timeout if task.timeout_seconds is None else task.timeout_seconds
        stall = self.config.stall_timeout if task.stall_timeout_seconds is None else task.stall_timeout_seconds
        # Its state dir restored from the attempt's checkpoint, if any (DeployError); then its checkpoints run.
        await checkpoints_for(c, self._master, rt, task_dir, notice).prepare()
        rt.phase = "running"
        rt.started_at = time.time()
        store = self._store.sync

        def say(lines: list[str]) -> None:  # on the loop (called from the spawn hop), before the spawn
            for line in lines:
                notice(line)
            grace, source = stop_grace(task.framework, task.stop_grace_seconds, c.kill_grace, c.max_stop_grace)
            notice(f"running {shown_argv(argv, task, c.agent_secrets)} (timeout {f'{timeout:g} s' if timeout else 'none'}; "
                   f"stop grace {grace:g} s: {source})")

        def spawn() -> Monitored:
            """The spawn hop: the framework's (and its runtime's) spawn hooks (Scrapy's items …), the
            log's lines before the spider's own, the spawn, and its process recorded in the state store."""
            lines: list[str] = []
            if frameworks.has_spawn_hooks(task.framework):
                added = frameworks.spawn_additions(frameworks.SpawnContext(
                    task.framework, argv, env, code.work, prepared.env_dir,
                    items_declared=bool(task.outputs is not None and task.outputs.items)))
                env.update(added.env)
                lines = added.notices
            check_exec_size(task, argv, env)  # the kernel's E2BIG, as BAD_TASK naming the field
            trio.from_thread.run_sync(say, lines)
            make_task_tmp(task_dir, rt.run_as)
            make_resume_files(task_dir)  # CK_STATE_DIR, the control channel (ckagent.task.taskenv)
            mon = spawn_monitored(
                resolve_on_path(argv, env), cwd=code.work, env=env, task_id=task.id, task_dir=task_dir,
                output_path=sink.path, jail=jail, run_as=rt.run_as,
                deadline_at=None if not timeout else (rt.started_at or 0.0) + timeout, work=code.work,
                stall_timeout=stall, env_dir=prepared.env_dir,
                proxy_port=self.config.egress.proxy_port(rt.egress) if self.config.egress is not None else 0,
                privacy=privacy,
            )
            try:
                store.set_process(task.id, mon.pid, mon.pid, mon.handle.to_json())
            except StateStoreError as exc:  # a full disk: the task runs on, unrecorded (a crash: AGENT_LOST)
                log.error("task %s: cannot record its process: %s", task.id, exc)
            return mon

        try:
            mon = await trio.to_thread.run_sync(spawn)
        except OSError as exc:
            # No process ran, so no exit code (docs/protocol.md); the message says what failed.
            raise SpawnError(f"cannot start {argv[0]!r}: {os_error_text(exc)}") from exc
        except ContainmentError as exc:
            raise JailError(f"cannot put the spider into the task's {jail.level} jail: {exc}") from exc
        rt.pid = mon.pid
        if rt.delivery is not None:
            rt.delivery.watch_item_files(code.work)  # declared JSON Lines files stream while they grow
        code_dir = code.code_dir

        def end(refused: list[Refusal] | None, blamed: bool = False) -> Callable[[], None]:
            """In the end hop, after its reads (``refused``: what the egress rules refused): the task's
            files → items, artifacts or kept (not for a task ``blamed`` for a full disk: its working
            copy is scratch); then the jail (emptied by the supervisor) and the working copy removed.
            Returns the outputs line's writer (on the loop, after the outcome's lines)."""
            if blamed:
                code.clearing.blocking(refused)
                return lambda: notice("outputs: not collected: the task filled the disk; its working copy, data "
                                      "dir and the files of its task dir that are not its log, items or artifacts "
                                      "are removed once this result is recorded")
            collected = self.deployer.collect_blocking(rt, task_dir, code.work, code_dir)
            code.clearing.blocking(refused)
            return lambda: self.deployer.say_collected(rt, collected, notice)

        return await self.finish_run(rt, mon, jail, sink, notice, timeout, end)

    async def finish_run(self, rt: RunningTask, mon: Monitored, jail: TaskJail, sink: LogSink,
                         notice: Notice, timeout_seconds: float,
                         end: Callable[[list[Refusal] | None, bool], Callable[[], None]] | None = None) -> TaskOutcome:
        """Supervise a spawned or re-adopted spider to its end and judge its outcome (ckagent.containment.monitor).

        The supervisor waits on the task's :class:`Watchdog`: its stop, its deadline
        (``mon.handle.deadline_at``, kept across agent restarts; ``timeout_seconds`` is its length,
        for the words) and its stall limit (``mon.handle.stall_timeout`` seconds without a sign of
        life the delivery recorded). ``end``: more blocking work for the end hop, after its reads (it
        gets what the egress rules refused; the runner's: the outputs and the clear-up); what it
        returns runs on the loop last; it is told whether the task was blamed for a full disk.
        """
        task, handle, c = rt.task, mon.handle, self.config
        accounted = diskshare.accounted_of(self.config, task, Path(handle.work))
        outbox: Outbox | None = self._outbox  # (None: a runner tests drive without one)
        if outbox is not None:
            outbox.account(task.id, accounted)  # the disk loop measures its use from now on
        work_dir = self.config.work_dir
        activity = rt.delivery.activity if rt.delivery is not None else None
        if activity is not None and handle.stall_timeout > 0:
            activity.touch()  # the stall limit counts from the spawn (or the re-adoption)
        grace, _source = stop_grace(task.framework, task.stop_grace_seconds, c.kill_grace, c.max_stop_grace)
        watchdog = Watchdog(rt.stop, deadline_at=handle.deadline_at, timeout_seconds=timeout_seconds,
                            stall_timeout=handle.stall_timeout, last_activity=activity.last if activity else None,
                            alarm=rt.checkpoints)  # its first checkpoint's time (ckagent.task.checkpoints)
        async with checkpointing(rt.checkpoints):  # its persist requests while it runs (ckagent.task.checkpoints)
            outcome = await supervise(
                mon, jail=jail, sink=sink, grace=grace, stop=watchdog, why=rt.stop.describe,
                notice=notice, stop_signal=task.stop_signal_number, leave_running=lambda: self._hand_over(rt),
            )
        egress = self.config.egress if rt.egress is not None else None

        def end_reads() -> tuple[bytes, Figures, list[Refusal] | None, Callable[[], None] | None]:
            """The end hop: the output's tail, the jail's figures (into the result: cpuSeconds,
            memoryPeakBytes, ...), what the egress rules refused (blocking reads, nft); the task's disk
            use judged (ckagent.delivery.diskwatch: a task that filled the disk too fast for the
            watch is blamed here, before its result); then ``end()`` (a blamed task's files are not
            collected: its working copy is scratch)."""
            refused = egress.refusals(rt.egress) if egress is not None else None
            remove_task_tmp(Path(handle.status_file).parent)  # its TMPDIR goes with its last process
            used, free = diskshare.measure_end(accounted, work_dir)
            blamed = outbox is not None and trio.from_thread.run_sync(diskshare.judge_end, outbox.disk, rt, used, free)
            return (output_tail(sink.path), jail.figures(), refused,
                    end(refused, blamed) if end is not None else None)

        try:
            tail, figures, refused, last = await trio.to_thread.run_sync(end_reads)
        finally:
            if outbox is not None:
                outbox.unaccount(task.id)
        stderr_tail = TailBuffer(16384)
        stderr_tail.write(tail)
        if figures.oom_kills and not outcome.stopped:
            judged = oom_outcome(jail, figures, outcome.returncode, "the spider")
            notice(f"{judged.error_message}; task FAILED (OOM_KILLED)")
        else:
            judged = judge_exit(rt, outcome, notice, stderr_tail, sink, self.config.agent_secrets)
            judged.figures = figures
        if refused is not None:
            judged.egress_refused = refused
            report_refusals(task.id, refused, notice)
        if last is not None:
            last()
        return judged

    def _hand_over(self, rt: RunningTask) -> bool:
        """True (and the task marked handed over) when the agent leaves this task's spider running."""
        if self._admission.handing_over and not rt.handed_over and rt.stop.reason in (None, StopReason.TERMINATING):
            rt.handed_over = True
        return rt.handed_over
