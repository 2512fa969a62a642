"""A task's lifecycle facts as frozen records on one memory channel, and the canonical task line.

Whoever learns a fact about a task *says* it by emitting a record; nobody calls into whoever cares::

    TaskAdmitted    the task runner admitted a claimed task (it is queued)        ckagent.task
    TaskStarted     it holds a slot and its spider's lock (the queue wait is over) ckagent.task
    DepsPrepared    its environment is ready (cache hit or an install's seconds)  ckagent.task
    TaskFinished    its outcome is known (streams not flushed, result not sent)   ckagent.task
    TaskDelivered   the master acknowledged its final result                      ckagent.delivery.outbox
    TaskLost        crash recovery stored its AGENT_LOST result                   ckagent.task.recovery

The agent's root nursery owns the one :class:`Lifecycle` (``await root.start(lifecycle.run)``): it
reads the channel and hands every record, in the order emitted, to each consumer — plain functions
``(record) -> None`` on the loop: the metrics (:meth:`ckagent.port.metrics.AgentMetrics.record`) and
the canonical task line (:class:`CanonicalLine`). A consumer that raises is logged and skipped for
that record; the others still get it.

**A slow consumer never holds up a task.** :meth:`Lifecycle.emit` never blocks and never raises: the
channel holds at most :data:`MAX_BUFFERED` records; when it is full (the loop has not run the reader
for thousands of records) the new record is dropped, counted in :attr:`Lifecycle.dropped`, and one
warning per episode says how many were lost (metrics and canonical lines then miss those tasks; the
tasks themselves, their data and results are not touched). A :class:`Lifecycle` without consumers
discards every record at once. When the reader is cancelled (the agent stops) it still hands what is
buffered to the consumers, so the canonical lines of the last flush are written.

The module sits in ``delivery`` because the outbox, the lowest layer that emits a record
(TaskDelivered), must be able to import it; the task runner and crash recovery are above it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import trio

from ckagent.master.protocol import TaskResult
from ckagent.node.logs import log_task_finished

log = logging.getLogger(__name__)

MAX_BUFFERED = 4096
"""Records the channel holds before :meth:`Lifecycle.emit` drops new ones (a few hundred bytes each)."""


@dataclass(frozen=True)
class TaskAdmitted:
    """A claimed task was admitted (queued). ``claimed_at``: epoch seconds of the claim."""

    task_id: str
    spider_id: str
    claimed_at: float


@dataclass(frozen=True)
class TaskStarted:
    """The task holds a slot and its spider's lock; epoch seconds of the claim and of now."""

    task_id: str
    claimed_at: float
    started_at: float

    @property
    def queue_wait_seconds(self) -> float:
        """Seconds from the claim to the start (never negative)."""
        return max(0.0, self.started_at - self.claimed_at)


@dataclass(frozen=True)
class DepsPrepared:
    """The task's dependencies are ready: ``cache_hit``, and the ``seconds`` the preparation took."""

    task_id: str
    seconds: float
    cache_hit: bool


@dataclass(frozen=True)
class TaskFinished:
    """The task's outcome is known (its streams are not flushed and its result not sent yet)."""

    task_id: str
    result: TaskResult


@dataclass(frozen=True)
class TaskDelivered:
    """The master acknowledged the task's final ``result`` (with its item and log line counts).

    ``spider``: the spider's name (its id when it has none), None when unknown; ``claimed_at``: epoch
    seconds of the claim (of an earlier run's claim for a delivery resumed at start).
    """

    task_id: str
    spider: str | None
    claimed_at: float
    result: TaskResult


@dataclass(frozen=True)
class TaskLost:
    """Crash recovery stored the AGENT_LOST ``result`` of a task an earlier run left running."""

    task_id: str
    result: TaskResult


Record: TypeAlias = TaskAdmitted | TaskStarted | DepsPrepared | TaskFinished | TaskDelivered | TaskLost
"""One lifecycle fact (a frozen record)."""
Consumer = Callable[[Record], None]


class Lifecycle:
    """The one channel of lifecycle records (see module docstring): :meth:`emit` on one side, the
    :meth:`run` task that hands them to ``consumers`` on the other."""

    def __init__(self, consumers: Sequence[Consumer] = (), max_buffered: int = MAX_BUFFERED) -> None:
        self.consumers = tuple(consumers)
        self._send, self._receive = trio.open_memory_channel[Record](max_buffered)
        self.dropped = 0
        """Records dropped because the channel was full (since the start)."""
        self._dropping = False

    def emit(self, record: Record) -> None:
        """Send ``record`` to the consumers (later, from :meth:`run`). Never blocks or raises: with the
        channel full the record is dropped and counted (one warning per episode)."""
        if not self.consumers:
            return
        try:
            self._send.send_nowait(record)
        except trio.WouldBlock:
            self.dropped += 1
            if not self._dropping:
                self._dropping = True
                log.warning("lifecycle records: the channel is full (%d records); dropping %s and the records "
                            "after it until the consumers catch up (metrics and task lines miss them)",
                            self._receive.statistics().current_buffer_used, type(record).__name__)
        else:
            if self._dropping:
                self._dropping = False
                log.warning("lifecycle records: consumers caught up; %d record(s) dropped so far", self.dropped)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hand every record to the consumers, in order, until cancelled (start it with
        ``nursery.start``: records emitted before are buffered). Cancellation: what is buffered is
        still handed over (synchronously), then it returns by raising Cancelled as usual."""
        task_status.started()
        try:
            async for record in self._receive:
                self._dispatch(record)
        finally:
            while True:
                try:
                    record = self._receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                self._dispatch(record)

    def _dispatch(self, record: Record) -> None:
        for consumer in self.consumers:
            try:
                consumer(record)
            except Exception:  # a consumer's bug must not stop the others, nor the agent
                log.exception("lifecycle records: %r failed on %s", consumer, type(record).__name__)


class CanonicalLine:
    """Consumer: the one log line per finished task, once the master acknowledged its result
    (:func:`ckagent.node.logs.log_task_finished`). It keeps each task's (install seconds, cache hit)
    from its :class:`DepsPrepared` record until its :class:`TaskDelivered` record."""

    def __init__(self) -> None:
        self._install: dict[str, tuple[float, bool]] = {}

    def __call__(self, record: Record) -> None:
        if isinstance(record, DepsPrepared):
            self._install[record.task_id] = (record.seconds, record.cache_hit)
        elif isinstance(record, TaskDelivered):
            install = self._install.pop(record.task_id, None)
            result = record.result
            log_task_finished(log, {
                "task_id": record.task_id,
                "spider": record.spider,
                "status": result.status,
                "error_code": result.error_code,
                "exit_code": result.exit_code,
                "duration_seconds": None if result.duration_ms is None else round(result.duration_ms / 1000, 3),
                "items": result.item_count,
                "log_lines": result.log_lines,
                "install_seconds": None if install is None else round(install[0], 3),
                "cache_hit": None if install is None else install[1],
            })

    @property
    def pending(self) -> int:
        """Tasks whose install figures wait for their delivery."""
        return len(self._install)
