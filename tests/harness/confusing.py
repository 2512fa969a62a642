"""What a confusing master does to a node (tests/test_log_escaping.py, tests/test_confusion.py; issue 36 item 5).

:func:`rename_task` gives a task created through the reference master's admin API an id the master
would never hand out itself (a control character, a forged log line), by rewriting its SQLite row.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

__all__ = ["rename_task"]


def rename_task(db_path: Path, task_id: str, new_id: str) -> None:
    """Give the task ``task_id`` of the reference master at ``db_path`` the id ``new_id`` (any text)."""
    db = sqlite3.connect(db_path)
    try:
        with db:
            db.execute("UPDATE tasks SET id = ? WHERE id = ?", (new_id, task_id))
    finally:
        db.close()
