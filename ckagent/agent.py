"""The agent: the root nursery and the shutdown state machine — composition only.

::

    trio.run(Agent.run)
    └── root nursery
        ├── status server      /metrics /healthz /readyz /status on agent.bind:agent.port (status.py);
        │                      listens from the start, serves from the first heartbeat on
        ├── signals            SIGTERM → drain or migrate (ckagent.node.stopsignals), SIGINT → terminate,
        │                      SIGUSR2 → hand over (stop, leave running spiders to the next agent)
        ├── migration          waits for a migrate (ckagent.task.migrating): checkpoint, stop, MIGRATED
        ├── memory watch       holds running tasks to their soft memory ceilings (ckagent.task.memwatch)
        ├── heartbeat loop     until STOPPED (each beat sends one NodeReport: the state as it is)
        ├── lifecycle records  the tasks' facts, one channel → metrics, the canonical task line
        ├── runtime scan, version watch (the upgrade the master may ask for)
        ├── ephemeral watch    agent.exit_when_idle / max_tasks: a drain when idle or done (ckagent.node.ephemeral)
        ├── outbox             every task's logs, items and result (delivery.Outbox): tasks hand
        │                      theirs over when their process ends (the slot frees at once); the
        │                      leftovers of an earlier run are resumed at start; retention cleanup
        └── work scope
            ├── poller         stops polling when draining starts; settles its claims on the wire
            └── one run_task per claimed task

The shutdown order is the nesting of :meth:`Agent.run` (as hypercorn's ``trio/run.py`` worker_serve)::

    root nursery                          status server, signals, heartbeat, outbox: until STOPPED
    └── work scope                        TERMINATING sets its deadline (kill_grace + flush_timeout)
        └── work nursery                  one run_task per claimed task
            ├── poller.run(work)          returns when DRAINING starts (claims on the wire settled:
            │                             run, or given back to the master)
            ├── move_on_at(drain deadline): supervisor.wait_idle()     DRAINING: tasks may finish
            └── terminate()               TERMINATING: every task TERM → kill_grace → KILL, CANCELLED
    STOPPING: move_on_at(flush deadline): outbox.wait_idle()            bounded flush
    STOPPED: the root nursery is gone; one last heartbeat says so (≤ FINAL_BEAT_TIMEOUT s), then leaving

States (:class:`AgentState`, reported truthfully in every heartbeat): STARTING → RUNNING → DRAINING
(SIGTERM: stop claiming; running tasks get ``task.drain_timeout`` seconds; a migrate: DRAINING too, each
task checkpointed and stopped MIGRATED within ``task.migrate_timeout``) → TERMINATING (SIGINT, a
second SIGTERM or the drain deadline) → STOPPING (a bounded flush; unsent data stays in the state
store for the next start) → STOPPED. The agent therefore exits within drain_timeout + kill_grace +
flush_timeout (plus a few seconds), even with the master down: one deadline, set when TERMINATING
starts, bounds both the tasks' reporting and the final flush. A signal while STOPPING skips the rest
of the flush (and the last heartbeat).

Crash recovery runs before registration (it needs no master): leftovers of tasks that ran when the
agent died are killed at once, and their AGENT_LOST results wait in the state store.

Exit codes are decided in one place (ckagent.node.errors): :meth:`Agent.run` returns 0 after a clean
drain/terminate and raises StartupError (exit 1: state store unusable, status port in use,
registration refused) or ConfigError (exit 2); ``ckagent.cli.main`` turns them into the exit status.
Before anything else :func:`run_agent` locks the work dir (ckagent.node.workdir): a second agent on the
same work dir is refused (ConfigError) instead of killing the first one's tasks as leftovers.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from functools import partial

import trio

from ckagent import __version__
from ckagent.code.capabilities import Capabilities
from ckagent.code.deps import Dependencies, IndexChooser, spider_base_env
from ckagent.code.runtimescan import RuntimeScan
from ckagent.code.workspace import Workspaces
from ckagent.containment import Containment, Limits
from ckagent.containment.egress import Egress
from ckagent.delivery import Outbox, OutboxConfig, cleanup_task_dirs
from ckagent.delivery.lifecycle import CanonicalLine, Lifecycle
from ckagent.master.client import MasterClient, RegistrationRefused
from ckagent.master.fleet import VersionWatch, final_beat, leave, load_node_uid, register_request
from ckagent.master.heartbeat import HeartbeatLoop, NodeReport
from ckagent.master.masterclock import MasterClock
from ckagent.master.protocol import HeartbeatResponse, RegisterRequest
from ckagent.node.config import Settings
from ckagent.node.ephemeral import EphemeralWatch
from ckagent.node.errors import StartupError
from ckagent.node.hardening import freeze_startup_objects
from ckagent.node.identity import Identities
from ckagent.node.intake import DiskFloorWatch, IntakeGate
from ckagent.node.listen import StatusPortError
from ckagent.node.notices import Notices
from ckagent.node.resources import HealthSampler, compute_max_workers
from ckagent.node.state import AsyncStateStore, StateStore, StateStoreError
from ckagent.node.stoprequest import StopMode, remove_request
from ckagent.node.stopsignals import HAND_OVER_SIGNAL, StopActions, receive_stop_signals, stop_at_start
from ckagent.port.metrics import AgentMetrics
from ckagent.port.snapshot import AgentHistory, agent_statistics, node_report
from ckagent.port.status import AgentStatistics, AgentStatus, serve_status
from ckagent.port.statuspage import StatusPage
from ckagent.task.adoption import Adoption, admit_adopted, find_adoptable, release_listeners, run_adopted
from ckagent.task.lifespan import end_of_life, open_lifespan
from ckagent.task.migrating import REAP_MARGIN
from ckagent.task.migration import migrate_node
from ckagent.task.nodelevels import EgressLost, open_levels
from ckagent.task.poller import Poller
from ckagent.task.recovery import recover_lost_tasks
from ckagent.task.supervisor import RunnerConfig, RunningTask, Supervisor

log = logging.getLogger(__name__)

__all__ = ["HAND_OVER_SIGNAL", "Agent", "AgentState"]


class AgentState(str, enum.Enum):
    """The agent's lifetime states, in order (see the module docstring); the heartbeat sends the value."""

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    DRAINING = "DRAINING"
    TERMINATING = "TERMINATING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"

    def __str__(self) -> str:
        return self.value


