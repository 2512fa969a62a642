"""The dev master's SQLite layout: the tables, the schema version, the columns added since.

The file carries its schema version (``PRAGMA user_version`` = SCHEMA_VERSION). A file from an
older dev master (one row per log line, version 0) is refused with SchemaError, not migrated:
this is a development tool, delete the file or choose another one. Columns added after version 2
are nullable and added to a file that lacks them (:data:`ADDED_COLUMNS`).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ckagent.devmaster import artifacts as task_artifacts
from ckagent.devmaster import stats as task_stats
from ckagent.devmaster.errors import SchemaError

SCHEMA_VERSION = 2
"""The layout of the SQLite file (``PRAGMA user_version``): 2 = logs and items in chunks."""

TABLES = """
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
-- One row per attempt of a task (store/attempts.py): created PENDING (attempt 1 with the task, the next
-- when the master gives it another), RUNNING when claimed, final with the node's result or NODE_LOST.
CREATE TABLE IF NOT EXISTS task_attempts (
    task_id         TEXT NOT NULL,
    attempt         INTEGER NOT NULL,
    status          TEXT NOT NULL,                       -- PENDING RUNNING SUCCESS FAILED CANCELLED
    node_id         TEXT,
    created_at      TEXT NOT NULL,
    not_before      TEXT,                                -- a retry waits until then (ISO time)
    claimed_at      TEXT,
    started_at      TEXT,
    finished_at     TEXT,
    exit_code       INTEGER,
    error_code      TEXT,
    error_message   TEXT,
    cause_class     TEXT,                                -- disruption resource spider setup (null: none)
    retryable       INTEGER,
    counted         INTEGER,                             -- 1: counts against retry.maxAttempts
    decision        TEXT,                                -- what the master did after it (retry policy's words)
    resumed_from    TEXT,                                -- the checkpoint id it started from (null: from scratch)
    item_seq_start  INTEGER NOT NULL DEFAULT 0,
    log_seq_start   INTEGER NOT NULL DEFAULT 0,
    items_kept      INTEGER NOT NULL DEFAULT 0,          -- earlier attempts' items kept at its start
    items_dropped   INTEGER NOT NULL DEFAULT 0,          -- ... and dropped
    checkpoint_id   TEXT,                                -- the newest checkpoint it shipped (result's checkpointId)
    PRIMARY KEY (task_id, attempt)
);
-- Checkpoints (store/checkpoints.py): a task keeps its newest manifest and the chunks it names.
CREATE TABLE IF NOT EXISTS task_checkpoints (
    n              INTEGER PRIMARY KEY AUTOINCREMENT,    -- the order they were recorded in
    task_id        TEXT NOT NULL,
    id             TEXT NOT NULL,
    attempt        INTEGER NOT NULL,
    created_at     TEXT NOT NULL,
    recorded_at    TEXT NOT NULL,
    reason         TEXT NOT NULL,
    item_seq       INTEGER NOT NULL,
    log_seq        INTEGER NOT NULL,
    size_bytes     INTEGER NOT NULL,
    packed_bytes   INTEGER NOT NULL,
    file_count     INTEGER NOT NULL,
    manifest       TEXT NOT NULL,                        -- the manifest as posted (JSON)
    UNIQUE (task_id, id)
);
CREATE TABLE IF NOT EXISTS checkpoint_chunks (
    task_id        TEXT NOT NULL,
    sha256         TEXT NOT NULL,                        -- of the unpacked bytes
    size_bytes     INTEGER NOT NULL,                     -- unpacked
    data           BLOB NOT NULL,                        -- gzip, as sent
    stored_at      TEXT NOT NULL,
    PRIMARY KEY (task_id, sha256)
);
"""


ADDED_COLUMNS: dict[str, tuple[str, ...]] = {
    # resources: JSON {memoryBytes, pids, cpus}; stop_signal: "SIGINT" ...; figures: JSON of the
    # result's figures: resources {cpuSeconds, memoryPeakBytes, pidsPeak, ioReadBytes, ioWriteBytes},
    # phases {deployMs, installMs, runMs} and incomplete (true: the node says data is missing); claim_poll_id: the pollId of the poll that claimed the
    # task (claim-in-poll; decimal text), null for a claim by POST .../result.
    # outputs: JSON {items: [glob], artifacts: [glob]} (a spider's default, copied into its tasks).
    # egress: JSON {deny: [str], allow: [str]} (a spider's default network policy; a task's own or the copy).
    # left_at: when the node's agent said it was leaving (POST .../leaving; ISO time), null while it holds its
    # name; a registration clears it. displaced_uids: JSON list of the nodeUids the name moved away from
    # (to another nodeUid), oldest first, at most DISPLACED_KEPT: they do not take it back by an exclusive
    # registration (nameExclusive) while the holder is live (store/nodes.py).
    "nodes": ("left_at", "displaced_uids"),
    # retry: JSON {maxAttempts, backoffSeconds, factor, on, exitCodes}; resume: restart-replace|restart-keep
    # (a spider's default, a task's own or the copy); not_before: a retried task is not handed out before
    # this ISO time.
    "spiders": ("resources", "stop_signal", "outputs", "egress", "retry", "resume"),
    "tasks": ("resources", "stop_signal", "figures", "claim_poll_id", "outputs", "egress", "retry", "resume",
              "not_before"),
}
NUMBER_COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    # stop_grace_seconds: a spider's default / a task's stopGraceSeconds (null: the framework's or node's);
    # clean_start: 1 when the task's cleanStart is true; checkpoint_interval_seconds: checkpointIntervalSeconds
    # (null: the node's); attempt: the task's current attempt (null: 1); item_seq_start/log_seq_start: where
    # that attempt's items and log lines start in the task's streams.
    "spiders": (("stop_grace_seconds", "REAL"), ("checkpoint_interval_seconds", "REAL")),
    "tasks": (("stop_grace_seconds", "REAL"), ("clean_start", "INTEGER"), ("checkpoint_interval_seconds", "REAL"),
              ("attempt", "INTEGER"), ("item_seq_start", "INTEGER"), ("log_seq_start", "INTEGER")),
}


def create_schema(db: sqlite3.Connection, db_path: Path) -> None:
    """Create the tables in an empty file; check the version of a used one (SchemaError naming
    ``db_path``); add the columns a used file lacks."""
    version = int(db.execute("PRAGMA user_version").fetchone()[0])
    used = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' LIMIT 1").fetchone()
    if version != SCHEMA_VERSION and (used is not None or version != 0):
        raise SchemaError(
            f"{db_path} is not a dev master database of schema version {SCHEMA_VERSION}"
            f" (it has version {version}"
            + (": an older dev master that stored one row per log line" if version == 0 else "")
            + "); the dev master does not migrate it: delete the file or pass another --db"
        )
    # one transaction: a file has all the tables and its version, or nothing
    db.executescript(f"BEGIN IMMEDIATE; {TABLES}; {task_stats.SCHEMA}; {task_artifacts.SCHEMA};"
                     f" PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
    if "stall_timeout_seconds" not in {r[1] for r in db.execute("PRAGMA table_info(tasks)")}:
        db.execute("ALTER TABLE tasks ADD COLUMN stall_timeout_seconds REAL")  # a file from before it
    for table, columns in ADDED_COLUMNS.items():
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}
        for name in columns:
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} TEXT")
    for table, typed in NUMBER_COLUMNS.items():
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}
        for name, kind in typed:
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
