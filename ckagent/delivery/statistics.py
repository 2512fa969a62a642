"""What the outbox holds that the master has not acknowledged: :class:`OutboxStatistics`, counted by
:class:`SpoolCounter` from the spool files and the acknowledged positions — with the delivery's own
line cutting (:class:`~ckagent.delivery.lines.LineSplitter`) and journal reading
(:func:`~ckagent.delivery.journal.parse_journal`), so the figures are the shippers' elements.

Two ways in: :meth:`ckagent.delivery.Outbox.figures` (what the agent's /metrics and /status use)
counts on the event loop, in slices of at most :data:`SLICE_SECONDS` with a checkpoint between
them, from the outbox's in-memory records (no SQL, no thread: a CPU-bound worker thread would
hold the GIL, and so the loop, for up to ``sys.getswitchinterval()`` = 5 ms at a time);
:meth:`ckagent.delivery.Outbox.statistics` counts from the state store, blocking (tools, tests).
The metrics and /status only render the record.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from ckagent.delivery.journal import parse_journal
from ckagent.delivery.lines import LineSplitter
from ckagent.delivery.spool import (
    ITEMS_FILE,
    JOURNAL_FILE,
    MAX_ITEM_BYTES,
    MAX_LINE_BYTES,
    OUTPUT_LOG,
    open_in,
    read_spool,
)
from ckagent.node.state import StateStore

READ_CHUNK = 64 * 1024
"""Bytes read from a spool file at a time while counting: one read and its line cutting take well
under a millisecond (C-level splitting of page-cache bytes), the unit of a slice on the loop."""
SLICE_SECONDS = 0.00025
"""Longest run of counting on the event loop before it lets other tasks run (a checkpoint)."""

OutboxRecord = tuple[str, Path, float, bool, int, int]
"""One task with something to deliver: ``(task_id, task_dir, claimed_at, has_result, log lines
acknowledged, items acknowledged)`` — a row of ``StateStore.pending_outbox`` or the same from the
outbox's memory (:meth:`ckagent.delivery.Outbox.figures`)."""


@dataclass(frozen=True)
class TaskBacklog:
    """One task's data waiting for the master: ``log_lines`` and ``items`` written and not acknowledged,
    ``bytes`` their approximate spool bytes (the task's spool bytes × the unacknowledged share of its
    elements), ``age_seconds`` how long the oldest of them has waited — since the master last took
    any of the task's data while some was waiting (0 when none waits)."""

    task_id: str
    log_lines: int
    items: int
    bytes: int
    age_seconds: float


@dataclass(frozen=True)
class OutboxStatistics:
    """What waits for the master: log lines and items written to the spool but not acknowledged,
    final results not acknowledged, and the number of tasks with anything left to deliver;
    ``backlog`` per task that has lines or items waiting (oldest wait first), ``oldest_seconds``
    the longest wait among them."""

    log_lines: int = 0
    items: int = 0
    results: int = 0
    tasks: int = 0
    backlog: tuple[TaskBacklog, ...] = ()
    bytes: int = 0
    oldest_seconds: float = 0.0


class _ElementCount:
    """Complete elements of one growing spool file, cut as the shippers cut them: log lines (LF, CR LF
    or a lone CR; pieces of MAX_LINE_BYTES) or items (non-blank LF-terminated lines). Incremental:
    :meth:`update` reads only what was appended since the last call (spool files only grow)."""

    def __init__(self, task_dir: Path, rel: str, *, log: bool) -> None:
        self.task_dir = task_dir
        self.rel = rel  # relative to the task dir (a spider log file may be in a folder: walked, never followed)
        self._log = log
        self._read_to = 0
        self._splitter = LineSplitter(0, MAX_LINE_BYTES, True) if log else LineSplitter(0, MAX_ITEM_BYTES, False)
        self.count = 0

    @property
    def read_bytes(self) -> int:
        """Bytes of the file counted so far."""
        return self._read_to

    def update(self) -> int:
        """Read what was appended (blocking); returns the count. A missing file counts 0."""
        for _ in self.steps():
            pass
        return self.count

    def steps(self) -> Iterator[None]:
        """:meth:`update` one chunk at a time: yields after each chunk read and counted (the caller
        may let the event loop run there); :attr:`count` is the figure once it is exhausted."""
        try:
            fd = open_in(self.task_dir, self.rel)
        except OSError:  # missing, or not a regular file (never followed, never blocked on)
            return
        try:
            while chunk := os.pread(fd, READ_CHUNK, self._read_to):
                self._read_to += len(chunk)
                lines, _ = self._splitter.feed(chunk)
                self.count += len(lines) if self._log else sum(map(bool, map(bytes.strip, lines)))
                yield
        except OSError:
            pass
        finally:
            os.close(fd)


