"""The agent: the root nursery and the shutdown state machine — composition only.

::

    trio.run(Agent.run)
    └── root nursery
        ├── status server      /metrics /healthz /readyz /status on agent.bind:agent.port (status.py);
        │                      listens from the start, serves from the first heartbeat on
        ├── signals            SIGTERM → drain (second SIGTERM → terminate), SIGINT → terminate
        ├── heartbeat loop     until STOPPED (beats DRAINING while draining)
        ├── outbox             every task's logs, items and result (delivery.Outbox): tasks hand
        │                      theirs over when their process ends (the slot frees at once); the
        │                      leftovers of an earlier run are resumed at start; retention cleanup
        └── work scope
            ├── poller         (its own scope: cancelled when draining starts)
            └── one run_task per claimed task

States: RUNNING → DRAINING (stop claiming; running tasks get ``task.drain_timeout`` seconds) →
TERMINATING (every task: TERM → ``task.kill_grace`` → KILL, reported CANCELLED; then a bounded
flush) → STOPPED (work scope cancelled if it still runs; unsent data stays in the state store for
the next start). The agent therefore exits within drain_timeout + kill_grace + flush_timeout
(plus a few seconds), even with the master down: one deadline, set when TERMINATING starts, bounds
both the tasks' reporting and the final flush. A signal while STOPPING (flushing) skips the rest
of the flush.

Crash recovery runs before registration (it needs no master): leftovers of tasks that ran when the
agent died are killed at once, and their AGENT_LOST results wait in the state store.

Exit codes of :func:`run_agent`: 0 after a clean drain/terminate, 1 when the agent cannot run
(registration refused, state store unusable, status port in use), 2 for configuration problems
found late. Before anything else it locks the work dir (ckagent.workdir): a second agent on the same
work dir is refused (ConfigError, exit 2) instead of killing the first one's tasks as leftovers.
"""

from __future__ import annotations

import logging
import os
import platform
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import trio

from ckagent import __version__
from ckagent.capabilities import Capabilities
from ckagent.config import ConfigError, Settings
from ckagent.containment import Containment, ContainmentError, Limits, open_containment
from ckagent.delivery import Outbox, OutboxConfig, cleanup_task_dirs
from ckagent.deps import Dependencies, IndexChooser, remove_legacy_environments, spider_base_env
from ckagent.fleet import VersionWatch, load_node_uid
from ckagent.hardening import protect_agent_memory
from ckagent.heartbeat import HeartbeatLoop
from ckagent.intake import DiskFloorWatch, IntakeGate
from ckagent.logs import log_task_finished, setup_logging
from ckagent.master import MasterClient, RegistrationRefused
from ckagent.metrics import AgentMetrics
from ckagent.poller import Poller
from ckagent.process import RunAs
from ckagent.protocol import FEATURES, PROTOCOL_VERSION, RegisterRequest, Task, TaskResult
from ckagent.recovery import recover_lost_tasks
from ckagent.resources import HealthSampler, compute_max_workers
from ckagent.runtimes import (
    BROWSER_VARS,
    RUNTIMES_CACHE,
    browser_env,
    detect_runtimes,
    load_cached_runtimes,
    save_runtimes_cache,
)
from ckagent.state import AsyncStateStore, StateStore, StateStoreError, TaskRecord
from ckagent.status import AgentStatus, StatusPortError, serve_status
from ckagent.supervisor import RunnerConfig, RunningTask, Supervisor
from ckagent.workdir import WorkDirError, WorkDirLock
from ckagent.workspace import Workspaces

log = logging.getLogger(__name__)

FLUSH_TIMEOUT = 10.0
"""Default of ``task.flush_timeout``: seconds the agent waits, when stopping, for unsent results and
streams before leaving them on disk."""
RUNTIME_SCAN_INTERVAL = 300.0
DEFERRED_START_LIMIT = 1.0
"""Seconds after the start by which the work kept off the way to the first heartbeat (see
:meth:`Agent._after_first_heartbeat`) begins even if that heartbeat has not gone out (master slow or away)."""