class Agent:
    """One node agent. Build it from Settings, then ``trio.run(agent.run)``; ``state`` is public."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = AgentState.STARTING
        self.history = AgentHistory()  # its start, the tasks re-adopted and handed over (/status)
        self.work_dir = settings.task.work_dir
        self.max_workers = compute_max_workers(settings.agent.max_workers, settings.agent.container_cpu_limit)
        self.intake = IntakeGate()
        """Closed while the node takes no tasks for a reason of its own (ckagent.node.intake)."""
        self.versions = VersionWatch(self.intake, auto_upgrade=settings.agent.auto_upgrade)
        self.node_uid: str | None = None
        self.capabilities = Capabilities(settings.deps.uv_path)
        self.scan = RuntimeScan(self.work_dir, settings.deps.uv_path, self.capabilities)
        """What the node can run (``scan.runtimes``), rescanned in the background."""
        self._startup_scope = trio.CancelScope()
        """Registration: a stop before it completes ends it."""
        self._work_scope = trio.CancelScope()
        """The tasks' scope: TERMINATING sets its deadline."""
        self._adopted: list[tuple[RunningTask, Adoption]] = []  # re-adopted at start (ckagent.task.adoption)
        self._handed = 0  # running tasks left to the next agent (hand_over)
        self._drain_scope = trio.CancelScope()
        """DRAINING's wait for the tasks: TERMINATING ends it."""
        self._flush_scope = trio.CancelScope()
        """STOPPING's flush: a signal while flushing ends it."""
        self._drain_deadline = float("inf")
        """trio time by which the running tasks must have finished (set when DRAINING starts)."""
        self._exit_deadline = float("inf")
        """trio time by which the agent stops waiting for tasks and the master (set by TERMINATING)."""
        self._hurry = False
        """A signal arrived while STOPPING: skip what is left, the last heartbeat included."""
        self.ephemeral: EphemeralWatch | None = None
        """agent.exit_when_idle / agent.max_tasks: the watch that stops an ephemeral worker (ckagent.task.lifespan)."""
        self._undelivered = 0  # tasks whose results or logs the final flush left on disk
        self.supervisor: Supervisor | None = None
        self.poller: Poller | None = None
        self.outbox: Outbox | None = None
        self.heartbeat: HeartbeatLoop | None = None
        self.workspaces: Workspaces | None = None
        self.started = trio.Event()
        """Set once the agent has registered, recovered and begun polling (state RUNNING)."""
        self.metrics = AgentMetrics(__version__, settings.agent.name)
        self.lifecycle = Lifecycle([self.metrics.record, CanonicalLine()])
        """The one channel of the tasks' lifecycle records (ckagent.delivery.lifecycle), read in the root nursery."""
        self.status_port: int | None = None
        """The port the status/metrics server listens on (``agent.port``, or the one picked for 0)."""
        self.containment: Containment | None = None
        """The containment level in force (set at the start of :meth:`run`)."""
        self.egress: Egress | None = None
        """The egress level and node policy in force (set at the start of :meth:`run`)."""
        self.notices = Notices()
        """Operator notices (spiders as root, the master's clock): logged once, in /status and on the page."""
        self.identities: Identities | None = None
        """Whom spiders run as: the identity level in force (set at the start of :meth:`run`)."""
        token = settings.agent.registration_token
        self._secrets = tuple(s.reveal() for s in (token,) if s is not None)
        self.master = MasterClient(
            settings.server.url,
            token.reveal() if token is not None else "",
            self._register_body,
            request_timeout=settings.server.request_timeout,
            max_backoff_interval=settings.server.max_backoff_interval,
            ca_file=str(settings.server.ca_file) if settings.server.ca_file else None,
            observer=self.metrics.master_request,
        )
        self.master.clock = MasterClock(self.notices)

    def _register_body(self) -> RegisterRequest:
        s = self.settings
        return register_request(
            s.agent, port=self.status_port if self.status_port is not None else s.agent.port,
            max_workers=self.max_workers, runtimes=self.scan.report(), node_uid=self.node_uid,
            containment={**(self.containment.to_json() if self.containment is not None else {}),
                         "spiderUser": self.identities.to_json() if self.identities is not None else {}},
            egress=self.egress.to_json() if self.egress is not None else {})

    async def run(self) -> int:
        """Run until stopped by a signal (or :meth:`drain` / :meth:`terminate`); returns 0.

        Raises StartupError (exit code 1) when the agent cannot run: state store unusable, status
        port in use, registration refused; ConfigError (exit code 2) for configuration found wrong
        late (``task.run_as_user``). Cancellation: stops at once (tasks' processes are still ended).
        """
        s = self.settings
        try:
            store = AsyncStateStore(await trio.to_thread.run_sync(StateStore, self.work_dir / "state.db"))
        except StateStoreError as exc:
            raise StartupError(str(exc)) from exc
        failure: StartupError | None = None
        try:
            supervisor, outbox, poller = await self._assemble(store)
            async with trio.open_nursery() as root:  # status, signals, heartbeat, records, outbox: until STOPPED
                failure = await self._start(root, store)
                if failure is None and self.state is AgentState.RUNNING:
                    with self._work_scope:  # TERMINATING sets its deadline
                        async with trio.open_nursery() as work:  # one run_task per claimed task
                            for rt, adoption in self._adopted:  # tasks an earlier agent left running
                                work.start_soon(run_adopted, supervisor, rt, adoption, name=f"adopted {rt.task.id}")
                            await poller.run(work)  # until DRAINING; claims on the wire are settled
                            supervisor.migration.claims_settled.set()  # (a migrate's last tasks are known)
                            self.drain()  # (when the poller ended by itself)
                            with self._drain_scope, trio.move_on_at(self._drain_deadline):
                                await supervisor.wait_idle()
                            if supervisor.running:
                                if not self._drain_scope.cancel_called:
                                    log.warning("drain deadline (%g s) passed with %d task(s) still running",
                                                s.task.drain_timeout, len(supervisor.running))
                                self.terminate()
                    if self._work_scope.cancelled_caught and not supervisor.handing_over:
                        log.warning("tasks did not finish reporting within their stop grace + flush_timeout; "
                                    "leaving unsent data for the next start")
                    self.state = AgentState.STOPPING
                    flush_until = min(trio.current_time() + s.task.flush_timeout, self._exit_deadline)
                    if not supervisor.handing_over:
                        with self._flush_scope, trio.move_on_at(flush_until):
                            await outbox.wait_idle()
                    else:  # what was read goes now (HAND_OVER_FLUSH_TIMEOUT at most): the next agent waits
                        with self._flush_scope:
                            flushed = await outbox.flush_read(flush_until - trio.current_time())
                        log.info("handed over: %d task(s) left running for the next agent (%s)", self._handed, flushed)
                    self._undelivered = 0 if supervisor.handing_over else outbox.pending
                    if self._undelivered:
                        log.warning("stopping with undelivered results or logs; they stay in %s for the "
                                    "next start", self.work_dir / "state.db")
                root.cancel_scope.cancel()
        finally:
            self.state = AgentState.STOPPED
            with trio.CancelScope(shield=True):
                if failure is None and self.master.registered and not self._hurry:
                    if self.heartbeat is not None:
                        await final_beat(self.heartbeat, store, self._node_report())
                    await leave(self.master, self.node_uid, self._exit_deadline < float("inf"), self._handed)
                await self.master.aclose()
                await trio.to_thread.run_sync(store.sync.close)
            if self.egress is not None:  # (the rules of tasks handed over stay in force until the next agent)
                self.egress.close(self._handed)  # one nft batch, at the very end (like the containment's rmdir)
            if self.containment is not None:
                self.containment.close()
            log.info("ckagent stopped")
        if failure is not None:
            raise failure
        return await end_of_life(self.ephemeral, self.work_dir, undelivered=self._undelivered,
                                 handed_over=self.supervisor is not None and self.supervisor.handing_over)

    async def _assemble(self, store: AsyncStateStore) -> tuple[Supervisor, Outbox, Poller]:
        """Build the agent's parts (no master traffic). Raises ConfigError for ``task.run_as_user``."""
        s = self.settings
        levels = await open_levels(s, store, lambda: self.supervisor.running_spider_ids() if self.supervisor else [])
        identities = self.identities = levels.identities
        containment = self.containment = levels.containment
        self.egress = levels.egress
        self.metrics.containment_level(containment.level)
        self.metrics.egress_level(self.egress.level)
        self.metrics.egress_proxy = self.egress.server
        self.metrics.egress_table = self.egress.keeper
        self.metrics.identity_level(identities.level)
        if (notice := identities.notice()) is not None:  # spiders as root or as the agent's uid: said once
            self.notices.set(*notice)
        if os.getpid() == 1:
            log.warning("running as PID 1 without an init: processes orphaned by spiders are not reaped "
                        "(<defunct> entries pile up) and a crash ends every crawl; start the container "
                        "with `ckagent supervise` as PID 1 (docs/operations.md, \"PID 1 and zombies\")")
        # Registration uses the last scan (cached on disk): a fresh scan runs ~0.5-1 s of
        # subprocesses, so it goes on in the background and reaches the master with the heartbeats.
        await self.scan.load_cached(identities)  # (and whether spiders' Chromium can sandbox itself)
        try:
            self.node_uid = await trio.to_thread.run_sync(load_node_uid, self.work_dir)
        except OSError as exc:
            raise StartupError(f"cannot keep the node's id in {self.work_dir}: {exc}") from exc
        base_env = spider_base_env()
        # Browser spiders use the system's browser (nothing can be downloaded at run time): its path
        # comes from the runtimes scan, updated in place after each rescan; its sandbox: load_cached.
        extra_env = self.scan.browser_env
        workspaces = self.workspaces = Workspaces(self.work_dir / "spiders", self.master,
                                                  stall_timeout=s.server.download_stall_timeout)
        deps = Dependencies(
            self.work_dir / "envs", uv_path=s.deps.uv_path, kill_grace=s.task.kill_grace,
            python=str(s.deps.python) if s.deps.python is not None else sys.executable,
            index=IndexChooser(s.deps.uv_index_url, s.deps.uv_fallback_index_url), uv_cache_dir=s.deps.uv_cache_dir,
            timeout=s.deps.uv_sync_timeout, base_env=base_env, run_as=identities.builder, budget_bytes=s.deps.env_budget_bytes)
        outbox = self.outbox = Outbox(self.master, store, self.work_dir, OutboxConfig(
            log_globs=tuple(g for g in s.task.log_files.split(",") if g),
            max_log_bytes=s.task.max_log_bytes, min_free_disk_bytes=s.task.min_free_disk_bytes,
            retention=s.task.retention, agent_secrets=self._secrets, refusal_timeout=s.server.refusal_timeout,
        ), lifecycle=self.lifecycle)
        self.metrics.outbox = outbox
        supervisor = self.supervisor = Supervisor(
            RunnerConfig(self.work_dir, s.task.execute_timeout, s.task.kill_grace, self._secrets, extra_env,
                         identities=identities, stall_timeout=s.task.stall_timeout, containment=containment,
                         egress=self.egress, max_stop_grace=s.task.max_stop_grace, checkpoint_interval=s.task.checkpoint_interval,
                         default_limits=Limits(s.task.memory_limit_bytes, s.task.pids_limit, s.task.cpus_limit),
                         max_artifact_bytes=s.task.max_artifact_bytes, default_disk_bytes=s.task.disk_limit_bytes,
                         memory_soft_bytes=s.task.memory_soft_bytes, migrate_timeout=s.task.migrate_timeout),
            self.master, store, workspaces, deps, self.max_workers,
            outbox=outbox, lifecycle=self.lifecycle,
        )
        outbox.on_disk_full = supervisor.stop_disk_full  # the task that fills the disk ends DISK_FULL
        outbox.busy_spiders = supervisor.busy_spiders  # (their Scrapy data stays: ckagent.code.scrapydata)
        self.heartbeat = HeartbeatLoop(self.master, HealthSampler(self.work_dir), s.heartbeat.interval,
                                       report=self._node_report, on_answer=self._heartbeat_answer)
        poller = self.poller = Poller(
            self.master, supervisor, poll_interval=s.task.poll_interval, long_poll_wait=s.task.long_poll_wait,
            request_timeout=s.server.request_timeout, gate=self.intake, cannot_run=self.capabilities.cannot_run,
            reported=outbox.wait_delivered)
        self.disk_watch = DiskFloorWatch(self.intake, self.work_dir, s.task.min_free_disk_bytes,
                                         idle=(lambda: not outbox.deliveries, outbox.wait_busy))
        self.ephemeral = await open_lifespan(s, supervisor, poller, outbox, self.intake, self.drain)
        return supervisor, outbox, poller

    async def _start(self, root: trio.Nursery, store: AsyncStateStore) -> StartupError | None:
        """STARTING → RUNNING: status server, signals, recovery, registration, outbox, heartbeat, each
        started in ``root``. Returns the StartupError that stops the agent (None: it runs, or a stop
        came first: the state says which)."""
        s, pending_stop = self.settings, stop_at_start()  # (a stop the pod's supervisor got meanwhile)
        assert self.outbox is not None and self.supervisor is not None and self.heartbeat is not None
        assert self.poller is not None
        log.info("ckagent %s starting: master %s, work_dir %s, max_workers %d",
                 __version__, s.server.url, self.work_dir, self.max_workers)
        self.capabilities.warn()
        status = AgentStatus(self.statistics, self.metrics, self.metrics.outbox)
        routes = status.routes(page=StatusPage(self.supervisor, self.outbox, self.work_dir, status.status))
        try:
            self.status_port = await root.start(partial(
                serve_status, routes, s.agent.bind or s.agent.ip, s.agent.port,
                serve_after=self.heartbeat.after_first_beat, on_serving=freeze_startup_objects))
        except StatusPortError as exc:
            return StartupError(str(exc))
        egress = self.egress
        if egress is not None:
            await trio.to_thread.run_sync(egress.listening, self.status_port)  # (agent.port 0: the one picked)
            await root.start(partial(egress.serve, lost=EgressLost(self.supervisor, self.intake)))  # (proxy; table)
        await trio.to_thread.run_sync(remove_request, self.work_dir)  # (a stale `ckagent stop` request)
        root.start_soon(receive_stop_signals, StopActions(
            self.drain, self.migrate, self.terminate, self.hand_over, self._hurry_now,
            fresh=lambda: self.state in (AgentState.STARTING, AgentState.RUNNING),
            stopping=lambda: self.state is AgentState.STOPPING,
            migrating=lambda: self._migrating),
            self.work_dir, StopMode(s.agent.sigterm))
        root.start_soon(self.supervisor.migration.run)
        root.start_soon(self.supervisor.memory_watch.run)
        await root.start(self.lifecycle.run)
        root.start_soon(partial(self.scan.run, self.heartbeat.after_first_beat, self.poller.forget_unrunnable))
        adoptions, refused = await find_adoptable(await store.pending_delivery())
        adopted = self.history.at_start(adoptions, refused)
        await trio.to_thread.run_sync(migrate_node, self.work_dir, self.identities, self.workspaces, store.sync,
                                      adoptions, s.deps.env_budget_bytes)  # what an earlier agent left, as now
        leftovers = await recover_lost_tasks(store, self.lifecycle, self.containment, keep=adopted,
                                             reasons=refused)
        if s.task.cleanup_temp_files:
            await cleanup_task_dirs(store, self.work_dir / "tasks", 0)
        root.start_soon(self.versions.run)  # the upgrade the master's policy may ask for
        try:
            with self._startup_scope:
                registered = await self.master.register()
                self.versions.apply(registered.policy)
        except RegistrationRefused as exc:
            return StartupError(str(exc))
        if self._startup_scope.cancel_called:
            log.info("stopped before registration completed")
            return None
        await root.start(self.outbox.run)
        self.outbox.stats_observer = self.metrics.crawl.observe
        for record in leftovers:
            await self.outbox.resume(record)
        self._adopted = [(admit_adopted(self.supervisor, adoption), adoption) for adoption in adoptions]
        release_listeners(self.supervisor, [a.handle.proxy_port for a in adoptions], keep=True)  # no task's
        if adoptions:
            log.info("re-adopted %d task(s) an earlier agent left: %s", len(adoptions), ", ".join(sorted(adopted)))
        if self.state is AgentState.STARTING:  # (a drain may have come meanwhile)
            self.state = AgentState.RUNNING  # before the first heartbeat: beats never say STARTING
        root.start_soon(self.heartbeat.run)
        if s.task.min_free_disk_bytes:
            await self.disk_watch.check()  # before the first poll
            root.start_soon(self.disk_watch.run)
        if self.ephemeral is not None:  # (idle from now on, or spent: a restart after the last task)
            root.start_soon(self.ephemeral.run)
        self.started.set()
        if pending_stop is not None:  # (the crawls are adopted: the signal receiver acts on it now)
            os.kill(os.getpid(), pending_stop)
        return None

    def statistics(self) -> AgentStatistics:
        """A frozen snapshot of the agent for /status and /metrics (ckagent.port.snapshot)."""
        return agent_statistics(self)

    # ------------------------------------------------------------------ shutdown

    def drain(self) -> None:
        """RUNNING → DRAINING: stop claiming; running tasks may finish (idempotent)."""
        drain_timeout = self.settings.task.drain_timeout
        if self.state in (AgentState.RUNNING, AgentState.STARTING):
            running = len(self.supervisor.running) if self.supervisor is not None else 0
            log.info("draining: no new tasks; %d running task(s) get up to %g s", running, drain_timeout)
            self.state = AgentState.DRAINING
        if self._drain_deadline == float("inf"):
            self._drain_deadline = trio.current_time() + drain_timeout
        self._startup_scope.cancel()
        if self.poller is not None:  # claims on the wire are answered within the drain
            self.poller.stop(claim_timeout=min(self.settings.server.request_timeout, drain_timeout))

    def terminate(self) -> None:
        """→ TERMINATING: stop every task (TERM → grace → KILL, reported CANCELLED) (idempotent).

        From then on the agent stops within its tasks' longest stop grace + ``flush_timeout`` seconds (the
        work scope's deadline): what the master has not acknowledged by then stays in the state store.
        """
        if self._exit_deadline != float("inf"):
            return
        log.info("terminating: stopping every running task")
        s = self.settings.task
        self._exit_deadline = trio.current_time() + s.flush_timeout + (REAP_MARGIN if self._migrating else (
            self.supervisor.longest_stop_grace() if self.supervisor is not None else s.kill_grace))
        if self.state in (AgentState.STARTING, AgentState.RUNNING, AgentState.DRAINING):
            self.state = AgentState.TERMINATING
        self._startup_scope.cancel()
        if self.poller is not None:
            self.poller.stop(claim_timeout=0)
        self._drain_scope.cancel()
        self._work_scope.deadline = self._exit_deadline
        if self.supervisor is not None:
            self.supervisor.terminate_all()

    def hand_over(self) -> None:
        """Stop the agent and leave its running spiders running, for the next agent to re-adopt
        (``run.sh upgrade``/``restart``; HAND_OVER_SIGNAL). Tasks still deploying or installing are
        stopped (CANCELLED); finished tasks' undelivered results stay in the state store. Idempotent."""
        if self._exit_deadline != float("inf") or self.supervisor is None:
            return
        running = [rt.task.id for rt in self.supervisor.running.values() if rt.phase == "running"]
        log.info("%s: stopping and leaving %d running task(s) to the next agent", HAND_OVER_SIGNAL.name,
                 len(running))
        self.supervisor.handing_over = True
        self._handed = len(self.history.hand_over(running))
        self._exit_deadline = trio.current_time() + self.settings.task.flush_timeout
        if self.state in (AgentState.STARTING, AgentState.RUNNING, AgentState.DRAINING):
            self.state = AgentState.TERMINATING
        self._startup_scope.cancel()
        if self.poller is not None:
            self.poller.stop(claim_timeout=0)
        self._drain_scope.cancel()
        self._work_scope.cancel()

    def migrate(self) -> None:
        """→ DRAINING, migrating: stop claiming; every task checkpointed, stopped and reported MIGRATED within
        ``task.migrate_timeout`` (ckagent.task.migrating), then the flush. Idempotent; also during a drain."""
        if self._exit_deadline != float("inf") or self.supervisor is None or self._migrating:
            return
        migration, timeout = self.supervisor.migration, self.settings.task.migrate_timeout
        migration.ask(timeout)
        if self.state in (AgentState.RUNNING, AgentState.STARTING):
            self.state = AgentState.DRAINING
        self._drain_deadline = min(self._drain_deadline, migration.deadline)
        self._drain_scope.deadline = self._drain_deadline  # (a drain already waiting waits no longer)
        self._startup_scope.cancel()
        if self.poller is not None:
            self.poller.stop(claim_timeout=min(self.settings.server.request_timeout, timeout / 4))

    @property
    def _migrating(self) -> bool:
        return self.supervisor is not None and self.supervisor.migration.asked.is_set()

    def _hurry_now(self) -> None:
        self._hurry = True
        self._flush_scope.cancel()

    # ------------------------------------------------------------------ the heartbeat's report

    def _node_report(self) -> NodeReport:
        """What the next heartbeat says of the node (ckagent.port.snapshot.node_report)."""
        return node_report(self)

    def _heartbeat_answer(self, answer: HeartbeatResponse) -> None:
        """The master's answer to a heartbeat: stop the tasks it cancelled, follow its version policy."""
        if self.supervisor is not None:
            self.supervisor.master_cancelled(answer.cancel_task_ids)
        self.versions.apply(answer.policy)
