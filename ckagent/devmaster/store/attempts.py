"""A task's attempts at the reference master (docs/protocol.md, "Attempts"): one row each, the rule that
refuses what an older attempt sends (409 ``supersededBy``), the start of a new attempt (its items cut
back to the newest checkpoint, its seq starts) and the retry decision after a final result.

The functions here take the open transaction's connection (the callers in claims.py, streams.py,
checkpoints.py and nodes.py hold it): each rule is part of the one transaction that needs it.
:class:`AttemptStore` has the reads (the attempts of a task for its view) and the node-lost sweep.
"""

from __future__ import annotations

import logging
import sqlite3
from datetime import datetime, timedelta, timezone
from typing import Any

from ckagent.devmaster import retrypolicy
from ckagent.devmaster.store.checkpoints import prune_chunks
from ckagent.devmaster.store.database import Database, epoch, loads, task_row
from ckagent.devmaster.store.streams import truncate_items
from ckagent.devmaster.store.supersede import current_attempt
from ckagent.master.protocol import utc_iso, utc_now_iso

RESTART_KEEP = "restart-keep"
"""A task's ``resume`` that keeps the earlier attempts' items when there is no checkpoint (the default,
``restart-replace``, drops them)."""

_log = logging.getLogger(__name__)


def ensure_attempt(db: sqlite3.Connection, task_id: str, attempt: int, now: str) -> None:
    """The row of ``attempt`` (PENDING) when there is none yet (a task from before attempts)."""
    db.execute("INSERT OR IGNORE INTO task_attempts (task_id, attempt, status, created_at) VALUES (?, ?, 'PENDING', ?)",
               (task_id, attempt, now))


def claim_attempt(db: sqlite3.Connection, row: sqlite3.Row, node_id: str, claimed_at: str, started_at: str) -> None:
    """The task's current attempt is claimed by ``node_id``."""
    attempt = current_attempt(row)
    ensure_attempt(db, row["id"], attempt, claimed_at)
    db.execute("UPDATE task_attempts SET status = 'RUNNING', node_id = ?, claimed_at = ?, started_at = ?"
               " WHERE task_id = ? AND attempt = ?", (node_id, claimed_at, started_at, row["id"], attempt))


def unclaim_attempt(db: sqlite3.Connection, row: sqlite3.Row, cancelled: bool, now: str) -> None:
    """The claim of the current attempt was given back: PENDING again (the same attempt: it never started),
    or CANCELLED."""
    if cancelled:
        db.execute("UPDATE task_attempts SET status = 'CANCELLED', error_code = 'CANCELLED', finished_at = ?,"
                   " decision = 'cancelled' WHERE task_id = ? AND attempt = ?", (now, row["id"], current_attempt(row)))
    else:
        db.execute("UPDATE task_attempts SET status = 'PENDING', node_id = NULL, claimed_at = NULL, started_at = NULL"
                   " WHERE task_id = ? AND attempt = ?", (row["id"], current_attempt(row)))


def cancel_pending_attempt(db: sqlite3.Connection, task_id: str, attempt: int, now: str) -> None:
    """An operator cancelled the task while its current attempt waited: that attempt is CANCELLED."""
    db.execute("UPDATE task_attempts SET status = 'CANCELLED', error_code = 'CANCELLED', finished_at = ?,"
               " decision = 'cancelled before it started' WHERE task_id = ? AND attempt = ? AND status = 'PENDING'",
               (now, task_id, attempt))


def newest_checkpoint(db: sqlite3.Connection, task_id: str) -> sqlite3.Row | None:
    """The task's newest recorded checkpoint (any attempt), or None."""
    found: sqlite3.Row | None = db.execute(
        "SELECT * FROM task_checkpoints WHERE task_id = ? ORDER BY n DESC LIMIT 1", (task_id,)).fetchone()
    return found