class Agent:
    """One node agent. Build it from Settings, then ``trio.run(agent.run)``; ``state`` is public."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = "STARTING"
        self.work_dir = settings.task.work_dir
        self.max_workers = compute_max_workers(settings.agent.max_workers, settings.agent.container_cpu_limit)
        self.runtimes: dict[str, Any] = {}
        self._browser_env: dict[str, str] = {}
        self.intake = IntakeGate()
        """Closed while the node takes no tasks for a reason of its own (ckagent.intake)."""
        self.versions = VersionWatch(self.intake, auto_upgrade=settings.agent.auto_upgrade)
        self.node_uid: str | None = None
        self.capabilities = Capabilities(settings.deps.uv_path)
        self._work_scope = trio.CancelScope()
        self._poll_scope = trio.CancelScope()
        self._startup_scope = trio.CancelScope()
        self.supervisor: Supervisor | None = None
        self._work_done = trio.Event()
        self._terminating = trio.Event()
        self._flush_scope = trio.CancelScope()
        self._exit_deadline = float("inf")
        """trio time by which the agent stops waiting for tasks and the master (set by TERMINATING)."""
        self.started = trio.Event()
        """Set once the agent has registered, recovered and begun polling (state RUNNING)."""
        self.metrics = AgentMetrics(__version__, settings.agent.name)
        self.status_port: int | None = None
        self.containment: Containment | None = None
        """The containment level in force (set at the start of :meth:`run`)."""
        """The port the status/metrics server listens on (``agent.port``, or the one picked for 0)."""
        token = settings.agent.registration_token
        self._secrets = tuple(
            s.reveal() for s in (token, settings.agent.api_key) if s is not None
        )
        self.master = MasterClient(
            settings.server.url,
            token.reveal() if token is not None else "",
            self._register_body,
            request_timeout=settings.server.request_timeout,
            ca_file=str(settings.server.ca_file) if settings.server.ca_file else None,
            observer=self.metrics.master_request,
        )

    def _register_body(self) -> RegisterRequest:
        s = self.settings
        return RegisterRequest(
            name=s.agent.name,
            ip=s.agent.ip,
            port=self.status_port if self.status_port is not None else s.agent.port,
            version=__version__,
            os=platform.system().lower(),
            arch=platform.machine(),
            python=platform.python_version(),
            cpu_count=psutil.cpu_count() or 1,
            memory_total_bytes=psutil.virtual_memory().total,
            max_workers=self.max_workers,
            runtimes=self._runtimes_report(),
            labels=dict(s.agent.labels),
            node_uid=self.node_uid,
            protocol_version=PROTOCOL_VERSION,
            features=list(FEATURES),
            containment=self.containment.to_json() if self.containment is not None else {},
        )

    async def run(self) -> int:
        """Run until stopped by a signal (or :meth:`drain` / :meth:`terminate`). Returns the exit code."""
        s = self.settings
        try:
            store = AsyncStateStore(await trio.to_thread.run_sync(StateStore, self.work_dir / "state.db"))
        except StateStoreError as exc:
            log.error("%s", exc)
            return 1
        try:
            run_as = _run_as(s.task.run_as_user)
        except ValueError as exc:
            log.error("%s", exc)
            return 2
        try:
            containment = self.containment = await trio.to_thread.run_sync(
                open_containment, s.task.containment, self.work_dir)
        except ContainmentError as exc:
            log.error("%s", exc)
            await trio.to_thread.run_sync(store.sync.close)
            return 2
        self.metrics.containment_level(containment.level)
        if os.getpid() == 1:
            log.warning("running as PID 1 without an init: processes orphaned by spiders are not reaped "
                        "(<defunct> entries pile up); run the container with `--init` or tini "
                        "(see docs/operations.md)")
        # Registration uses the last scan (cached on disk): a fresh scan runs ~0.5-1 s of
        # subprocesses, so it goes on in the background and reaches the master with the heartbeats.
        self.runtimes = await trio.to_thread.run_sync(load_cached_runtimes, self.work_dir / RUNTIMES_CACHE)
        try:
            self.node_uid = await trio.to_thread.run_sync(load_node_uid, self.work_dir)
        except OSError as exc:
            log.error("cannot keep the node's id in %s: %s", self.work_dir, exc)
            return 1
        base_env = spider_base_env()
        # Browser spiders use the system's browser (nothing can be downloaded at run time): its path
        # comes from the runtimes scan, updated in place after each rescan.
        extra_env = self._browser_env = browser_env(self.runtimes)
        workspaces = self.workspaces = Workspaces(self.work_dir / "spiders", self.master)
        deps = Dependencies(
            self.work_dir / "envs",
            uv_path=s.deps.uv_path,
            index=IndexChooser(s.deps.uv_index_url, s.deps.uv_fallback_index_url),
            uv_cache_dir=s.deps.uv_cache_dir,
            timeout=s.deps.uv_sync_timeout,
            base_env=base_env,
            run_as=run_as,
            budget_bytes=s.deps.env_budget_bytes,
        )
        await trio.to_thread.run_sync(remove_legacy_environments, self.work_dir)
        outbox = self.outbox = Outbox(self.master, store, self.work_dir, OutboxConfig(
            log_globs=tuple(g for g in s.task.log_files.split(",") if g),
            max_log_bytes=s.task.max_log_bytes, min_free_disk_bytes=s.task.min_free_disk_bytes,
            retention=s.task.retention, agent_secrets=self._secrets,
        ))
        self.metrics.outbox = outbox
        supervisor = self.supervisor = Supervisor(
            RunnerConfig(self.work_dir, s.task.execute_timeout, s.task.kill_grace, self._secrets, extra_env,
                         run_as=run_as, stall_timeout=s.task.stall_timeout, containment=containment,
                         default_limits=Limits(s.task.memory_limit_bytes, s.task.pids_limit, s.task.cpus_limit)),
            self.master, store, workspaces, deps, self.max_workers,
            on_finished=self._task_delivered, outbox=outbox, observer=self.metrics,
        )
        self.heartbeat = HeartbeatLoop(
            self.master, supervisor, HealthSampler(self.work_dir), s.heartbeat.interval,
            status=lambda: "DRAINING" if self.state in ("DRAINING", "TERMINATING") else "RUNNING",
            runtimes=self._runtimes_report,
            paused_reason=lambda: self.intake.reason,
            on_policy=self.versions.apply,
        )
        self.poller = Poller(
            self.master, supervisor, poll_interval=s.task.poll_interval,
            long_poll_wait=s.task.long_poll_wait, request_timeout=s.server.request_timeout,
            gate=self.intake,
            cannot_run=self.capabilities.cannot_run,
        )
        disk_watch = self.disk_watch = DiskFloorWatch(self.intake, self.work_dir, s.task.min_free_disk_bytes)
        log.info("ckagent %s starting: master %s, work_dir %s, max_workers %d",
                 __version__, s.server.url, self.work_dir, self.max_workers)
        self.capabilities.warn()
        try:
            async with trio.open_nursery() as root:
                status = AgentStatus(self, self.metrics, self.metrics.outbox)
                try:
                    self.status_port = await root.start(partial(
                        serve_status, status.routes(), s.agent.bind or s.agent.ip, s.agent.port,
                        serve_after=self._after_first_heartbeat))
                except StatusPortError as exc:
                    log.error("%s", exc)
                    root.cancel_scope.cancel()
                    return 1
                root.start_soon(self._signals)
                root.start_soon(self._rescan_runtimes)
                leftovers = await recover_lost_tasks(store, self.metrics.task_lost, containment)
                if s.task.cleanup_temp_files:
                    await cleanup_task_dirs(store, self.work_dir / "tasks", 0)
                self.versions.nursery = root
                try:
                    with self._startup_scope:
                        registered = await self.master.register()
                        self.versions.apply(registered.policy)
                except RegistrationRefused as exc:
                    log.error("%s", exc)
                    root.cancel_scope.cancel()
                    return 1
                if self._startup_scope.cancel_called:
                    log.info("stopped before registration completed")
                    root.cancel_scope.cancel()
                    return 0
                await root.start(outbox.run)
                outbox.stats_observer = self.metrics.crawl.observe
                for record in leftovers:
                    await outbox.resume(record)
                    delivery = outbox.deliveries.get(record.task_id)
                    if delivery is not None:  # the canonical line of a task an earlier run left unsent
                        delivery.on_delivered = partial(self._leftover_delivered, record)
                root.start_soon(self.heartbeat.run)
                if s.task.min_free_disk_bytes:
                    await disk_watch.check()  # before the first poll
                    root.start_soon(disk_watch.run)
                if self.state == "STARTING":
                    self.state = "RUNNING"
                self.started.set()
                with self._work_scope:
                    async with trio.open_nursery() as work:
                        with self._poll_scope:
                            await self.poller.run(work)
                self._work_done.set()
                self.state = "STOPPING"
                flush_until = min(trio.current_time() + s.task.flush_timeout, self._exit_deadline)
                with self._flush_scope, trio.move_on_at(flush_until):
                    await outbox.wait_idle()
                if outbox.pending:
                    log.warning("stopping with undelivered results or logs; they stay in %s for the next start",
                                self.work_dir / "state.db")
                root.cancel_scope.cancel()
        finally:
            self.state = "STOPPED"
            with trio.CancelScope(shield=True):
                await self.master.aclose()
                await trio.to_thread.run_sync(store.sync.close)
            containment.close()
            log.info("ckagent stopped")
        return 0

    # ------------------------------------------------------------------ shutdown

    def drain(self) -> None:
        """RUNNING → DRAINING: stop claiming; running tasks may finish (idempotent)."""
        if self.state in ("RUNNING", "STARTING"):
            running = len(self.supervisor.running) if self.supervisor is not None else 0
            log.info("draining: no new tasks; %d running task(s) get up to %g s",
                     running, self.settings.task.drain_timeout)
            self.state = "DRAINING"
        self._startup_scope.cancel()
        self._poll_scope.cancel()

    def terminate(self) -> None:
        """→ TERMINATING: stop every task (TERM → grace → KILL, reported CANCELLED) (idempotent).

        From then on the agent stops within ``kill_grace + flush_timeout`` seconds: what the master
        has not acknowledged by then stays in the state store. Call it from inside the agent's Trio run.
        """
        if self._terminating.is_set():
            return
        log.info("terminating: stopping every running task")
        self._exit_deadline = trio.current_time() + self.settings.task.kill_grace + self.settings.task.flush_timeout
        self.state = "TERMINATING"
        self._terminating.set()
        self._startup_scope.cancel()
        self._poll_scope.cancel()
        if self.supervisor is not None:
            self.supervisor.cancel_all("agent terminating")
        trio.lowlevel.spawn_system_task(self._terminate_deadline)

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if self.state == "STOPPING":
                    log.info("%s while flushing: leaving unsent data on disk and exiting now", name)
                    self._flush_scope.cancel()
                elif signum == signal.SIGTERM and self.state not in ("DRAINING", "TERMINATING"):
                    log.info("SIGTERM: draining (a second SIGTERM or SIGINT terminates)")
                    self.drain()
                    trio.lowlevel.spawn_system_task(self._drain_deadline)
                else:
                    log.info("%s: terminating", name)
                    self.terminate()

    async def _drain_deadline(self) -> None:
        with trio.move_on_after(self.settings.task.drain_timeout):
            await self._work_done.wait()
            return
        log.warning("drain deadline (%g s) passed with tasks still running", self.settings.task.drain_timeout)
        self.terminate()

    async def _terminate_deadline(self) -> None:
        with trio.move_on_at(self._exit_deadline):
            await self._work_done.wait()
            return
        log.warning("tasks did not finish reporting within kill_grace + flush_timeout (%g s); leaving "
                    "unsent data for the next start",
                    self.settings.task.kill_grace + self.settings.task.flush_timeout)
        self._work_scope.cancel()

    # ------------------------------------------------------------------ the canonical task line

    def _task_delivered(self, rt: RunningTask, result: TaskResult) -> None:
        """The master acknowledged a task's final result: log its canonical line, settle its metrics."""
        install = self.metrics.install_info.pop(rt.task.id, None)
        _canonical_line(rt.task, result, install)
        self.metrics.task_reported(rt.task.id, result, rt.claimed_at)

    def _leftover_delivered(self, record: TaskRecord, result: TaskResult) -> None:
        try:
            task: Task | None = Task.from_json(record.task_json)
        except ValueError:
            task = None
        _canonical_line(task, result, None, task_id=record.task_id)
        self.metrics.task_reported(record.task_id, result, record.claimed_at)

    async def _after_first_heartbeat(self) -> None:
        """Return once the first heartbeat was tried, or DEFERRED_START_LIMIT seconds after the call.

        What the first heartbeat does not need waits here, so that it does not compete with the
        start for the CPU: the status server's hypercorn (~45 ms of imports; the port listens from
        the start and early requests wait in its backlog) and the runtime rescan's subprocesses
        (registration uses the cached scan; the fresh one reaches the master with the heartbeats).
        """
        with trio.move_on_after(DEFERRED_START_LIMIT):
            await self.heartbeat.first_beat.wait()

    def _runtimes_report(self) -> dict[str, Any]:
        """The runtimes scan, plus ``missing``: tool → what its absence costs (ckagent.capabilities)."""
        missing = self.capabilities.missing
        return {**self.runtimes, "missing": dict(missing)} if missing else self.runtimes

    async def _rescan_runtimes(self) -> None:
        """Scan what the node can run (after the first heartbeat) and every RUNTIME_SCAN_INTERVAL seconds;
        keep the last scan on disk."""
        await self._after_first_heartbeat()
        while True:
            self.runtimes = await trio.to_thread.run_sync(detect_runtimes, self.settings.deps.uv_path)
            was_missing = set(self.capabilities.missing)
            if was_missing - set(self.capabilities.refresh()):
                log.info("found %s again: taking the spiders that need it",
                         ", ".join(sorted(was_missing - set(self.capabilities.missing))))
                self.poller.forget_unrunnable()
            await trio.to_thread.run_sync(save_runtimes_cache, self.work_dir / RUNTIMES_CACHE, self.runtimes)
            browsers = await trio.to_thread.run_sync(browser_env, self.runtimes)
            for variable in BROWSER_VARS.values():
                self._browser_env.pop(variable, None)
            self._browser_env.update(browsers)
            await trio.sleep(RUNTIME_SCAN_INTERVAL)


