"""The dev master's crawl statistics: each task's latest snapshot and a bounded history (SQLite).

Table ``task_stats``: one row per kept snapshot ``(task_id, seq, at, final, data)``. A live
snapshot (``POST /api/tasks/{id}/stats``) is stored when its ``seq`` is higher than every kept one;
the final snapshot (``stats`` of a final result) is stored in the result's transaction and marked
``final``. At most HISTORY_LIMIT rows per task: beyond it every second row is dropped (the oldest,
the newest and the final one always stay), so the history covers the whole crawl, denser towards
the newest snapshot.

Functions take the store's connection inside its transaction (``Store._tx``/``Store._read``); the
table is created with the rest of the schema (``CREATE TABLE IF NOT EXISTS``, no version bump: an
older file simply gains the table).
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from ckagent.master.protocol import TaskStats

HISTORY_LIMIT = 100
"""Snapshots kept per task (the first, the newest, the final one, and a thinned history between)."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS task_stats (
    task_id  TEXT NOT NULL,
    seq      INTEGER NOT NULL,
    at       TEXT,
    final    INTEGER NOT NULL DEFAULT 0,
    data     TEXT NOT NULL,                               -- the TaskStats JSON
    PRIMARY KEY (task_id, seq)
);
"""


def save(db: sqlite3.Connection, task_id: str, snapshot: TaskStats, *, final: bool = False) -> bool:
    """Keep ``snapshot`` if it is newer than every kept one (or ``final``). Returns True when stored."""
    newest = db.execute("SELECT MAX(seq), MAX(final) FROM task_stats WHERE task_id = ?", (task_id,)).fetchone()
    top, has_final = newest if newest is not None else (None, None)
    if not final and (has_final or (top is not None and snapshot.seq <= top)):
        return False
    data = json.dumps(snapshot.to_json(), ensure_ascii=False, separators=(",", ":"))
    db.execute(
        "INSERT INTO task_stats (task_id, seq, at, final, data) VALUES (?, ?, ?, ?, ?) "
        "ON CONFLICT (task_id, seq) DO UPDATE SET final = MAX(final, excluded.final), data = excluded.data",
        (task_id, snapshot.seq, snapshot.at, int(final), data),
    )
    if final:  # a live snapshot that raced past the final one is not the latest
        db.execute("DELETE FROM task_stats WHERE task_id = ? AND seq > ? AND final = 0", (task_id, snapshot.seq))
    _thin(db, task_id)
    return True


def _thin(db: sqlite3.Connection, task_id: str) -> None:
    seqs = [int(r[0]) for r in db.execute(
        "SELECT seq FROM task_stats WHERE task_id = ? AND final = 0 ORDER BY seq", (task_id,))]
    if len(seqs) <= HISTORY_LIMIT - 1:
        return
    drop = seqs[1:-1:2]  # every second one between the oldest and the newest
    db.executemany("DELETE FROM task_stats WHERE task_id = ? AND seq = ?", [(task_id, s) for s in drop])


def read(db: sqlite3.Connection, task_id: str) -> dict[str, Any]:
    """``{"latest": snapshot | None, "final": bool, "history": [snapshots, oldest first]}``."""
    rows = db.execute("SELECT data, final FROM task_stats WHERE task_id = ? ORDER BY final, seq",
                      (task_id,)).fetchall()
    history = [json.loads(r[0]) for r in rows]
    final = bool(rows and rows[-1][1])
    return {"latest": history[-1] if history else None, "final": final, "history": history}


def latest(db: sqlite3.Connection, task_id: str) -> dict[str, Any] | None:
    """The task's latest snapshot (the final one when there is one), or None."""
    row = db.execute("SELECT data FROM task_stats WHERE task_id = ? ORDER BY final DESC, seq DESC LIMIT 1",
                     (task_id,)).fetchone()
    return None if row is None else json.loads(row[0])
