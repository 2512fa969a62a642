"""One task's delivery: the journal writer, the two stream shippers, stats, artifacts, then the result.

Owned by the agent's :class:`ckagent.delivery.outbox.Outbox`, which it reaches only through
:class:`DeliveryHost` (what a delivery uses of its owner). See the package docstring
(ckagent.delivery) for the whole design.

**One task per delivery.** :meth:`TaskDelivery.run` is the delivery's only Trio task: one loop
drives the journal writer, both stream shippers and live stats (each a step that never waits), and
sleeps on one :class:`ckagent.delivery.waiting.Waker` that every notification sets (output written,
a journal record, a grown file the outbox's scan saw, a batch's answer, the task's end) until the
earliest time one of them is due. A batch in a node batch has no task of its own (its answer comes
back as a call); a per-task post, a retry after a backoff and a live stats post run in the loop's
nursery while they last.

**Thread hops of a task's end**: :meth:`TaskDelivery.finish` stores the runner's result and reads
what the end needs (the log files' last sizes, the items journal's, the final stats, the artifacts'
state) in one hop; the result as sent is stored (with the streams' last positions) in one more,
before it is sent; its acknowledgement is marked in the outbox's next round (its once-a-second hop,
shared by every task: :meth:`ckagent.delivery.outbox.Outbox.acknowledged`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import trio

from ckagent.delivery.activity import Activity
from ckagent.delivery.artifacts import upload_artifacts
from ckagent.delivery.capture import LogSink
from ckagent.delivery.crawlstats import STATS_FILE, Snapshot
from ckagent.delivery.endreads import EndReads, end_reads, size_of
from ckagent.delivery.headroom import Headroom
from ckagent.delivery.itemscan import scan_oversize
from ckagent.delivery.journal import LogJournal, scan_log_files
from ckagent.delivery.lifecycle import Lifecycle, TaskDelivered
from ckagent.delivery.lines import Masker
from ckagent.delivery.nodebatch import NodeBatcher
from ckagent.delivery.outputs.live import LiveItemFiles, link_starts
from ckagent.delivery.readers import _FileReader, _ItemJournalReader
from ckagent.delivery.result import send_result
from ckagent.delivery.shipper import StreamShipper
from ckagent.delivery.spool import (
    DEFAULT_LOG_GLOBS,
    DEFAULT_REFUSAL_TIMEOUT,
    ITEMS_FILE,
    MAX_ITEM_BYTES,
    OUTPUT_LOG,
)
from ckagent.delivery.stats import StatsShipper
from ckagent.delivery.waiting import Waker
from ckagent.master.client import MasterClient
from ckagent.master.protocol import TaskResult
from ckagent.node.state import AsyncStateStore, StateStoreError

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class OutboxConfig:
    """Settings of the outbox: globs of spider log files, the disk budget (bytes; 0 = none),
    retention (seconds; 0 = keep forever) and how long a refusal of a task's data is retried before
    the agent gives up on it (``refusal_timeout``, seconds: server.refusal_timeout)."""

    log_globs: tuple[str, ...] = DEFAULT_LOG_GLOBS
    max_log_bytes: int = 0
    min_free_disk_bytes: int = 0
    retention: float = 0.0
    agent_secrets: tuple[str, ...] = ()
    refusal_timeout: float = DEFAULT_REFUSAL_TIMEOUT


Scanned = tuple[dict[str, int], int, int, dict[str, int]]
"""What :meth:`TaskDelivery.scan` found: (log files → size, items.jsonl's, stats file's, items journal's sources')."""

class DeliveryHost(Protocol):
    """What a :class:`TaskDelivery` uses of the outbox that owns it (the :class:`Outbox`)."""

    master: MasterClient
    store: AsyncStateStore
    config: OutboxConfig
    limiter: trio.CapacityLimiter
    batcher: NodeBatcher
    stats_observer: Callable[[str, str, dict[str, Any], bool], None] | None
    lifecycle: Lifecycle
    """Where a delivery says its task's result was acknowledged (a TaskDelivered record)."""

    async def next_look(self) -> None:
        """Return after the owner's next look at the disk (a writer waiting for room tries again)."""

    def acknowledged(self, task_id: str) -> None:
        """The master acknowledged the task's final result (or refused it for good): mark it so in the
        owner's next write."""


