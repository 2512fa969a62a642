"""The durable state store: what must survive an agent crash, in ``work_dir/state.db`` (SQLite, WAL).

Per task: the task as claimed, its directory, its process group, how far each stream (log lines,
items) has been acknowledged by the master (the element count and a small JSON *position* that lets
the shipper resume reading right after the last acknowledged element), and the final result until
the master acknowledged it. The task's own files are the spool; this store only holds positions, so
it stays small. Per spider: its uid at the ``spider-uids`` identity level (ckagent.node.stateids).

All methods of :class:`StateStore` are blocking (sqlite3): call them through
``trio.to_thread.run_sync`` — or use :class:`AsyncStateStore`, which does. One connection guarded by
a lock; ``synchronous=NORMAL`` in WAL mode survives a process crash (what we guard against) and
costs ~no fsync per acknowledgement.

Exception tree::

    Exception
    ├── StateStoreError    the database file cannot be opened or created (the message names the path)
    │   └── StateStoreFull a write met a full disk even though the store keeps free pages of its own
    │                      (also an sqlite3.OperationalError)
    └── sqlite3.Error      anything later propagates: a broken state db is an operator problem

**A full disk** (ckagent.node.diskfull): the store owns its room beforehand (its own free pages, a WAL
never truncated: :meth:`StateStore.keep_reserve`), which no spider can take; past it a write raises
StateStoreFull and its caller keeps the data in memory and tries again later (the shippers, the outbox).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from ckagent.node.diskfull import STORE_RESERVE_BYTES, StoreReserve, is_disk_full
from ckagent.node.stateids import IDENTITIES_SCHEMA, IdentityTable

_R = TypeVar("_R")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id      TEXT PRIMARY KEY,
    spider_id    TEXT NOT NULL,
    task_json    TEXT NOT NULL,
    task_dir     TEXT NOT NULL,
    pid          INTEGER,
    pgid         INTEGER,
    claimed_at   REAL NOT NULL,
    result_json  TEXT,
    result_acked INTEGER NOT NULL DEFAULT 0,
    finished_at  REAL,
    handle       TEXT
);
CREATE TABLE IF NOT EXISTS streams (
    task_id      TEXT NOT NULL,
    stream       TEXT NOT NULL,
    acked_seq    INTEGER NOT NULL,
    acked_offset INTEGER NOT NULL DEFAULT 0,
    position     TEXT,
    PRIMARY KEY (task_id, stream)
);
"""


SCHEMA_VERSION = 3
"""The state store's schema (``PRAGMA user_version``). 0/1: before it was versioned (``streams.position`` may
be missing); 2: ``tasks.handle``, to re-adopt a running task (ckagent.task.adoption); 3: the ``identities``
table (ckagent.node.stateids). An agent migrates older stores up at open and refuses newer ones."""


class StateStoreError(Exception):
    """The state database cannot be opened or created, or a newer agent wrote it."""


class StateStoreFull(StateStoreError, sqlite3.OperationalError):
    """A write failed because the disk is full, even though the store keeps free pages of its own. Nothing
    was written; the caller keeps its data and tries again later. Also an ``sqlite3.OperationalError``
    (what the write raised before): callers that catch sqlite3.Error keep catching it."""


@dataclass(frozen=True)
class TaskRecord:
    """A task row: ``result`` is the final result JSON (None while the task has not finished).

    ``claimed_at`` and ``finished_at`` are epoch seconds.
    """

    task_id: str
    spider_id: str
    task_json: dict[str, Any]
    task_dir: Path
    pid: int | None
    pgid: int | None
    claimed_at: float
    result: dict[str, Any] | None
    result_acked: bool
    finished_at: float | None
    handle: dict[str, Any] | None = None
    """What re-adopting the running spider needs (ckagent.task.adoption); None: none recorded."""


