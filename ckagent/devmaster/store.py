"""The dev master's storage: one SQLite file (WAL) holding nodes, spiders, packages, tasks, logs and items.

Every method is synchronous and thread-safe (one connection guarded by a lock); the HTTP layer calls
them through ``trio.to_thread.run_sync``. WAL checkpoints run in a thread of their own (with its own
connection), not in the commit of whichever request crossed SQLite's autocheckpoint threshold: a
batch of log lines is acknowledged after its commit alone (every WAL_LIMIT_BYTES one write also
truncates the WAL, so the file stays bounded under a steady stream). The rules of the wire protocol that depend on stored state
(claims, final results, sequence numbers) live here, each inside one transaction, so the SQL reads
as the contract.

Logs and items are stored as chunks, one row per accepted batch (or its new tail): ``first_seq``,
``count`` and the elements as one text: log lines joined by ``\\n`` (when none contains a ``\\n``,
which is every line an agent sends) or else a JSON array; items as a JSON array. The task row keeps
the stored count of each stream, so a sequence check is one row read and a batch of 5000 lines is
one insert. Reads concatenate the chunks in ``first_seq`` order.

The file carries its schema version (``PRAGMA user_version`` = SCHEMA_VERSION). A file from an
older dev master (one row per log line, version 0) is refused with SchemaError, not migrated:
this is a development tool, delete the file or choose another one.

The exceptions it raises are drawn in :mod:`ckagent.devmaster.errors`; code packages are read by
:mod:`ckagent.devmaster.packages`.

A payload that breaks the schema raises ``ckagent.master.protocol.ProtocolError`` (422) instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from ckagent.devmaster import artifacts as task_artifacts
from ckagent.devmaster import stats as task_stats
from ckagent.devmaster.errors import (
    BadRequestError,
    ConflictError,
    NotFoundError,
    SchemaError,
)
from ckagent.devmaster.packages import (
    PackageContents,
)
from ckagent.master.ids import url_segment
from ckagent.master.protocol import (
    FINAL_STATUSES,
    Heartbeat,
    RegisterRequest,
    TaskResult,
    TaskStats,
    VersionPolicy,
    utc_now_iso,
)
from ckagent.node.versions import InvalidVersion, Version

__all__ = ["NODE_LIVE_SECONDS", "SCHEMA_VERSION", "Store"]

CHECKPOINT_BYTES = 4 * 1024 * 1024
"""Bytes written to the WAL (estimated) after which the checkpointer thread copies it into the database."""
WAL_LIMIT_BYTES = 64 * 1024 * 1024
"""Bytes written to the WAL (estimated) after which a write truncates it (the bound on the file: a
PASSIVE checkpoint racing steady writes never lets SQLite restart the WAL from its start)."""
_PAGE_BYTES = 4096
NODE_LIVE_SECONDS = 90.0
"""A node that heartbeated this recently (seconds) is live: its name is not given to another nodeUid."""
SCHEMA_VERSION = 2
"""The layout of the SQLite file (``PRAGMA user_version``): 2 = logs and items in chunks."""
CLAIM_GRACE_SECONDS = 60.0
"""A RUNNING task a node does not list in a heartbeat (running, claiming or reporting) goes back to
PENDING only when it was claimed at least this long ago: a claim answered after the node took its
heartbeat's snapshot must not be taken back (docs/protocol.md, "Claims and releases")."""

_log = logging.getLogger(__name__)

_T = TypeVar("_T")
_E = TypeVar("_E")

_LINES = "lines"
"""Log chunk format: the lines joined by ``\\n`` (none of them holds one)."""
_JSON = "json"
"""Log chunk format: a JSON array of strings (some line holds a ``\n``)."""


# --------------------------------------------------------------------------- schema

_SCHEMA = """
CREATE TABLE IF NOT EXISTS master_settings (
    key               TEXT PRIMARY KEY,   -- minAgentVersion, desiredAgentVersion
    value             TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS nodes (
    id                TEXT PRIMARY KEY,
    name              TEXT NOT NULL UNIQUE,
    api_key_sha256    TEXT NOT NULL UNIQUE,
    ip                TEXT NOT NULL,
    port              INTEGER NOT NULL,
    version           TEXT NOT NULL,
    max_workers       INTEGER NOT NULL,
    labels            TEXT NOT NULL,      -- JSON object
    runtimes          TEXT NOT NULL,      -- JSON object
    info              TEXT NOT NULL,      -- the whole registration body (JSON)
    registered_at     TEXT NOT NULL,
    last_heartbeat    TEXT,               -- the last heartbeat body (JSON)
    last_heartbeat_at TEXT
);
CREATE TABLE IF NOT EXISTS spiders (
    id              TEXT PRIMARY KEY,
    name            TEXT NOT NULL,
    framework       TEXT NOT NULL,
    command         TEXT NOT NULL,        -- JSON: list, string or null
    timeout_seconds REAL,
    code_mode       TEXT NOT NULL,        -- package | files
    env             TEXT NOT NULL,        -- JSON object
    code_version    TEXT,                 -- current package, NULL before the first upload
    created_at      TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS packages (
    spider_id    TEXT NOT NULL,
    code_version TEXT NOT NULL,
    sha256       TEXT NOT NULL,
    size_bytes   INTEGER NOT NULL,
    data         BLOB NOT NULL,
    uploaded_at  TEXT NOT NULL,
    PRIMARY KEY (spider_id, code_version)
);
CREATE TABLE IF NOT EXISTS spider_files (
    id           TEXT PRIMARY KEY,
    spider_id    TEXT NOT NULL,
    code_version TEXT NOT NULL,
    path         TEXT NOT NULL,
    size_bytes   INTEGER NOT NULL,
    sha256       TEXT NOT NULL,
    data         BLOB NOT NULL,
    UNIQUE (spider_id, code_version, path)
);
CREATE TABLE IF NOT EXISTS tasks (
    n                INTEGER PRIMARY KEY AUTOINCREMENT,   -- creation order
    id               TEXT NOT NULL UNIQUE,
    spider_id        TEXT NOT NULL,
    spider_name      TEXT NOT NULL,
    framework        TEXT NOT NULL,
    command          TEXT NOT NULL,                       -- JSON: list, string or null
    args             TEXT NOT NULL,                       -- JSON array
    env              TEXT NOT NULL,                       -- JSON object
    params           TEXT NOT NULL,                       -- JSON object
    timeout_seconds  REAL,
    code_version     TEXT,
    code_mode        TEXT NOT NULL,
    status           TEXT NOT NULL,                       -- PENDING RUNNING SUCCESS FAILED CANCELLED
    node_id          TEXT,                                -- the claiming node
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    exit_code        INTEGER,
    error_code       TEXT,
    error_message    TEXT,
    created_at       TEXT NOT NULL,
    claimed_at       TEXT,
    started_at       TEXT,
    finished_at      TEXT,
    duration_ms      INTEGER,
    item_count       INTEGER,
    log_lines        INTEGER,
    stored_log_lines INTEGER NOT NULL DEFAULT 0,
    stored_items     INTEGER NOT NULL DEFAULT 0,
    stall_timeout_seconds REAL                            -- the task's stallTimeoutSeconds (null: the node's)
);
CREATE INDEX IF NOT EXISTS tasks_by_status ON tasks (status, n);
-- One row per accepted batch (its new tail): elements first_seq .. first_seq + count - 1 of the
-- stream, as one text. Chunks of a task are contiguous and never overlap, and their counts
-- add up to tasks.stored_log_lines / tasks.stored_items. (Rowid tables: the rows are large.)
CREATE TABLE IF NOT EXISTS task_log_chunks (
    task_id   TEXT NOT NULL,
    first_seq INTEGER NOT NULL,
    count     INTEGER NOT NULL,
    format    TEXT NOT NULL,                              -- lines (joined by newlines) or json (an array)
    data      TEXT NOT NULL,
    PRIMARY KEY (task_id, first_seq)
);
CREATE TABLE IF NOT EXISTS task_item_chunks (
    task_id   TEXT NOT NULL,
    first_seq INTEGER NOT NULL,
    count     INTEGER NOT NULL,
    data      TEXT NOT NULL,                              -- JSON array of objects
    PRIMARY KEY (task_id, first_seq)
);
"""


