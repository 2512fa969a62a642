"""How a task is stopped: why (:class:`StopReason`), the one request (:class:`TaskStop`), the runner's
watchdog on its run time and its signs of life (:class:`Watchdog`), and what each reason becomes.

Every place that stops a task asks its ``TaskStop`` with a reason; the first reason wins, later ones
are ignored (and say so in the debug log)::

    who asks                                   reason        status     errorCode
    the master (heartbeat or poll answer)      CANCELLED     CANCELLED  CANCELLED
    the agent terminating (SIGINT, 2nd TERM)   TERMINATING   CANCELLED  CANCELLED
    the watchdog: run time over                TIMEOUT       FAILED     TIMEOUT
    the watchdog: no sign of life              STALLED       FAILED     STALLED
    the outbox: the task fills the disk        DISK_FULL     FAILED     DISK_FULL
    adoption: its egress rules cannot return   EGRESS_LOST   CANCELLED  CANCELLED
    a migrate (ckagent stop --migrate)         MIGRATED      FAILED     MIGRATED
    the soft memory ceiling                    MEMORY_LIMIT  FAILED     MEMORY_LIMIT
    a newer attempt runs elsewhere (409)       SUPERSEDED    (no result is sent: the master moved on)

What a request does, at once and on the Trio thread: it cancels :attr:`TaskStop.prepare_scope`
(waiting for the spider lock or a slot, deploying, installing: an installer is stopped by its
supervisor with the node's ``kill_grace``) and wakes whatever waits in :meth:`TaskStop.wait` — the
process supervisor of the running spider (ckagent.containment.monitor), which sends the stop signal,
waits ``kill_grace`` seconds and kills every process of the task. How the stopped task is then
reported is :func:`stopped_outcome`'s, the one place a reason becomes a status and errorCode
(ckagent.task.outcome calls it).

The watchdog is the runner's: a deadline (the task's run-time limit, kept across agent restarts)
and a stall limit measured from the last sign of life the delivery recorded
(ckagent.delivery.activity.Activity: output written, items or stats file changed). It runs inside the
supervisor's own wait (no task of its own): the supervisor waits in :meth:`Watchdog.cancelling`, a
scope the stop's request cancels and that ends at the nearer of the two limits; entered again, the
watchdog looks (:meth:`Watchdog.look`) and requests the stop if a limit is over — at most one
wake-up per ``stall_timeout`` of activity, never a poll.

To stop a task for a new reason: add a member here (its status, errorCode and words) and call
``rt.stop.request(StopReason.X, "what happened")`` where it is noticed.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import trio

from ckagent.master.protocol import TIMEOUT_MESSAGE

log = logging.getLogger(__name__)


class StopReason(enum.Enum):
    """Why a task was stopped; ``value`` is the short text the task log and result use by default."""

    CANCELLED = "cancelled by the master"
    TERMINATING = "agent terminating"
    TIMEOUT = "timed out"
    STALLED = "stalled"
    DISK_FULL = "disk full"
    EGRESS_LOST = "egress rules lost"
    MIGRATED = "migrated: handed over to another node"
    MEMORY_LIMIT = "over its soft memory ceiling"
    SUPERSEDED = "superseded by a newer attempt"

    @property
    def status(self) -> str:
        """The result's status a task stopped for this reason ends with (``FAILED`` or ``CANCELLED``)."""
        return "FAILED" if self in _FAILURES else "CANCELLED"

    @property
    def error_code(self) -> str:
        """The result's errorCode (docs/protocol.md, "Outcomes")."""
        return _FAILURES.get(self, "CANCELLED")


_FAILURES = {StopReason.TIMEOUT: "TIMEOUT", StopReason.STALLED: "STALLED", StopReason.DISK_FULL: "DISK_FULL",
             StopReason.MIGRATED: "MIGRATED", StopReason.MEMORY_LIMIT: "MEMORY_LIMIT"}


