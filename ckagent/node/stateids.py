"""The state store's ``identities`` table: the uid each spider (and the node's builder) holds at the
``spider-uids`` identity level (ckagent.node.identity), kept across tasks and restarts. A part of
:class:`~ckagent.node.state.StateStore` (its mixin).
Blocking, as the store is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["IDENTITIES_SCHEMA", "IdentityRecord", "IdentityTable"]

IDENTITIES_SCHEMA = """
CREATE TABLE IF NOT EXISTS identities (
    kind         TEXT NOT NULL,
    name         TEXT NOT NULL,
    uid          INTEGER NOT NULL UNIQUE,
    allocated_at REAL NOT NULL,
    last_used    REAL NOT NULL,
    PRIMARY KEY (kind, name)
);
"""
"""The table (schema 3 of the state store; made by its schema script, so an older store gets it at open)."""


@dataclass(frozen=True)
class IdentityRecord:
    """The uid held by one spider (``kind`` "spider", ``name`` its id) or by the node's builder (``kind``
    "builder", ``name`` ""); ``allocated_at`` and ``last_used`` are epoch seconds."""

    kind: str
    name: str
    uid: int
    allocated_at: float
    last_used: float


class IdentityTable:
    """The operations of the ``identities`` table (StateStore's; its ``_exec`` runs one statement)."""

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError  # pragma: no cover - StateStore's

    def identities(self) -> list[IdentityRecord]:
        """Every uid held (spiders' and the builder's), least recently used first."""
        rows = self._exec("SELECT kind, name, uid, allocated_at, last_used FROM identities ORDER BY last_used, uid")
        return [IdentityRecord(str(r[0]), str(r[1]), int(r[2]), float(r[3]), float(r[4])) for r in rows]

    def hold_identity(self, kind: str, name: str, uid: int, when: float) -> None:
        """Record that ``(kind, name)`` holds ``uid`` from ``when`` on (replacing what it held). Raises
        sqlite3.IntegrityError when another holder has that uid."""
        self._exec("INSERT INTO identities (kind, name, uid, allocated_at, last_used) VALUES (?,?,?,?,?) "
                   "ON CONFLICT(kind, name) DO UPDATE SET uid=excluded.uid, allocated_at=excluded.allocated_at, "
                   "last_used=excluded.last_used", (kind, name, uid, when, when))

    def touch_identity(self, kind: str, name: str, when: float) -> None:
        """``(kind, name)`` was used at ``when`` (epoch seconds): the least recently used is released first."""
        self._exec("UPDATE identities SET last_used=? WHERE kind=? AND name=?", (when, kind, name))

    def release_identity(self, kind: str, name: str) -> None:
        """``(kind, name)`` holds no uid any more."""
        self._exec("DELETE FROM identities WHERE kind=? AND name=?", (kind, name))

    def spider_ids(self) -> set[str]:
        """The spider ids of every task the store knows (delivered or not): what tells a spider's dirs,
        named by ``safe_name`` of its id, by name (ckagent.task.migration)."""
        return {str(r[0]) for r in self._exec("SELECT DISTINCT spider_id FROM tasks")}
