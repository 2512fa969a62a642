"""Admission: who may run when — the node's slots, one lock per spider, the running set, and the
poller's claim bookkeeping.

A ``trio.CapacityLimiter(max_workers)`` for the node and one ``trio.Lock`` per spider (same spider:
serial; different spiders: parallel). The runner takes the spider lock first, then a capacity token,
so a queued task never holds a slot. :attr:`Admission.running` holds every claimed, unfinished task
(queued ones included): it is what the heartbeat reports, what the poller excludes
(``excludeSpiderIds``) and what limits the next claim (:meth:`Admission.free_slots`). A task that
leaves it (:meth:`Admission.task_left`) wakes whoever waits for a slot, for idleness or for a spider;
:attr:`Admission.idle_since` says when the set last became empty (the idle clock, ckagent.port.snapshot).
With ``agent.max_tasks`` (:attr:`Admission.budget`, ckagent.node.taskbudget) every admission but a
re-adoption counts against the budget, and the free slots never exceed what is left of it.

Everything here runs on the Trio thread and never blocks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import trio

from ckagent.containment import TaskJail
from ckagent.containment.egress import TaskRules
from ckagent.delivery.lifecycle import Lifecycle, TaskAdmitted
from ckagent.master.protocol import Task
from ckagent.node.broadcast import Broadcast
from ckagent.node.runas import RunAs
from ckagent.node.taskbudget import TaskBudget
from ckagent.task.stop import StopReason, TaskStop

log = logging.getLogger(__name__)


@dataclass
class RunningTask:
    """A task this node has claimed and not yet reported. Read by the heartbeat, /status and metrics."""

    task: Task
    claimed_at: float = field(default_factory=time.time)
    started_at: float | None = None
    pid: int | None = None
    phase: str = "queued"
    stop: TaskStop = field(init=False)
    """The task's one stop (ckagent.task.stop): its reason, the scope it cancels, what waits on it."""
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds spent per phase so far: ``deploy``, ``install``, ``run`` (the result's deployMs/installMs/runMs)."""
    delivery: Any = None
    """The task's ``ckagent.delivery.TaskDelivery`` once opened (live stats: ``delivery.stats.latest``)."""
    jail: TaskJail | None = None
    """The task's containment (from the deploy on); /status reads its live figures."""
    egress: TaskRules | None = None
    """The task's egress rules (nftables level: in the kernel); /status reads their counters."""
    handed_over: bool = False
    """The agent stopped and left this task's spider running for the next agent (ckagent.task.adoption)."""
    run_as: RunAs | None = None
    """Whom the task's spider runs as (its spider's identity, set when its directory is made; a
    re-adopted task's from its handle); None: the agent's own user."""

    superseded_by: int | None = None
    """The attempt the master moved this task on to (a 409 ``supersededBy`` to one of its streams): this
    attempt ships nothing more and sends no result; :attr:`superseded` is set then."""
    superseded: trio.Event = field(default_factory=trio.Event)
    checkpoints: Any = None
    """The task's ``ckagent.task.checkpoints.TaskCheckpoints`` while its spider runs (None before)."""

    def __post_init__(self) -> None:
        self.stop = TaskStop(self.task.id)

    def mark_superseded(self, attempt: int) -> None:
        """The master moved the task on to ``attempt`` (the delivery's hook): :attr:`superseded` is set and
        this attempt's spider is stopped (SUPERSEDED: stop signal → grace → kill; no result is sent)."""
        if self.superseded_by is None:
            self.superseded_by = attempt
            log.warning("task %s: superseded by attempt %d: stopping this attempt's spider; no result is sent "
                        "(the master has moved on)", self.task.id, attempt)
            self.superseded.set()
            self.stop.request(StopReason.SUPERSEDED, f"superseded: the master moved this task on to attempt "
                              f"{attempt}; this attempt sends nothing more")


class Admission:
    """The node's slots, spider locks and running set (see module docstring); ``max_workers`` ≥ 1."""

    def __init__(self, max_workers: int, lifecycle: Lifecycle | None = None) -> None:
        self.max_workers = max_workers
        self.capacity = trio.CapacityLimiter(max_workers)
        self.running: dict[str, RunningTask] = {}
        self.claiming: set[str] = set()
        """Tasks whose claim is on the wire (the poller's; the heartbeat reports them)."""
        self.claim_polls: set[int] = set()
        """Claiming polls (``pollId``) not settled yet (the poller's; the heartbeat reports them)."""
        self.last_claim_poll: int | None = None
        """The newest claiming poll id the poller has sent (None: none yet)."""
        self.idle_since: float | None = None
        """``time.monotonic()`` when the last claimed task left :attr:`running` (None: none has left yet)."""
        self._spider_locks: dict[str, trio.Lock] = {}
        self._slot_freed = Broadcast()
        self.admitted = Broadcast()
        """Set at each :meth:`admit` (the soft memory watch sleeps on it while no task has a ceiling)."""
        self._stale_scopes: dict[trio.CancelScope, tuple[frozenset[str], float]] = {}  # see cancel_when_spider_free
        self.lifecycle = lifecycle or Lifecycle()
        """Where the runner says what happened to each task (ckagent.delivery.lifecycle records)."""
        self.budget: TaskBudget | None = None
        """agent.max_tasks: the tasks this life may still claim (None: no limit)."""
        self.changed = Broadcast()
        """Set whenever a claim starts or ends, or a task is admitted or leaves (the ephemeral watch)."""
        self.handing_over = False
        """Set when the agent stops and leaves its running spiders to the next agent (not drain, not
        terminate): a cancelled task whose spider runs is then left alone, its state kept for re-adoption."""

    def spider_lock(self, spider_id: str) -> trio.Lock:
        """The lock that keeps one spider's tasks serial (one per spider id ever seen: a few bytes
        each, and never a window with two locks)."""
        return self._spider_locks.setdefault(spider_id, trio.Lock())

    def task_left(self, task_id: str) -> None:
        """A task is no longer ours to run: its slot is free."""
        if self.running.pop(task_id, None) is not None and not self.running:
            self.idle_since = time.monotonic()
        self._slot_freed.set()
        self.changed.set()
        if self._stale_scopes:
            self._cancel_stale()

    def free_slots(self) -> int:
        """Slots not taken by a claimed, unfinished task (queued ones count: we must not over-claim), at
        most what is left of the budget (:meth:`claim_room`)."""
        return max(0, min(self.max_workers - len(self.running), self.claim_room()))

    def claim_room(self) -> int:
        """Tasks the budget still allows beyond the claims on the wire (a large number without one)."""
        return self.max_workers if self.budget is None else max(0, self.budget.left - len(self.claiming))

    def claim_started(self, task_id: str) -> None:
        """The poller's claim of ``task_id`` goes on the wire."""
        self.claiming.add(task_id)
        self.changed.set()

    def claim_ended(self, task_id: str) -> None:
        """The claim of ``task_id`` is settled (admitted, given back, or refused)."""
        self.claiming.discard(task_id)
        self.changed.set()

    def running_spider_ids(self) -> list[str]:
        """Spiders with a claimed, unfinished task here: the poller excludes them."""
        return sorted({rt.task.spider_id for rt in self.running.values()})

    async def wait_for_free_slot(self) -> None:
        """Return when at least one slot is free. Cancellation: returns nothing, as usual."""
        while self.free_slots() <= 0:
            await self._slot_freed.wait()

    async def wait_idle(self) -> None:
        """Return once no claimed task is left (running or queued). Cancellation: as usual."""
        while self.running:
            await self._slot_freed.wait()

    async def wait_spider_free(self, spider_ids: list[str]) -> None:
        """Return once a spider of ``spider_ids`` has no claimed task here any more (a long poll that
        excluded it has gone stale). Never returns for an empty list. Cancellation: as usual."""
        while set(spider_ids) <= set(self.running_spider_ids()):
            await self._slot_freed.wait()

    @contextlib.contextmanager
    def cancel_when_spider_free(self, spider_ids: list[str], scope: trio.CancelScope,
                                grace: float = 0.0) -> Iterator[None]:
        """While in the block, cancel ``scope`` once a spider of ``spider_ids`` has no claimed task here
        (what :meth:`wait_spider_free` waits for, without a task of its own to wait in); at once
        when one has none already. With ``grace`` (seconds), ``scope`` gets a deadline that much
        later instead (what it waits for may come meanwhile). Nothing for an empty list."""
        if not spider_ids:
            yield
            return
        self._stale_scopes[scope] = (frozenset(spider_ids), grace)
        try:
            self._cancel_stale()
            yield
        finally:
            self._stale_scopes.pop(scope, None)

    def _cancel_stale(self) -> None:
        running = {rt.task.spider_id for rt in self.running.values()}
        for scope, (spider_ids, grace) in self._stale_scopes.items():
            if not spider_ids <= running:
                if grace > 0:
                    scope.deadline = min(scope.deadline, trio.current_time() + grace)
                else:
                    scope.cancel()

    def admit(self, task: Task, *, adopted: bool = False) -> RunningTask:
        """Record a claimed task as ours (call before spawning the task's runner); counted against the
        budget (on disk before this returns) unless ``adopted`` (an earlier agent's, counted when claimed)."""
        rt = RunningTask(task=task)
        if self.budget is not None and not adopted:
            self.budget.take(task.id)
        self.running[task.id] = rt
        self.admitted.set()
        self.changed.set()
        self.lifecycle.emit(TaskAdmitted(task.id, task.spider_id, rt.claimed_at))
        return rt

    def cancel(self, task_id: str, reason: StopReason, detail: str | None = None) -> bool:
        """Stop a task of ours for ``reason`` (:meth:`TaskStop.request <ckagent.task.stop.TaskStop.request>`:
        idempotent, the first reason wins). Returns True when this call requested the stop."""
        rt = self.running.get(task_id)
        if rt is None:
            return False
        if rt.stop.request(reason, detail):
            log.info("task %s: stopping (%s)", task_id, rt.stop.describe())
            return True
        return False

    def stop_disk_full(self, task_id: str, detail: str) -> None:
        """Stop a task that fills the work dir's disk: it ends FAILED DISK_FULL with ``detail`` (also
        when it dies of the full disk on its own before the stop reaches it)."""
        self.cancel(task_id, StopReason.DISK_FULL, detail)

    def master_cancelled(self, task_ids: Iterable[str]) -> None:
        """The master cancelled ``task_ids`` (a heartbeat's or a poll's answer): stop those of ours
        (CANCELLED; ids not running here are ignored)."""
        for task_id in task_ids:
            self.cancel(task_id, StopReason.CANCELLED)

    def terminate_all(self) -> None:
        """Stop every task: the agent terminates (CANCELLED unless a task's stop said otherwise first)."""
        for task_id in list(self.running):
            self.cancel(task_id, StopReason.TERMINATING)
