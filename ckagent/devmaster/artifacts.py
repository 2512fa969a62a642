"""The dev master's task artifacts: a table of ``(task, path, size, sha256)`` and content-addressed blobs.

``PUT /api/tasks/{id}/artifacts/{path}`` (node): the body is the file, ``X-Content-SHA256`` its
sha256. The master checks both, stores the bytes once under ``<db>.artifacts/<sha256[:2]>/<sha256>``
(written to a temporary file, then renamed: a crash leaves no half file under a digest) and records the
path; answers ``{path, sizeBytes, sha256}``. The same path with the same sha256 again (a resend after
an outage or an agent restart) is acknowledged without a second copy; another sha256 at a path the
task already holds → 409. Only the node that claimed the task may upload, only while it is RUNNING or
just final from that node.

``GET /api/tasks/{id}/artifacts`` (admin) → ``[{path, sizeBytes, sha256, storedAt}]`` in path order;
``GET /api/tasks/{id}/artifacts/{path}`` (admin) → the bytes.

Functions on the table take the store's connection inside its transaction (``Store._tx``/``_read``);
the table is created with the schema (``CREATE TABLE IF NOT EXISTS``: an older file gains it).
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

SCHEMA = """
CREATE TABLE IF NOT EXISTS task_artifacts (
    task_id    TEXT NOT NULL,
    path       TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    sha256     TEXT NOT NULL,
    stored_at  TEXT NOT NULL,
    PRIMARY KEY (task_id, path)
);
"""


def blob_dir(db_path: Path) -> Path:
    """Where the blobs of the database ``db_path`` live."""
    return db_path.with_name(db_path.name + ".artifacts")


def blob_path(db_path: Path, sha256: str) -> Path:
    """The blob of one sha256 (64 lowercase hex digits, checked by the caller)."""
    return blob_dir(db_path) / sha256[:2] / sha256


def write_blob(db_path: Path, data: bytes, sha256: str) -> None:
    """Check ``data`` against ``sha256`` and store it once (atomic rename). Raises BadRequestError
    when the bytes do not match the digest. Blocking."""
    if hashlib.sha256(data).hexdigest() != sha256:
        raise BadRequestError("the body does not match X-Content-SHA256: the upload was cut or changed; send it again")
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