def _hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _seconds_since(iso: str | None, now: float | None = None) -> float:
    """Seconds from the protocol timestamp ``iso`` to ``now`` (epoch seconds; default the clock); inf for None."""
    if not iso:
        return float("inf")
    moment = datetime.strptime(iso, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    return (time.time() if now is None else now) - moment.timestamp()


_ADDED_COLUMNS: dict[str, tuple[str, ...]] = {
    # resources: JSON {memoryBytes, pids, cpus}; stop_signal: "SIGINT" ...; figures: JSON of the
    # result's figures: resources {cpuSeconds, memoryPeakBytes, pidsPeak, ioReadBytes, ioWriteBytes},
    # phases {deployMs, installMs, runMs} and incomplete (true: the node says data is missing); claim_poll_id: the pollId of the poll that claimed the
    # task (claim-in-poll; decimal text), null for a claim by POST .../result.
    # outputs: JSON {items: [glob], artifacts: [glob]} (a spider's default, copied into its tasks).
    "spiders": ("resources", "stop_signal", "outputs"),
    "tasks": ("resources", "stop_signal", "figures", "claim_poll_id", "outputs"),
}


def _new_id() -> str:
    return uuid.uuid4().hex


def _epoch(iso: str | None) -> float:
    """A stored ISO-8601 UTC time as epoch seconds (0 when missing or unreadable: counts as long ago)."""
    if not iso:
        return 0.0
    try:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class Store:
    """The dev master's state in one SQLite file (WAL mode). Thread-safe; every method blocks.

    Open with ``Store(db_path)`` (creates the file and the schema), close with ``close()``.
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
        self.claim_grace_seconds = CLAIM_GRACE_SECONDS
        self.discard_logs = False
        """Acknowledge log lines without storing them, keeping only their count and SHA-256 (see
        :meth:`log_digest`): a master that keeps up with any agent, for benchmarks of the agent alone."""
        self._log_digests: dict[str, Any] = {}
        self._conn = sqlite3.connect(str(self.db_path), check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        try:
            with self._lock:
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=NORMAL")
                self._conn.execute("PRAGMA foreign_keys=ON")
                self._conn.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread does it
                self._create_schema()
        except BaseException:
            self._conn.close()
            raise

    def _create_schema(self) -> None:
        """Create the tables in an empty file; check the version of a used one (SchemaError)."""
        db = self._conn
        version = int(db.execute("PRAGMA user_version").fetchone()[0])
        used = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' LIMIT 1").fetchone()
        if version != SCHEMA_VERSION and (used is not None or version != 0):
            raise SchemaError(
                f"{self.db_path} is not a dev master database of schema version {SCHEMA_VERSION}"
                f" (it has version {version}"
                + (": an older dev master that stored one row per log line" if version == 0 else "")
                + "); the dev master does not migrate it: delete the file or pass another --db"
            )
        # one transaction: a file has all the tables and its version, or nothing
        db.executescript(f"BEGIN IMMEDIATE; {_SCHEMA}; {task_stats.SCHEMA}; {task_artifacts.SCHEMA};"
                         f" PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
        if "stall_timeout_seconds" not in {r[1] for r in db.execute("PRAGMA table_info(tasks)")}:
            db.execute("ALTER TABLE tasks ADD COLUMN stall_timeout_seconds REAL")  # a file from before it
        self._add_columns()

    def _add_columns(self) -> None:
        """Columns added after schema 2 (nullable, JSON or text): added to a file that lacks them."""
        db = self._conn
        for table, columns in _ADDED_COLUMNS.items():
            have = {r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}
            for name in columns:
                if name not in have:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {name} TEXT")

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

    # ----------------------------------------------------------------------- nodes

    def register_node(self, req: RegisterRequest, *, at: float | None = None) -> tuple[str, str]:
        """Register (or re-register by name) a node. Returns ``(node_id, api_key)``.

        Re-registering the same name keeps the node id and issues a new key; the old key stops working.
        Only the key's sha256 is stored. One identity per name: when the request carries a ``nodeUid``
        and the name belongs to a node that registered another ``nodeUid`` and heartbeated within
        NODE_LIVE_SECONDS (``at``: epoch seconds, default the clock), ConflictError (409) — two live
        agents with one name would otherwise take each other's key on every re-registration. Agents
        that send no nodeUid keep the old rule.
        """
        api_key = secrets.token_urlsafe(32)
        now = utc_now_iso()
        values = (
            _hash_key(api_key),
            req.ip,
            req.port,
            req.version,
            req.max_workers,
            _dumps(req.labels),
            _dumps(req.runtimes),
            _dumps(req.to_json()),
            now,
        )
        with self._tx() as db:
            row = db.execute("SELECT id, info, last_heartbeat_at FROM nodes WHERE name = ?", (req.name,)).fetchone()
            if row is not None and req.node_uid:
                other = (_loads(row["info"]) or {}).get("nodeUid")
                if other and other != req.node_uid and _seconds_since(row["last_heartbeat_at"], at) < NODE_LIVE_SECONDS:
                    raise ConflictError(
                        f"node name {req.name!r} belongs to another live agent (another nodeUid, heartbeat "
                        f"within {NODE_LIVE_SECONDS:g} s): give this agent its own agent.name (AGENT_NAME), "
                        "or stop the other one and retry after its heartbeats stop")
            if row is None:
                node_id = _new_id()
                db.execute(
                    "INSERT INTO nodes (api_key_sha256, ip, port, version, max_workers, labels, runtimes,"
                    " info, registered_at, id, name) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (*values, node_id, req.name),
                )
            else:
                node_id = row["id"]
                db.execute(
                    "UPDATE nodes SET api_key_sha256 = ?, ip = ?, port = ?, version = ?, max_workers = ?,"
                    " labels = ?, runtimes = ?, info = ?, registered_at = ? WHERE id = ?",
                    (*values, node_id),
                )
        return node_id, api_key

    def version_policy(self) -> VersionPolicy:
        """The agent version policy set through the admin API (both None when never set)."""
        rows = self._read(lambda db: db.execute(
            "SELECT key, value FROM master_settings WHERE key IN ('minAgentVersion', 'desiredAgentVersion')").fetchall())
        values = {r["key"]: r["value"] for r in rows}
        return VersionPolicy(values.get("minAgentVersion"), values.get("desiredAgentVersion"))

    def below_minimum(self, node_id: str) -> bool:
        """Whether the node's agent version is below the minimum agent version (such a node gets no
        tasks: it has been told, at registration and with every heartbeat). An unknown or unparsable
        version counts as below a set minimum."""
        minimum = self.version_policy().min_agent_version
        if minimum is None:
            return False
        row = self._read(lambda db: db.execute("SELECT version FROM nodes WHERE id = ?", (node_id,)).fetchone())
        try:
            return row is None or Version(row["version"]) < Version(minimum)
        except InvalidVersion:
            return True

    def set_version_policy(self, policy: VersionPolicy) -> None:
        """Store both fields (None clears one). Raises BadRequestError for a version that is not PEP 440."""
        for key, value in (("minAgentVersion", policy.min_agent_version),
                           ("desiredAgentVersion", policy.desired_agent_version)):
            if value is not None:
                try:
                    Version(value)
                except InvalidVersion:
                    raise BadRequestError(f"{key}: {value!r} is not a PEP 440 version (e.g. 0.2.0)") from None
        with self._tx() as db:
            for key, value in (("minAgentVersion", policy.min_agent_version),
                               ("desiredAgentVersion", policy.desired_agent_version)):
                if value is None:
                    db.execute("DELETE FROM master_settings WHERE key = ?", (key,))
                else:
                    db.execute("INSERT OR REPLACE INTO master_settings (key, value) VALUES (?, ?)", (key, value))

    def node_for_key(self, api_key: str) -> str | None:
        """The id of the node holding ``api_key``, or None for an unknown or revoked key."""
        digest = _hash_key(api_key)
        row = self._read(
            lambda db: db.execute("SELECT id FROM nodes WHERE api_key_sha256 = ?", (digest,)).fetchone()
        )
        return None if row is None else str(row["id"])

    def heartbeat(self, node_id: str, beat: Heartbeat) -> list[str]:
        """Store a heartbeat's figures (and its ``runtimes``, when sent); returns ``cancelTaskIds``.

        Those are the node's RUNNING tasks with a cancel request, plus every id in the beat's
        ``runningTaskIds`` that is final or claimed by another node (the node should not be running
        it). Pending or unknown ids are left alone: a node lists a task before its claim lands.
        """
        with self._tx() as db:
            db.execute(
                "UPDATE nodes SET last_heartbeat = ?, last_heartbeat_at = ? WHERE id = ?",
                (_dumps(beat.to_json()), utc_now_iso(), node_id),
            )
            if beat.runtimes is not None:  # a fresher scan than the one sent at registration
                db.execute("UPDATE nodes SET runtimes = ? WHERE id = ?", (_dumps(beat.runtimes), node_id))
            cancel = self._cancel_ids(db, node_id)
            for task_id in beat.running_task_ids:
                row = db.execute("SELECT status, node_id FROM tasks WHERE id = ?", (task_id,)).fetchone()
                if row is None or task_id in cancel:
                    continue
                if row["status"] in FINAL_STATUSES or (
                    row["status"] == "RUNNING" and row["node_id"] != node_id
                ):
                    cancel.append(task_id)
            return cancel

    def reconcile(self, node_id: str, beat: Heartbeat) -> list[str]:
        """Take back what ``node_id`` holds at the master but does not run: returns the task ids.

        Only for a beat that lists the node's claims on the wire (``claimingTaskIds``; an older agent
        does not, and is left alone). A task RUNNING for this node that the beat lists nowhere
        (running, claiming, reporting) and that was claimed at least ``claim_grace_seconds`` ago
        goes back to PENDING (CANCELLED when an operator asked to cancel it): the node never started
        it (a claim whose answer was lost, a node killed between claim and start). A task claimed by a
        poll (claim-in-poll) goes back at once, without the wait, when the beat shows that poll settled:
        its ``pollId`` is at most the beat's ``lastClaimPollId`` and not among its ``claimPollIds``
        (the node admitted every task of that poll's answer, or never got it).
        """
        if beat.claiming_task_ids is None:
            return []
        held = {*beat.running_task_ids, *beat.claiming_task_ids, *(beat.reporting_task_ids or [])}
        cutoff = datetime.now(timezone.utc).timestamp() - self.claim_grace_seconds
        taken: list[str] = []
        with self._tx() as db:
            rows = db.execute(
                "SELECT id, claimed_at, cancel_requested, claim_poll_id FROM tasks"
                " WHERE node_id = ? AND status = 'RUNNING'",
                (node_id,),
            ).fetchall()
            for row in rows:
                if row["id"] in held:
                    continue
                if not _poll_settled(row["claim_poll_id"], beat) and _epoch(row["claimed_at"]) > cutoff:
                    continue
                self._give_back(db, str(row["id"]), bool(row["cancel_requested"]),
                                "the node does not run it (reconciled against its heartbeat)")
                taken.append(str(row["id"]))
        return taken

    def release_task(self, task_id: str, node_id: str, reason: str | None) -> dict[str, Any]:
        """``POST /api/tasks/{id}/release``: the node gives back a task it claimed and did not start.

        RUNNING for this node → PENDING (CANCELLED when an operator asked to cancel it); PENDING →
        nothing to do (the claim never landed); claimed by another node or final → ConflictError.
        Raises NotFoundError for an unknown task. Returns the task as admin JSON.
        """
        with self._tx() as db:
            row = self._task_row(db, task_id)
            if row["status"] == "RUNNING" and row["node_id"] == node_id:
                self._give_back(db, task_id, bool(row["cancel_requested"]),
                                f"given back by the node: {reason or 'no reason given'}")
            elif row["status"] == "RUNNING":
                raise ConflictError(f"task {task_id!r} is claimed by another node")
            elif row["status"] != "PENDING":
                raise ConflictError(f"task {task_id!r} is already {row['status']}")
            return self._task_json(self._task_row(db, task_id))

    @staticmethod
    def _give_back(db: sqlite3.Connection, task_id: str, cancel_requested: bool, why: str) -> None:
        if cancel_requested:
            db.execute(
                "UPDATE tasks SET status = 'CANCELLED', error_code = 'CANCELLED', error_message = ?,"
                " finished_at = ? WHERE id = ?",
                (f"cancelled before it started ({why})", utc_now_iso(), task_id),
            )
        else:
            db.execute(
                "UPDATE tasks SET status = 'PENDING', node_id = NULL, claimed_at = NULL, started_at = NULL,"
                " claim_poll_id = NULL WHERE id = ?",
                (task_id,),
            )
        _log.info("task %s: %s; %s", task_id, why, "CANCELLED" if cancel_requested else "PENDING again")

    @staticmethod
    def _cancel_ids(db: sqlite3.Connection, node_id: str) -> list[str]:
        rows = db.execute(
            "SELECT id FROM tasks WHERE node_id = ? AND status = 'RUNNING' AND cancel_requested = 1 ORDER BY n",
            (node_id,),
        ).fetchall()
        return [str(r["id"]) for r in rows]

    def cancel_ids(self, node_id: str) -> list[str]:
        """Tasks claimed by ``node_id`` that an operator asked to cancel (oldest first)."""
        return self._read(lambda db: self._cancel_ids(db, node_id))

    def list_nodes(self) -> list[dict[str, Any]]:
        """Every node as admin JSON, in registration order of first appearance (name)."""
        rows = self._read(lambda db: db.execute("SELECT * FROM nodes ORDER BY name").fetchall())
        return [
            {
                "id": r["id"],
                "name": r["name"],
                "ip": r["ip"],
                "port": r["port"],
                "version": r["version"],
                "maxWorkers": r["max_workers"],
                "labels": _loads(r["labels"]),
                "runtimes": _loads(r["runtimes"]),
                "containment": _loads(r["info"]).get("containment"),
                "egress": _loads(r["info"]).get("egress"),
                "registeredAt": r["registered_at"],
                "lastHeartbeatAt": r["last_heartbeat_at"],
                "lastHeartbeat": _loads(r["last_heartbeat"]),
                "pausedReason": (_loads(r["last_heartbeat"]) or {}).get("pausedReason"),
            }
            for r in rows
        ]

    # ----------------------------------------------------------------------- spiders and code

    def create_spider(
        self,
        *,
        name: str,
        framework: str,
        command: list[str] | str | None,
        timeout_seconds: float | None,
        code_mode: str,
        env: dict[str, str],
        resources: dict[str, Any] | None = None,
        stop_signal: str | None = None,
        outputs: dict[str, Any] | None = None,
    ) -> str:
        """Create a spider (arguments already validated). Returns its id. ``resources`` (limits of its
        tasks), ``stop_signal`` and ``outputs`` (declared item files and artifacts) are the defaults of its tasks."""
        spider_id = _new_id()
        with self._tx() as db:
            db.execute(
                "INSERT INTO spiders (id, name, framework, command, timeout_seconds, code_mode, env, created_at,"
                " resources, stop_signal, outputs) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    spider_id,
                    name,
                    framework,
                    _dumps(command),
                    timeout_seconds,
                    code_mode,
                    _dumps(env),
                    utc_now_iso(),
                    _dumps(resources) if resources else None,
                    stop_signal,
                    _dumps(outputs) if outputs is not None else None,
                ),
            )
        return spider_id

    @staticmethod
    def _spider_json(r: sqlite3.Row) -> dict[str, Any]:
        return {
            "id": r["id"],
            "name": r["name"],
            "framework": r["framework"],
            "command": _loads(r["command"]),
            "timeoutSeconds": r["timeout_seconds"],
            "codeMode": r["code_mode"],
            "env": _loads(r["env"]),
            "codeVersion": r["code_version"],
            "createdAt": r["created_at"],
            "resources": _loads(r["resources"]) if r["resources"] else {},
            "stopSignal": r["stop_signal"],
            "outputs": _loads(r["outputs"]),
        }

    def list_spiders(self) -> list[dict[str, Any]]:
        """Every spider as admin JSON, oldest first."""
        rows = self._read(lambda db: db.execute("SELECT * FROM spiders ORDER BY created_at, id").fetchall())
        return [self._spider_json(r) for r in rows]

    def get_spider(self, spider_id: str) -> dict[str, Any]:
        """One spider as admin JSON. Raises NotFoundError."""
        row = self._read(lambda db: db.execute("SELECT * FROM spiders WHERE id = ?", (spider_id,)).fetchone())
        if row is None:
            raise NotFoundError(f"no spider {spider_id!r}")
        return self._spider_json(row)

    def update_spider(self, spider_id: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Change a spider's ``name``, ``framework``, ``command``, ``timeout_seconds``, ``env`` (validated
        values; only the keys given). Returns the spider's admin JSON. Raises NotFoundError."""
        as_json = {"command", "env", "resources", "outputs"}  # JSON columns; the others store the value itself
        sets: list[str] = []
        values: list[Any] = []
        for key, value in changes.items():
            if key not in ("name", "framework", "command", "timeout_seconds", "env", "resources", "stop_signal",
                           "outputs"):
                raise ValueError(f"update_spider: {key!r} is not a changeable column")
            sets.append(f"{key} = ?")
            if key in ("resources", "outputs") and not value:
                values.append(None)  # nullable column: none
            else:
                values.append(_dumps(value) if key in as_json else value)
        with self._tx() as db:
            if db.execute("SELECT 1 FROM spiders WHERE id = ?", (spider_id,)).fetchone() is None:
                raise NotFoundError(f"no spider {spider_id!r}")
            if sets:
                db.execute(f"UPDATE spiders SET {', '.join(sets)} WHERE id = ?", (*values, spider_id))
        return self.get_spider(spider_id)

    def store_package(self, spider_id: str, package: PackageContents, data: bytes) -> dict[str, Any]:
        """Store a validated package (zip + files) and make it the spider's current code.

        Returns ``{codeVersion, sha256, sizeBytes, fileCount}``. Uploading the same zip again is a no-op
        apart from making it current. Raises NotFoundError for an unknown spider.
        """
        version = package.code_version
        with self._tx() as db:
            if db.execute("SELECT 1 FROM spiders WHERE id = ?", (spider_id,)).fetchone() is None:
                raise NotFoundError(f"no spider {spider_id!r}")
            known = db.execute(
                "SELECT 1 FROM packages WHERE spider_id = ? AND code_version = ?", (spider_id, version)
            ).fetchone()
            if known is None:
                db.execute(
                    "INSERT INTO packages (spider_id, code_version, sha256, size_bytes, data, uploaded_at)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (spider_id, version, package.sha256, package.size_bytes, data, utc_now_iso()),
                )
                db.executemany(
                    "INSERT INTO spider_files (id, spider_id, code_version, path, size_bytes, sha256, data)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [
                        (_new_id(), spider_id, version, f.path, f.size_bytes, f.sha256, f.data)
                        for f in package.files
                    ],
                )
            db.execute("UPDATE spiders SET code_version = ? WHERE id = ?", (version, spider_id))
        return {
            "codeVersion": version,
            "sha256": package.sha256,
            "sizeBytes": package.size_bytes,
            "fileCount": len(package.files),
        }

    def spider_files(self, spider_id: str) -> list[dict[str, Any]]:
        """The files of the spider's current package, by path: ``[{id, path, sizeBytes, sha256}]``.

        An empty list for a spider without a package. Raises NotFoundError for an unknown spider.
        """

        def query(db: sqlite3.Connection) -> list[sqlite3.Row]:
            spider = db.execute("SELECT code_version FROM spiders WHERE id = ?", (spider_id,)).fetchone()
            if spider is None:
                raise NotFoundError(f"no spider {spider_id!r}")
            return db.execute(
                "SELECT id, path, size_bytes, sha256 FROM spider_files WHERE spider_id = ? AND code_version = ?"
                " ORDER BY path",
                (spider_id, spider["code_version"]),
            ).fetchall()

        return [
            {"id": r["id"], "path": r["path"], "sizeBytes": r["size_bytes"], "sha256": r["sha256"]}
            for r in self._read(query)
        ]

    def spider_file(self, file_id: str) -> bytes:
        """The bytes of one spider file. Raises NotFoundError."""
        row = self._read(
            lambda db: db.execute("SELECT data FROM spider_files WHERE id = ?", (file_id,)).fetchone()
        )
        if row is None:
            raise NotFoundError(f"no spider file {file_id!r}")
        return bytes(row["data"])

    def package_zip(self, spider_id: str, code_version: str) -> bytes:
        """The zip bytes of one package version. Raises NotFoundError."""
        row = self._read(
            lambda db: db.execute(
                "SELECT data FROM packages WHERE spider_id = ? AND code_version = ?",
                (spider_id, code_version),
            ).fetchone()
        )
        if row is None:
            raise NotFoundError(f"no package {code_version!r} for spider {spider_id!r}")
        return bytes(row["data"])

    # ----------------------------------------------------------------------- tasks (admin side)

    def create_task(
        self,
        spider_id: str,
        *,
        args: list[str],
        env: dict[str, str],
        params: dict[str, Any],
        timeout_seconds: float | None,
        stall_timeout_seconds: float | None = None,
        resources: dict[str, Any] | None = None,
        stop_signal: str | None = None,
    ) -> str:
        """Create a PENDING task from a snapshot of the spider. Returns its id. ``resources`` are merged
        over the spider's (per key); ``stop_signal`` None takes the spider's.

        ``env`` is merged over the spider's env; ``timeout_seconds`` None takes the spider's.
        Raises NotFoundError (unknown spider) and ConflictError (the spider has no package yet).
        """
        task_id = _new_id()
        with self._tx() as db:
            spider = db.execute("SELECT * FROM spiders WHERE id = ?", (spider_id,)).fetchone()
            if spider is None:
                raise NotFoundError(f"no spider {spider_id!r}")
            if spider["code_version"] is None:
                raise ConflictError(
                    f"spider {spider_id!r} has no code package yet: PUT /api/spiders/{spider_id}/package first"
                )
            merged_env = {**_loads(spider["env"]), **env}
            timeout = spider["timeout_seconds"] if timeout_seconds is None else timeout_seconds
            merged_resources = {**(_loads(spider["resources"]) if spider["resources"] else {}), **(resources or {})}
            db.execute(
                "INSERT INTO tasks (id, spider_id, spider_name, framework, command, args, env, params,"
                " timeout_seconds, code_version, code_mode, status, created_at, stall_timeout_seconds, resources,"
                " stop_signal, outputs) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'PENDING', ?, ?, ?, ?, ?)",
                (
                    task_id,
                    spider_id,
                    spider["name"],
                    spider["framework"],
                    spider["command"],
                    _dumps(args),
                    _dumps(merged_env),
                    _dumps(params),
                    timeout,
                    spider["code_version"],
                    spider["code_mode"],
                    utc_now_iso(),
                    stall_timeout_seconds,
                    _dumps(merged_resources) if merged_resources else None,
                    stop_signal or spider["stop_signal"],
                    spider["outputs"],
                ),
            )
        return task_id

    @staticmethod
    def _task_json(r: sqlite3.Row) -> dict[str, Any]:
        return {
            "id": r["id"],
            "spiderId": r["spider_id"],
            "spiderName": r["spider_name"],
            "framework": r["framework"],
            "command": _loads(r["command"]),
            "args": _loads(r["args"]),
            "env": _loads(r["env"]),
            "params": _loads(r["params"]),
            "timeoutSeconds": r["timeout_seconds"],
            "stallTimeoutSeconds": r["stall_timeout_seconds"],
            "codeVersion": r["code_version"],
            "codeMode": r["code_mode"],
            "status": r["status"],
            "exitCode": r["exit_code"],
            "errorCode": r["error_code"],
            "errorMessage": r["error_message"],
            "nodeId": r["node_id"],
            "createdAt": r["created_at"],
            "claimedAt": r["claimed_at"],
            "startedAt": r["started_at"],
            "finishedAt": r["finished_at"],
            "durationMs": r["duration_ms"],
            "itemCount": r["item_count"],
            "logLines": r["log_lines"],
            "cancelRequested": bool(r["cancel_requested"]),
            "storedLogLines": r["stored_log_lines"],
            "storedItems": r["stored_items"],
            "resources": _loads(r["resources"]) if r["resources"] else {},
            "stopSignal": r["stop_signal"],
            "outputs": _loads(r["outputs"]),
            **(_loads(r["figures"]) if r["figures"] else {}),
        }

    @staticmethod
    def _task_row(db: sqlite3.Connection, task_id: str) -> sqlite3.Row:
        row: sqlite3.Row | None = db.execute("SELECT * FROM tasks WHERE id = ?", (task_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no task {task_id!r}")
        return row

    def get_task(self, task_id: str) -> dict[str, Any]:
        """One task as admin JSON, with its latest stats snapshot (``stats``, null when none) and
        ``finishReason``. Raises NotFoundError."""
        def query(db: sqlite3.Connection) -> tuple[sqlite3.Row, dict[str, Any] | None]:
            return self._task_row(db, task_id), task_stats.latest(db, task_id)

        row, latest = self._read(query)
        task = self._task_json(row)
        reason = (latest or {}).get("stats", {}).get("finishReason") if row["status"] in FINAL_STATUSES else None
        task["stats"] = latest
        task["finishReason"] = reason if isinstance(reason, str) else None
        return task

    def save_stats(self, task_id: str, node_id: str, snapshot: TaskStats) -> bool:
        """Keep a live stats snapshot of a task claimed by ``node_id`` if it is the newest (True).

        Raises NotFoundError (unknown task), ConflictError (another node's or an unclaimed task).
        """
        with self._tx() as db:
            row = self._task_row(db, task_id)
            if row["node_id"] != node_id:
                raise ConflictError(f"task {task_id!r} is not claimed by this node")
            stored = task_stats.save(db, task_id, snapshot)
        return stored

    def task_stats(self, task_id: str) -> dict[str, Any]:
        """``{"latest", "final", "history"}`` of a task (see ckagent.devmaster.stats). Raises NotFoundError."""
        def query(db: sqlite3.Connection) -> dict[str, Any]:
            self._task_row(db, task_id)
            return task_stats.read(db, task_id)

        return self._read(query)

    def list_tasks(
        self, *, status: str | None = None, spider_id: str | None = None, limit: int = 1000
    ) -> list[dict[str, Any]]:
        """Tasks as admin JSON, oldest first, optionally filtered; at most ``limit``."""
        where: list[str] = []
        params: list[Any] = []
        if status:
            where.append("status = ?")
            params.append(status)
        if spider_id:
            where.append("spider_id = ?")
            params.append(spider_id)
        sql = (
            "SELECT * FROM tasks" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY n LIMIT ?"
        )
        rows = self._read(lambda db: db.execute(sql, (*params, limit)).fetchall())
        return [self._task_json(r) for r in rows]

    def _log_chunks(self, task_id: str) -> list[tuple[str, str]]:
        """``(format, data)`` of a task's log chunks, in order. Raises NotFoundError."""

        def query(db: sqlite3.Connection) -> list[tuple[str, str]]:
            self._task_row(db, task_id)
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
            self._task_row(db, task_id)
            rows = db.execute(
                "SELECT data FROM task_item_chunks WHERE task_id = ? ORDER BY first_seq", (task_id,)
            ).fetchall()
            return [str(r[0]) for r in rows]

        items: list[Any] = []
        for data in self._read(query):
            items.extend(json.loads(data))
        return items

    def cancel_task(self, task_id: str) -> dict[str, Any]:
        """Operator cancel. PENDING → CANCELLED at once; RUNNING → cancelRequested (the agent reports
        CANCELLED); a final task raises ConflictError. Returns the task as admin JSON.
        """
        with self._tx() as db:
            row = self._task_row(db, task_id)
            if row["status"] == "PENDING":
                db.execute(
                    "UPDATE tasks SET status = 'CANCELLED', error_code = 'CANCELLED',"
                    " error_message = 'cancelled before any node claimed it', finished_at = ? WHERE id = ?",
                    (utc_now_iso(), task_id),
                )
            elif row["status"] == "RUNNING":
                db.execute("UPDATE tasks SET cancel_requested = 1 WHERE id = ?", (task_id,))
            else:
                raise ConflictError(f"task {task_id!r} is already {row['status']}")
            return self._task_json(self._task_row(db, task_id))

    # ----------------------------------------------------------------------- tasks (node side)

    def pending_tasks(
        self, *, limit: int, exclude_spider_ids: Sequence[str], base_url: str
    ) -> list[dict[str, Any]]:
        """PENDING tasks as wire JSON, oldest first, at most one per spider, none of the excluded spiders.

        ``base_url`` (no trailing slash) prefixes the codePackage url: "" hands it out relative to the
        agent's server.url (``/api/packages/…``). Handing out does not assign.
        """
        chosen = self._read(lambda db: self._choose_pending(db, limit, set(exclude_spider_ids)))
        return [self._wire_task(r, package, base_url) for r, package in chosen]

    def claim_pending(
        self, node_id: str, *, poll_id: int, limit: int, exclude_spider_ids: Sequence[str], base_url: str
    ) -> tuple[list[dict[str, Any]], list[str]]:
        """Claim-in-poll (docs/protocol.md, "Claims in the poll answer"), in one transaction: the
        tasks this poll (``poll_id``) claimed before and that are still RUNNING for ``node_id`` (a
        re-sent poll whose answer was lost gets them again), then PENDING tasks chosen as
        :meth:`pending_tasks` chooses them, at most ``limit`` in all; the new ones become RUNNING
        for ``node_id`` (claimed now, by ``poll_id``). Returns ``(tasks as wire JSON with
        "claimed": true, cancelTaskIds)``.
        """
        now = utc_now_iso()
        with self._tx() as db:
            again = db.execute(
                "SELECT * FROM tasks WHERE node_id = ? AND status = 'RUNNING' AND claim_poll_id = ? ORDER BY n",
                (node_id, str(poll_id)),
            ).fetchall()[:limit]
            chosen = [(r, self._package(db, r)) for r in again]
            excluded = set(exclude_spider_ids) | {r["spider_id"] for r in again}
            for r, _package in (fresh := self._choose_pending(db, limit - len(chosen), excluded)):
                db.execute(
                    "UPDATE tasks SET status = 'RUNNING', node_id = ?, claimed_at = ?, started_at = ?,"
                    " claim_poll_id = ? WHERE id = ? AND status = 'PENDING'",
                    (node_id, now, now, str(poll_id), r["id"]),
                )
            chosen += fresh
            cancel = self._cancel_ids(db, node_id)
        return [{**self._wire_task(r, package, base_url), "claimed": True} for r, package in chosen], cancel

    @staticmethod
    def _package(db: sqlite3.Connection, row: sqlite3.Row) -> sqlite3.Row | None:
        return db.execute(
            "SELECT sha256, size_bytes FROM packages WHERE spider_id = ? AND code_version = ?",
            (row["spider_id"], row["code_version"]),
        ).fetchone()

    def _choose_pending(
        self, db: sqlite3.Connection, limit: int, excluded: set[str]
    ) -> list[tuple[sqlite3.Row, sqlite3.Row | None]]:
        """Up to ``limit`` PENDING tasks, oldest first, one per spider, none of ``excluded``, with their package row."""
        chosen: list[tuple[sqlite3.Row, sqlite3.Row | None]] = []
        if limit <= 0:
            return chosen
        seen: set[str] = set()
        for row in db.execute("SELECT * FROM tasks WHERE status = 'PENDING' ORDER BY n"):
            spider_id = row["spider_id"]
            if spider_id in excluded or spider_id in seen:
                continue
            seen.add(spider_id)
            chosen.append((row, self._package(db, row)))
            if len(chosen) >= limit:
                break
        return chosen

    @staticmethod
    def _wire_task(r: sqlite3.Row, found: sqlite3.Row | None, base_url: str) -> dict[str, Any]:
        """A task row as the poll answer's JSON."""
        code_package = None
        if r["code_mode"] == "package" and found is not None:
            code_package = {
                "url": f"{base_url}/api/packages/{url_segment(r['spider_id'])}/{url_segment(r['code_version'] + '.zip')}",
                "sha256": found["sha256"],
                "sizeBytes": found["size_bytes"],
            }
        return {
            "id": r["id"],
            "spiderId": r["spider_id"],
            "spiderName": r["spider_name"],
            "framework": r["framework"],
            "command": _loads(r["command"]),
            "args": _loads(r["args"]),
            "env": _loads(r["env"]),
            "timeoutSeconds": r["timeout_seconds"],
            "codeVersion": r["code_version"],
            "codePackage": code_package,
            "params": _loads(r["params"]),
            "stallTimeoutSeconds": r["stall_timeout_seconds"],
            "resources": _loads(r["resources"]) if r["resources"] else None,
            "stopSignal": r["stop_signal"],
            "outputs": _loads(r["outputs"]),
        }

    # ----------------------------------------------------------------------- artifacts (ckagent.devmaster.artifacts)

    def store_artifact(self, task_id: str, node_id: str, path: str, data: bytes, sha256: str) -> dict[str, Any]:
        """Keep one artifact of a task claimed by ``node_id`` (idempotent for the same bytes). Returns
        ``{path, sizeBytes, sha256}``. Raises NotFoundError, ConflictError (another node's task, or
        another file at that path), BadRequestError (the bytes do not match ``sha256``)."""
        with self._tx() as db:
            if self._task_row(db, task_id)["node_id"] != node_id:
                raise ConflictError(f"task {task_id!r} is not claimed by this node")
        task_artifacts.write_blob(self.db_path, data, sha256)
        with self._tx() as db:
            task_artifacts.record(db, task_id, path, len(data), sha256, utc_now_iso())
        return {"path": path, "sizeBytes": len(data), "sha256": sha256}

    def list_artifacts(self, task_id: str) -> list[dict[str, Any]]:
        """A task's artifacts ``[{path, sizeBytes, sha256, storedAt}]``. Raises NotFoundError."""
        def read(db: sqlite3.Connection) -> list[dict[str, Any]]:
            self._task_row(db, task_id)
            return task_artifacts.listing(db, task_id)
        return self._read(read)

    def artifact_path(self, task_id: str, path: str) -> Path:
        """The file holding one artifact's bytes. Raises NotFoundError."""
        sha = self._read(lambda db: task_artifacts.find(db, task_id, path))
        return task_artifacts.blob_path(self.db_path, sha)

    def report_result(self, task_id: str, node_id: str, result: TaskResult) -> dict[str, Any]:
        """Apply a node's result report; returns the task as admin JSON.

        RUNNING is the claim: PENDING → RUNNING for this node; the same node again is fine; claimed by
        another node, final or cancelled → ConflictError. SUCCESS/FAILED/CANCELLED: only from the
        claiming node; the same final status again is a no-op, a different one is ConflictError. A
        PENDING task may be reported FAILED with errorCode BAD_TASK by a node that could not parse it.
        Raises NotFoundError for an unknown task.
        """
        now = utc_now_iso()
        with self._tx() as db:
            row = self._task_row(db, task_id)
            status, owner = row["status"], row["node_id"]
            if result.status == "RUNNING":
                if status == "PENDING":
                    db.execute(
                        "UPDATE tasks SET status = 'RUNNING', node_id = ?, claimed_at = ?, started_at = ?"
                        " WHERE id = ?",
                        (node_id, now, result.started_at or now, task_id),
                    )
                elif status == "RUNNING" and owner == node_id:
                    pass
                elif status == "RUNNING":
                    raise ConflictError(f"task {task_id!r} is claimed by another node")
                elif status == "CANCELLED" and owner is None:
                    raise ConflictError(f"task {task_id!r} was cancelled")
                else:
                    raise ConflictError(f"task {task_id!r} is already {status}")
            else:
                if status == "PENDING":
                    if result.error_code != "BAD_TASK":
                        raise ConflictError(f"task {task_id!r} was never claimed: report RUNNING first")
                    if result.status != "FAILED":
                        raise ConflictError("errorCode BAD_TASK on an unclaimed task needs status FAILED")
                    db.execute("UPDATE tasks SET node_id = ? WHERE id = ?", (node_id, task_id))
                    self._finish(db, task_id, result, now)
                elif owner != node_id:
                    raise ConflictError(f"task {task_id!r} is not claimed by this node")
                elif status == "RUNNING":
                    self._finish(db, task_id, result, now)
                elif status != result.status:
                    raise ConflictError(f"task {task_id!r} is already {status}, not {result.status}")
                # else: the same final result again: nothing to do
            return self._task_json(self._task_row(db, task_id))

    @staticmethod
    def _finish(db: sqlite3.Connection, task_id: str, result: TaskResult, now: str) -> None:
        assert result.status in FINAL_STATUSES
        db.execute(
            "UPDATE tasks SET status = ?, exit_code = ?, error_code = ?, error_message = ?,"
            " started_at = COALESCE(?, started_at), finished_at = ?, duration_ms = ?, item_count = ?,"
            " log_lines = ?, figures = ? WHERE id = ?",
            (
                result.status,
                result.exit_code,
                result.error_code,
                result.error_message,
                result.started_at,
                result.finished_at or now,
                result.duration_ms,
                result.item_count,
                result.log_lines,
                _result_figures(result),
                task_id,
            ),
        )
        if result.stats is not None:
            task_stats.save(db, task_id, result.stats, final=True)

    def append_logs(self, task_id: str, node_id: str, seq: int, lines: Sequence[str]) -> int:
        """Store log lines ``seq``.. once each; returns the new stored count (``acceptedSeq``).

        A full repeat stores nothing; an overlap stores only the new tail; ``seq`` beyond the stored
        count raises ConflictError with ``expectedSeq``. Only the claiming node may post (ConflictError).
        The new lines become one chunk row.
        """

        def encode(tail: Sequence[str]) -> dict[str, str]:
            text = "\n".join(tail)
            if text.count("\n") == len(tail) - 1:  # no line holds a \n of its own
                return {"format": _LINES, "data": text}
            return {"format": _JSON, "data": _dumps(list(tail))}

        discard = self._digest_logs if self.discard_logs else None
        return self._append("task_log_chunks", "stored_log_lines", task_id, node_id, seq, lines, encode, discard)

    def _digest_logs(self, task_id: str, lines: Sequence[str]) -> None:
        digest = self._log_digests.setdefault(task_id, hashlib.sha256())
        if lines:
            digest.update(("\n".join(lines) + "\n").encode())

    def log_digest(self, task_id: str) -> dict[str, Any]:
        """``{"count", "sha256", "discarded"}``: how many log lines the task has and the SHA-256 of
        them, each followed by ``\\n`` (UTF-8). Lines kept (not :attr:`discard_logs`) are read back
        to hash them. Raises NotFoundError."""
        count = self._read(lambda db: int(self._task_row(db, task_id)["stored_log_lines"]))
        digest = self._log_digests.get(task_id)
        if digest is None:
            lines = [] if self.discard_logs else self.task_logs(task_id)
            digest = hashlib.sha256("".join(line + "\n" for line in lines).encode())
        return {"count": count, "sha256": digest.hexdigest(), "discarded": self.discard_logs}

    def append_items(self, task_id: str, node_id: str, seq: int, items: Sequence[dict[str, Any]],
                     text: str | None = None) -> int:
        """Store items ``seq``.. once each (as JSON text); same rules and answer as ``append_logs``.
        ``text``: the JSON array ``items`` were decoded from, kept as it is when every item is new
        (no encoding again); when some were stored already, the new ones are encoded."""
        def encode(tail: Sequence[dict[str, Any]]) -> dict[str, str]:
            if text is not None and tail is items:
                return {"data": text}
            return {"data": _dumps(list(tail))}

        return self._append("task_item_chunks", "stored_items", task_id, node_id, seq, items, encode)

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
    ) -> int:
        """Store ``values[stored - seq:]`` as one chunk row, ``encode(tail)`` giving its other columns
        (name → value), or only count it and hand it to ``discard(task_id, tail)``. Returns the new
        stored count; ConflictError for another node or a gap.
        """
        with self._tx() as db:
            row = db.execute(f"SELECT node_id, {counter} FROM tasks WHERE id = ?", (task_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"no task {task_id!r}")
            if row[0] != node_id:
                raise ConflictError(f"task {task_id!r} is not claimed by this node")
            stored = int(row[1])
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


def _poll_settled(claim_poll_id: str | None, beat: Heartbeat) -> bool:
    """Whether ``beat`` shows the claiming poll ``claim_poll_id`` settled: sent before the beat's
    snapshot and no longer on the wire (its answer's tasks admitted or given back, or never received)."""
    if claim_poll_id is None or beat.claim_poll_ids is None or beat.last_claim_poll_id is None:
        return False
    poll = int(claim_poll_id)
    return poll <= beat.last_claim_poll_id and poll not in beat.claim_poll_ids


def _result_figures(result: TaskResult) -> str | None:
    """The resource figures and phase durations of a result as stored JSON (None when it carries none)."""
    figures = {k: v for k, v in result.to_json().items()
               if k in ("cpuSeconds", "memoryPeakBytes", "pidsPeak", "ioReadBytes", "ioWriteBytes",
                        "deployMs", "installMs", "runMs", "egressRefused", "incomplete")}
    return _dumps(figures) if figures else None