def end_attempt(db: sqlite3.Connection, task_id: str, *, status: str, error_code: str | None,
                error_message: str | None, exit_code: int | None, cause_class: str | None, retryable: bool,
                checkpoint_id: str | None, finished_at: str, started_at: str | None = None) -> dict[str, Any]:
    """End the task's current attempt with a final result and apply the retry decision, in the caller's
    transaction: the task is final with this result (the caller wrote it), or PENDING again at a new
    attempt (:func:`start_next_attempt`). Returns the attempt's end as ``{"attempt", "decision", "again"}``."""
    row = task_row(db, task_id)
    attempt = current_attempt(row)
    ensure_attempt(db, task_id, attempt, finished_at)
    newest = newest_checkpoint(db, task_id)
    checkpointed = newest is not None and int(newest["attempt"]) == attempt
    earlier = db.execute("SELECT counted FROM task_attempts WHERE task_id = ? AND attempt < ? AND status IN"
                         " ('SUCCESS', 'FAILED', 'CANCELLED') ORDER BY attempt DESC", (task_id, attempt)).fetchall()
    in_a_row = 0
    for e in earlier:
        if e["counted"]:
            break
        in_a_row += 1
    decision = retrypolicy.decide(
        retrypolicy.Policy.from_stored(loads(row["retry"])),
        retrypolicy.Ending(status=status, error_code=error_code, exit_code=exit_code, cause_class=cause_class,
                           retryable=retryable, checkpointed=checkpointed,
                           cancel_requested=bool(row["cancel_requested"])),
        counted_before=sum(1 for e in earlier if e["counted"]), uncounted_in_a_row=in_a_row)
    db.execute(
        "UPDATE task_attempts SET status = ?, error_code = ?, error_message = ?, exit_code = ?, cause_class = ?,"
        " retryable = ?, checkpoint_id = COALESCE(?, checkpoint_id), finished_at = ?,"
        " started_at = COALESCE(?, started_at), counted = ?, decision = ? WHERE task_id = ? AND attempt = ?",
        (status, error_code, error_message, exit_code, cause_class, 1 if retryable else 0, checkpoint_id, finished_at,
         started_at, 1 if decision.counted else 0, decision.why, task_id, attempt))
    if decision.again:
        # the backoff counts from the attempt's end (the node's finishedAt), never from a time later than
        # the master's clock: a node's clock ahead cannot hold a retry back
        now = utc_now_iso()
        ended = finished_at if 0 < epoch(finished_at) <= epoch(now) else now
        start_next_attempt(db, task_id, delay_seconds=decision.delay_seconds, now=ended)
    else:
        prune_chunks(db, task_id)  # final: its newest checkpoint stays, nothing else
    _log.info("task %s attempt %d ended %s: %s", task_id, attempt, error_code or status, decision.why)
    return {"attempt": attempt, "decision": decision.why, "again": decision.again}


