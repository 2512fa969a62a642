"""A task's checkpoints at the reference master (docs/protocol.md, "Checkpoints"): chunks stored once by
the sha256 of their unpacked bytes, manifests that name them, and the rule that a task keeps only what
its newest checkpoint needs.

A chunk arrives gzip-compressed and is checked before it is stored (:func:`unpack_chunk`: it gunzips,
to at most ``CHUNK_BYTES``, to bytes of its name's sha256; the decompression is bounded, so a gzip bomb
costs at most one chunk's memory). A manifest is recorded when every chunk it names is stored, the
master holds the items up to its ``itemSeq`` and it comes from the task's current attempt on the node
that runs it; recording it deletes the task's older checkpoints and every chunk the new one does not
name. A final task keeps its newest checkpoint (for a look or a new task) and nothing else.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from typing import Any

from ckagent.devmaster.errors import ConflictError, NotFoundError, PayloadTooLargeError
from ckagent.devmaster.store.database import Database, dumps, task_row
from ckagent.devmaster.store.supersede import check_attempt, current_attempt
from ckagent.master.protocol import ProtocolError, utc_now_iso
from ckagent.master.protocol.checkpoints import CheckpointManifest, ChunkError
from ckagent.master.protocol.checkpoints import unpack_chunk as _unpack_chunk

__all__ = ["MAX_CHUNK_BODY_BYTES", "MAX_TASK_CHUNK_BYTES", "CheckpointStore", "ChunkError", "check_sha", "prune_chunks", "unpack_chunk"]

MAX_CHUNK_BODY_BYTES = 2 * 1024 * 1024
"""Largest gzip body of one chunk (bytes): level 1 of incompressible CHUNK_BYTES stays well below."""
MAX_TASK_CHUNK_BYTES = 4 * 1024**3
"""Most gzip bytes of checkpoint chunks one task may hold at a time (its newest checkpoint's and those
uploaded for the next); an upload beyond is 413."""
_SQL_BATCH = 500
"""Shas per ``IN (...)`` list (SQLite's variable limit)."""


def unpack_chunk(gz: bytes, sha256: str) -> int:
    """Check one chunk before it is stored (:func:`ckagent.master.protocol.checkpoints.unpack_chunk`, the
    check the agent makes too) and return its unpacked size. Raises ChunkError (→ 422). Blocking (CPU)."""
    return len(_unpack_chunk(gz, sha256))


def _batches(values: list[str]) -> Iterable[list[str]]:
    for i in range(0, len(values), _SQL_BATCH):
        yield values[i:i + _SQL_BATCH]


def _chunk_sizes(db: sqlite3.Connection, task_id: str, shas: list[str]) -> dict[str, int]:
    """The unpacked sizes of those of ``shas`` the task has stored."""
    found: dict[str, int] = {}
    for batch in _batches(shas):
        rows = db.execute(f"SELECT sha256, size_bytes FROM checkpoint_chunks WHERE task_id = ? AND sha256 IN"
                          f" ({', '.join('?' * len(batch))})", (task_id, *batch)).fetchall()
        found.update((str(r[0]), int(r[1])) for r in rows)
    return found


def _named(manifest_json: str) -> set[str]:
    """The chunk shas a stored manifest names."""
    return {sha for f in json.loads(manifest_json).get("files", []) for sha in f.get("chunks") or []}


def prune_chunks(db: sqlite3.Connection, task_id: str) -> int:
    """Delete the task's chunks its newest checkpoint does not name (all of them without one), in the
    caller's transaction. Returns how many were deleted."""
    newest = db.execute("SELECT manifest FROM task_checkpoints WHERE task_id = ? ORDER BY n DESC LIMIT 1",
                        (task_id,)).fetchone()
    keep = set() if newest is None else _named(newest["manifest"])
    stored = [str(r[0]) for r in db.execute("SELECT sha256 FROM checkpoint_chunks WHERE task_id = ?", (task_id,))]
    drop = [sha for sha in stored if sha not in keep]
    for batch in _batches(drop):
        db.execute(f"DELETE FROM checkpoint_chunks WHERE task_id = ? AND sha256 IN ({', '.join('?' * len(batch))})",
                   (task_id, *batch))
    return len(drop)


def _identity(manifest: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two posts of a manifest the same checkpoint: its attempt, positions and files (not its
    createdAt, reason or packedBytes, which a resend rebuilt after an agent restart may state anew)."""
    return (manifest.get("attempt"), manifest.get("itemSeq"), manifest.get("logSeq"), manifest.get("files"))


def _running_here(db: sqlite3.Connection, row: sqlite3.Row, node_id: str, attempt: int | None) -> None:
    """Refuse a checkpoint request of another attempt (409 supersededBy) or of a node that does not run the
    task's current attempt (409)."""
    check_attempt(db, row, node_id, attempt)
    if row["status"] != "RUNNING" or row["node_id"] != node_id:
        raise ConflictError(f"task {row['id']!r} is not running on this node (it is {row['status']})")


class CheckpointStore(Database):
    """Checkpoint chunks and manifests (part of :class:`ckagent.devmaster.store.Store`)."""

    def put_checkpoint_chunk(self, task_id: str, node_id: str, sha256: str, gz: bytes) -> None:
        """Store one chunk of a task ``node_id`` runs (idempotent). Checks the bytes first
        (:func:`unpack_chunk`: ChunkError → 422), then the task: NotFoundError, ConflictError (not running
        here; ``supersededBy`` when the node ran an older attempt of it), PayloadTooLargeError (the task
        would hold more than MAX_TASK_CHUNK_BYTES)."""
        size = unpack_chunk(gz, sha256)
        with self._tx() as db:
            _running_here(db, task_row(db, task_id), node_id, None)
            held = int(db.execute("SELECT COALESCE(SUM(length(data)), 0) FROM checkpoint_chunks WHERE task_id = ?",
                                  (task_id,)).fetchone()[0])
            if held + len(gz) > MAX_TASK_CHUNK_BYTES:
                raise PayloadTooLargeError(f"task {task_id!r} holds {held} bytes of checkpoint chunks; at most"
                                           f" {MAX_TASK_CHUNK_BYTES} (a task keeps its newest checkpoint's)")
            cursor = db.execute("INSERT OR IGNORE INTO checkpoint_chunks (task_id, sha256, size_bytes, data, stored_at)"
                                " VALUES (?, ?, ?, ?, ?)", (task_id, sha256, size, gz, utc_now_iso()))
            if cursor.rowcount:
                self._wrote(len(gz))

    def checkpoint_chunk(self, task_id: str, sha256: str) -> bytes:
        """A stored chunk's gzip bytes. Raises NotFoundError (an unknown task or chunk)."""
        def read(db: sqlite3.Connection) -> bytes:
            task_row(db, task_id)
            row = db.execute("SELECT data FROM checkpoint_chunks WHERE task_id = ? AND sha256 = ?",
                             (task_id, sha256)).fetchone()
            if row is None:
                raise NotFoundError(f"task {task_id!r} has no checkpoint chunk {sha256}")
            return bytes(row[0])
        return self._read(read)

    def record_checkpoint(self, task_id: str, node_id: str, manifest: CheckpointManifest) -> str:
        """Record a checkpoint of the task's current attempt; returns its id (a repeat of the same checkpoint
        — attempt, positions, files — the same answer).

        Raises NotFoundError; ConflictError with ``supersededBy`` (an older attempt), ``missingChunks``
        (chunks not stored: upload them, post again), ``storedItems`` (the master holds fewer items than
        ``itemSeq``), or plain (not running here; the id recorded with another manifest); ProtocolError
        (422) for an ``itemSeq`` before the attempt's ``itemSeqStart`` or a file whose chunks do not add
        up to its size. Recording it deletes the task's older checkpoints and the chunks it does not name.
        """
        body = manifest.to_json()
        text = dumps(body)
        shas = sorted({sha for f in manifest.files for sha in f.chunks})
        with self._tx() as db:
            row = task_row(db, task_id)
            _running_here(db, row, node_id, manifest.attempt)
            known = db.execute("SELECT manifest FROM task_checkpoints WHERE task_id = ? AND id = ?",
                               (task_id, manifest.id)).fetchone()
            if known is not None:
                if _identity(json.loads(known["manifest"])) != _identity(body):
                    raise ConflictError(f"checkpoint {manifest.id!r} of task {task_id!r} was recorded with"
                                        " another manifest")
                return manifest.id
            start, stored = int(row["item_seq_start"] or 0), int(row["stored_items"])
            if manifest.item_seq < start:
                raise ProtocolError("itemSeq", f"{manifest.item_seq} is before this attempt's first item"
                                    f" (itemSeqStart {start})")
            sizes = _chunk_sizes(db, task_id, shas)
            missing = [sha for sha in shas if sha not in sizes]
            if missing:
                raise ConflictError(f"{len(missing)} chunks of checkpoint {manifest.id!r} are not stored",
                                    missingChunks=missing)
            if manifest.item_seq > stored:
                raise ConflictError(f"the master holds {stored} items of task {task_id}, fewer than the"
                                    f" checkpoint's itemSeq {manifest.item_seq}: deliver them first",
                                    storedItems=stored)
            for i, f in enumerate(manifest.files):
                if f.chunks and sum(sizes[sha] for sha in f.chunks) != f.size:
                    raise ProtocolError(f"files[{i}].chunks", f"the chunks hold {sum(sizes[s] for s in f.chunks)}"
                                        f" bytes, the file {f.size}")
            db.execute(
                "INSERT INTO task_checkpoints (task_id, id, attempt, created_at, recorded_at, reason, item_seq,"
                " log_seq, size_bytes, packed_bytes, file_count, manifest) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (task_id, manifest.id, current_attempt(row), body.get("createdAt"), utc_now_iso(), body.get("reason"),
                 manifest.item_seq, manifest.log_seq, manifest.size_bytes, manifest.packed_bytes, len(manifest.files),
                 text))
            db.execute("DELETE FROM task_checkpoints WHERE task_id = ? AND id != ?", (task_id, manifest.id))
            prune_chunks(db, task_id)
            self._wrote(len(text))
        return manifest.id

    def checkpoint_manifest(self, task_id: str, checkpoint_id: str) -> dict[str, Any]:
        """A recorded manifest (the JSON it was recorded as). Raises NotFoundError (an unknown task, or a
        checkpoint never recorded or replaced by a newer one)."""
        def read(db: sqlite3.Connection) -> str:
            task_row(db, task_id)
            row = db.execute("SELECT manifest FROM task_checkpoints WHERE task_id = ? AND id = ?",
                             (task_id, checkpoint_id)).fetchone()
            if row is None:
                raise NotFoundError(f"task {task_id!r} has no checkpoint {checkpoint_id!r} (only its newest is kept)")
            return str(row[0])
        loaded: dict[str, Any] = json.loads(self._read(read))
        return loaded


def check_sha(value: str) -> str:
    """``value`` when it is a sha256 as 64 lowercase hexadecimal digits; else ProtocolError (422)."""
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ProtocolError("sha256", "a chunk is named by the sha256 of its unpacked bytes: 64 lowercase"
                            " hexadecimal digits")
    return value