class TaskStop:
    """The one stop of one task: its reason once requested, the scope it cancels, what waits on it.

    Made by the task's ``RunningTask``; lives on the Trio thread (never blocks).
    """

    def __init__(self, task_id: str = "") -> None:
        self.task_id = task_id
        self.reason: StopReason | None = None
        """Why the task is being stopped (None: it is not)."""
        self.detail: str | None = None
        """The words of the request (``stalled: no output … for 61 s``), None: the reason's own."""
        self.grace_limit: float | None = None
        """Seconds the stop grace may last at most (a migrate's time left), None: the task's own grace."""
        self.prepare_scope = trio.CancelScope()
        """Entered by the runner around waiting for a slot, deploying and installing: a stop cancels it."""
        self._event = trio.Event()
        self._scopes: set[trio.CancelScope] = set()  # see cancelling

    def request(self, reason: StopReason, detail: str | None = None, *, grace: float | None = None) -> bool:
        """Stop the task for ``reason`` (``detail``: the words for its log and result; ``grace``: seconds
        its stop grace may last at most). Idempotent: returns True when this call stopped it, False when
        it was already stopped (the first reason stands; the later one is logged at debug level). Never
        raises, never blocks."""
        if self.reason is not None:
            log.debug("task %s: already stopping (%s); %s ignored", self.task_id, self.reason.name, reason.name)
            return False
        self.reason, self.detail, self.grace_limit = reason, detail, grace
        self.prepare_scope.cancel()
        for scope in self._scopes:
            scope.cancel()
        self._event.set()
        return True

    @contextlib.contextmanager
    def cancelling(self, deadline: float = math.inf) -> Iterator[trio.CancelScope]:
        """A cancel scope a request cancels (at once when one was made already), ending at ``deadline``
        (Trio's clock) at the latest: what a process supervisor waits in, in its own task
        (ckagent.containment.stopping.ScopedStop)."""
        with trio.CancelScope(deadline=deadline) as scope:
            if self.reason is not None:
                scope.cancel()
            self._scopes.add(scope)
            try:
                yield scope
            finally:
                self._scopes.discard(scope)

    def is_set(self) -> bool:
        """True once a stop was requested."""
        return self.reason is not None

    async def wait(self) -> None:
        """Return once a stop is requested (at once if it was). Cancellation: as usual."""
        await self._event.wait()

    def describe(self) -> str:
        """The request's words for the task log: its detail, else its reason (``"not stopped"`` before one)."""
        if self.reason is None:
            return "not stopped"
        return self.detail or self.reason.value


def stopped_outcome(stop: TaskStop) -> tuple[str, str, str]:
    """(status, errorCode, errorMessage) of a task ended by ``stop`` (a stop must have been requested).

    TIMEOUT's message is the protocol's own (``TIMEOUT_MESSAGE``); the others say what happened.
    """
    reason = stop.reason
    assert reason is not None, "stopped_outcome of a task nobody stopped"
    message = TIMEOUT_MESSAGE if reason is StopReason.TIMEOUT else stop.describe()
    return reason.status, reason.error_code, message


class Alarm(Protocol):
    """Something a :class:`Watchdog`'s wait wakes at ``due`` (Trio's clock; inf: never): ``fire()`` on the
    loop, which must not block and moves ``due`` on."""

    due: float

    def fire(self) -> None:
        """The alarm's time has come."""


