"""The outbox: one per agent, owns every task's delivery (journal writer, shippers, result) and retention.

See the package docstring (ckagent.delivery) for the whole design.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trio

from ckagent.delivery.artifacts import upload_artifacts
from ckagent.delivery.capture import DiskGuard, LogSink
from ckagent.delivery.crawlstats import STATS_FILE, Snapshot
from ckagent.delivery.diskwatch import DiskWatch, tree_bytes
from ckagent.delivery.journal import LogJournal, rejected_log_globs, scan_log_files, task_log_globs
from ckagent.delivery.lines import Masker, secret_values
from ckagent.delivery.nodebatch import NodeBatcher
from ckagent.delivery.outputs import cleanup_kept
from ckagent.delivery.shipper import DEFAULT_REFUSAL_TIMEOUT, StreamShipper, send_result
from ckagent.delivery.spool import DEFAULT_LOG_GLOBS, ITEMS_FILE, OUTPUT_LOG, SCAN_INTERVAL, SEND_CONCURRENCY
from ckagent.delivery.stall import Activity, watch_stall
from ckagent.delivery.statistics import OutboxStatistics, SpoolCounter
from ckagent.delivery.stats import StatsShipper, final_stats
from ckagent.master.client import MasterClient
from ckagent.master.protocol import Task, TaskResult
from ckagent.node.diskfull import RESERVE_BYTES, SpaceReserve
from ckagent.node.state import AsyncStateStore, StateStoreError, TaskRecord

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- outbox

Delivered = Callable[[TaskResult], None]


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


class TaskDelivery:
    """One task's delivery, owned by the :class:`Outbox`. The supervisor writes to :attr:`sink`
    while the process runs and calls :meth:`finish` once with the final result."""

    def __init__(self, outbox: Outbox, task_id: str, task_dir: Path, masker: Masker, globs: list[str],
                 sink: LogSink | None, journal: LogJournal, on_delivered: Delivered | None,
                 spider: str = "") -> None:
        self.outbox = outbox
        self.task_id = task_id
        self.task_dir = task_dir
        self.globs = globs
        self.sink = sink
        self.journal = journal
        self.on_delivered = on_delivered
        refusal_timeout = outbox.config.refusal_timeout
        self.logs = StreamShipper.logs(outbox.master, outbox.store, task_id, task_dir, masker, outbox.limiter,
                                       refusal_timeout=refusal_timeout)
        self.items = StreamShipper.items(outbox.master, outbox.store, task_id, task_dir, outbox.limiter,
                                         refusal_timeout)
        self.spider = spider
        self.claimed_at = time.time()  # epoch seconds; a resumed delivery: the claim of an earlier run
        self.stats = StatsShipper(outbox.master, task_id, task_dir, outbox.limiter, on_snapshot=self._observe)
        self.activity = Activity((task_dir / ITEMS_FILE, task_dir / STATS_FILE))
        self.logs.batcher = self.items.batcher = outbox.batcher
        journal.on_record = self.logs.notify
        self._wake = trio.Event()
        self._found: dict[str, int] | None = None  # spider log files found by the last scan, not yet noted
        self._found_sizes: dict[str, int] = {}  # spider log files and sizes the last scan found
        self._items_size = 0  # items.jsonl's size at the last scan
        self._stats_size = 0  # the stats file's size at the last scan
        self._output_grew: trio.Event | None = None  # set by the next output write (see wait_output)
        self.scanning = False  # True while the task runs: the outbox scans its files every SCAN_INTERVAL
        self.ended = trio.Event()
        self.delivered = trio.Event()
        self.result: TaskResult | None = None
        self.ship_logs = True  # False when the journal cannot be opened (the result still goes)
        self._stall: tuple[float, Callable[[float], None]] = (0.0, lambda idle: None)
        self._stall_armed = trio.Event()

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
        self._wake.set()
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

    def watch_stall(self, timeout: float, on_stall: Callable[[float], None]) -> None:
        """Arm the stall watchdog (the process has started): ``on_stall(idle_seconds)`` is called once
        when no output, item or stats change was seen for ``timeout`` seconds before :meth:`finish`."""
        self.activity.touch()
        self._stall = (timeout, on_stall)
        self._stall_armed.set()

    async def _stall_loop(self) -> None:
        if not self.ended.is_set():
            await self._stall_armed.wait()  # set by watch_stall() or finish()
        if self.ended.is_set():
            return
        timeout, on_stall = self._stall
        await watch_stall(timeout, self.activity.last, self.ended, on_stall)

    async def finish(self, result: TaskResult) -> None:
        """The process is over: close output.log, store ``result``, let the streams complete and the
        result follow them. Returns at once (after the state store write); cancellation before that
        write leaves the task to the next start (reported AGENT_LOST)."""
        if self.sink is not None:
            self.sink.close()
        await self._store_result(result)
        self.result = result
        self.items.finish()
        self.ended.set()
        self._stall_armed.set()
        self._wake.set()
        if self._output_grew is not None:
            self._output_grew.set()
            self._output_grew = None

    async def _store_result(self, result: TaskResult) -> None:
        """The result into the state store; on a full disk it is kept in memory and sent all the same
        (an agent crash before it is acknowledged then reports the task AGENT_LOST)."""
        try:
            await self.outbox.store.set_result(self.task_id, result.to_json())
        except StateStoreError as exc:
            log.error("task %s: cannot store its result (%s); sending it from memory", self.task_id, exc)

    async def _journal_loop(self) -> None:
        """Record the growth of output.log (when notified) and of spider log files (when the outbox's
        once-a-second scan, :meth:`scanned`, found them)."""
        self.scanning = True
        try:
            while not self.ended.is_set():
                await self._wake.wait()
                self._wake = trio.Event()
                sizes: dict[str, int] = {}
                if self.sink is not None:
                    sizes[OUTPUT_LOG] = self.sink.size
                if self._found is not None:
                    sizes.update(self._found)
                    self._found = None
                self.journal.note(sizes)
        finally:
            self.scanning = False
        sizes = await trio.to_thread.run_sync(self._final_sizes)
        self.journal.end(sizes)
        while not self.journal.flush():  # a full disk: the stream's last records wait for room
            await self.outbox.next_look()
        self.journal.close()

    def scan(self) -> tuple[dict[str, int], int, int]:
        """(spider log files → size, items.jsonl's size or 0, the stats file's size or 0). Blocking:
        the outbox calls it in its once-a-second worker thread, for every running task in one hop."""
        return scan_log_files(self.task_dir, self.globs), _size(self.task_dir / ITEMS_FILE), \
            _size(self.task_dir / STATS_FILE)

    def scanned(self, found: dict[str, int], items_size: int, stats_size: int = 0) -> None:
        """The result of :meth:`scan` (on the loop): the journal notes the log files; a grown items
        file wakes its shipper, a grown stats file the stats shipper (neither polls a file that is
        not growing)."""
        if found != self._found_sizes:  # the journal loop wakes only for log files that changed
            self._found_sizes = found
            self._found = found
            self._wake.set()
        if items_size != self._items_size:
            self._items_size = items_size
            self.items.notify()
        if stats_size != self._stats_size:
            self._stats_size = stats_size
            self.stats.notify()

    def _final_sizes(self) -> dict[str, int]:
        sizes = scan_log_files(self.task_dir, self.globs)
        try:
            sizes[OUTPUT_LOG] = (self.task_dir / OUTPUT_LOG).stat().st_size
        except FileNotFoundError:
            sizes[OUTPUT_LOG] = 0
        return sizes

    async def run(self) -> None:
        """Journal, ship both streams, then send the result. Cancellation leaves it all for the next start."""
        async with trio.open_nursery() as nursery:
            if self.ship_logs:
                nursery.start_soon(self._journal_loop)
                nursery.start_soon(self.logs.run)
            nursery.start_soon(self.items.run)
            nursery.start_soon(self.stats.run, self.ended)
            nursery.start_soon(self._stall_loop)
            await self.ended.wait()
        assert self.result is not None
        # The final stats snapshot is the stats file's last line (the spool): read again on every
        # (re)start, so neither an agent crash nor a master outage loses it.
        final = await trio.to_thread.run_sync(final_stats, self.task_dir)
        self._observe(Snapshot(final.seq if final else 0, {"stats": final.stats if final else {}}), final=True)
        stats = final if final is not None else self.result.stats
        reason = self.result.finish_reason
        if reason is None and stats is not None and isinstance(stats.stats.get("finishReason"), str):
            reason = stats.stats["finishReason"] or None
        refused = [shipper.stream for shipper in (self.logs, self.items) if shipper.refused]
        if not self.ship_logs:
            refused.insert(0, "log")
        incomplete = True if refused or self.result.incomplete else None
        if refused:
            log.error("task %s: its result says incomplete: the master refused its %s for good; it holds %d log "
                      "lines and %d items; the spool stays in %s until task.retention", self.task_id,
                      " and ".join(refused), self.logs.acked, self.items.acked, self.task_dir)
        # Artifacts go before the result, which lists what the master holds (ckagent.delivery.artifacts).
        artifacts = await upload_artifacts(self.outbox.master, self.task_id, self.task_dir, self.outbox.limiter)
        result = dataclasses.replace(self.result, item_count=self.items.acked, log_lines=self.logs.acked,
                                     stats=stats, finish_reason=reason, incomplete=incomplete,
                                     artifacts=artifacts)
        await self._store_result(result)
        await send_result(self.outbox.master, self.outbox.store, self.task_id, result, self.outbox.limiter,
                          self.outbox.config.refusal_timeout)
        self.delivered.set()
        if self.on_delivered is not None:
            self.on_delivered(result)


class Outbox:
    """Every task's delivery, in one nursery that outlives the tasks (see module docstring).

    ``await nursery.start(outbox.run)`` starts it; :meth:`open_task` / :meth:`resume` add tasks;
    :meth:`wait_idle` waits until nothing is left to send; :meth:`statistics` says what is left. Also keeps the free-space figure of the
    work dir fresh and deletes expired task directories (retention).
    """

    def __init__(self, master: MasterClient, store: AsyncStateStore, work_dir: Path,
                 config: OutboxConfig | None = None) -> None:
        self.master = master
        self.store = store
        self.work_dir = work_dir
        self.tasks_dir = work_dir / "tasks"
        self.config = config or OutboxConfig()
        self.limiter = trio.CapacityLimiter(SEND_CONCURRENCY)
        self.batcher = NodeBatcher(master)
        """Several tasks' batches in one request, when the master offers it (ckagent.delivery.nodebatch)."""
        self.guard = DiskGuard(work_dir, self.config.min_free_disk_bytes)
        self.disk = DiskWatch(self.config.min_free_disk_bytes, SCAN_INTERVAL)
        """Which running task fills the disk (ckagent.delivery.diskwatch); :attr:`on_disk_full` stops it."""
        floor = self.config.min_free_disk_bytes
        self.reserve = SpaceReserve(work_dir, min(RESERVE_BYTES, floor // 4)) if floor else None
        """Disk space kept for the state store's writes on a full disk (ckagent.node.diskfull); with a floor only."""
        if self.reserve is not None:
            store.sync.reserve = self.reserve
        self.on_disk_full: Callable[[str, str], None] | None = None
        """Called with (task id, reason) for a running task that fills the disk: the agent stops it DISK_FULL."""
        self._reserve_released: float | None = None  # the reserve's released_at seen by the last look
        self._store_full = False  # the last flush of positions met a full disk (logged once)
        self._looked = trio.Event()  # set (and replaced) after each look of the disk loop
        self.deliveries: dict[str, TaskDelivery] = {}
        self._counter = SpoolCounter(store.sync)
        self.stats_observer: Callable[[str, str, dict[str, Any], bool], None] | None = None
        """Called with (task id, spider name, stats, final) for every newer stats snapshot (metrics)."""
        self._nursery: trio.Nursery | None = None
        self._idle = trio.Event()
        self._idle.set()
        self._busy = trio.Event()  # set while a delivery is open (the disk loop runs)
        self._delivered = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled (the agent's stop). Unsent data stays on disk for the next start; the
        acknowledged positions noted since the last write are written on the way out (shielded, ≤ 5 s)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await self.guard.refresh()
                if self.reserve is not None:
                    await trio.to_thread.run_sync(self.reserve.restore)
                nursery.start_soon(self.batcher.run)
                nursery.start_soon(self._disk_loop)
                if self.config.retention > 0:
                    nursery.start_soon(self._retention_loop)
                task_status.started()
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5.0):
                await self._flush_positions()

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

    async def wait_busy(self) -> None:
        """Return once a delivery is open (at once if one is). Cancellation: as usual."""
        await self._busy.wait()

    async def wait_delivered(self, task_ids: set[str]) -> None:
        """Return once a task of ``task_ids`` has no delivery here any more (at once if none has).
        The poller waits here for the results a master's stale ``cancelTaskIds`` are waiting for."""
        while task_ids & self.deliveries.keys():
            await self._delivered.wait()

    async def open_task(self, task: Task, task_dir: Path, on_delivered: Delivered | None = None) -> TaskDelivery:
        """Start delivering a task that is about to run; write its output to ``.sink``.

        Raises OSError when output.log or the journal cannot be created.
        """
        masker = Masker(secret_values(task.env, self.config.agent_secrets, [*(task.command or ()), *task.args]))
        journal = LogJournal(task_dir)
        await trio.to_thread.run_sync(journal.open)
        delivery = TaskDelivery(self, task.id, task_dir, masker, task_log_globs(task, self.config.log_globs),
                                None, journal, on_delivered, spider=task.spider_name or task.spider_id)
        delivery.sink = LogSink(task_dir / OUTPUT_LOG, delivery.output_written,
                                max_bytes=self.config.max_log_bytes, guard=self.guard)
        rejected = rejected_log_globs(task)
        if rejected:  # said in the task's own log (and the agent's), not silently dropped
            log.warning("task %s: %s", task.id, rejected)
            stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            delivery.sink.write_line(f"[ckagent {stamp}] {rejected}\n".encode())
        self._start(delivery)
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
        delivery = TaskDelivery(self, record.task_id, record.task_dir, masker, globs, None, journal, None,
                                spider=spider)
        delivery.ship_logs = ship_logs
        delivery.claimed_at = record.claimed_at
        for shipper in (delivery.logs, delivery.items):  # the outbox figures count from here at once
            shipper.acked = (await self.store.stream_position(record.task_id, shipper.stream))[0]
        delivery.result = TaskResult.from_json(record.result)
        delivery.items.finish()
        delivery.ended.set()
        self._start(delivery)

    def _start(self, delivery: TaskDelivery) -> None:
        if self._nursery is None:
            raise RuntimeError("the outbox is not running")
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
            self.deliveries.pop(delivery.task_id, None)
            self._delivered.set()
            self._delivered = trio.Event()
            if not self.deliveries:
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
                await self._busy.wait()
                await self.guard.refresh()  # the figure may be hours old
            await trio.sleep(self.disk.next_interval())
            await self._flush_positions()  # the shippers' acknowledged positions, all streams at once
            live = [delivery for delivery in self.deliveries.values() if delivery.scanning]
            found, free, sizes = await trio.to_thread.run_sync(_scan_round, live, self.guard.path)  # one hop
            for delivery, (files, items_size, stats_size) in zip(live, found, strict=True):
                delivery.scanned(files, items_size, stats_size)
            if free is not None:
                self.guard.free_bytes = free
            await self._watch_disk(free, {d.task_id: size for d, size in zip(live, sizes, strict=True)})
            self._looked.set()
            self._looked = trio.Event()

    async def next_look(self) -> None:
        """Return after the disk loop's next look at the disk (a writer waiting for room tries again
        then). Cancellation: as usual."""
        await self._looked.wait()

    async def _watch_disk(self, free: int | None, sizes: dict[str, int]) -> None:
        """One look of the disk watch: stop the task that fills the disk; make the reserve again once
        there is room for it."""
        released = self.reserve.released_at if self.reserve is not None else None
        was_full = released is not None and released != self._reserve_released
        self._reserve_released = released
        for task_id, reason in self.disk.observe(trio.current_time(), free, sizes, was_full):
            log.error("task %s: %s; stopping it (DISK_FULL)", task_id, reason)
            if self.on_disk_full is not None:
                self.on_disk_full(task_id, reason)
        reserve = self.reserve
        if (reserve is not None and free is not None and free > self.disk.critical_bytes + 2 * reserve.size_bytes
                and not await trio.to_thread.run_sync(lambda: reserve.held)):
            await trio.to_thread.run_sync(reserve.restore)

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

    async def _retention_loop(self) -> None:
        interval = min(3600.0, max(1.0, self.config.retention / 4))
        while True:
            await cleanup_task_dirs(self.store, self.tasks_dir, self.config.retention)
            # Files kept on the node (over the artifact budget, ...) follow the same retention.
            await trio.to_thread.run_sync(cleanup_kept, self.work_dir, self.config.retention)
            await trio.sleep(interval)


def _size(path: Path) -> int:
    """``path``'s size (bytes; 0 when it cannot be seen), without following a symlink. Blocking."""
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def _scan_round(deliveries: list[TaskDelivery], disk: Path) -> tuple[list[tuple[dict[str, int], int, int]],
                                                                     int | None, list[int]]:
    """One round of the disk loop in its worker thread (blocking): :func:`_scan_all`, the free bytes of
    the filesystem holding ``disk`` (None when it cannot be measured) and each task dir's bytes."""
    try:
        free: int | None = shutil.disk_usage(disk).free
    except OSError as exc:
        log.debug("cannot measure free space of %s: %s", disk, exc)
        free = None
    return _scan_all(deliveries), free, [tree_bytes(delivery.task_dir) for delivery in deliveries]


def _scan_all(deliveries: list[TaskDelivery]) -> list[tuple[dict[str, int], int, int]]:
    """:meth:`TaskDelivery.scan` of each (blocking); a task whose dir cannot be read is skipped."""
    found = []
    for delivery in deliveries:
        try:
            found.append(delivery.scan())
        except OSError as exc:
            log.debug("task %s: cannot scan its files: %s", delivery.task_id, exc)
            found.append(({}, 0, 0))
    return found


async def cleanup_task_dirs(store: AsyncStateStore, tasks_dir: Path, older_than: float) -> int:
    """Delete the directories of tasks fully acknowledged more than ``older_than`` seconds ago.

    ``older_than`` 0 deletes every acknowledged task's directory (``--cleanup-temp-files`` at start).
    Never touches a task whose result the master has not acknowledged, nor anything outside
    ``tasks_dir``. Returns how many were deleted; errors are logged, not raised.
    """
    cutoff = time.time() - older_than
    deleted = 0
    root = await trio.to_thread.run_sync(tasks_dir.resolve)
    for record in await store.delivered_before(cutoff if older_than > 0 else time.time() + 1):
        target = record.task_dir
        if target.resolve().parent != root:
            log.warning("task %s: not deleting %s (outside %s)", record.task_id, target, tasks_dir)
            await store.forget(record.task_id)
            continue
        try:
            await trio.to_thread.run_sync(_rmtree, target)
        except OSError as exc:
            log.warning("task %s: cannot delete %s: %s", record.task_id, target, exc)
            continue
        await store.forget(record.task_id)
        deleted += 1
    if deleted:
        log.info("deleted %d delivered task director%s", deleted, "y" if deleted == 1 else "ies")
    return deleted


def _rmtree(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
