"""A migrate: hand every running crawl over to another node within a bound (``ckagent stop --migrate``,
SIGTERM with ``agent.sigterm: migrate``). Not to be confused with :mod:`ckagent.task.migration` (the
work dir's own migrations between agent versions).

The agent asks (:meth:`Migration.ask`) when the migrate starts: it stops claiming (the agent's drain
mechanics) and this runs, for every task it holds, in parallel, within ``task.migrate_timeout``
(``deadline``)::

    a spider running, that checkpoints (its RunningTask.checkpoints, ckagent.task.checkpoints):
        take(MIGRATE, seconds_left, timeout ≤ half of what is left)   the spider persists, acks
        shipped(timeout: what is left but a stop's STOP_RESERVE)       the checkpoint is durable at the master
        stop: MIGRATED, its stop grace cut to what is left            SIGTERM → grace → kill, by the deadline
    a spider running without checkpoints (or whose checkpoint failed): stop MIGRATED at once, no
        checkpointId: its next attempt restarts as its task's ``resume`` says (the master applies it)
    a task not running yet (waiting for a slot, deploying, installing): stop MIGRATED at once (no
        checkpoint: nothing ran); its next attempt, on another node, starts afresh

The stop goes through the task's TaskStop, so the runner reports FAILED/MIGRATED (a disruption:
never counted against the retry budget) with the newest shipped checkpoint's id (the result's
``checkpointId``: ckagent.task.outcome), and its logs and items reach the master in the final flush.
Tasks admitted while the claims on the wire settle are handled too (:attr:`Migration.claims_settled`).

:func:`checkpoint_then_stop` is the same sequence for one task; the soft memory ceiling uses it too.
A task's trouble (a checkpoint that raises) is logged and ends in the stop, never the migrate.
"""

from __future__ import annotations

import importlib
import logging
import math
from typing import Any

import trio

from ckagent.task.admission import Admission, RunningTask
from ckagent.task.stop import StopReason

log = logging.getLogger(__name__)

STOP_RESERVE = 2.0
"""Seconds of the bound kept for a spider's stop (signal → its grace → kill) after its checkpoint."""
REAP_MARGIN = 1.0
"""Seconds before the deadline by which every task's processes are killed (the rest: reaping, its result)."""


def checkpoint_reason(name: str) -> Any:
    """``CheckpointReason[name]`` of ckagent.task.checkpoints (loop's; imported late so this module
    works before it lands), or None when there is none."""
    try:
        module = importlib.import_module("ckagent.task.checkpoints")
    except ImportError:
        return None
    reasons = getattr(module, "CheckpointReason", None)
    return None if reasons is None else reasons[name]


async def checkpoint_then_stop(rt: RunningTask, *, reason: StopReason, checkpoint: str, deadline: float,
                               why: str) -> str | None:
    """Checkpoint ``rt`` for ``checkpoint`` (a CheckpointReason name: MIGRATE, MEMORY), wait until it is
    shipped, then stop it for ``reason``, everything by ``deadline`` (Trio's clock: the spider's processes
    are killed by ``deadline - REAP_MARGIN``). ``why`` begins the stop's words. Returns the id of the
    checkpoint shipped (None: none — the spider does not checkpoint, or it failed or took too long; the
    words say which). Never raises for the task's trouble. Cancellation: the stop is still requested."""
    def left() -> float:
        return deadline - REAP_MARGIN - trio.current_time()

    shipped: str | None = None
    words = why
    checkpoints = getattr(rt, "checkpoints", None)
    try:
        wanted = checkpoint_reason(checkpoint)
        if rt.phase != "running" or rt.pid is None:
            words = f"{why}: before its spider started (no checkpoint: its next attempt starts afresh)"
        elif checkpoints is None or wanted is None:
            words = f"{why}: the spider does not checkpoint here; {_restart_words(rt)}"
        elif rt.stop.is_set():
            return None
        else:
            took = await checkpoints.take(wanted, seconds_left=max(0.0, left()), timeout=max(0.0, left() / 2))
            if took:
                shipped = await checkpoints.shipped(timeout=max(0.0, left() - STOP_RESERVE))
            if shipped is not None:
                words = f"{why}: checkpoint {shipped} shipped"
            elif took:
                words = f"{why}: its checkpoint was not shipped in time; {_next_words(rt, checkpoints)}"
            elif getattr(checkpoints, "unsupported", False):  # (it never answered a persist request)
                words = f"{why}: the spider does not persist its state; {_restart_words(rt)}"
            else:
                words = f"{why}: the spider did not persist its state in time; {_next_words(rt, checkpoints)}"
    except Exception as exc:  # a task's checkpoint trouble ends in its stop, never the caller's
        log.exception("task %s: checkpoint for %s failed", rt.task.id, reason.name)
        words = f"{why}: its checkpoint failed ({type(exc).__name__}: {exc}); {_next_words(rt, checkpoints)}"
    finally:
        if rt.stop.request(reason, words, grace=max(0.0, left())):
            log.info("task %s: %s", rt.task.id, words)
    return shipped


