"""The stats shipper: a running task's newest stats snapshot → ``POST /api/tasks/{id}/stats``.

Coalesced and rate-limited: the shipper looks at the task's stats file when woken by
:meth:`StatsShipper.notify` — the outbox's once-a-second scan of every running task's files calls it
when the stats file's size changed, so a task that writes no stats costs the shipper no wake-up at
all (a read of the last line only when the file grew) — keeps the newest snapshot, and sends it at
most once per STATS_INTERVAL seconds — only the newest one; those in
between are never sent. Live snapshots are best effort: a master that is down, or answers 4xx,
gets the next newest one later (a 404 or 409 ends live shipping for the task: the master does not
know the task, or the endpoint). The *final* snapshot is durable: it is read from the stats file
(the spool) when the result is built, and travels inside the result (``stats``, ``finishReason``),
which is stored and retried until acknowledged (see :mod:`ckagent.delivery.outbox`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import trio

from ckagent.delivery.crawlstats import STATS_FILE, Snapshot, read_last_snapshot
from ckagent.master.client import MasterClient, MasterError, MasterRejected
from ckagent.master.protocol import TaskStats, utc_iso

log = logging.getLogger(__name__)

STATS_INTERVAL = 5.0
"""Seconds between two live stats posts of one task (at most)."""


def snapshot_message(snapshot: Snapshot) -> TaskStats:
    """The protocol message of a snapshot (``at`` from its ``time``; malformed parts left out)."""
    data = snapshot.data
    at = None
    moment = data.get("time")
    if isinstance(moment, int | float) and not isinstance(moment, bool) and 0 < moment < 1e11:
        at = utc_iso(datetime.fromtimestamp(moment, timezone.utc))
    progress = data.get("progress")
    return TaskStats(seq=snapshot.seq, stats=snapshot.stats,
                     progress=progress if isinstance(progress, dict) else None, at=at)


def final_stats(task_dir: Path) -> TaskStats | None:
    """The task's last snapshot as a message (blocking, one small read), or None."""
    try:
        snapshot = read_last_snapshot(task_dir / STATS_FILE)
    except OSError as exc:
        log.warning("cannot read the stats file of %s: %s", task_dir.name, exc)
        return None
    return None if snapshot is None else snapshot_message(snapshot)


class StatsShipper:
    """Ships one task's live stats (see module docstring). ``latest`` is the newest snapshot read
    (for the status page, the metrics and the stall watchdog); ``changed_at`` when it last changed
    (``trio.current_time()``); ``sent`` how many posts the master acknowledged. ``on_snapshot(snapshot)``
    is called on the Trio thread for every newer snapshot read (the crawl metrics)."""

    def __init__(self, master: MasterClient, task_id: str, task_dir: Path,
                 limiter: trio.CapacityLimiter | None = None, interval: float | None = None,
                 on_snapshot: Callable[[Snapshot], None] | None = None) -> None:
        self._master = master
        self.task_id = task_id
        self.path = task_dir / STATS_FILE
        self._limiter = limiter or trio.CapacityLimiter(1)
        self.interval = STATS_INTERVAL if interval is None else interval
        self.latest: Snapshot | None = None
        self.changed_at: float | None = None
        self.sent_seq = -1
        self.sent = 0
        self.refused = False
        self._on_snapshot = on_snapshot
        self._wake = trio.Event()
        self._stopped = trio.CancelScope()  # see stop
        self.looks = 0
        """How many times the loop woke to look at the file (a figure for tests and benchmarks)."""

    def notify(self) -> None:
        """The stats file changed (its size): look at it again (on the Trio thread; never blocks)."""
        self._wake.set()

    def look(self) -> Snapshot | None:
        """Read a newer snapshot if the file grew (a syscall or two, page cache); returns the newest."""
        try:
            newer = read_last_snapshot(self.path, self.latest.seq if self.latest is not None else -1)
        except OSError as exc:
            log.debug("task %s: cannot read its stats file: %s", self.task_id, exc)
            newer = None
        if newer is not None:
            self.latest = newer
            self.changed_at = trio.current_time()
            if self._on_snapshot is not None:
                self._on_snapshot(newer)
        return self.latest

    async def run(self, ended: trio.Event) -> None:
        """Look and ship until ``ended`` is set (then return at once, even mid-request). Live stats are
        a side channel: a bug here is logged and ends them, never the task's delivery."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.run_until_stopped)
            await ended.wait()
            self.stop()

    async def run_until_stopped(self) -> None:
        """:meth:`run` without a task of its own waiting for the end: returns once :meth:`stop` is
        called (at once if it was), even mid-request."""
        with self._stopped:
            await self._guarded_loop()

    def stop(self) -> None:
        """End :meth:`run_until_stopped` (idempotent; before it started too). On the Trio thread."""
        self._stopped.cancel()

    async def _guarded_loop(self) -> None:
        try:
            await self._loop()
        except Exception:
            log.exception("task %s: live stats stopped", self.task_id)
            self.refused = True

    async def _loop(self) -> None:
        """Look when notified; post the newest unsent snapshot once ``interval`` has passed since the
        last post (waiting for that moment when a newer one came sooner). No timed looks: without a
        notification the loop sleeps until the task ends."""
        next_send = trio.current_time()
        while True:
            self.looks += 1
            latest = self.look()
            if latest is not None and latest.seq > self.sent_seq and not self.refused:
                now = trio.current_time()
                if now < next_send:
                    await trio.sleep_until(next_send)  # rate limit; a look then finds the newest
                    continue
                next_send = now + self.interval
                await self._post(latest)
                if self.sent_seq < latest.seq and not self.refused:
                    continue  # unavailable: the newest goes again after the interval
            await self._wake.wait()
            self._wake = trio.Event()

    async def _post(self, snapshot: Snapshot) -> None:
        try:
            async with self._limiter:
                await self._master.post_stats(self.task_id, snapshot_message(snapshot))
        except MasterRejected as exc:
            if exc.status in (404, 409):
                log.info("task %s: the master takes no live stats for it (%s); the final ones go with the "
                         "result", self.task_id, exc)
                self.refused = True
            else:
                log.warning("task %s: the master rejected a stats snapshot (%s)", self.task_id, exc)
                self.sent_seq = snapshot.seq
            return
        except (MasterError, ValueError):
            return  # unavailable (or an answer that is not JSON): the newest snapshot goes next time
        self.sent_seq = snapshot.seq
        self.sent += 1