def _run_as(user: str | None) -> RunAs | None:
    """``task.run_as_user`` resolved; None when unset or when it is the agent's own user.

    Raises ValueError for an unknown user, or when switching users needs root and the agent is not.
    """
    if user is None:
        return None
    try:
        run_as = RunAs.lookup(user)
    except ValueError as exc:
        raise ValueError(f"task.run_as_user (AGENT_TASK_RUN_AS_USER): no user {user!r} on this node; "
                         "create the user or unset the setting") from exc
    if run_as.uid == os.geteuid():
        return None
    if os.geteuid() != 0:
        raise ValueError(f"task.run_as_user={user!r} needs the agent to run as root (it runs as uid "
                         f"{os.geteuid()}); unset it or start the agent as root")
    log.info("spiders and installers run as %s (uid %d, gid %d)", run_as.name, run_as.uid, run_as.gid)
    return run_as


def _canonical_line(task: Task | None, result: TaskResult, install: tuple[float, bool] | None,
                    task_id: str | None = None) -> None:
    """The one line per finished task (see :func:`ckagent.logs.log_task_finished`); ``install`` is
    (seconds, cache hit) when the dependencies were prepared."""
    log_task_finished(log, {
        "task_id": task.id if task is not None else task_id,
        "spider": (task.spider_name or task.spider_id) if task is not None else None,
        "status": result.status,
        "error_code": result.error_code,
        "exit_code": result.exit_code,
        "duration_seconds": None if result.duration_ms is None else round(result.duration_ms / 1000, 3),
        "items": result.item_count,
        "log_lines": result.log_lines,
        "install_seconds": None if install is None else round(install[0], 3),
        "cache_hit": None if install is None else install[1],
    })


