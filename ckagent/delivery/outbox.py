"""The outbox: one per agent, owns every task's delivery (:mod:`ckagent.delivery.taskdelivery`), the
disk loop (positions, scans of running tasks' files, the disk watch) and retention.

See the package docstring (ckagent.delivery) for the whole design.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trio

from ckagent.delivery.capture import DiskGuard, LogSink
from ckagent.delivery.diskwatch import Accounted, DiskWatch, accounted_bytes
from ckagent.delivery.headroom import Spooled, headroom_fds, top_up
from ckagent.delivery.journal import LogJournal, rejected_log_globs, task_log_globs
from ckagent.delivery.lifecycle import Lifecycle
from ckagent.delivery.lines import Masker, secret_values
from ckagent.delivery.nodebatch import NodeBatcher
from ckagent.delivery.retention import retention_loop
from ckagent.delivery.spool import (
    ITEMS_FILE,
    ITEMS_JOURNAL,
    OUTPUT_LOG,
    SCAN_INTERVAL,
    SEND_CONCURRENCY,
)
from ckagent.delivery.statistics import OutboxStatistics, SpoolCounter
from ckagent.delivery.taskdelivery import OutboxConfig, Scanned, TaskDelivery
from ckagent.master.client import MasterClient
from ckagent.master.protocol import Task, TaskResult
from ckagent.node.broadcast import Broadcast
from ckagent.node.diskfull import STORE_RESERVE_BYTES, remove_old_reserve
from ckagent.node.state import AsyncStateStore, StateStore, StateStoreError, TaskRecord

log = logging.getLogger(__name__)


FULL_MEASURE_EVERY = 5
"""While the disk is calm (at least twice the critical level free, not falling fast), the accounted trees
are walked every this many looks of the disk loop (a spider's data dir may hold many files)."""
HAND_OVER_FLUSH_TIMEOUT = 2.0
"""Seconds a hand-over spends sending what was already read (lines, items, finished tasks' results)
before exiting; the next agent sends the rest from the acknowledged positions (docs/operations.md)."""


class Outbox:
    """Every task's delivery, in one nursery that outlives the tasks (see module docstring).

    ``await nursery.start(outbox.run)`` starts it; :meth:`open_task` / :meth:`resume` add tasks;
    :meth:`wait_idle` waits until nothing is left to send; :meth:`statistics` says what is left. Also keeps the free-space figure of the
    work dir fresh and deletes expired task directories (retention).
    """

    def __init__(self, master: MasterClient, store: AsyncStateStore, work_dir: Path,
                 config: OutboxConfig | None = None, lifecycle: Lifecycle | None = None) -> None:
        self.master = master
        self.lifecycle = lifecycle or Lifecycle()
        """Where each delivery emits its TaskDelivered record (ckagent.delivery.lifecycle; none: discarded)."""
        self.store = store
        self.work_dir = work_dir
        self.tasks_dir = work_dir / "tasks"
        self.config = config or OutboxConfig()
        self.limiter = trio.CapacityLimiter(SEND_CONCURRENCY)
        self.batcher = NodeBatcher(master)
        """Several tasks' batches in one request, when the master offers it (ckagent.delivery.nodebatch)."""
        self.guard = DiskGuard(work_dir, self.config.min_free_disk_bytes)
        self.disk = DiskWatch(self.config.min_free_disk_bytes, SCAN_INTERVAL)
        """Which task filled the disk (ckagent.delivery.diskwatch); :attr:`on_disk_full` stops it. Its
        ``last_culprit`` (a DiskCulprit or None) is the status page's."""
        self.accounted: dict[str, Accounted] = {}
        """The running tasks' trees whose disk use the disk loop measures (:meth:`account`)."""
        self._used: dict[str, int] = {}  # each accounted task's use at its last measure (bytes)
        self._looks = 0
        self.on_disk_full: Callable[[str, str], None] | None = None
        """Called with (task id, reason) for a running task that fills the disk: the agent stops it DISK_FULL."""
        self.busy_spiders: Callable[[], set[str]] | None = None
        """The safe names of the spiders with a task on this node (the retention loop keeps their Scrapy
        data: ckagent.code.scrapydata.remove_unused); None: none known."""
        self._store_full = False  # the last flush of positions met a full disk (logged once)
        self._looked = Broadcast()  # after each look of the disk loop
        self.deliveries: dict[str, TaskDelivery] = {}
        self.idle_since: float | None = None
        """``time.monotonic()`` when the last open delivery ended (None: none has ended yet)."""
        self._counter = SpoolCounter(store.sync)
        self.stats_observer: Callable[[str, str, dict[str, Any], bool], None] | None = None
        """Called with (task id, spider name, stats, final) for every newer stats snapshot (metrics)."""
        self._nursery: trio.Nursery | None = None
        self._idle = trio.Event()
        self._idle.set()
        self._busy = trio.Event()  # set while a delivery is open (the disk loop runs)
        self._delivered = Broadcast()  # a delivery ended
        self._acked: set[str] = set()  # tasks whose acknowledged result is not marked so yet (see acknowledged)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled (the agent's stop). Unsent data stays on disk for the next start; the
        acknowledged positions noted since the last write are written on the way out (shielded, ≤ 5 s)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self.guard.refresh()
                await trio.to_thread.run_sync(self._own_room)
                nursery.start_soon(self.batcher.run)
                nursery.start_soon(self._disk_loop)
                if self.config.retention > 0:
                    nursery.start_soon(retention_loop, self.store, self.work_dir, self.config.retention,
                                       lambda: self.busy_spiders() if self.busy_spiders is not None else set())
                task_status.started()
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                await self._flush_positions()
                await self._mark_acked()

    def _own_room(self) -> None:
        """At start: the state store's room of its own (ckagent.node.diskfull), an earlier agent's spare
        file removed. Blocking."""
        remove_old_reserve(self.work_dir)
        self.store.sync.keep_reserve()

    def statistics(self) -> OutboxStatistics:
        """What waits for the master now (see ckagent.delivery.statistics). **Blocking** (SQLite and
        spool reads, incremental): call it in a worker thread."""
        return self._counter.read()

    async def figures(self) -> OutboxStatistics:
        """What waits for the master now, from the deliveries in memory (their acknowledged
        positions) and the spool files, counted on the event loop in slices (see
        ckagent.delivery.statistics): no SQL, no thread. Cancellation: the figures are not updated."""
        records = [(d.task_id, d.task_dir, d.claimed_at, d.result is not None, d.logs.acked, d.items.acked)
                   for d in self.deliveries.values()]
        figures = await self._counter.refresh(records)
        if not figures.backlog:
            return figures
        # How long a task's data has waited, as its shippers know it (the counter knows only since
        # when it has seen the backlog).
        now, backlog = time.time(), []
        for entry in figures.backlog:
            delivery = self.deliveries.get(entry.task_id)
            since = [s.waiting_since for s in (delivery.logs, delivery.items) if s.waiting_since is not None] \
                if delivery is not None else []
            backlog.append(dataclasses.replace(entry, age_seconds=max(entry.age_seconds, now - min(since)))
                           if since else entry)
        backlog.sort(key=lambda b: -b.age_seconds)
        return dataclasses.replace(figures, backlog=tuple(backlog), oldest_seconds=backlog[0].age_seconds)

    def shipped(self) -> tuple[int, int]:
        """(log lines, items) the master acknowledged while this process runs (never decreasing)."""
        return self._counter.shipped_log_lines, self._counter.shipped_items

    def task_acknowledged(self, task_id: str, log_lines: int, items: int, claimed_at: float) -> None:
        """The master acknowledged a task's final result with these counts (settles :meth:`shipped`)."""
        self._counter.task_done(task_id, log_lines, items, claimed_at)

    @property
    def pending(self) -> int:
        """Tasks whose delivery is not complete."""
        return len(self.deliveries)

    async def wait_idle(self) -> None:
        """Return when every delivery is complete (at once if none is pending)."""
        await self._idle.wait()

    async def flush_read(self, timeout_seconds: float = HAND_OVER_FLUSH_TIMEOUT) -> str:
        """Every delivery sends what it has read at once, for at most ``timeout_seconds`` or
        HAND_OVER_FLUSH_TIMEOUT, whichever is shorter (a hand-over: the next agent sends the rest).
        Returns what happened, for the log: ``sent what was read in 0.05 s; 1 delivery(ies) left
        in the state store``."""
        started = trio.current_time()
        with trio.move_on_after(max(0.0, min(timeout_seconds, HAND_OVER_FLUSH_TIMEOUT))) as bound:
            async with trio.open_nursery() as nursery:
                for delivery in list(self.deliveries.values()):
                    nursery.start_soon(delivery.flush_read)
        done = "stopped sending what was read after" if bound.cancelled_caught else "sent what was read in"
        return f"{done} {trio.current_time() - started:.2f} s; {self.pending} delivery(ies) left in the state store"

    def acknowledged(self, task_id: str) -> None:
        """The master acknowledged a task's final result (or refused it for good): it is marked so in
        the disk loop's next round (≤ SCAN_INTERVAL later, in the hop the round makes anyway; on the
        loop's way to sleep and at the agent's stop, in one of its own). A crash before that write
        only makes the next start send the result again, which the master answers as a repeat. On
        the Trio thread; never blocks."""
        self._acked.add(task_id)

    def marking(self, task_id: str) -> bool:
        """True while the task's result is acknowledged by the master but not yet marked so in the state
        store (≤ one round): a reader of the store's ``result_acked`` (the status page) may count it
        delivered."""
        return task_id in self._acked

    async def wait_busy(self) -> None:
        """Return once a delivery is open (at once if one is). Cancellation: as usual."""
        await self._busy.wait()

    async def wait_delivered(self, task_ids: set[str]) -> None:
        """Return once a task of ``task_ids`` has no delivery here any more (at once if none has).
        The poller waits here for the results a master's stale ``cancelTaskIds`` are waiting for."""
        while task_ids & self.deliveries.keys():
            await self._delivered.wait()

    async def open_task(self, task: Task, task_dir: Path, claimed_at: float | None = None, *,
                        make_dir: Callable[[], None] | None = None) -> TaskDelivery:
        """Start delivering a task that is about to run; write its output to ``.sink``. ``claimed_at``:
        epoch seconds of its claim (default: now); its TaskDelivered record carries it.

        One thread hop opens it all: ``make_dir()`` (the caller's: the task's directory), the task's
        durable record in the state store, its journals and output.log (and, when no other delivery
        is open, the free space: the disk loop has not looked for a while). Raises OSError when one of
        them cannot be created, sqlite3.Error when the record cannot be written.
        """
        masker = Masker(secret_values(task.env, self.config.agent_secrets, [*(task.command or ()), *task.args]))
        journal = LogJournal(task_dir)
        item_globs = list(task.outputs.items) if task.outputs is not None else []
        # declared item files: the items stream is a journal's merge (ckagent.delivery.outputs.live)
        item_journal = LogJournal(task_dir, ITEMS_JOURNAL, ITEMS_FILE, "item file") if item_globs else None
        delivery = TaskDelivery(self, task.id, task_dir, masker, task_log_globs(task, self.config.log_globs),
                                None, journal, spider=task.spider_name or task.spider_id, claimed_at=claimed_at,
                                item_journal=item_journal, item_globs=item_globs)
        task_json = task.to_json()
        guard = self.guard
        idle = not self.deliveries  # the free-space figure may be hours old: measured in this hop

        def opening() -> tuple[bool, LogSink, int | None]:
            free = guard.measure() if idle else None
            if make_dir is not None:
                make_dir()
            fresh = self.store.sync.add_task(task.id, task.spider_id, task_json, task_dir)
            journal.open()
            try:
                if item_journal is not None:
                    item_journal.open()
                return fresh, LogSink(task_dir / OUTPUT_LOG, delivery.output_written,
                                      max_bytes=self.config.max_log_bytes), free
            except BaseException:
                journal.close()
                if item_journal is not None:
                    item_journal.close()
                raise

        fresh, sink, free = await trio.to_thread.run_sync(opening)
        guard.measured(free)
        delivery.sink = sink
        if fresh:  # both streams start at (0, None): the shippers need not ask the database
            self.store.mark_fresh(task.id)
        rejected = rejected_log_globs(task)
        if rejected:  # said in the task's own log (and the agent's), not silently dropped
            log.warning("task %s: %s", task.id, rejected)
            stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            sink.write_line(f"[ckagent {stamp}] {rejected}\n".encode())
        self._start(delivery, task_json)
        return delivery

    async def resume(self, record: TaskRecord) -> None:
        """Deliver what an earlier run left: the streams from their stored positions, then the result."""
        assert record.result is not None, "recover the task (AGENT_LOST) before resuming its delivery"
        try:
            task = Task.from_json(record.task_json)
            env, globs = task.env, task_log_globs(task, self.config.log_globs)
            words = [*(task.command or ()), *task.args]
        except ValueError:
            env, globs, words = {}, list(self.config.log_globs), []
        masker = Masker(secret_values(env, self.config.agent_secrets, words))
        journal = LogJournal(record.task_dir)
        ship_logs = True
        try:
            await trio.to_thread.run_sync(journal.open)
        except (OSError, ValueError) as exc:
            log.error("task %s: cannot open its log journal (%s); not sending its log", record.task_id, exc)
            ship_logs = False
        spider = str(record.task_json.get("spiderName") or record.spider_id)
        item_journal = await trio.to_thread.run_sync(_item_journal_of, record.task_dir)
        delivery = TaskDelivery(self, record.task_id, record.task_dir, masker, globs, None, journal,
                                spider=spider, claimed_at=record.claimed_at, item_journal=item_journal)
        delivery.ship_logs = ship_logs
        for shipper in (delivery.logs, delivery.items):  # the outbox figures count from here at once
            shipper.acked = (await self.store.stream_position(record.task_id, shipper.stream))[0]
        delivery.result = TaskResult.from_json(record.result)
        delivery.items.finish()
        delivery.ended.set()
        delivery.stats.stop()
        self._start(delivery, record.task_json)

    def _start(self, delivery: TaskDelivery, task_json: dict[str, Any]) -> None:
        if self._nursery is None:
            raise RuntimeError("the outbox is not running")
        # An attempt's streams continue the task's numbering (the spool counts from 0) and say their attempt.
        attempt = _count(task_json.get("attempt"), 1)
        for shipper, start in ((delivery.items, "itemSeqStart"), (delivery.logs, "logSeqStart")):
            shipper.seq_start = _count(task_json.get(start), 0)
            shipper.attempt = attempt if attempt > 1 else None  # absent = 1 (what an older master knows)
        self.deliveries[delivery.task_id] = delivery
        self._idle = trio.Event()
        self._busy.set()
        self._nursery.start_soon(self._guarded, delivery, name=f"deliver {delivery.task_id}")

    async def _guarded(self, delivery: TaskDelivery) -> None:
        try:
            await delivery.run()
        except Exception:
            log.exception("task %s: delivery failed; it stays in the state store for the next start",
                          delivery.task_id)
        finally:
            if delivery.sink is not None:
                delivery.sink.close()
            delivery.journal.close()
            if delivery.item_journal is not None:
                delivery.item_journal.close()
            self.deliveries.pop(delivery.task_id, None)
            self._delivered.set()
            if not self.deliveries:
                self.idle_since = time.monotonic()
                self._idle.set()
                self._busy = trio.Event()

    async def _disk_loop(self) -> None:
        """Every SCAN_INTERVAL while a delivery is open (sooner while the free space falls fast: see
        ckagent.delivery.diskwatch): the shippers' noted positions (one write), the files of every
        running task, their directories' sizes and the free-space figure (one hop) — for the whole
        agent, not per task or stream; a task that fills the disk is handed to :attr:`on_disk_full`.
        With no delivery open it sleeps until one opens (an idle agent has nothing here to look at:
        no wake-up), then refreshes the free-space figure at once."""
        while True:
            if not self.deliveries:
                await self._flush_positions()  # the last delivery's last positions
                await self._mark_acked()  # and its result's acknowledgement
                await self._busy.wait()
                measured = self.guard.measured_at
                if measured is None or trio.current_time() - measured > SCAN_INTERVAL:
                    await self.guard.refresh()  # the figure may be hours old (an opening task measures it)
            await trio.sleep(self.disk.next_interval())
            await self._flush_positions()  # the shippers' acknowledged positions, all streams at once
            live = [delivery for delivery in self.deliveries.values() if delivery.scanning]
            acked, self._acked = self._acked, set()
            last_free = self.guard.free_bytes
            self._looks += 1
            # A calm disk (judged again in the hop, on the free space it measures): the trees are walked
            # every FULL_MEASURE_EVERY looks (new tasks at once).
            calm = 2 * self.disk.critical_bytes if (
                self.disk.next_interval() >= SCAN_INTERVAL and self._looks % FULL_MEASURE_EVERY) else None
            accounted = [(task_id, entry, task_id in self._used) for task_id, entry in self.accounted.items()]
            spool = headroom_fds(live)  # duplicated here: a descriptor closed meanwhile is not reused under us
            keep = last_free is not None and last_free > self.disk.critical_bytes + 2 * STORE_RESERVE_BYTES
            found, free, sizes, unmarked = await trio.to_thread.run_sync(
                _scan_round, live, self.guard.path, accounted, calm, spool, self.store.sync, acked, keep)  # one hop
            self._acked |= unmarked  # a full disk: marked at the next write
            for delivery, (files, items_size, stats_size, item_sizes) in zip(live, found, strict=True):
                delivery.scanned(files, items_size, stats_size, item_sizes)
                if delivery.sink is not None and delivery.sink.full_since is not None:
                    delivery.sink.retry()
            self.guard.measured(free)
            self._used.update(sizes)
            self._used = {task_id: self._used[task_id] for task_id in self.accounted if task_id in self._used}
            self._watch_disk(free, dict(self._used))
            self._looked.set()

    async def next_look(self) -> None:
        """Return after the disk loop's next look at the disk (a writer waiting for room tries again
        then). Cancellation: as usual."""
        await self._looked.wait()

    def _watch_disk(self, free: int | None, sizes: dict[str, int]) -> None:
        """One look of the disk watch: stop the task that filled the disk (ckagent.delivery.diskwatch)."""
        for task_id, reason in self.disk.observe(trio.current_time(), free, sizes):
            log.error("task %s: %s; stopping it (DISK_FULL)", task_id, reason)
            if self.on_disk_full is not None:
                self.on_disk_full(task_id, reason)

    def account(self, task_id: str, accounted: Accounted) -> None:
        """Measure the task's disk use at every look from now on (its trees and its own limit: see
        ckagent.delivery.diskwatch) until :meth:`unaccount`. On the Trio thread."""
        self.accounted[task_id] = accounted
        self.disk.set_limit(task_id, accounted.limit_bytes)

    def unaccount(self, task_id: str) -> None:
        """The task's processes have ended: no more looks at its use (its blame, if any, stays until
        ckagent.delivery.diskwatch.DiskWatch.reclaimed)."""
        self.accounted.pop(task_id, None)
        self.disk.forget(task_id)

    async def _mark_acked(self) -> None:
        """The acknowledged results waiting for their mark, in a hop of their own (none when none waits)."""
        if self._acked:
            acked, self._acked = self._acked, set()
            self._acked |= await trio.to_thread.run_sync(_mark_all, self.store.sync, acked)

    async def _flush_positions(self) -> None:
        """The noted positions into the state store; on a full disk they stay noted for the next try
        (logged once per episode), the agent goes on."""
        try:
            await self.store.flush_positions()
        except StateStoreError as exc:
            if not self._store_full:
                self._store_full = True
                log.error("cannot save the acknowledged positions: %s; they are kept in memory and saved when "
                          "there is room (a crash meanwhile only makes the agent send those batches again)", exc)
            return
        if self._store_full:
            self._store_full = False
            log.info("the acknowledged positions are saved again")


def _scan_round(deliveries: list[TaskDelivery], disk: Path, accounted: list[tuple[str, Accounted, bool]],
                calm_bytes: int | None, spool: list[tuple[Spooled, list[tuple[int, int]]]], store: StateStore,
                acked: set[str], keep_reserve: bool) -> tuple[list[Scanned], int | None, dict[str, int], set[str]]:
    """One round of the disk loop in its worker thread (blocking): the acknowledged results marked
    (:func:`_mark_all`), :func:`_scan_all`, the spool files' headroom topped up (ckagent.delivery.headroom.top_up),
    the state store's own free pages kept (``keep_reserve``: there is room for them), the free
    bytes of the filesystem holding ``disk`` (None when it cannot be measured), the accounted tasks'
    bytes (ckagent.delivery.diskwatch.accounted_bytes: ``(task, trees, measured before)`` — one
    measured before is left out while at least ``calm_bytes`` are free; None: none is left out) and
    the marks that could not be written."""
    unmarked = _mark_all(store, acked)
    top_up(spool)
    if keep_reserve:
        store.keep_reserve()
    free = _free_bytes(disk)
    calm = calm_bytes is not None and free is not None and free >= calm_bytes
    sizes = {task_id: accounted_bytes(entry) for task_id, entry, known in accounted if not (calm and known)}
    return _scan_all(deliveries), _free_bytes(disk) if sizes else free, sizes, unmarked


def _free_bytes(disk: Path) -> int | None:
    """Free bytes of the filesystem holding ``disk``, None when they cannot be measured. Blocking."""
    try:
        return shutil.disk_usage(disk).free
    except OSError as exc:
        log.debug("cannot measure free space of %s: %s", disk, exc)
        return None


def _mark_all(store: StateStore, acked: set[str]) -> set[str]:
    """Mark each task of ``acked`` acknowledged (blocking); returns those a full disk left unmarked
    (said once per write)."""
    unmarked: set[str] = set()
    for task_id in acked:
        try:
            store.mark_result_acked(task_id)
        except StateStoreError as exc:
            unmarked.add(task_id)
            error = exc
    if unmarked:
        log.error("the master has the results of %d task(s), but %s; marked when there is room (a crash "
                  "meanwhile only makes the next start send them again)", len(unmarked), error)
    return unmarked


def _scan_all(deliveries: list[TaskDelivery]) -> list[Scanned]:
    """:meth:`TaskDelivery.scan` of each (blocking); a task whose dir cannot be read is skipped."""
    found = []
    for delivery in deliveries:
        try:
            found.append(delivery.scan())
        except OSError as exc:
            log.debug("task %s: cannot scan its files: %s", delivery.task_id, exc)
            found.append(({}, 0, 0, {}))
    return found


def _item_journal_of(task_dir: Path) -> LogJournal | None:
    """The items journal an earlier run left in ``task_dir`` (opened), or None: a task without one.
    A journal that cannot be read is logged and ignored (the items stream is items.jsonl alone). Blocking."""
    if not (task_dir / ITEMS_JOURNAL).exists():
        return None
    journal = LogJournal(task_dir, ITEMS_JOURNAL, ITEMS_FILE, "item file")
    try:
        journal.open()
    except (OSError, ValueError) as exc:
        log.error("%s: cannot open its items journal (%s); sending items.jsonl alone", task_dir.name, exc)
        return None
    return journal


def _count(value: Any, default: int) -> int:
    """A task's stored counter (``attempt``, ``itemSeqStart``, …): an int ≥ 0, else ``default``."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default