class TaskDelivery:
    """One task's delivery, owned by an :class:`Outbox` (``outbox``, seen as a :class:`DeliveryHost`). The supervisor writes to :attr:`sink`
    while the process runs and calls :meth:`finish` once with the final result."""

    def __init__(self, outbox: DeliveryHost, task_id: str, task_dir: Path, masker: Masker, globs: list[str],
                 sink: LogSink | None, journal: LogJournal, spider: str = "",
                 claimed_at: float | None = None, item_journal: LogJournal | None = None,
                 item_globs: tuple[str, ...] | list[str] = ()) -> None:
        self.outbox = outbox
        self.task_id = task_id
        self.task_dir = task_dir
        self.globs = globs
        self.sink = sink
        self.journal = journal
        refusal_timeout = outbox.config.refusal_timeout
        self.waker = Waker()
        """What wakes :meth:`run`'s loop: set by every notification of the task's streams and stats."""
        self.logs = StreamShipper.logs(outbox.master, outbox.store, task_id, task_dir, masker, outbox.limiter,
                                       refusal_timeout=refusal_timeout, waker=self.waker)
        self.items = StreamShipper.items(outbox.master, outbox.store, task_id, task_dir, outbox.limiter,
                                         refusal_timeout, journal=item_journal is not None, waker=self.waker)
        self.item_journal = item_journal
        """The items journal of a task with declared item files (ckagent.delivery.outputs.live), else None."""
        self.item_globs = list(item_globs)
        self.live: LiveItemFiles | None = None
        """Its declared JSON Lines files streamed while it runs (set by :meth:`watch_item_files`)."""
        self._item_sizes: dict[str, int] = {}  # the items journal's sources and sizes the last scan found
        if item_journal is not None:
            item_journal.on_record = self.items.notify
            item_journal.on_notice = self.notice
        self.spider = spider
        self.claimed_at = time.time() if claimed_at is None else claimed_at
        """Epoch seconds of the task's claim (of an earlier run's claim for a delivery resumed at start)."""
        self.stats = StatsShipper(outbox.master, task_id, task_dir, outbox.limiter, on_snapshot=self._observe,
                                  waker=self.waker)
        self.activity = Activity((task_dir / ITEMS_FILE, task_dir / STATS_FILE))
        reader = self.items.reader
        self._oversize = reader.oversize_notes if isinstance(reader, (_FileReader, _ItemJournalReader)) else None
        if self._oversize is not None:  # items over the size limit: said in the task's log, once
            self._oversize.say = self._say_oversize
        self.logs.batcher = self.items.batcher = outbox.batcher
        self.logs.end_kept = self.items.end_kept = True  # the last positions matter only until the result's ack
        journal.on_record = self.logs.notify
        self._journal_due = False  # output.log grew or a scan found log files: the journal notes them
        self._found: dict[str, int] | None = None  # spider log files found by the last scan, not yet noted
        self._found_sizes: dict[str, int] = {}  # spider log files and sizes the last scan found
        self._items_size = 0  # items.jsonl's size at the last scan
        self._stats_size = 0  # the stats file's size at the last scan
        self._output_grew: trio.Event | None = None  # set by the next output write (see wait_output)
        self.scanning = False  # True while the task runs: the outbox scans its files every SCAN_INTERVAL
        self.headroom = Headroom()  # blocks beyond output.log's and items.jsonl's ends (ckagent.delivery.headroom)
        self.ended = trio.Event()
        self._end: EndReads | None = None  # what the end read (finish's hop, else run's)
        self.delivered = trio.Event()
        self.result: TaskResult | None = None
        self.ship_logs = True  # False when the journal cannot be opened (the result still goes)
        self.superseded_by: int | None = None
        """The attempt the master moved on to (a stream's 409 with ``supersededBy``): nothing more is
        shipped for this one, and no result is sent (ckagent.delivery.judging)."""
        self.on_superseded: Callable[[int], None] | None = None
        """Called once, on the loop, when :attr:`superseded_by` is set (the runner stops the spider)."""
        self.logs.on_superseded = self.items.on_superseded = self._superseded

    def _superseded(self, attempt: int) -> None:
        if self.superseded_by is None:
            self.superseded_by = attempt
            self.notice(f"the master moved this task on to attempt {attempt}: this attempt ships nothing more")
            if self.on_superseded is not None:
                self.on_superseded(attempt)

    def notice(self, text: str) -> None:
        """A line of the agent's in the task's log (the agent log once output.log is closed)."""
        if self.sink is not None and not self.sink.closed:
            stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            self.sink.write_line(f"[ckagent {stamp}] {text}\n".encode())
        else:
            log.info("task %s: %s", self.task_id, text)

    def _say_oversize(self, text: str) -> None:
        """An item over the size limit: said in the task's log (the agent log once output.log is closed)."""
        if self.sink is not None and not self.sink.closed:
            self.notice(text)
        else:
            log.warning("task %s: %s", self.task_id, text)

    def watch_item_files(self, work: Path) -> None:
        """The process runs in the working copy ``work``: stream its declared JSON Lines files from
        now on (the next scans link and journal them; see ckagent.delivery.outputs.live). No-op for
        a task without ``outputs.items``."""
        if self.item_journal is not None and self.item_globs and self.live is None:
            self.live = LiveItemFiles(self.task_dir, work, self.item_globs)

    def take_notices(self) -> None:
        """Write to the task's log what the declared item files' watcher has to say (a file streamed,
        replaced, not linkable). On the loop; the end-of-task collection calls it before its summary,
        so that the summary stays the log's last ``outputs:`` line."""
        if self.live is not None:
            for text in self.live.take_notices():
                self.notice(text)

    def _observe(self, snapshot: Snapshot, final: bool = False) -> None:
        observer = self.outbox.stats_observer
        if observer is not None:
            try:
                observer(self.task_id, self.spider, snapshot.stats, final)
            except Exception:  # metrics must never break a delivery
                log.exception("task %s: the stats observer failed", self.task_id)

    def output_written(self) -> None:
        """The sink wrote to output.log."""
        self.activity.touch()
        self._journal_due = True
        self.waker.set()
        if self._output_grew is not None:
            self._output_grew.set()
            self._output_grew = None

    async def wait_output(self) -> None:
        """Return after the next write to output.log, or once the process is over (at once if it is).
        For readers of output.log beside the shipper (the status page's live tail): an event, not a
        timed look. Cancellation: as usual, nothing to undo."""
        if self.ended.is_set():
            return
        if self._output_grew is None:
            self._output_grew = trio.Event()
        await self._output_grew.wait()

    async def finish(self, result: TaskResult) -> None:
        """The process is over: store ``result``, say in the task's log the items over the size limit
        its items reader has not reached yet (:func:`ckagent.delivery.itemscan.scan_oversize`), close
        output.log, let the streams complete and the result follow them. Returns at once after one
        thread hop (the state store write, the scan, and what the end reads: :func:`end_reads`);
        cancellation before that write leaves the task to the next start (reported AGENT_LOST)."""
        self.take_notices()  # what the end-of-task collection said of the streamed files
        stored = result.to_json()
        store, task_id, task_dir, globs = self.outbox.store.sync, self.task_id, self.task_dir, self.globs
        items_journal, headroom = self.item_journal is not None, self.headroom
        reader = self.items.reader
        # The items the reader has not reached yet: any over the size limit is said in the task's log
        # now, while it is open (the reader, later, would only reach the agent log).
        unread = reader.line_start if isinstance(reader, _FileReader) and not reader.done else None

        def ending() -> tuple[StateStoreError | None, EndReads | None, tuple[list[tuple[int, int]], int] | None]:
            headroom.give_back(task_dir)  # no writer is left (the lines said below only append, as any write)
            error: StateStoreError | None = None
            try:
                store.set_result(task_id, stored)
            except StateStoreError as exc:
                error = exc
            oversize = None if unread is None else scan_oversize(task_dir / ITEMS_FILE, unread, MAX_ITEM_BYTES)
            try:
                return error, end_reads(task_dir, globs, items_journal), oversize
            except Exception:  # read again by run, whose hop raises it to the outbox's log
                return error, None, oversize

        error, self._end, oversize = await trio.to_thread.run_sync(ending)
        notes = self._oversize
        if oversize is not None and notes is not None:
            for size, end in oversize[0]:
                notes(ITEMS_FILE, size, MAX_ITEM_BYTES, end)
        if self.sink is not None:
            self.sink.close()  # after the lines just said (and its truncation marker): output.log's last size
            if self._end is not None:
                self._end[0][OUTPUT_LOG] = size_of(task_dir / OUTPUT_LOG)  # one lstat, as end_reads did
        if error is not None:
            log.error("task %s: cannot store its result (%s); sending it from memory", self.task_id, error)
        self.result = result
        self.items.finish()
        self.ended.set()
        self.stats.stop()
        self.waker.set()
        if self._output_grew is not None:
            self._output_grew.set()
            self._output_grew = None

    def _note_finals(self) -> None:
        """The streams' last acknowledged positions (kept by the shippers: ``end_kept``) to the state
        store's next write (no hop). Not needed once the result is acknowledged."""
        for shipper in (self.logs, self.items):
            if shipper.final is not None:
                final, shipper.final = shipper.final, None
                self.outbox.store.note_stream_position(self.task_id, shipper.stream, *final)

    async def _store_result(self, result: TaskResult) -> None:
        """The result into the state store with the streams' last positions; on a full disk it is
        kept in memory and sent all the same (an agent crash before it is acknowledged then reports
        the task AGENT_LOST)."""
        self._note_finals()
        try:
            await self.outbox.store.set_result(self.task_id, result.to_json())
        except StateStoreError as exc:
            log.error("task %s: cannot store its result (%s); sending it from memory", self.task_id, exc)

    def scan(self) -> Scanned:
        """(spider log files → size, items.jsonl's size or 0, the stats file's size or 0, the items
        journal's sources → size: empty without one). Blocking: the outbox calls it in its
        once-a-second worker thread, for every running task in one hop."""
        items_size = size_of(self.task_dir / ITEMS_FILE)
        item_sizes: dict[str, int] = {}
        if self.live is not None:
            item_sizes.update(self.live.scan())
        if self.item_journal is not None:
            # After the links, as at the end (_final_item_sizes): items.jsonl's size was read before
            # them, so the item files the end-of-task collection appends to it come after the
            # streamed files' last lines however a scan falls between the collection's steps.
            item_sizes[ITEMS_FILE] = items_size
        return scan_log_files(self.task_dir, self.globs), items_size, size_of(self.task_dir / STATS_FILE), item_sizes

    def scanned(self, found: dict[str, int], items_size: int, stats_size: int = 0,
                item_sizes: dict[str, int] | None = None) -> None:
        """The result of :meth:`scan` (on the loop): the journal notes the log files; a grown items
        file wakes its shipper (the items journal notes the item files' growth, which wakes it), a
        grown stats file the stats shipper (neither polls a file that is not growing)."""
        self.take_notices()
        if self.item_journal is not None and item_sizes and item_sizes != self._item_sizes:
            self._item_sizes = item_sizes
            self.activity.touch()
            self.item_journal.note(item_sizes, None if self.live is None else self.live.starts)
        if found != self._found_sizes:  # the journal notes only log files that changed
            self._found_sizes = found
            self._found = found
            self._journal_due = True
            self.waker.set()
        if items_size != self._items_size:
            self._items_size = items_size
            self.items.notify()
        if stats_size != self._stats_size:
            self._stats_size = stats_size
            self.stats.notify()

    async def flush_read(self) -> None:
        """Send what was read so far at once (a hand-over's last flush): returns when nothing read
        waits for the master, or, for a task that has ended, when its result is delivered. Call it
        while :meth:`run` runs; bound it with a cancel scope (a master that does not answer)."""
        if self.ended.is_set():
            await self.delivered.wait()
            return
        async with trio.open_nursery() as nursery:
            for shipper in (self.logs, self.items) if self.ship_logs else (self.items,):
                nursery.start_soon(_flushed, shipper)

    async def run(self) -> None:
        """Journal, ship both streams and live stats from one loop, then send the result (see the
        module docstring). Cancellation leaves it all for the next start."""
        shippers = [self.logs, self.items] if self.ship_logs else [self.items]
        shipped = False
        try:
            async with trio.open_nursery() as nursery:  # a per-task post, a retry, a stats post while they last
                for shipper in shippers:
                    await shipper.open(nursery)
                await self._drive(nursery, shippers)
                nursery.cancel_scope.cancel()  # nothing of the streams is left; a wait for room may be
            shipped = True
        finally:
            for shipper in shippers:
                shipper.close()
            self.scanning = False
            if not shipped:  # cancelled (or failed) before its result: the outbox's last write saves them
                self._note_finals()
        self.journal.close()
        if self.item_journal is not None:
            self.item_journal.close()
        if self.superseded_by is not None:  # the newer attempt's result is the task's: none from this one
            self.outbox.acknowledged(self.task_id)
            self.delivered.set()
            return
        assert self._end is not None
        _, final, artifact_state, _ = self._end
        assert self.result is not None
        self._observe(Snapshot(final.seq if final else 0, {"stats": final.stats if final else {}}), final=True)
        stats = final if final is not None else self.result.stats
        reason = self.result.finish_reason
        if reason is None and stats is not None and isinstance(stats.stats.get("finishReason"), str):
            reason = stats.stats["finishReason"] or None
        refused = [shipper.stream for shipper in (self.logs, self.items) if shipper.refused]
        if not self.ship_logs:
            refused.insert(0, "log")
        incomplete = True if refused or self.result.incomplete else None
        reasons = [shipper.refusal for shipper in (self.logs, self.items) if shipper.refused and shipper.refusal]
        reason_text = "; ".join(reasons) or self.result.incomplete_reason
        if refused:
            log.error("task %s: its result says incomplete: the master refused its %s for good (%s); it holds %d "
                      "log lines and %d items; the spool stays in %s until task.retention", self.task_id,
                      " and ".join(refused), reason_text or "no reason given", self.logs.acked, self.items.acked,
                      self.task_dir)
        # Artifacts go before the result, which lists what the master holds (ckagent.delivery.artifacts).
        artifacts = await upload_artifacts(self.outbox.master, self.task_id, self.task_dir, self.outbox.limiter,
                                           artifact_state)
        result = dataclasses.replace(self.result, item_count=self.items.acked, log_lines=self.logs.acked,
                                     stats=stats, finish_reason=reason, incomplete=incomplete,
                                     incomplete_reason=reason_text if incomplete else None,
                                     artifacts=artifacts)
        # Stored before it is sent, with the streams' last positions (what the status page shows of a
        # finished task, and where a crash resumes); acknowledged, it is marked so in the outbox's next
        # round (Outbox.acknowledged: no hop of its own).
        await self._store_result(result)
        await send_result(self.outbox.master, self.outbox.store, self.task_id, result, self.outbox.limiter,
                          self.outbox.config.refusal_timeout, mark=False)
        self.outbox.acknowledged(self.task_id)
        self.delivered.set()
        self.outbox.lifecycle.emit(TaskDelivered(self.task_id, self.spider or None, self.claimed_at, result))

    async def _drive(self, nursery: trio.Nursery, shippers: list[StreamShipper]) -> None:
        """The delivery's loop: until both streams are complete and the journals ended, note what the
        journal must record, step live stats and the streams, then sleep on :attr:`waker` until the
        earliest time one of them is due."""
        journals = [j for j in ((self.journal if self.ship_logs else None), self.item_journal) if j is not None]
        self.scanning = self.ship_logs and not self.ended.is_set()
        ending = True  # the journals' end is still to be recorded
        room: trio.CancelScope | None = None  # a wait for room on a full disk (unwritten journal records)
        while True:
            if not self.ended.is_set():
                if self._journal_due and self.ship_logs:
                    self._journal_due = False
                    sizes: dict[str, int] = {}
                    if self.sink is not None:
                        sizes[OUTPUT_LOG] = self.sink.size
                    if self._found is not None:
                        sizes.update(self._found)
                        self._found = None
                    self.journal.note(sizes)
            elif ending:
                ending = self.scanning = False
                if self._end is None:  # a resumed delivery (or finish's reads failed): read here
                    self._end = await trio.to_thread.run_sync(
                        end_reads, self.task_dir, self.globs, self.item_journal is not None)
                last_sizes, _, _, item_sizes = self._end
                if self.ship_logs:
                    self.journal.end(last_sizes)
                if self.item_journal is not None:
                    assert item_sizes is not None
                    self.item_journal.end(item_sizes, self.live.starts if self.live is not None  # (or: resumed)
                                          else await trio.to_thread.run_sync(link_starts, self.task_dir))
            if journals and not ending:
                journals = [journal for journal in journals if not journal.flush()]  # a full disk: wait for room
                if journals and room is None:
                    room = trio.CancelScope()
                    nursery.start_soon(self._wake_after_look, room)
            deadline = self.stats.step(nursery)
            now = trio.current_time()
            for shipper in shippers:
                if shipper.due(now):  # poked (its file grew, an answer came, the end) or its time has come
                    await shipper.step()
                if not shipper.done:
                    deadline = min(deadline, shipper.due_at)
            if not journals and not ending and all(shipper.done for shipper in shippers):
                return
            await self.waker.wait(deadline)
            if room is not None and room.cancel_called:
                room = None

    async def _wake_after_look(self, scope: trio.CancelScope) -> None:
        """Wake the loop after the outbox's next look at the disk (journal records wait for room)."""
        with scope:
            await self.outbox.next_look()
        scope.cancel()  # done: the loop may start another
        self.waker.set()


async def _flushed(shipper: StreamShipper) -> None:
    idle = trio.Event()
    shipper.hurry, shipper.on_idle = True, idle.set
    shipper.notify()
    await idle.wait()
