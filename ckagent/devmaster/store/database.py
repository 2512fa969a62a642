"""The dev master's SQLite connection: one connection under a lock, transactions, WAL checkpoints.

Every method is synchronous and thread-safe (one connection guarded by a lock); the HTTP layer calls
them through ``trio.to_thread.run_sync``. WAL checkpoints run in a thread of their own (with its own
connection), not in the commit of whichever request crossed SQLite's autocheckpoint threshold: a
batch of log lines is acknowledged after its commit alone (every WAL_LIMIT_BYTES one write also
truncates the WAL, so the file stays bounded under a steady stream).

:class:`Database` is the base of the store's parts (ckagent.devmaster.store); the helpers here
(JSON columns, ids, times, the task row) are shared by them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from ckagent.devmaster.errors import NotFoundError
from ckagent.devmaster.store.schema import create_schema

CHECKPOINT_BYTES = 4 * 1024 * 1024
"""Bytes written to the WAL (estimated) after which the checkpointer thread copies it into the database."""
WAL_LIMIT_BYTES = 64 * 1024 * 1024
"""Bytes written to the WAL (estimated) after which a write truncates it (the bound on the file: a
PASSIVE checkpoint racing steady writes never lets SQLite restart the WAL from its start)."""
_PAGE_BYTES = 4096

_T = TypeVar("_T")


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def seconds_since(iso: str | None, now: float | None = None) -> float:
    """Seconds from the protocol timestamp ``iso`` to ``now`` (epoch seconds; default the clock); inf for None."""
    if not iso:
        return float("inf")
    moment = datetime.strptime(iso, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    return (time.time() if now is None else now) - moment.timestamp()


def new_id() -> str:
    return uuid.uuid4().hex


def epoch(iso: str | None) -> float:
    """A stored ISO-8601 UTC time as epoch seconds (0 when missing or unreadable: counts as long ago)."""
    if not iso:
        return 0.0
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))



def task_row(db: sqlite3.Connection, task_id: str) -> sqlite3.Row:
    """The row of one task. Raises NotFoundError."""
    row: sqlite3.Row | None = db.execute("SELECT * FROM tasks WHERE id = ?", (task_id,)).fetchone()
    if row is None:
        raise NotFoundError(f"no task {task_id!r}")
    return row


class Database:
    """One SQLite file (WAL mode) behind a lock. Thread-safe; every method blocks.

    Open with ``Database(db_path)`` (creates the file and the schema), close with ``close()``.
    Raises SchemaError if the file holds another layout (e.g. one written by an older dev master)
    and sqlite3.Error if it cannot be opened.
    """

    def __init__(self, db_path: Path) -> None:
        self.db_path = Path(db_path)
        self._lock = threading.Lock()
        self._wal_bytes = 0  # estimated bytes written to the WAL since the last checkpoint request
        self._wal_total = 0  # ... since the last truncation
        self._checkpoint_wanted = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self._closed = False
        self._log_digests: dict[str, Any] = {}  # task id → sha256 of its discarded lines (streams.py)
        self._conn = sqlite3.connect(str(self.db_path), check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        try:
            with self._lock:
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=NORMAL")
                self._conn.execute("PRAGMA foreign_keys=ON")
                self._conn.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread does it
                create_schema(self._conn, self.db_path)
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        """Stop the checkpointer, close the connection (idempotent; SQLite checkpoints the WAL on close)."""
        with self._lock:
            self._closed = True
            checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            self._checkpoint_wanted.set()
            checkpointer.join()
        with self._lock:
            self._conn.close()

    def _wrote(self, size: int) -> None:
        """Count ``size`` bytes (estimated) written to the WAL; past CHECKPOINT_BYTES wake the checkpointer.
        Call with the lock held."""
        self._wal_bytes += size
        self._wal_total += size
        if self._wal_bytes < CHECKPOINT_BYTES or self._closed:
            return
        self._wal_bytes = 0
        if self._checkpointer is None:
            self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="devmaster-checkpoint",
                                                  daemon=True)
            self._checkpointer.start()
        self._checkpoint_wanted.set()

    def _checkpoint_loop(self) -> None:
        """The checkpointer thread: a PASSIVE checkpoint (never waits for readers or writers) per request."""
        conn = sqlite3.connect(str(self.db_path), check_same_thread=False, isolation_level=None)
        try:
            while True:
                self._checkpoint_wanted.wait()
                self._checkpoint_wanted.clear()
                if self._closed:
                    return
                # Busy or failing: the next request tries again, and close() checkpoints.
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction under the lock; commits on success, rolls back on any exception."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            self._wrote(2 * _PAGE_BYTES)
            if self._wal_total >= WAL_LIMIT_BYTES:
                self._wal_total = 0
                # Most pages were copied by the checkpointer already; waits (busy timeout) for it.
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _read(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        with self._lock:
            return fn(self._conn)