def run_agent(settings: Settings) -> int:
    """Entry point for ``ckagent run``: set up logging, lock the work dir, run the agent on Trio;
    returns the exit code.

    Raises ConfigError (the CLI prints it, exit 2) when the log file cannot be opened or the work
    dir cannot be created, written or locked (another agent uses it).
    """
    from ckagent.preflight import preflight

    errors = [p.message for p in preflight(settings, port=False) if p.error]  # the checks of `config check`
    if errors:
        raise ConfigError("; ".join(errors))
    token, api_key = settings.agent.registration_token, settings.agent.api_key
    protect_agent_memory()  # spiders of the same user must not read the secrets in /proc/<pid>/environ
    try:
        setup_logging(settings.logging.level, settings.logging.file, settings.logging.format,
                      max_bytes=settings.logging.max_bytes, backup_count=settings.logging.backup_count,
                      secrets=[s.reveal() for s in (token, api_key) if s is not None])
    except OSError as exc:
        raise ConfigError(f"logging.file (AGENT_LOG_FILE) {str(settings.logging.file)!r} cannot be opened: "
                          f"{exc.strerror or exc}; point it at a writable file (its directory is created)") from exc
    try:
        # Before anything touches the work dir: crash recovery would kill another agent's tasks.
        lock = WorkDirLock.acquire(Path(settings.task.work_dir))
    except WorkDirError as exc:
        log.error("%s", exc)
        raise ConfigError(str(exc)) from exc
    agent = Agent(settings)
    try:
        return trio.run(agent.run)
    except KeyboardInterrupt:  # pragma: no cover - SIGINT is handled inside; this is a second Ctrl-C race
        return 130
    finally:
        lock.release()
        sys.stderr.flush()