class StateStore(IdentityTable):
    """Blocking SQLite store (see module docstring). Thread-safe; one instance per agent.

    Raises StateStoreError when ``path`` cannot be opened or created.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Task records hold every task's env (its secrets): owner-only, also for spiders that run
            # as another user. SQLite gives the -wal and -shm files the database file's mode.
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            os.chmod(path, 0o600)
            for extra in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
                if extra.exists():
                    os.chmod(extra, 0o600)
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            # Room owned beforehand (ckagent.node.diskfull): the WAL keeps its frames after a checkpoint
            # (overwritten, never truncated), SQLite's temporary files stay in memory.
            self._db.execute("PRAGMA journal_size_limit=-1")
            self._db.execute("PRAGMA temp_store=MEMORY")
            version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                self._db.close()
                raise StateStoreError(
                    f"the state store {path} was written by a newer ckagent (schema {version}; this agent "
                    f"reads up to {SCHEMA_VERSION}): run that version again (or a newer one), or move "
                    f"{path.parent} aside to start this one with an empty work dir")
            self._db.executescript(_SCHEMA + IDENTITIES_SCHEMA)
            _migrate(self._db)
        except (OSError, sqlite3.Error) as exc:
            raise StateStoreError(f"cannot open the state store {path}: {exc}") from exc
        self._lock = threading.Lock()
        self.reserve = StoreReserve(path)  # its own free pages (ckagent.node.diskfull): .held_bytes

    def keep_reserve(self, target_bytes: int = STORE_RESERVE_BYTES) -> int:
        """Grow the store's own free pages and write-ahead log back to ``target_bytes`` when less than
        half is left (ckagent.node.diskfull.StoreReserve.keep); returns the bytes held. Never raises."""
        with self._lock:
            return self.reserve.keep(self._db, target_bytes)

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._unless_full(self._exec_once, sql, args)

    def _exec_once(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _unless_full(self, write: Callable[..., _R], *args: Any) -> _R:
        """``write(*args)``; a full disk raises StateStoreFull (its own free pages are used up)."""
        try:
            return write(*args)
        except sqlite3.OperationalError as exc:
            if is_disk_full(exc):
                raise StateStoreFull(f"the state store {self.path} cannot be written: the disk is full "
                                     "(its own free pages are used up too)") from exc
            raise

    def add_task(self, task_id: str, spider_id: str, task_json: dict[str, Any], task_dir: Path) -> bool:
        """Record a claimed task (idempotent). Returns True when the task is new here and has no
        stream positions (both streams start at ``(0, None)``)."""
        with self._lock:
            inserted = self._db.execute(
                "INSERT OR IGNORE INTO tasks (task_id, spider_id, task_json, task_dir, claimed_at) VALUES (?,?,?,?,?)",
                (task_id, spider_id, json.dumps(task_json), str(task_dir), time.time()),
            ).rowcount == 1
            return inserted and not self._db.execute(
                "SELECT 1 FROM streams WHERE task_id=? LIMIT 1", (task_id,)).fetchall()

    def set_process(self, task_id: str, pid: int | None, pgid: int | None,
                    handle: dict[str, Any] | None = None) -> None:
        """Record (or clear, with None) the spider's main pid and process group, and its re-adoption
        handle (see :meth:`set_handle`)."""
        self._exec("UPDATE tasks SET pid=?, pgid=?, handle=? WHERE task_id=?",
                   (pid, pgid, None if handle is None else json.dumps(handle), task_id))

    def set_handle(self, task_id: str, handle: dict[str, Any] | None) -> None:
        """Record (or clear) what a later agent needs to re-adopt the task's running spider
        (ckagent.task.adoption: the monitor's pid and start time, the boot, the status file, the deadline)."""
        self._exec("UPDATE tasks SET handle=? WHERE task_id=?",
                   (None if handle is None else json.dumps(handle), task_id))

    def stream_position(self, task_id: str, stream: str) -> tuple[int, Any]:
        """(acknowledged element count, JSON position after it); ``(0, None)`` for a new stream."""
        rows = self._exec(
            "SELECT acked_seq, position, acked_offset FROM streams WHERE task_id=? AND stream=?", (task_id, stream)
        )
        if not rows:
            return 0, None
        seq, position, offset = rows[0]
        if position is None:  # written before positions were JSON: a byte offset in one file
            return int(seq), {"offset": int(offset)}
        return int(seq), json.loads(position)

    def save_stream_position(self, task_id: str, stream: str, seq: int, position: Any) -> None:
        """Record that the master acknowledged ``seq`` elements; ``position`` (JSON-able) is where they end."""
        self._exec(
            "INSERT INTO streams (task_id, stream, acked_seq, acked_offset, position) VALUES (?,?,?,0,?) "
            "ON CONFLICT(task_id, stream) DO UPDATE SET acked_seq=excluded.acked_seq, "
            "position=excluded.position",
            (task_id, stream, seq, json.dumps(position, separators=(",", ":"))),
        )

    def save_stream_positions(self, positions: dict[tuple[str, str], tuple[int, Any]]) -> None:
        """:meth:`save_stream_position` for many streams in one transaction:
        ``{(task_id, stream): (seq, position)}``."""
        rows = [(task_id, stream, seq, json.dumps(position, separators=(",", ":")))
                for (task_id, stream), (seq, position) in positions.items()]
        if rows:
            self._unless_full(self._save_rows, rows)

    def _save_rows(self, rows: list[tuple[str, str, int, str]]) -> None:
        with self._lock, self._db:  # one transaction: BEGIN here, committed (or rolled back) by ``with``
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT INTO streams (task_id, stream, acked_seq, acked_offset, position) VALUES (?,?,?,0,?) "
                "ON CONFLICT(task_id, stream) DO UPDATE SET acked_seq=excluded.acked_seq, "
                "position=excluded.position",
                rows,
            )

    def streams(self, task_id: str) -> dict[str, int]:
        """Every stream of the task: name → acknowledged element count."""
        rows = self._exec("SELECT stream, acked_seq FROM streams WHERE task_id=?", (task_id,))
        return {str(r[0]): int(r[1]) for r in rows}

    def set_result(self, task_id: str, result: dict[str, Any]) -> None:
        """Store the final result before it is sent (so a crash cannot lose it). Keeps the first finish time."""
        self._exec(
            "UPDATE tasks SET result_json=?, finished_at=COALESCE(finished_at, ?), pid=NULL, pgid=NULL, handle=NULL "
            "WHERE task_id=?",
            (json.dumps(result), time.time(), task_id),
        )

    def mark_result_acked(self, task_id: str) -> None:
        """The master acknowledged the final result (or refused it for good): nothing is left to send."""
        self._exec("UPDATE tasks SET result_acked=1 WHERE task_id=?", (task_id,))

    def get(self, task_id: str) -> TaskRecord | None:
        """One task, or None."""
        rows = self._exec(f"SELECT {_COLUMNS} FROM tasks WHERE task_id=?", (task_id,))
        return _record(rows[0]) if rows else None

    def pending_delivery(self) -> list[TaskRecord]:
        """Tasks whose final result the master has not acknowledged yet (oldest first).

        After a crash this includes tasks that were running (``result`` is None): the recovery
        kills their leftovers and reports them AGENT_LOST.
        """
        rows = self._exec(f"SELECT {_COLUMNS} FROM tasks WHERE result_acked=0 ORDER BY claimed_at")
        return [_record(r) for r in rows]

    def pending_outbox(self) -> list[tuple[str, Path, float, bool, int, int]]:
        """What the outbox figures need of :meth:`pending_delivery`, in one statement and without
        decoding any JSON: ``(task_id, task_dir, claimed_at, has_result, log acked, items acked)``."""
        rows = self._exec(
            "SELECT t.task_id, t.task_dir, t.claimed_at, t.result_json IS NOT NULL, "
            "COALESCE(l.acked_seq, 0), COALESCE(i.acked_seq, 0) FROM tasks t "
            "LEFT JOIN streams l ON l.task_id = t.task_id AND l.stream = 'log' "
            "LEFT JOIN streams i ON i.task_id = t.task_id AND i.stream = 'items' "
            "WHERE t.result_acked=0 ORDER BY t.claimed_at"
        )
        return [(str(r[0]), Path(r[1]), float(r[2]), bool(r[3]), int(r[4]), int(r[5])) for r in rows]

    def delivered_before(self, cutoff: float) -> list[TaskRecord]:
        """Fully acknowledged tasks that finished before ``cutoff`` (epoch seconds): retention candidates."""
        rows = self._exec(
            f"SELECT {_COLUMNS} FROM tasks WHERE result_acked=1 AND finished_at < ? ORDER BY finished_at",
            (cutoff,),
        )
        return [_record(r) for r in rows]

    def recent_finished(self, limit: int) -> list[TaskRecord]:
        """The ``limit`` tasks that finished last (newest first), delivered or not (the status page)."""
        rows = self._exec(
            f"SELECT {_COLUMNS} FROM tasks WHERE result_json IS NOT NULL ORDER BY finished_at DESC LIMIT ?",
            (limit,),
        )
        return [_record(r) for r in rows]

    def task_ids(self) -> set[str]:
        """Ids of every task the store knows (delivered or not)."""
        return {str(r[0]) for r in self._exec("SELECT task_id FROM tasks")}

    def forget(self, task_id: str) -> None:
        """Drop a task and its stream positions (after its directory was removed)."""
        self._unless_full(self._forget, task_id)

    def _forget(self, task_id: str) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute("DELETE FROM streams WHERE task_id=?", (task_id,))
                self._db.execute("DELETE FROM tasks WHERE task_id=?", (task_id,))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

