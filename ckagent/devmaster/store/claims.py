"""The dev master's claims: the queue of PENDING tasks, claims (by poll or by result), releases,
reconciliation against a node's heartbeat, final results (docs/protocol.md, "Claims and releases"). A
final result ends the task's current attempt; the retry decision and the next attempt live in attempts.py,
the refusal of an older attempt's reports (409 ``supersededBy``) in supersede.py.

Each rule is one transaction, so the SQL reads as the contract.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Collection, Sequence
from datetime import datetime, timezone
from typing import Any

from ckagent.devmaster import stats as task_stats
from ckagent.devmaster.errors import ConflictError
from ckagent.devmaster.store.attempts import claim_attempt, end_attempt, newest_checkpoint, unclaim_attempt
from ckagent.devmaster.store.database import Database, dumps, epoch, loads, task_row
from ckagent.devmaster.store.supersede import check_attempt, current_attempt
from ckagent.devmaster.store.tasks import task_json
from ckagent.master.ids import url_segment
from ckagent.master.protocol import FINAL_STATUSES, Heartbeat, TaskResult, cause_of, utc_now_iso

CLAIM_GRACE_SECONDS = 60.0
"""A RUNNING task a node does not list in a heartbeat (running, claiming or reporting) goes back to
PENDING only when it was claimed at least this long ago: a claim answered after the node took its
heartbeat's snapshot must not be taken back (docs/protocol.md, "Claims and releases")."""

_log = logging.getLogger(__name__)

_Chosen = tuple[sqlite3.Row, "sqlite3.Row | None", "sqlite3.Row | None"]
"""A task chosen for a poll answer: its row, its package row, its newest checkpoint."""


def cancel_ids_of(db: sqlite3.Connection, node_id: str) -> list[str]:
    """Tasks claimed by ``node_id`` that an operator asked to cancel (oldest first)."""
    rows = db.execute(
        "SELECT id FROM tasks WHERE node_id = ? AND status = 'RUNNING' AND cancel_requested = 1 ORDER BY n",
        (node_id,),
    ).fetchall()
    return [str(r["id"]) for r in rows]


