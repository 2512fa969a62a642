"""The rule of attempts every stream shares: what an older attempt of a task sends is refused with 409
``{"error": "task 7 moved on to attempt 3", "supersededBy": 3}`` (docs/protocol.md, "Attempts")."""

from __future__ import annotations

import sqlite3

from ckagent.devmaster.errors import ConflictError


def current_attempt(row: sqlite3.Row) -> int:
    """The attempt a task row is at (1 for a row from before attempts)."""
    return int(row["attempt"] or 1)


def superseded(task_id: str, current: int) -> ConflictError:
    """The 409 for a request of an attempt older than ``current``."""
    return ConflictError(f"task {task_id} moved on to attempt {current}", supersededBy=current)


def ran_earlier(db: sqlite3.Connection, task_id: str, node_id: str, current: int) -> bool:
    """Whether ``node_id`` ran an attempt of the task older than ``current``."""
    return db.execute("SELECT 1 FROM task_attempts WHERE task_id = ? AND node_id = ? AND attempt < ? LIMIT 1",
                      (task_id, node_id, current)).fetchone() is not None


def check_attempt(db: sqlite3.Connection, row: sqlite3.Row, node_id: str, attempt: int | None, *,
                  infer: bool = True) -> None:
    """Refuse what an older attempt of the task sends (ConflictError with ``supersededBy``).

    ``attempt`` None: the request does not say (an older agent, a chunk upload): superseded when the
    node is not the task's claimant now but ran an earlier attempt of it (unless ``infer`` is False: a
    claim of the task as handed out). An attempt the task has not reached is a ConflictError too. The
    caller still checks that the node is the claimant.
    """
    current, task_id = current_attempt(row), str(row["id"])
    if attempt is None:
        if infer and row["node_id"] != node_id and current > 1 and ran_earlier(db, task_id, node_id, current):
            raise superseded(task_id, current)
        return
    if attempt < current:
        raise superseded(task_id, current)
    if attempt > current:
        raise ConflictError(f"task {task_id} has no attempt {attempt} (it is at attempt {current})")