_COLUMNS = ("task_id, spider_id, task_json, task_dir, pid, pgid, claimed_at, result_json, result_acked, finished_at, "
            "handle")


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a store written by an older agent up to SCHEMA_VERSION (each step idempotent)."""
    streams = {row[1] for row in db.execute("PRAGMA table_info(streams)")}
    if "position" not in streams:  # a state.db written by an agent before positions were JSON
        db.execute("ALTER TABLE streams ADD COLUMN position TEXT")
    tasks = {row[1] for row in db.execute("PRAGMA table_info(tasks)")}
    if "handle" not in tasks:  # schema 1: no re-adoption handle
        db.execute("ALTER TABLE tasks ADD COLUMN handle TEXT")
    db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")


def _record(row: tuple[Any, ...]) -> TaskRecord:
    return TaskRecord(
        task_id=row[0],
        spider_id=row[1],
        task_json=json.loads(row[2]),
        task_dir=Path(row[3]),
        pid=row[4],
        pgid=row[5],
        claimed_at=row[6],
        result=None if row[7] is None else json.loads(row[7]),
        result_acked=bool(row[8]),
        finished_at=row[9],
        handle=None if row[10] is None else json.loads(row[10]),
    )


STREAMS = ("log", "items")
"""The streams of a task (``stream`` in the positions)."""


class AsyncStateStore:
    """The same operations, each run in a worker thread so the Trio loop never blocks on SQLite.

    Cancellation while a call runs abandons waiting for it; the SQL statement itself completes.
    """

    def __init__(self, store: StateStore) -> None:
        self.sync = store
        self._positions: dict[tuple[str, str], tuple[int, Any]] = {}  # saves not yet on their way
        self._writing: trio.Event | None = None  # set when the write on its way is done
        self._inflight: dict[tuple[str, str], tuple[int, Any]] = {}  # the write on its way
        self._fresh: set[tuple[str, str]] = set()  # streams of tasks added by this run, not yet asked for

    async def add_task(self, task_id: str, spider_id: str, task_json: dict[str, Any], task_dir: Path) -> None:
        """See :meth:`StateStore.add_task`."""
        if await trio.to_thread.run_sync(self.sync.add_task, task_id, spider_id, task_json, task_dir):
            self.mark_fresh(task_id)

    def mark_fresh(self, task_id: str) -> None:
        """The task's streams start at ``(0, None)`` (the caller's ``sync.add_task`` returned True)."""
        self._fresh.update((task_id, stream) for stream in STREAMS)

    async def set_process(self, task_id: str, pid: int | None, pgid: int | None,
                          handle: dict[str, Any] | None = None) -> None:
        """See :meth:`StateStore.set_process`."""
        await trio.to_thread.run_sync(self.sync.set_process, task_id, pid, pgid, handle)

    async def set_handle(self, task_id: str, handle: dict[str, Any] | None) -> None:
        """See :meth:`StateStore.set_handle`."""
        await trio.to_thread.run_sync(self.sync.set_handle, task_id, handle)

    async def stream_position(self, task_id: str, stream: str) -> tuple[int, Any]:
        """See :meth:`StateStore.stream_position` (a noted position not yet written counts)."""
        noted = self._positions.get((task_id, stream)) or self._inflight.get((task_id, stream))
        if noted is not None:
            return noted
        if (task_id, stream) in self._fresh:  # asked once, by the stream's shipper: no hop for a new task
            self._fresh.discard((task_id, stream))
            return 0, None
        return await trio.to_thread.run_sync(self.sync.stream_position, task_id, stream)

    def note_stream_position(self, task_id: str, stream: str, seq: int, position: Any) -> None:
        """Record a position for the next write (:meth:`flush_positions` or any save) without waiting:
        on the event loop, no I/O. Until then :meth:`stream_position` answers it from memory."""
        self._fresh.discard((task_id, stream))
        self._positions[(task_id, stream)] = (seq, position)

    async def flush_positions(self) -> None:
        """Write every noted position (one transaction, one thread hop); nothing to do when none waits.
        Same guarantees as :meth:`save_stream_position`."""
        while self._writing is not None:
            await self._writing.wait()
        if self._positions:
            await self._write_positions()

    async def save_stream_position(self, task_id: str, stream: str, seq: int, position: Any) -> None:
        """See :meth:`StateStore.save_stream_position`; returns once the position is in the database.

        Group commit: saves of every stream that arrive while a write is on its way go together in
        the next one (one transaction, one thread hop), so many busy streams cost one hop per round,
        not one per acknowledgement. Cancellation while waiting for another's write leaves this
        position to that write or the next one (it is kept); a write itself always completes. An
        sqlite3.Error reaches the caller that wrote, and its positions are kept for the next write.
        """
        self._fresh.discard((task_id, stream))
        self._positions[(task_id, stream)] = (seq, position)
        while self._writing is not None:  # a write on its way may or may not carry this position
            await self._writing.wait()
        if not self._positions:
            return  # another caller's write carried it
        await self._write_positions()

    async def _write_positions(self, write: Callable[[Any], bool | None] | None = None) -> None:
        """One position write (callers wait for ``_writing`` first): the noted positions, taken as one
        batch, go to ``write(batch)`` in one thread hop (default: save_stream_positions); they are
        noted again when it raises or returns False (newer notes win)."""
        batch, self._positions = self._positions, {}
        self._inflight = batch
        done = self._writing = trio.Event()
        try:
            if await trio.to_thread.run_sync(write or self.sync.save_stream_positions, batch) is False:
                self._renote(batch)
        except BaseException:
            self._renote(batch)
            raise
        finally:
            self._writing = None
            self._inflight = {}
            done.set()

    async def streams(self, task_id: str) -> dict[str, int]:
        """See :meth:`StateStore.streams`."""
        return await trio.to_thread.run_sync(self.sync.streams, task_id)

    async def set_result(self, task_id: str, result: dict[str, Any]) -> None:
        """See :meth:`StateStore.set_result`. The noted stream positions (:meth:`note_stream_position`:
        a stream's end notes its last one, ckagent.delivery.shipper) go in the same thread hop; a
        full disk keeps them noted for the next write (whose caller hears of it)."""
        await self._write_with_positions("set_result", lambda: self.sync.set_result(task_id, result))

    async def _write_with_positions(self, name: str, statement: Callable[[], None]) -> None:
        """``statement()`` (blocking; ``name`` names the hop), then the noted positions, in one thread hop."""
        while self._writing is not None:  # one position write at a time (see _write_positions)
            await self._writing.wait()

        def write(batch: dict[tuple[str, str], tuple[int, Any]]) -> bool:
            statement()
            try:
                self.sync.save_stream_positions(batch)
            except StateStoreError:
                return False
            return True

        write.__name__ = name
        await self._write_positions(write)

    def _renote(self, batch: dict[tuple[str, str], tuple[int, Any]]) -> None:  # a failed write's: newer notes win
        for key, value in batch.items():
            self._positions.setdefault(key, value)

    async def mark_result_acked(self, task_id: str) -> None:
        """See :meth:`StateStore.mark_result_acked`. The noted stream positions go in the same thread hop
        (as with :meth:`set_result`): a delivery whose streams end just before its result is acknowledged
        writes its last positions and the acknowledgement at once. On a full disk the acknowledgement
        raises StateStoreFull; the positions stay noted."""
        await self._write_with_positions("mark_result_acked", lambda: self.sync.mark_result_acked(task_id))

    async def get(self, task_id: str) -> TaskRecord | None:
        """See :meth:`StateStore.get`."""
        return await trio.to_thread.run_sync(self.sync.get, task_id)

    async def pending_delivery(self) -> list[TaskRecord]:
        """See :meth:`StateStore.pending_delivery`."""
        return await trio.to_thread.run_sync(self.sync.pending_delivery)

    async def delivered_before(self, cutoff: float) -> list[TaskRecord]:
        """See :meth:`StateStore.delivered_before`."""
        return await trio.to_thread.run_sync(self.sync.delivered_before, cutoff)

    async def recent_finished(self, limit: int) -> list[TaskRecord]:
        """See :meth:`StateStore.recent_finished`."""
        return await trio.to_thread.run_sync(self.sync.recent_finished, limit)

    async def task_ids(self) -> set[str]:
        """See :meth:`StateStore.task_ids`."""
        return await trio.to_thread.run_sync(self.sync.task_ids)

    async def forget(self, task_id: str) -> None:
        """See :meth:`StateStore.forget`."""
        self._fresh.difference_update((task_id, stream) for stream in STREAMS)
        await trio.to_thread.run_sync(self.sync.forget, task_id)