def start_next_attempt(db: sqlite3.Connection, task_id: str, *, delay_seconds: float, now: str) -> int:
    """Make the task PENDING at its next attempt, not handed out for ``delay_seconds``; returns its number.

    Its items: kept up to the newest checkpoint's ``itemSeq`` (the rest dropped: the new attempt resumes
    from that checkpoint and writes them again); without a checkpoint, ``resume`` decides: restart-keep
    keeps them all, restart-replace (the default) drops them all. Its log lines are all kept. The new
    attempt's ``itemSeqStart`` / ``logSeqStart`` are the counts kept.
    """
    row = task_row(db, task_id)
    stored_items, stored_logs = int(row["stored_items"]), int(row["stored_log_lines"])
    checkpoint = newest_checkpoint(db, task_id)
    if checkpoint is not None:
        keep = min(int(checkpoint["item_seq"]), stored_items)
    elif row["resume"] == RESTART_KEEP:
        keep = stored_items
    else:
        keep = 0
    truncate_items(db, task_id, keep)
    db.execute("DELETE FROM task_stats WHERE task_id = ?", (task_id,))  # the stats of the attempt that runs
    attempt = current_attempt(row) + 1
    not_before = None
    if delay_seconds > 0:
        moment = datetime.fromtimestamp(epoch(now), timezone.utc) + timedelta(seconds=delay_seconds)
        not_before = utc_iso(moment)
    db.execute(
        "UPDATE tasks SET attempt = ?, status = 'PENDING', node_id = NULL, claimed_at = NULL, started_at = NULL,"
        " finished_at = NULL, claim_poll_id = NULL, exit_code = NULL, error_code = NULL, error_message = NULL,"
        " duration_ms = NULL, item_count = NULL, log_lines = NULL, figures = NULL, not_before = ?,"
        " item_seq_start = ?, log_seq_start = ? WHERE id = ?",
        (attempt, not_before, keep, stored_logs, task_id))
    db.execute(
        "INSERT OR REPLACE INTO task_attempts (task_id, attempt, status, created_at, not_before, resumed_from,"
        " item_seq_start, log_seq_start, items_kept, items_dropped) VALUES (?, ?, 'PENDING', ?, ?, ?, ?, ?, ?, ?)",
        (task_id, attempt, now, not_before, None if checkpoint is None else checkpoint["id"], keep, stored_logs,
         keep, stored_items - keep))
    return attempt


def attempt_json(r: sqlite3.Row) -> dict[str, Any]:
    """One attempt as admin JSON."""
    return {
        "attempt": r["attempt"], "status": r["status"], "nodeId": r["node_id"], "createdAt": r["created_at"],
        "notBefore": r["not_before"], "claimedAt": r["claimed_at"], "startedAt": r["started_at"],
        "finishedAt": r["finished_at"], "exitCode": r["exit_code"], "errorCode": r["error_code"],
        "errorMessage": r["error_message"], "causeClass": r["cause_class"],
        "retryable": None if r["retryable"] is None else bool(r["retryable"]),
        "counted": None if r["counted"] is None else bool(r["counted"]), "decision": r["decision"],
        "resumedFrom": r["resumed_from"], "itemSeqStart": r["item_seq_start"], "logSeqStart": r["log_seq_start"],
        "itemsKept": r["items_kept"], "itemsDropped": r["items_dropped"], "checkpointId": r["checkpoint_id"],
    }


def checkpoint_json(r: sqlite3.Row, now: float | None = None) -> dict[str, Any]:
    """A recorded checkpoint as admin JSON: what the poll's ``checkpoint`` carries, its reason, file count,
    packed size and age (seconds since its ``createdAt``)."""
    return {"id": r["id"], "attempt": r["attempt"], "itemSeq": r["item_seq"], "logSeq": r["log_seq"],
            "createdAt": r["created_at"], "recordedAt": r["recorded_at"], "reason": r["reason"],
            "sizeBytes": r["size_bytes"], "packedBytes": r["packed_bytes"], "fileCount": r["file_count"],
            "ageSeconds": round(max(0.0, (datetime.now(timezone.utc).timestamp() if now is None else now)
                                    - epoch(r["created_at"])), 3)}


def attempts_of(db: sqlite3.Connection, task_id: str) -> dict[str, Any]:
    """``{"attempts": [...], "checkpoint": {...} | None}`` of a task: every attempt (oldest first) and its
    newest checkpoint, as admin JSON."""
    rows = db.execute("SELECT * FROM task_attempts WHERE task_id = ? ORDER BY attempt", (task_id,)).fetchall()
    newest = newest_checkpoint(db, task_id)
    return {"attempts": [attempt_json(r) for r in rows],
            "checkpoint": None if newest is None else checkpoint_json(newest)}


