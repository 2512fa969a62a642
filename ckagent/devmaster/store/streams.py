"""The dev master's streams: a task's log lines and items, stored once each by sequence number.

Logs and items are stored as chunks, one row per accepted batch (or its new tail): ``first_seq``,
``count`` and the elements as one text: log lines joined by ``\\n`` (when none contains a ``\\n``,
which is every line an agent sends) or else a JSON array; items as a JSON array. The task row keeps
the stored count of each stream, so a sequence check is one row read and a batch of 5000 lines is
one insert. Reads concatenate the chunks in ``first_seq`` order.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ckagent.devmaster.errors import ConflictError, NotFoundError
from ckagent.devmaster.store.database import Database, dumps, task_row
from ckagent.devmaster.store.supersede import check_attempt

_E = TypeVar("_E")

_LINES = "lines"
"""Log chunk format: the lines joined by ``\\n`` (none of them holds one)."""
_JSON = "json"
"""Log chunk format: a JSON array of strings (some line holds a ``\n``)."""


class StreamStore(Database):
    """Log and item streams (part of :class:`ckagent.devmaster.store.Store`)."""

    discard_logs: bool = False
    """Acknowledge log lines without storing them, keeping only their count and SHA-256 (see
    :meth:`log_digest`): a master that keeps up with any agent, for benchmarks of the agent alone."""

    def _log_chunks(self, task_id: str) -> list[tuple[str, str]]:
        """``(format, data)`` of a task's log chunks, in order. Raises NotFoundError."""

        def query(db: sqlite3.Connection) -> list[tuple[str, str]]:
            task_row(db, task_id)
            rows = db.execute(
                "SELECT format, data FROM task_log_chunks WHERE task_id = ? ORDER BY first_seq", (task_id,)
            ).fetchall()
            return [(str(r[0]), str(r[1])) for r in rows]

        return self._read(query)

    def task_logs(self, task_id: str) -> list[str]:
        """The stored log lines of a task, in order. Raises NotFoundError."""
        lines: list[str] = []
        for fmt, data in self._log_chunks(task_id):
            lines.extend(data.split("\n") if fmt == _LINES else json.loads(data))
        return lines

    def task_log_text(self, task_id: str) -> str:
        """The stored log lines of a task joined by ``\\n`` (no trailing one). Raises NotFoundError."""
        return "\n".join(
            data if fmt == _LINES else "\n".join(json.loads(data)) for fmt, data in self._log_chunks(task_id)
        )

    def task_items(self, task_id: str) -> list[Any]:
        """The stored items of a task, in order. Raises NotFoundError."""

        def query(db: sqlite3.Connection) -> list[str]:
            task_row(db, task_id)
            rows = db.execute(
                "SELECT data FROM task_item_chunks WHERE task_id = ? ORDER BY first_seq", (task_id,)
            ).fetchall()
            return [str(r[0]) for r in rows]

        items: list[Any] = []
        for data in self._read(query):
            items.extend(json.loads(data))
        return items

    def item_chunks_from(self, task_id: str, seq: int, limit: int = 64) -> list[tuple[int, str]]:
        """Up to ``limit`` stored item chunks of a task from item ``seq`` on, in order: ``(count, JSON
        array text)`` each. ``seq`` is a chunk boundary (the count of items read so far): a reader that
        adds up the counts follows the stream as it is stored. Raises NotFoundError."""

        def query(db: sqlite3.Connection) -> list[tuple[int, str]]:
            task_row(db, task_id)
            rows = db.execute(
                "SELECT count, data FROM task_item_chunks WHERE task_id = ? AND first_seq >= ? "
                "ORDER BY first_seq LIMIT ?", (task_id, seq, limit)
            ).fetchall()
            return [(int(r[0]), str(r[1])) for r in rows]

        return self._read(query)

    def append_logs(self, task_id: str, node_id: str, seq: int, lines: Sequence[str],
                    attempt: int | None = None) -> int:
        """Store log lines ``seq``.. once each; returns the new stored count (``acceptedSeq``).

        A full repeat stores nothing; an overlap stores only the new tail; ``seq`` beyond the stored
        count raises ConflictError with ``expectedSeq``. Only the claiming node may post (ConflictError).
        A batch of an attempt older than the task's current one (``attempt``; None: not said) raises
        ConflictError with ``supersededBy`` (store/supersede.py). The new lines become one chunk row.
        """

        def encode(tail: Sequence[str]) -> dict[str, str]:
            text = "\n".join(tail)
            if text.count("\n") == len(tail) - 1:  # no line holds a \n of its own
                return {"format": _LINES, "data": text}
            return {"format": _JSON, "data": dumps(list(tail))}

        discard = self._digest_logs if self.discard_logs else None
        return self._append("task_log_chunks", "stored_log_lines", task_id, node_id, seq, lines, encode, discard,
                            attempt=attempt)

    def _digest_logs(self, task_id: str, lines: Sequence[str]) -> None:
        digest = self._log_digests.setdefault(task_id, hashlib.sha256())
        if lines:
            digest.update(("\n".join(lines) + "\n").encode())

    def log_digest(self, task_id: str) -> dict[str, Any]:
        """``{"count", "sha256", "discarded"}``: how many log lines the task has and the SHA-256 of
        them, each followed by ``\\n`` (UTF-8). Lines kept (not :attr:`discard_logs`) are read back
        to hash them. Raises NotFoundError."""
        count = self._read(lambda db: int(task_row(db, task_id)["stored_log_lines"]))
        digest = self._log_digests.get(task_id)
        if digest is None:
            lines = [] if self.discard_logs else self.task_logs(task_id)
            digest = hashlib.sha256("".join(line + "\n" for line in lines).encode())
        return {"count": count, "sha256": digest.hexdigest(), "discarded": self.discard_logs}

    def append_items(self, task_id: str, node_id: str, seq: int, items: Sequence[dict[str, Any]],
                     text: str | None = None, attempt: int | None = None) -> int:
        """Store items ``seq``.. once each (as JSON text); same rules and answer as ``append_logs``.
        ``text``: the JSON array ``items`` were decoded from, kept as it is when every item is new
        (no encoding again); when some were stored already, the new ones are encoded."""
        def encode(tail: Sequence[dict[str, Any]]) -> dict[str, str]:
            if text is not None and tail is items:
                return {"data": text}
            return {"data": dumps(list(tail))}

        return self._append("task_item_chunks", "stored_items", task_id, node_id, seq, items, encode,
                            attempt=attempt)

    def _append(
        self,
        table: str,
        counter: str,
        task_id: str,
        node_id: str,
        seq: int,
        values: Sequence[_E],
        encode: Callable[[Sequence[_E]], dict[str, str]],
        discard: Callable[[str, Sequence[_E]], None] | None = None,
        *,
        attempt: int | None = None,
    ) -> int:
        """Store ``values[stored - seq:]`` as one chunk row, ``encode(tail)`` giving its other columns
        (name → value), or only count it and hand it to ``discard(task_id, tail)``. Returns the new
        stored count; ConflictError for another node or a gap, and for a batch of a later attempt
        (``attempt`` > 1 named) that starts before that attempt's seq start: those positions are the
        earlier attempts' (no ``expectedSeq``: the sender numbers its stream wrongly, the stream ends).
        """
        start_column = "log_seq_start" if counter == "stored_log_lines" else "item_seq_start"
        with self._tx() as db:
            row = db.execute(f"SELECT id, attempt, node_id, {counter}, {start_column} FROM tasks WHERE id = ?",
                             (task_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"no task {task_id!r}")
            check_attempt(db, row, node_id, attempt)
            if row["node_id"] != node_id:
                raise ConflictError(f"task {task_id!r} is not claimed by this node")
            stored = int(row[counter])
            start = int(row[start_column] or 0)
            if attempt is not None and attempt > 1 and seq < start:
                raise ConflictError(f"attempt {attempt} of task {task_id} starts at {start} in this stream"
                                    f" ({'logSeqStart' if start_column == 'log_seq_start' else 'itemSeqStart'}),"
                                    f" not {seq}: what is before belongs to the earlier attempts")
            if seq > stored:
                raise ConflictError(
                    f"gap: this batch starts at {seq} but only {stored} are stored", expectedSeq=stored
                )
            tail = values[stored - seq :] if stored > seq else values
            if tail and discard is not None:
                discard(task_id, tail)
                stored += len(tail)
                db.execute(f"UPDATE tasks SET {counter} = ? WHERE id = ?", (stored, task_id))
            elif tail:
                columns = {"task_id": task_id, "first_seq": stored, "count": len(tail), **encode(tail)}
                self._wrote(sum(len(v) for v in columns.values() if isinstance(v, str)))
                db.execute(
                    f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                    tuple(columns.values()),
                )
                stored += len(tail)
                db.execute(f"UPDATE tasks SET {counter} = ? WHERE id = ?", (stored, task_id))
            return stored



def truncate_items(db: sqlite3.Connection, task_id: str, keep: int) -> int:
    """Keep a task's first ``keep`` items, drop the rest (a new attempt resumes at item ``keep``), in the
    caller's transaction: chunks from ``keep`` on are deleted, the chunk spanning it is rewritten with its
    head. Returns how many items were dropped."""
    stored = int(task_row(db, task_id)["stored_items"])
    keep = max(0, min(keep, stored))
    if keep == stored:
        return 0
    spanning = db.execute("SELECT first_seq, data FROM task_item_chunks WHERE task_id = ? AND first_seq < ?"
                          " AND first_seq + count > ?", (task_id, keep, keep)).fetchone()
    db.execute("DELETE FROM task_item_chunks WHERE task_id = ? AND first_seq >= ?", (task_id, keep))
    if spanning is not None:
        head = json.loads(spanning["data"])[: keep - int(spanning["first_seq"])]
        db.execute("UPDATE task_item_chunks SET count = ?, data = ? WHERE task_id = ? AND first_seq = ?",
                   (len(head), dumps(head), task_id, spanning["first_seq"]))
    db.execute("UPDATE tasks SET stored_items = ? WHERE id = ?", (keep, task_id))
    return stored - keep
