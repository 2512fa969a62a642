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
import math
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import trio

from ckagent.delivery.crawlstats import STATS_FILE, Snapshot, read_last_snapshot
from ckagent.delivery.waiting import Waker
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
    is called on the Trio thread for every newer snapshot read (the crawl metrics).

    Two ways to drive it: :meth:`run` / :meth:`run_until_stopped` (a task of its own), or its
    owner's loop — :meth:`step` whenever its :attr:`waker` wakes or the time :meth:`step` returned
    has come (a task's delivery drives it so, beside its streams: ckagent.delivery.taskdelivery);
    a post then runs in the owner's nursery, only while it is on its way."""

    def __init__(self, master: MasterClient, task_id: str, task_dir: Path,
                 limiter: trio.CapacityLimiter | None = None, interval: float | None = None,
                 on_snapshot: Callable[[Snapshot], None] | None = None, waker: Waker | None = None) -> None:
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
        self.waker = waker or Waker()
        """What :meth:`notify` and a post's end set (shared with the streams of a task's delivery)."""
        self._look_due = True  # the first step looks
        self._next_send: float | None = None  # trio time before which no post starts (None: at once)
        self._rate_wait = False  # a newer snapshot waits for _next_send: look again then
        self._posting: trio.CancelScope | None = None  # the post on its way (see stop)
        self._stopped = trio.CancelScope()  # see stop
        self.looks = 0
        """How many times the loop woke to look at the file (a figure for tests and benchmarks)."""

    def notify(self) -> None:
        """The stats file changed (its size): look at it again (on the Trio thread; never blocks)."""
        self._look_due = True
        self.waker.set()

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
            async with trio.open_nursery() as nursery:
                while True:
                    await self.waker.wait(self.step(nursery))

    def stop(self) -> None:
        """End live stats: :meth:`run_until_stopped` returns, a post on its way is cancelled, :meth:`step`
        does nothing more (idempotent; before it started too). On the Trio thread."""
        self._stopped.cancel()
        if self._posting is not None:
            self._posting.cancel()

    def step(self, nursery: trio.Nursery) -> float:
        """Look when notified (or when a newer snapshot's wait is over); start the post of the newest
        unsent snapshot in ``nursery`` once ``interval`` has passed since the last post. Returns the
        ``trio.current_time()`` of the next look due without a notification (inf: none — no timed
        looks). Never raises: a bug is logged and ends live stats, never the task's delivery."""
        if self._stopped.cancel_called or self._posting is not None:
            return math.inf
        try:
            now = trio.current_time()
            if self._look_due or (self._rate_wait and self._next_send is not None and now >= self._next_send):
                self._look_due = self._rate_wait = False
                self.looks += 1
                self.look()
            latest = self.latest
            if latest is None or latest.seq <= self.sent_seq or self.refused:
                return math.inf
            if self._next_send is not None and now < self._next_send:
                self._rate_wait = True  # rate limit; a look then finds the newest
                return self._next_send
            self._next_send = now + self.interval
            self._posting = trio.CancelScope()
            nursery.start_soon(self._posting_task, self._posting, latest)
        except Exception:
            log.exception("task %s: live stats stopped", self.task_id)
            self.refused = True
        return math.inf

    async def _posting_task(self, scope: trio.CancelScope, snapshot: Snapshot) -> None:
        try:
            with scope:
                await self._post(snapshot)
        except Exception:
            log.exception("task %s: live stats stopped", self.task_id)
            self.refused = True
        finally:
            self._posting = None
            if self.sent_seq < snapshot.seq and not self.refused:
                self._look_due = True  # unavailable: the newest goes again after the interval
            self.waker.set()

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