class Watchdog:
    """The runner's limits on a running task: what the process supervisor waits on instead of the bare stop.

    ``deadline_at``: epoch seconds when the task's run time is over (None: no limit); a deadline that
    passed already (a task re-adopted late) stops it at once. ``timeout_seconds`` is that limit's
    length, for the words. ``stall_timeout`` seconds without a sign of life (``last_activity()``, in
    Trio's clock) stop it as STALLED (0: off). Both go through ``stop`` (:meth:`TaskStop.request`).
    ``alarm``: woken at its ``due`` time (Trio's clock) by the same wait, it does its own work then
    (``fire()``, which moves ``due`` on): the task's first checkpoint (ckagent.task.checkpoints) needs no
    task of its own before it is due.
    """

    def __init__(self, stop: TaskStop, *, deadline_at: float | None, timeout_seconds: float,
                 stall_timeout: float, last_activity: Callable[[], float] | None, alarm: Alarm | None = None) -> None:
        self.stop = stop
        self.alarm = alarm
        self.deadline = math.inf if deadline_at is None else trio.current_time() + (deadline_at - time.time())
        self.timeout_seconds = timeout_seconds
        self.stall_timeout = stall_timeout if last_activity is not None else 0.0
        self.last_activity = last_activity

    def is_set(self) -> bool:
        """True once the task's stop was requested (by anyone)."""
        return self.stop.is_set()

    def describe(self) -> str:
        """The stop's words (:meth:`TaskStop.describe`)."""
        return self.stop.describe()

    @property
    def grace_limit(self) -> float | None:
        """:attr:`TaskStop.grace_limit` (the process supervisor cuts its grace to it)."""
        return self.stop.grace_limit

    def cancelling(self, deadline: float = math.inf) -> contextlib.AbstractContextManager[trio.CancelScope]:
        """:meth:`TaskStop.cancelling`, ending at the next look at the limits too (:meth:`look`
        first: a limit that is over requests the stop, and the scope is cancelled at once)."""
        wake = self.look() if not self.stop.is_set() else math.inf
        return self.stop.cancelling(min(deadline, wake))

    def look(self) -> float:
        """Request the stop (TIMEOUT, STALLED) when a limit is over; else return when to look again
        (Trio's clock; inf: never — no limit, or stopped). Never blocks."""
        now = trio.current_time()
        if now >= self.deadline:
            self.stop.request(StopReason.TIMEOUT, f"timed out after {self.timeout_seconds:g} s")
            return math.inf
        wake = self.deadline
        if self.alarm is not None:
            if now >= self.alarm.due:
                self.alarm.fire()
            wake = min(wake, self.alarm.due)
        if self.stall_timeout > 0 and self.last_activity is not None:
            last = self.last_activity()
            if now >= last + self.stall_timeout:
                detail = (f"stalled: no output, items or stats for {now - last:.0f} s "
                          f"(stall timeout {self.stall_timeout:g} s)")
                if self.stop.request(StopReason.STALLED, detail):
                    log.warning("task %s: %s", self.stop.task_id, detail)
                return math.inf
            wake = min(wake, last + self.stall_timeout)
        return wake

    async def wait(self) -> None:
        """Return once the task's stop is requested — by the deadline or the stall limit here, or by
        anyone else. Sleeps until the nearer limit, looks again (activity may have moved the stall
        limit on). Cancellation: returns nothing, requests nothing."""
        while not self.stop.is_set():
            wake = self.look()
            if self.stop.is_set():
                break
            with trio.move_on_at(wake):
                await self.stop.wait()


def stop_grace(framework: str, asked: float | None, kill_grace: float, max_grace: float = math.inf) -> tuple[float, str]:
    """(seconds from a task's stop signal to the kill of every process of it, where they come from —
    words for the task log). The task's own ``stopGraceSeconds`` (``asked``), else its framework's
    default (ckagent.code.frameworks: Scrapy's graceful close of a polite crawl), else the node's
    ``task.kill_grace``; never more than ``max_grace`` (the node's ``task.max_stop_grace``: what
    ``terminationGracePeriodSeconds`` covers). Pure."""
    from ckagent.code.frameworks import REGISTRY  # (the code layer below: no circle)

    record = REGISTRY.get(framework)
    if asked is not None:
        grace, source = asked, "the task's stopGraceSeconds"
    elif record is not None and record.stop_grace is not None:
        grace, source = max(record.stop_grace, kill_grace), f"{record.title}'s default stop grace"
    else:
        grace, source = kill_grace, "task.kill_grace"
    if grace > max_grace:
        return max_grace, f"{source} ({grace:g} s) cut to task.max_stop_grace"
    return grace, source
