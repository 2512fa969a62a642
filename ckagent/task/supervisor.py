"""The supervisor: the one handle on this node's tasks that the agent passes around — admission
(:mod:`.admission`: slots, spider locks, the running set, the poller's bookkeeping) with the phase
runner (:mod:`.runner`) beside it. The outcome rules are :mod:`.outcome`'s.

The poller admits a claimed task and starts :meth:`Supervisor.run_task` in its work nursery; the
heartbeat, /status and metrics read :attr:`Supervisor.running`; re-adoption (ckagent.task.adoption)
takes a slot and supervises an adopted spider with :meth:`Supervisor.finish_run`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ckagent.code.deps import Dependencies
from ckagent.code.workspace import Workspaces
from ckagent.containment import TaskJail
from ckagent.containment.monitor import Monitored
from ckagent.delivery import LogSink, Outbox
from ckagent.delivery.lifecycle import Lifecycle
from ckagent.master.client import MasterClient
from ckagent.master.ids import safe_name
from ckagent.node.state import AsyncStateStore
from ckagent.task.admission import Admission, RunningTask
from ckagent.task.memwatch import SoftMemoryWatch
from ckagent.task.migrating import Migration
from ckagent.task.outcome import Notice, TaskOutcome
from ckagent.task.runconfig import RunnerConfig
from ckagent.task.runner import TaskRunner
from ckagent.task.stop import stop_grace

__all__ = ["RunnerConfig", "RunningTask", "Supervisor", "TaskOutcome"]


class Supervisor(Admission):
    """Admits claimed tasks (:class:`~ckagent.task.admission.Admission`) and runs each one's life
    (:class:`~ckagent.task.runner.TaskRunner`)."""

    def __init__(
        self,
        config: RunnerConfig,
        master: MasterClient,
        store: AsyncStateStore,
        workspaces: Workspaces,
        deps: Dependencies,
        max_workers: int,
        *,
        outbox: Outbox,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        super().__init__(max_workers, lifecycle)
        self.config = config
        self.master = master
        """The master client (a re-adopted task's checkpoints: ckagent.task.adoption)."""
        self._store = store
        self._outbox = outbox
        self.runner = TaskRunner(config, master, store, workspaces, deps, self, outbox)
        self.migration = Migration(self)
        """A migrate of this node's tasks (ckagent.task.migrating): its ``run`` waits for ``ask``."""
        self.memory_watch = SoftMemoryWatch(self, node_default=config.memory_soft_bytes, bound=config.migrate_timeout)
        """The soft memory ceilings (ckagent.task.memwatch)."""

    @property
    def store(self) -> AsyncStateStore:
        """The state store (ckagent.task.adoption)."""
        return self._store

    @property
    def outbox(self) -> Outbox:
        """The outbox every task's delivery goes to (ckagent.task.adoption)."""
        return self._outbox

    async def run_task(self, rt: RunningTask) -> None:
        """The whole life of one admitted task (:meth:`TaskRunner.run_task`): never raises for task
        trouble; cancellation stores CANCELLED (or hands the spider over); the slot is free after."""
        await self.runner.run_task(rt)

    async def finish_run(self, rt: RunningTask, mon: Monitored, jail: TaskJail, sink: LogSink,
                         notice: Notice, timeout_seconds: float) -> TaskOutcome:
        """Supervise a re-adopted spider to its end and judge it (:meth:`TaskRunner.finish_run`)."""
        return await self.runner.finish_run(rt, mon, jail, sink, notice, timeout_seconds)

    async def collect_outputs(self, rt: RunningTask, task_dir: Path, work: Path, version_dir: Path | None,
                              notice: Notice) -> None:
        """The task's files → items, artifacts or kept ones (:meth:`Deployer.collect_outputs`)."""
        await self.runner.deployer.collect_outputs(rt, task_dir, work, version_dir, notice)

    def egress_detach(self, rt: RunningTask) -> Callable[[], None] | None:
        """What removes the task's egress rules at its end (blocking), or None without a policy."""
        return self.runner.deployer.egress_detach(rt)

    def longest_stop_grace(self) -> float:
        """Seconds: the longest stop grace of the running tasks (ckagent.task.stop.stop_grace), at least
        the node's ``kill_grace`` — what a stop of every task takes at most before the kill."""
        c = self.config
        return max([c.kill_grace, *(stop_grace(rt.task.framework, rt.task.stop_grace_seconds, c.kill_grace,
                                               c.max_stop_grace)[0] for rt in self.running.values())])

    def busy_spiders(self) -> set[str]:
        """The safe names (ckagent.master.ids.safe_name) of the spiders with a task here now."""
        return {safe_name(rt.task.spider_id) for rt in self.running.values()}

    def adopt_environment(self, env_dir: Path) -> Callable[[], None]:
        """A re-adopted task's dependency environment counts as in use (:meth:`TaskRunner.adopt_environment`);
        call what this returns when the task has ended here."""
        return self.runner.adopt_environment(env_dir)