def _next_words(rt: RunningTask, checkpoints: Any) -> str:
    """How the next attempt starts when this stop's own checkpoint did not ship: from the newest one
    shipped before (an interval's), else from scratch."""
    last = getattr(checkpoints, "last", None)
    earlier = getattr(last, "id", None)
    return f"its next attempt resumes from checkpoint {earlier}" if earlier else _restart_words(rt)


def _restart_words(rt: RunningTask) -> str:
    resume = getattr(rt.task, "resume", None)
    mode = getattr(resume, "value", resume) or "restart-replace"
    return f"its next attempt restarts from scratch (resume: {mode})"


class Migration:
    """One migrate of this node's tasks (see module docstring); :meth:`run` in the agent's root nursery."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.asked = trio.Event()
        """Set by :meth:`ask`: the migrate started."""
        self.claims_settled = trio.Event()
        """Set by the agent once its poller has settled the claims on the wire (no task is admitted after)."""
        self.deadline = math.inf
        """Trio time by which every task is stopped (:meth:`ask` sets it)."""
        self.timeout = 0.0
        self.shipped: dict[str, str | None] = {}
        """Task id → the checkpoint id its migrate shipped (None: none), once its stop was requested."""
        self._handled: set[str] = set()

    def ask(self, timeout: float) -> None:
        """Start the migrate: every task is stopped within ``timeout`` seconds from now (idempotent)."""
        if self.asked.is_set():
            return
        self.timeout = timeout
        self.deadline = trio.current_time() + timeout
        log.info("migrating: no new tasks; %d task(s) get %g s to checkpoint and stop (MIGRATED)",
                 len(self._admission.running), timeout)
        self.asked.set()

    async def run(self) -> None:
        """Wait for :meth:`ask`, then migrate every task held now and every one admitted until the claims
        are settled; returns once each one's stop is requested. Cancellation: as usual."""
        await self.asked.wait()
        async with trio.open_nursery() as nursery:
            self._start_new(nursery)
            await self.claims_settled.wait()
            self._start_new(nursery)
        log.info("migrating: every task stopped (%d with a checkpoint shipped, %d without)",
                 sum(1 for v in self.shipped.values() if v), sum(1 for v in self.shipped.values() if not v))

    def _start_new(self, nursery: trio.Nursery) -> None:
        for task_id, rt in list(self._admission.running.items()):
            if task_id not in self._handled:
                self._handled.add(task_id)
                nursery.start_soon(self._one, rt, name=f"migrate {task_id}")

    async def _one(self, rt: RunningTask) -> None:
        self.shipped[rt.task.id] = await checkpoint_then_stop(
            rt, reason=StopReason.MIGRATED, checkpoint="MIGRATE", deadline=self.deadline, why="migrated")
