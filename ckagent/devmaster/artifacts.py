"""The dev master's task artifacts: a table of ``(task, path, size, sha256)`` and content-addressed blobs.

``PUT /api/tasks/{id}/artifacts/{path}`` (node): the body is the file, ``X-Content-SHA256`` its
sha256. The master checks both and records the path; answers ``{path, sizeBytes, sha256}``. The same
path with the same sha256 again (a resend after an outage or an agent restart) is acknowledged without
a second copy; another sha256 at a path the task already holds → 409. Only the node that claimed the
task may upload, only while it is RUNNING or just final from that node.

Where the bytes live, by size (each sha256 once):

- up to INLINE_MAX_BYTES: in the table ``artifact_blobs`` of the SQLite file, written in the same
  transaction as the path's record — one transaction per upload, no fsync of its own. Small blobs
  are faster in SQLite than as files (SQLite's own measurements put the crossover near 100 KB).
- larger: a file ``<db>.artifacts/<sha256[:2]>/<sha256>``, written to a temporary file, fsynced,
  renamed and its directory fsynced, all before the record's transaction (a crash leaves no half
  file under a digest, and no record without its bytes).

What an answer guarantees is what every acknowledgement of this master guarantees (SQLite WAL with
``synchronous=NORMAL``): it survives the master process crashing or being killed; a power loss or a
kernel crash may take back the last acknowledged writes, artifacts with log lines and items, but never
leaves a listed artifact without its bytes.

``GET /api/tasks/{id}/artifacts`` (admin) → ``[{path, sizeBytes, sha256, storedAt}]`` in path order;
``GET /api/tasks/{id}/artifacts/{path}`` (admin) → the bytes.

Functions on the tables take the store's connection inside its transaction (``Store._tx``/``_read``);
the tables are created with the schema (``CREATE TABLE IF NOT EXISTS``: an older file gains them).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path
from typing import Any

from ckagent.devmaster.errors import BadRequestError, ConflictError, NotFoundError

MAX_ARTIFACT_BYTES = 512 * 1024 * 1024
"""Largest artifact the dev master takes (bytes); larger → 413."""
INLINE_MAX_BYTES = 128 * 1024
"""Artifacts up to this size (bytes) are kept in the SQLite file, larger ones as files beside it."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS task_artifacts (
    task_id    TEXT NOT NULL,
    path       TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    sha256     TEXT NOT NULL,
    stored_at  TEXT NOT NULL,
    PRIMARY KEY (task_id, path)
);
CREATE TABLE IF NOT EXISTS artifact_blobs (
    sha256 TEXT PRIMARY KEY,
    data   BLOB NOT NULL
);
"""


def blob_dir(db_path: Path) -> Path:
    """Where the blobs of the database ``db_path`` live."""
    return db_path.with_name(db_path.name + ".artifacts")


def blob_path(db_path: Path, sha256: str) -> Path:
    """The blob of one sha256 (64 lowercase hex digits, checked by the caller)."""
    return blob_dir(db_path) / sha256[:2] / sha256


def check_digest(data: bytes, sha256: str) -> None:
    """Raises BadRequestError when ``data`` does not match ``sha256``. Blocking (hashes ``data``)."""
    if hashlib.sha256(data).hexdigest() != sha256:
        raise BadRequestError("the body does not match X-Content-SHA256: the upload was cut or changed; send it again")


def write_blob(db_path: Path, data: bytes, sha256: str) -> None:
    """Store the file of a large artifact once (checked against ``sha256`` by the caller): temporary
    file, fsync, rename, fsync of the directory. Blocking. Raises OSError."""
    target = blob_path(db_path, sha256)
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{sha256}.{os.getpid()}.{id(data)}.tmp")
    with open(tmp, "wb") as fout:
        fout.write(data)
        fout.flush()
        os.fsync(fout.fileno())
    os.replace(tmp, target)
    folder = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def keep_inline(db: sqlite3.Connection, data: bytes, sha256: str) -> None:
    """Keep the bytes of a small artifact in the database (once per sha256), in the caller's transaction."""
    db.execute("INSERT OR IGNORE INTO artifact_blobs (sha256, data) VALUES (?, ?)", (sha256, data))


def recorded(db: sqlite3.Connection, task_id: str, path: str) -> str | None:
    """The sha256 recorded for one artifact path of a task, or None."""
    row = db.execute("SELECT sha256 FROM task_artifacts WHERE task_id = ? AND path = ?", (task_id, path)).fetchone()
    return None if row is None else str(row[0])


def inline_bytes(db: sqlite3.Connection, sha256: str) -> bytes | None:
    """The bytes of a small artifact kept in the database, or None (a file holds them)."""
    row = db.execute("SELECT data FROM artifact_blobs WHERE sha256 = ?", (sha256,)).fetchone()
    return None if row is None else bytes(row[0])


def record(db: sqlite3.Connection, task_id: str, path: str, size_bytes: int, sha256: str, at: str) -> None:
    """Record an artifact (idempotent for the same sha256). Raises ConflictError for another sha256."""
    row = db.execute("SELECT sha256 FROM task_artifacts WHERE task_id = ? AND path = ?", (task_id, path)).fetchone()
    if row is not None:
        if row[0] != sha256:
            raise ConflictError(f"task {task_id!r} already holds another file at {path!r}")
        return
    db.execute("INSERT INTO task_artifacts (task_id, path, size_bytes, sha256, stored_at) VALUES (?, ?, ?, ?, ?)",
               (task_id, path, size_bytes, sha256, at))


def listing(db: sqlite3.Connection, task_id: str) -> list[dict[str, Any]]:
    """A task's artifacts in path order."""
    rows = db.execute("SELECT path, size_bytes, sha256, stored_at FROM task_artifacts WHERE task_id = ? "
                      "ORDER BY path", (task_id,)).fetchall()
    return [{"path": r[0], "sizeBytes": r[1], "sha256": r[2], "storedAt": r[3]} for r in rows]


def find(db: sqlite3.Connection, task_id: str, path: str) -> str:
    """The sha256 of one artifact. Raises NotFoundError."""
    row = db.execute("SELECT sha256 FROM task_artifacts WHERE task_id = ? AND path = ?", (task_id, path)).fetchone()
    if row is None:
        raise NotFoundError(f"task {task_id!r} has no artifact {path!r}")
    return str(row[0])
