"""The queue as an autoscaler sees it: pending and running tasks, nodes by state, their slots — a few
aggregate queries in one read transaction (ckagent.devmaster.queuemetrics renders them on ``/metrics``).

The figures are read on a connection of their own (``query_only``, opened at the first read): in WAL
mode a reader does not wait for the store's writers, nor they for it (only the WAL's truncation, once
per WAL_LIMIT_BYTES written, waits for a read in progress: milliseconds), and the store's lock is not
taken, so a scrape does not delay a heartbeat or a batch. The statements run in one transaction (one
snapshot: the counts agree with each other). Neither their number nor the rows they return grow with
the queue — the spiders come back at most ``max_spiders`` at a time (the most pending first), the rest
as one sum — but their time does: they count the pending rows (through the status index).

Node states (one per node, in this order of precedence): ``left`` (its agent said it was leaving),
``lost`` (no heartbeat for NODE_LIVE_SECONDS, or never one and registered longer ago than that),
``draining`` (its last heartbeat says DRAINING, TERMINATING, STOPPING or STOPPED), ``paused`` (its last
heartbeat carries a ``pausedReason``), ``live`` (the rest). Slots are summed over live nodes: ``maxWorkers``
of the last heartbeat (of the registration before the first), busy = ``maxWorkers - freeSlots``.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ckagent.devmaster.store.database import Database, epoch
from ckagent.devmaster.store.nodes import NODE_LIVE_SECONDS
from ckagent.master.protocol import utc_iso

NODE_STATES = ("live", "lost", "left", "draining", "paused")
"""Every value of ``ckmaster_nodes{state}`` (each exported, 0 when no node is in it)."""
STOPPING_STATUSES = ("DRAINING", "TERMINATING", "STOPPING", "STOPPED")
"""Heartbeat statuses of a node on its way out: ``draining``."""


@dataclass(frozen=True)
class QueueFigures:
    """One snapshot of the queue (see the module docstring).

    ``pending_by_spider``: (spider name, pending tasks), the most pending first (ties by name), at most
    the ``max_spiders`` asked for; ``pending_other``: the pending tasks of the spiders left out (0 when
    none was), ``spiders_pending``: how many distinct spider names have pending tasks.
    ``pending_by_framework``: framework → pending tasks. ``oldest_pending_age_seconds``: how long the
    pending task that has waited longest has waited since it could be claimed (its current attempt's
    creation, or its retry's not-before time when later); 0 without one.
    """

    pending: int = 0
    running: int = 0
    pending_by_spider: tuple[tuple[str, int], ...] = ()
    pending_other: int = 0
    spiders_pending: int = 0
    pending_by_framework: tuple[tuple[str, int], ...] = ()
    oldest_pending_age_seconds: float = 0.0
    nodes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NODE_STATES, 0))
    slots_capacity: int = 0
    slots_busy: int = 0


_NODES_SQL = f"""
SELECT state, COUNT(*) AS n, SUM(slots) AS slots, SUM(busy) AS busy FROM (
  SELECT CASE
      WHEN left_at IS NOT NULL THEN 'left'
      WHEN COALESCE(last_heartbeat_at, registered_at) < :cutoff THEN 'lost'
      WHEN json_extract(last_heartbeat, '$.status') IN ({", ".join(f"'{s}'" for s in STOPPING_STATUSES)})
        THEN 'draining'
      WHEN json_extract(last_heartbeat, '$.pausedReason') IS NOT NULL THEN 'paused'
      ELSE 'live' END AS state,
    COALESCE(json_extract(last_heartbeat, '$.maxWorkers'), max_workers) AS slots,
    MAX(0, COALESCE(json_extract(last_heartbeat, '$.maxWorkers') - json_extract(last_heartbeat, '$.freeSlots'),
                    0)) AS busy
  FROM nodes
) GROUP BY state
"""

_OLDEST_FIRST_SQL = ("SELECT created_at FROM tasks WHERE status = 'PENDING' AND COALESCE(attempt, 1) = 1"
                     " ORDER BY n LIMIT 1")
"""The oldest pending first attempt: its task's creation (the first row of the status index in creation order)."""
_OLDEST_RETRY_SQL = """
SELECT MIN(MAX(COALESCE(a.created_at, t.created_at), COALESCE(t.not_before, '')))
FROM tasks t LEFT JOIN task_attempts a ON a.task_id = t.id AND a.attempt = t.attempt
WHERE t.status = 'PENDING' AND t.attempt > 1
"""
"""The oldest pending retry: its attempt's creation, or its not-before time when later."""


class QueueStore(Database):
    """The queue's figures (part of :class:`ckagent.devmaster.store.Store`), on a reader connection of
    their own."""

    def __init__(self, db_path: Path) -> None:
        super().__init__(db_path)
        self._queue_lock = threading.Lock()
        self._queue_conn: sqlite3.Connection | None = None

    def close(self) -> None:
        """Close the reader connection, then the store (idempotent)."""
        with self._queue_lock:
            conn, self._queue_conn = self._queue_conn, None
            if conn is not None:
                conn.close()
        super().close()

    def queue_figures(self, *, max_spiders: int = 500, now: float | None = None) -> QueueFigures:
        """The queue now (``now``: epoch seconds, default the clock): six or seven aggregate statements
        in one read transaction, whatever the number of tasks, spiders or nodes. Blocks (run it in a thread).
        Raises sqlite3.Error (the store's file gone or broken, the store closed)."""
        now = time.time() if now is None else now
        cutoff = utc_iso(datetime.fromtimestamp(now - NODE_LIVE_SECONDS, timezone.utc))
        with self._queue_lock:
            if self._closed:
                raise sqlite3.ProgrammingError(f"the store {self.db_path} is closed")
            if self._queue_conn is None:
                conn = sqlite3.connect(str(self.db_path), check_same_thread=False, isolation_level=None, timeout=10)
                conn.execute("PRAGMA query_only = 1")
                self._queue_conn = conn
            db = self._queue_conn
            db.execute("BEGIN")
            try:
                frameworks = db.execute("SELECT framework, COUNT(*) FROM tasks WHERE status = 'PENDING'"
                                        " GROUP BY framework").fetchall()
                running = db.execute("SELECT COUNT(*) FROM tasks WHERE status = 'RUNNING'").fetchone()[0]
                limit = max(0, max_spiders)
                spiders = db.execute("SELECT spider_name, COUNT(*) AS n FROM tasks WHERE status = 'PENDING'"
                                     " GROUP BY spider_name ORDER BY n DESC, spider_name LIMIT ?", (limit,)).fetchall()
                distinct = len(spiders) if len(spiders) < limit else db.execute(
                    "SELECT COUNT(DISTINCT spider_name) FROM tasks WHERE status = 'PENDING'").fetchone()[0]
                first = db.execute(_OLDEST_FIRST_SQL).fetchone()
                retry = db.execute(_OLDEST_RETRY_SQL).fetchone()[0]
                nodes = db.execute(_NODES_SQL, {"cutoff": cutoff}).fetchall()
            finally:
                db.execute("COMMIT")
        pending = sum(int(n) for _, n in frameworks)
        named = tuple((str(name), int(n)) for name, n in spiders)
        since = min([s for s in (first[0] if first else None, retry) if s], default=None)
        states = dict.fromkeys(NODE_STATES, 0)
        slots_capacity = slots_busy = 0
        for state, n, slots, busy in nodes:
            states[state] = int(n)
            if state == "live":
                slots_capacity, slots_busy = int(slots or 0), int(busy or 0)
        return QueueFigures(
            pending=pending,
            running=int(running),
            pending_by_spider=named,
            pending_other=pending - sum(n for _, n in named),
            spiders_pending=int(distinct),
            pending_by_framework=tuple(sorted((str(fw), int(n)) for fw, n in frameworks)),
            oldest_pending_age_seconds=max(0.0, now - epoch(since)) if since else 0.0,
            nodes=states,
            slots_capacity=slots_capacity,
            slots_busy=slots_busy,
        )