class _TaskSpool:
    """The spool files of one task: its log sources (output.log and the spider log files the
    journal's S records name) and items.jsonl."""

    def __init__(self, task_dir: Path) -> None:
        self.task_dir = task_dir
        self.logs: dict[str, _ElementCount] = {OUTPUT_LOG: _ElementCount(task_dir, OUTPUT_LOG, log=True)}
        self.items = _ElementCount(task_dir, ITEMS_FILE, log=False)
        self._journal_read_to = 0

    def spool_bytes(self) -> int:
        """Bytes of the spool files counted so far."""
        return sum(counter.read_bytes for counter in self.logs.values()) + self.items.read_bytes

    def log_lines(self) -> int:
        """Lines written to every log source so far (blocking)."""
        for _ in self.steps():
            pass
        return sum(counter.count for counter in self.logs.values())

    def steps(self) -> Iterator[None]:
        """Bring every count up to date, one chunk at a time (see :meth:`_ElementCount.steps`)."""
        self._scan_journal()
        yield
        for counter in list(self.logs.values()):
            yield from counter.steps()
        yield from self.items.steps()

    def _scan_journal(self) -> None:
        try:
            data = read_spool(self.task_dir / JOURNAL_FILE, self._journal_read_to)
        except OSError:
            return
        try:
            records, good = parse_journal(data)
        except ValueError:  # a damaged journal: its sources stay uncounted (the shipper says why)
            return
        self._journal_read_to += good
        for _, kind, _, path in records:
            if kind == "S" and path not in self.logs:
                self.logs[path] = _ElementCount(self.task_dir, path, log=True)  # (open_in refuses a path out)