class ClaimStore(Database):
    """Who runs which task (part of :class:`ckagent.devmaster.store.Store`)."""

    claim_grace_seconds: float = CLAIM_GRACE_SECONDS

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
                if not _poll_settled(row["claim_poll_id"], beat) and epoch(row["claimed_at"]) > cutoff:
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
            row = task_row(db, task_id)
            if row["status"] == "RUNNING" and row["node_id"] == node_id:
                self._give_back(db, task_id, bool(row["cancel_requested"]),
                                f"given back by the node: {reason or 'no reason given'}")
            elif row["status"] == "RUNNING":
                raise ConflictError(f"task {task_id!r} is claimed by another node")
            elif row["status"] != "PENDING":
                raise ConflictError(f"task {task_id!r} is already {row['status']}")
            return task_json(task_row(db, task_id))

    @staticmethod
    def _give_back(db: sqlite3.Connection, task_id: str, cancel_requested: bool, why: str) -> None:
        unclaim_attempt(db, task_row(db, task_id), cancel_requested, utc_now_iso())
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


    def cancel_ids(self, node_id: str) -> list[str]:
        """Tasks claimed by ``node_id`` that an operator asked to cancel (oldest first)."""
        return self._read(lambda db: cancel_ids_of(db, node_id))


    def pending_tasks(
        self, *, limit: int, exclude_spider_ids: Sequence[str], base_url: str, node_id: str | None = None,
        running_spider_ids: Collection[str] = (),
    ) -> list[dict[str, Any]]:
        """PENDING tasks as wire JSON, oldest first, at most one per spider, none of the excluded spiders.

        ``base_url`` (no trailing slash) prefixes the codePackage url: "" hands it out relative to the
        agent's server.url (``/api/packages/…``). Handing out does not assign. ``running_spider_ids``
        (feature ``poll-follows-results``): those of the excluded spiders that stay excluded only while
        ``node_id`` has a RUNNING task of theirs (:meth:`excluded_now`).
        """
        def choose(db: sqlite3.Connection) -> list[_Chosen]:
            excluded = self.excluded_now(db, node_id, exclude_spider_ids, running_spider_ids)
            return self._choose_pending(db, limit, excluded)

        return [self._wire_task(r, package, checkpoint, base_url) for r, package, checkpoint in self._read(choose)]

    @staticmethod
    def excluded_now(db: sqlite3.Connection, node_id: str | None, exclude_spider_ids: Sequence[str],
                     running_spider_ids: Collection[str]) -> set[str]:
        """The spiders a poll of ``node_id`` excludes now: ``exclude_spider_ids``, less those of
        ``running_spider_ids`` of which the node has no RUNNING task any more (its final result has
        arrived: docs/protocol.md, "A held poll follows the node's results")."""
        excluded = set(exclude_spider_ids)
        lapsing = excluded & set(running_spider_ids)
        if lapsing and node_id is not None:
            held = {r[0] for r in db.execute(
                "SELECT DISTINCT spider_id FROM tasks WHERE node_id = ? AND status = 'RUNNING'", (node_id,))}
            excluded -= lapsing - held
        return excluded

    def claim_pending(
        self, node_id: str, *, poll_id: int, limit: int, exclude_spider_ids: Sequence[str], base_url: str,
        running_spider_ids: Collection[str] = (),
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
            chosen = [(r, self._package(db, r), newest_checkpoint(db, r["id"])) for r in again]
            excluded = self.excluded_now(db, node_id, exclude_spider_ids, running_spider_ids)
            excluded |= {r["spider_id"] for r in again}
            for r, _package, _checkpoint in (fresh := self._choose_pending(db, limit - len(chosen), excluded)):
                db.execute(
                    "UPDATE tasks SET status = 'RUNNING', node_id = ?, claimed_at = ?, started_at = ?,"
                    " claim_poll_id = ? WHERE id = ? AND status = 'PENDING'",
                    (node_id, now, now, str(poll_id), r["id"]),
                )
                claim_attempt(db, r, node_id, now, now)
            chosen += fresh
            cancel = cancel_ids_of(db, node_id)
        return [{**self._wire_task(r, package, checkpoint, base_url), "claimed": True}
                for r, package, checkpoint in chosen], cancel

    @staticmethod
    def _package(db: sqlite3.Connection, row: sqlite3.Row) -> sqlite3.Row | None:
        return db.execute(
            "SELECT sha256, size_bytes FROM packages WHERE spider_id = ? AND code_version = ?",
            (row["spider_id"], row["code_version"]),
        ).fetchone()

    def _choose_pending(self, db: sqlite3.Connection, limit: int, excluded: set[str]) -> list[_Chosen]:
        """Up to ``limit`` PENDING tasks, oldest first, one per spider, none of ``excluded``, none waiting
        for its retry time (``not_before``), with their package row and newest checkpoint."""
        chosen: list[_Chosen] = []
        if limit <= 0:
            return chosen
        seen: set[str] = set()
        now = utc_now_iso()
        for row in db.execute("SELECT * FROM tasks WHERE status = 'PENDING' AND (not_before IS NULL OR not_before <= ?)"
                              " ORDER BY n", (now,)):
            spider_id = row["spider_id"]
            if spider_id in excluded or spider_id in seen:
                continue
            seen.add(spider_id)
            chosen.append((row, self._package(db, row), newest_checkpoint(db, row["id"])))
            if len(chosen) >= limit:
                break
        return chosen

    @staticmethod
    def _wire_task(r: sqlite3.Row, found: sqlite3.Row | None, checkpoint: sqlite3.Row | None,
                   base_url: str) -> dict[str, Any]:
        """A task row as the poll answer's JSON (``checkpoint``: the task's newest, the one its attempt
        resumes from)."""
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
            "command": loads(r["command"]),
            "args": loads(r["args"]),
            "env": loads(r["env"]),
            "timeoutSeconds": r["timeout_seconds"],
            "codeVersion": r["code_version"],
            "codePackage": code_package,
            "params": loads(r["params"]),
            "stallTimeoutSeconds": r["stall_timeout_seconds"],
            "resources": loads(r["resources"]) if r["resources"] else None,
            "stopSignal": r["stop_signal"],
            "outputs": loads(r["outputs"]),
            "egress": loads(r["egress"]),
            "stopGraceSeconds": r["stop_grace_seconds"],
            "cleanStart": True if r["clean_start"] else None,
            "attempt": current_attempt(r),
            "itemSeqStart": r["item_seq_start"] or 0,
            "logSeqStart": r["log_seq_start"] or 0,
            "checkpoint": None if checkpoint is None else {
                "id": checkpoint["id"], "attempt": checkpoint["attempt"], "itemSeq": checkpoint["item_seq"],
                "logSeq": checkpoint["log_seq"], "createdAt": checkpoint["created_at"],
                "sizeBytes": checkpoint["size_bytes"],
                "url": f"{base_url}/api/tasks/{url_segment(r['id'])}/checkpoints/{url_segment(checkpoint['id'])}",
            },
            "checkpointIntervalSeconds": r["checkpoint_interval_seconds"],
            "resume": r["resume"],
            "retry": loads(r["retry"]),
        }

    def report_result(self, task_id: str, node_id: str, result: TaskResult,
                      attempt: int | None = None) -> dict[str, Any]:
        """Apply a node's result report; returns the task as admin JSON.

        RUNNING is the claim: PENDING → RUNNING for this node; the same node again is fine; claimed by
        another node, final or cancelled → ConflictError. SUCCESS/FAILED/CANCELLED: only from the
        claiming node; the same final status again is a no-op, a different one is ConflictError. A
        PENDING task may be reported FAILED with errorCode BAD_TASK by a node that could not parse it.
        ``attempt`` (None: the report does not say): a report of an attempt older than the task's
        current one is ConflictError ``supersededBy`` — unless it repeats that attempt's stored end (a
        resend whose answer was lost: a no-op). A final result ends the current attempt and applies the
        retry decision (store/attempts.py): the task is final, or PENDING at its next attempt.
        Raises NotFoundError for an unknown task.
        """
        now = utc_now_iso()
        with self._tx() as db:
            row = task_row(db, task_id)
            status, owner = row["status"], row["node_id"]
            # Without an attempt (an older agent), a claim or a BAD_TASK of a PENDING task is of the task as
            # handed out now; only other reports of a node that ran an older attempt are that attempt's.
            handed_out = result.status == "RUNNING" or (status == "PENDING" and result.error_code == "BAD_TASK")
            try:
                check_attempt(db, row, node_id, None if handed_out and attempt is None else attempt,
                              infer=not handed_out)
            except ConflictError as exc:
                if "supersededBy" in exc.extra and self._repeated(db, task_id, node_id, result, attempt):
                    return task_json(row)
                raise
            if result.status == "RUNNING":
                if status == "PENDING":
                    db.execute(
                        "UPDATE tasks SET status = 'RUNNING', node_id = ?, claimed_at = ?, started_at = ?"
                        " WHERE id = ?",
                        (node_id, now, result.started_at or now, task_id),
                    )
                    claim_attempt(db, row, node_id, now, result.started_at or now)
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
                    db.execute("UPDATE task_attempts SET node_id = ? WHERE task_id = ? AND attempt = ?",
                               (node_id, task_id, current_attempt(row)))
                    self._finish(db, task_id, result, now)
                elif owner != node_id:
                    raise ConflictError(f"task {task_id!r} is not claimed by this node")
                elif status == "RUNNING":
                    self._finish(db, task_id, result, now)
                elif status != result.status:
                    raise ConflictError(f"task {task_id!r} is already {status}, not {result.status}")
                # else: the same final result again: nothing to do
            return task_json(task_row(db, task_id))

    @staticmethod
    def _repeated(db: sqlite3.Connection, task_id: str, node_id: str, result: TaskResult, attempt: int | None) -> bool:
        """Whether ``result`` repeats the stored end of an earlier attempt ``node_id`` ran (``attempt``, or
        its newest when None)."""
        if result.status not in FINAL_STATUSES:
            return False
        prior = db.execute(
            "SELECT status, error_code FROM task_attempts WHERE task_id = ? AND node_id = ? AND (? IS NULL OR attempt = ?)"
            " ORDER BY attempt DESC LIMIT 1", (task_id, node_id, attempt, attempt)).fetchone()
        return prior is not None and prior["status"] == result.status and prior["error_code"] == result.error_code

    @staticmethod
    def _finish(db: sqlite3.Connection, task_id: str, result: TaskResult, now: str) -> None:
        """Write a final result into the task and end its current attempt (the retry decision may make
        the task PENDING at its next attempt)."""
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
        cause, retryable = cause_of(result.error_code if result.status == "FAILED" else None)
        if result.status == "FAILED" and result.cause_class is not None:
            cause = result.cause_class
        if result.status == "FAILED" and result.retryable is not None:
            retryable = result.retryable
        end_attempt(db, task_id, status=result.status, error_code=result.error_code,
                    error_message=result.error_message, exit_code=result.exit_code,
                    cause_class=None if cause is None else str(getattr(cause, "value", cause)), retryable=retryable,
                    checkpoint_id=result.checkpoint_id, finished_at=result.finished_at or now,
                    started_at=result.started_at)



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
                        "deployMs", "installMs", "runMs", "egressRefused", "incomplete",
                        "incompleteReason")}
    return dumps(figures) if figures else None