def lose_node_attempts(db: sqlite3.Connection, node_id: str, message: str) -> list[str]:
    """In the caller's transaction: every RUNNING task of ``node_id`` ends its attempt FAILED AGENT_LOST
    (``message``; a disruption: a new attempt at once, from the newest checkpoint, not counted) — its
    agent is gone for good (another nodeUid registered the node's name). Returns the task ids."""
    now = utc_now_iso()
    lost = [str(r["id"]) for r in db.execute("SELECT id FROM tasks WHERE node_id = ? AND status = 'RUNNING' ORDER BY n",
                                             (node_id,)).fetchall()]
    for task_id in lost:
        end_attempt(db, task_id, status="FAILED", error_code="AGENT_LOST", error_message=message, exit_code=None,
                    cause_class="disruption", retryable=True, checkpoint_id=None, finished_at=now)
        if task_row(db, task_id)["status"] == "RUNNING":  # final: no new attempt (a cancel asked, 25 in a row)
            db.execute("UPDATE tasks SET status = 'FAILED', error_code = 'AGENT_LOST', error_message = ?,"
                       " finished_at = ? WHERE id = ?", (message, now, task_id))
    return lost


class AttemptStore(Database):
    """Attempts: the node-lost sweep and the retry clock (part of :class:`ckagent.devmaster.store.Store`)."""

    def lose_nodes(self, lost_after_seconds: float, *, now: float | None = None) -> list[str]:
        """The node-lost sweep: every RUNNING task whose node has shown no sign of life (a heartbeat, its
        registration, this task's claim) for ``lost_after_seconds`` ends its attempt FAILED NODE_LOST
        (a disruption: a new attempt at once, from the newest checkpoint, not counted). Returns the task
        ids. ``now``: epoch seconds (default the clock)."""
        moment = datetime.now(timezone.utc).timestamp() if now is None else now

        def silent_ones(db: sqlite3.Connection) -> list[tuple[sqlite3.Row, float]]:
            rows = db.execute(
                "SELECT t.id, t.node_id, t.claimed_at, n.last_heartbeat_at, n.registered_at, n.name FROM tasks t"
                " LEFT JOIN nodes n ON n.id = t.node_id WHERE t.status = 'RUNNING'").fetchall()
            found = []
            for r in rows:
                alive = max(epoch(r["last_heartbeat_at"]), epoch(r["registered_at"]), epoch(r["claimed_at"]))
                if moment - alive >= lost_after_seconds:
                    found.append((r, moment - alive))
            return found

        lost: list[str] = []
        if not self._read(silent_ones):  # the common case: a read, no write transaction every tick
            return lost
        with self._tx() as db:
            for r, silent in silent_ones(db):  # again, in the transaction: a heartbeat may have come since
                message = (f"node {r['name'] or r['node_id']} lost: no heartbeat for {silent:.0f} s"
                           f" (the node-lost grace is {lost_after_seconds:g} s)")
                end_attempt(db, r["id"], status="FAILED", error_code="NODE_LOST", error_message=message,
                            exit_code=None, cause_class="disruption", retryable=True, checkpoint_id=None,
                            finished_at=utc_iso(datetime.fromtimestamp(moment, timezone.utc)))
                if task_row(db, r["id"])["status"] == "RUNNING":  # final: no new attempt (25 in a row)
                    db.execute("UPDATE tasks SET status = 'FAILED', error_code = 'NODE_LOST', error_message = ?,"
                               " finished_at = ? WHERE id = ?", (message, utc_now_iso(), r["id"]))
                lost.append(str(r["id"]))
        for task_id in lost:
            _log.warning("task %s: its node is lost; attempt ended NODE_LOST", task_id)
        return lost

    def next_due(self, after: float) -> float | None:
        """The earliest ``not_before`` (epoch seconds) of a PENDING task later than ``after``, or None."""
        since = utc_iso(datetime.fromtimestamp(after, timezone.utc))
        row = self._read(lambda db: db.execute(
            "SELECT MIN(not_before) FROM tasks WHERE status = 'PENDING' AND not_before > ?", (since,)).fetchone())
        return None if row is None or row[0] is None else epoch(row[0])