class SpoolCounter:
    """Counts the outbox from acknowledged positions and the spool files: :meth:`refresh` on the
    event loop in slices (the agent), or :meth:`read` from the state store, blocking (in a thread).

    Unacknowledged elements = complete elements in the spool files (a last line without its newline
    counts once the task ends) minus the acknowledged count in the state store. Counting is
    incremental — each call reads only the bytes written since the previous one — so a scrape costs
    little even while the master is away.

    It also keeps the ``shipped`` counters (elements acknowledged by the master while this process
    runs): the growth of each task's acknowledged position between calls, plus the rest when the
    task's result is acknowledged (:meth:`task_done`). Tasks already in the outbox when the agent
    started count from where they were first seen.
    """

    def __init__(self, store: StateStore, started_at: float | None = None) -> None:
        self._store = store
        self._started_at = time.time() if started_at is None else started_at
        self._lock = threading.Lock()  # the shipped figures (short sections, never across a read)
        self._refreshing = trio.Lock()  # one refresh at a time (they share the incremental counts)
        self._spools: dict[str, _TaskSpool] = {}
        self._seen: dict[str, list[int]] = {}  # task id -> [log seq, items seq] already counted as shipped
        self._done: set[str] = set()  # settled by task_done; may still be in a read that started before
        self._shipped = [0, 0]  # (log lines, items): see shipped_log_lines / shipped_items
        self._settled: deque[tuple[str, int, int, float]] = deque()  # task_done calls not yet applied
        self._waiting: dict[str, tuple[int, int, float]] = {}  # task id -> (log acked, items acked, waiting since)
        self.last = OutboxStatistics()

    def read(self) -> OutboxStatistics:
        """Figures now from the state store (blocking: one SQLite statement and file reads). Also
        advances the shipped counters. Not to be mixed with a :meth:`refresh` in progress."""
        for _ in self._count(self._store.pending_outbox()):
            pass
        return self.last

    async def refresh(self, records: Sequence[OutboxRecord]) -> OutboxStatistics:
        """Figures now for ``records`` (the outbox's in-memory view), counted on the event loop's
        thread in slices of at most :data:`SLICE_SECONDS`, with a checkpoint between them — the loop
        never waits for a thread holding the GIL. Refreshes run one at a time (a second caller waits
        for the first, then counts what was appended meanwhile). Cancellation between slices leaves
        the counts consistent (each chunk is counted whole); the figures are then not updated."""
        async with self._refreshing:
            await trio.lowlevel.checkpoint()  # a fresh slice: not on top of what this step did before
            deadline = time.perf_counter() + SLICE_SECONDS
            for _ in self._count(records):
                if time.perf_counter() >= deadline:
                    await trio.lowlevel.checkpoint()
                    deadline = time.perf_counter() + SLICE_SECONDS
            return self.last

    def _count(self, records: Sequence[OutboxRecord]) -> Iterator[None]:
        """Count ``records``' spools (yielding between chunks); sets :attr:`last` when exhausted."""
        with self._lock:
            self._settle()
        lines = items = results = 0
        backlog: list[TaskBacklog] = []
        now = time.time()
        for task_id, task_dir, claimed_at, has_result, log_acked, items_acked in records:
            if has_result:
                results += 1
            spool = self._spools.get(task_id)
            if spool is None or spool.task_dir != task_dir:
                spool = self._spools[task_id] = _TaskSpool(task_dir)
            yield from spool.steps()
            written = sum(counter.count for counter in spool.logs.values()) + spool.items.count
            task_lines = max(0, sum(counter.count for counter in spool.logs.values()) - log_acked)
            task_items = max(0, spool.items.count - items_acked)
            lines += task_lines
            items += task_items
            if task_lines or task_items:
                seen = self._waiting.get(task_id)
                since = now if seen is None or (seen[0], seen[1]) != (log_acked, items_acked) else seen[2]
                self._waiting[task_id] = (log_acked, items_acked, since)
                share = (task_lines + task_items) / written if written else 0.0
                backlog.append(TaskBacklog(task_id, task_lines, task_items, int(spool.spool_bytes() * share),
                                           now - since))
            else:
                self._waiting.pop(task_id, None)
            with self._lock:
                self._advance(task_id, [log_acked, items_acked], before_start=claimed_at < self._started_at)
        pending_ids = {record[0] for record in records}
        for task_id in set(self._spools) - pending_ids:
            del self._spools[task_id]
        for task_id in set(self._waiting) - pending_ids:
            del self._waiting[task_id]
        with self._lock:
            self._done &= pending_ids
        backlog.sort(key=lambda b: -b.age_seconds)
        self.last = OutboxStatistics(log_lines=lines, items=items, results=results, tasks=len(records),
                                     backlog=tuple(backlog), bytes=sum(b.bytes for b in backlog),
                                     oldest_seconds=backlog[0].age_seconds if backlog else 0.0)

    def task_done(self, task_id: str, log_lines: int, items: int, claimed_at: float) -> None:
        """The master acknowledged the task's final result with these counts: settle its shipped figures.

        Called on the event loop: it only queues (a deque append is atomic); a count in progress
        applies it at its next short locked section."""
        self._settled.append((task_id, log_lines, items, claimed_at))

    @property
    def shipped_log_lines(self) -> int:
        """Log lines acknowledged by the master while this process runs (takes the lock briefly)."""
        with self._lock:
            self._settle()
            return self._shipped[0]

    @property
    def shipped_items(self) -> int:
        """Items acknowledged by the master while this process runs (takes the lock briefly)."""
        with self._lock:
            self._settle()
            return self._shipped[1]

    def _settle(self) -> None:
        """Apply the queued :meth:`task_done` calls (the lock is held)."""
        while self._settled:
            task_id, log_lines, items, claimed_at = self._settled.popleft()
            self._done.add(task_id)
            seen = self._seen.pop(task_id, None)
            if seen is None:
                if claimed_at < self._started_at:
                    continue  # shipped (at least partly) by an earlier run: unknown share, count nothing
                seen = [0, 0]
            self._shipped[0] += max(0, log_lines - seen[0])
            self._shipped[1] += max(0, items - seen[1])

    def _advance(self, task_id: str, acked: list[int], *, before_start: bool) -> None:
        if task_id in self._done:
            return
        seen = self._seen.get(task_id)
        if seen is None:
            seen = self._seen[task_id] = list(acked) if before_start else [0, 0]
        self._shipped[0] += max(0, acked[0] - seen[0])
        self._shipped[1] += max(0, acked[1] - seen[1])
        seen[0], seen[1] = max(seen[0], acked[0]), max(seen[1], acked[1])
