"""The dev master's tasks on the admin side: created from a spider, listed, read, cancelled; their
stats snapshots (ckagent.devmaster.stats) and artifacts (ckagent.devmaster.artifacts)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from ckagent.devmaster import artifacts as task_artifacts
from ckagent.devmaster import stats as task_stats
from ckagent.devmaster.errors import ConflictError, NotFoundError
from ckagent.devmaster.store.attempts import attempts_of, cancel_pending_attempt, ensure_attempt
from ckagent.devmaster.store.database import Database, dumps, loads, new_id, task_row
from ckagent.devmaster.store.supersede import check_attempt
from ckagent.master.protocol import FINAL_STATUSES, TaskStats, utc_now_iso


def task_json(r: sqlite3.Row) -> dict[str, Any]:
        return {
            "id": r["id"],
            "spiderId": r["spider_id"],
            "spiderName": r["spider_name"],
            "framework": r["framework"],
            "command": loads(r["command"]),
            "args": loads(r["args"]),
            "env": loads(r["env"]),
            "params": loads(r["params"]),
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
            "resources": loads(r["resources"]) if r["resources"] else {},
            "stopSignal": r["stop_signal"],
            "outputs": loads(r["outputs"]),
            "egress": loads(r["egress"]),
            "stopGraceSeconds": r["stop_grace_seconds"],
            "cleanStart": bool(r["clean_start"]),
            "attempt": int(r["attempt"] or 1),
            "itemSeqStart": r["item_seq_start"] or 0,
            "logSeqStart": r["log_seq_start"] or 0,
            "notBefore": r["not_before"],
            "retry": loads(r["retry"]),
            "resume": r["resume"],
            "checkpointIntervalSeconds": r["checkpoint_interval_seconds"],
            **(loads(r["figures"]) if r["figures"] else {}),
        }



class TaskStore(Database):
    """Tasks for operators (part of :class:`ckagent.devmaster.store.Store`)."""

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
        egress: dict[str, Any] | None = None,
        stop_grace_seconds: float | None = None,
        clean_start: bool = False,
        retry: dict[str, Any] | None = None,
        resume: str | None = None,
        checkpoint_interval_seconds: float | None = None,
    ) -> str:
        """Create a PENDING task from a snapshot of the spider. Returns its id. ``resources`` are merged
        over the spider's (per key); ``stop_signal`` None takes the spider's; ``egress`` (the wire shape)
        replaces the spider's network policy, None takes the spider's; ``stop_grace_seconds`` None takes the
        spider's; ``clean_start``: the task's cleanStart (its spider's data on the node starts empty);
        ``retry`` (the wire's RetryPolicy JSON), ``resume`` and ``checkpoint_interval_seconds``: None takes
        the spider's. The task starts at attempt 1 (its row in task_attempts, PENDING).

        ``env`` is merged over the spider's env; ``timeout_seconds`` None takes the spider's.
        Raises NotFoundError (unknown spider) and ConflictError (the spider has no package yet).
        """
        task_id = new_id()
        with self._tx() as db:
            spider = db.execute("SELECT * FROM spiders WHERE id = ?", (spider_id,)).fetchone()
            if spider is None:
                raise NotFoundError(f"no spider {spider_id!r}")
            if spider["code_version"] is None:
                raise ConflictError(
                    f"spider {spider_id!r} has no code package yet: PUT /api/spiders/{spider_id}/package first"
                )
            merged_env = {**loads(spider["env"]), **env}
            timeout = spider["timeout_seconds"] if timeout_seconds is None else timeout_seconds
            merged_resources = {**(loads(spider["resources"]) if spider["resources"] else {}), **(resources or {})}
            db.execute(
                "INSERT INTO tasks (id, spider_id, spider_name, framework, command, args, env, params,"
                " timeout_seconds, code_version, code_mode, status, created_at, stall_timeout_seconds, resources,"
                " stop_signal, outputs, egress, stop_grace_seconds, clean_start, retry, resume,"
                " checkpoint_interval_seconds, attempt, item_seq_start, log_seq_start)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'PENDING', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 1, 0, 0)",
                (
                    task_id,
                    spider_id,
                    spider["name"],
                    spider["framework"],
                    spider["command"],
                    dumps(args),
                    dumps(merged_env),
                    dumps(params),
                    timeout,
                    spider["code_version"],
                    spider["code_mode"],
                    utc_now_iso(),
                    stall_timeout_seconds,
                    dumps(merged_resources) if merged_resources else None,
                    stop_signal or spider["stop_signal"],
                    spider["outputs"],
                    spider["egress"] if egress is None else dumps(egress),
                    spider["stop_grace_seconds"] if stop_grace_seconds is None else stop_grace_seconds,
                    1 if clean_start else 0,
                    spider["retry"] if retry is None else dumps(retry),
                    spider["resume"] if resume is None else resume,
                    (spider["checkpoint_interval_seconds"] if checkpoint_interval_seconds is None
                     else checkpoint_interval_seconds),
                ),
            )
            ensure_attempt(db, task_id, 1, utc_now_iso())
        return task_id


    def get_task(self, task_id: str) -> dict[str, Any]:
        """One task as admin JSON, with its latest stats snapshot (``stats``, null when none),
        ``finishReason``, its ``attempts`` and newest ``checkpoint`` (store/attempts.py). Raises NotFoundError."""
        def query(db: sqlite3.Connection) -> tuple[sqlite3.Row, dict[str, Any] | None, dict[str, Any]]:
            return task_row(db, task_id), task_stats.latest(db, task_id), attempts_of(db, task_id)

        row, latest, attempts = self._read(query)
        task = {**task_json(row), **attempts}
        reason = (latest or {}).get("stats", {}).get("finishReason") if row["status"] in FINAL_STATUSES else None
        task["stats"] = latest
        task["finishReason"] = reason if isinstance(reason, str) else None
        return task

    def save_stats(self, task_id: str, node_id: str, snapshot: TaskStats) -> bool:
        """Keep a live stats snapshot of a task claimed by ``node_id`` if it is the newest (True).

        Raises NotFoundError (unknown task), ConflictError (another node's or an unclaimed task;
        ``supersededBy`` when the node ran an older attempt of it).
        """
        with self._tx() as db:
            row = task_row(db, task_id)
            check_attempt(db, row, node_id, None)
            if row["node_id"] != node_id:
                raise ConflictError(f"task {task_id!r} is not claimed by this node")
            stored = task_stats.save(db, task_id, snapshot)
        return stored

    def task_stats(self, task_id: str) -> dict[str, Any]:
        """``{"latest", "final", "history"}`` of a task (see ckagent.devmaster.stats). Raises NotFoundError."""
        def query(db: sqlite3.Connection) -> dict[str, Any]:
            task_row(db, task_id)
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
        return [task_json(r) for r in rows]

    def cancel_task(self, task_id: str) -> dict[str, Any]:
        """Operator cancel. PENDING → CANCELLED at once; RUNNING → cancelRequested (the agent reports
        CANCELLED); a final task raises ConflictError. Returns the task as admin JSON.
        """
        with self._tx() as db:
            row = task_row(db, task_id)
            if row["status"] == "PENDING":
                cancel_pending_attempt(db, task_id, int(row["attempt"] or 1), utc_now_iso())
                db.execute(
                    "UPDATE tasks SET status = 'CANCELLED', error_code = 'CANCELLED',"
                    " error_message = 'cancelled before any node claimed it', finished_at = ? WHERE id = ?",
                    (utc_now_iso(), task_id),
                )
            elif row["status"] == "RUNNING":
                db.execute("UPDATE tasks SET cancel_requested = 1 WHERE id = ?", (task_id,))
            else:
                raise ConflictError(f"task {task_id!r} is already {row['status']}")
            return task_json(task_row(db, task_id))

    # ----------------------------------------------------------------------- artifacts (ckagent.devmaster.artifacts)

    def store_artifact(self, task_id: str, node_id: str, path: str, data: bytes, sha256: str) -> dict[str, Any]:
        """Keep one artifact of a task claimed by ``node_id`` (idempotent for the same bytes): a small one
        with its bytes in one transaction, a large one as a synced file first (ckagent.devmaster.artifacts).
        Returns ``{path, sizeBytes, sha256}``. Raises NotFoundError, ConflictError (another node's task,
        or another file at that path), BadRequestError (the bytes do not match ``sha256``)."""
        task_artifacts.check_digest(data, sha256)
        answer: dict[str, Any] = {"path": path, "sizeBytes": len(data), "sha256": sha256}

        def owned(db: sqlite3.Connection) -> None:
            row = task_row(db, task_id)
            check_attempt(db, row, node_id, None)  # a node that ran an older attempt: supersededBy
            if row["node_id"] != node_id:
                raise ConflictError(f"task {task_id!r} is not claimed by this node")

        if len(data) > task_artifacts.INLINE_MAX_BYTES:
            def known(db: sqlite3.Connection) -> str | None:
                owned(db)
                return task_artifacts.recorded(db, task_id, path)

            if self._read(known) != sha256:  # not a resend: the file first, then its record
                task_artifacts.write_blob(self.db_path, data, sha256)
        with self._tx() as db:
            owned(db)
            task_artifacts.record(db, task_id, path, len(data), sha256, utc_now_iso())
            if len(data) <= task_artifacts.INLINE_MAX_BYTES:
                task_artifacts.keep_inline(db, data, sha256)
                self._wrote(len(data))
        return answer

    def list_artifacts(self, task_id: str) -> list[dict[str, Any]]:
        """A task's artifacts ``[{path, sizeBytes, sha256, storedAt}]``. Raises NotFoundError."""
        def read(db: sqlite3.Connection) -> list[dict[str, Any]]:
            task_row(db, task_id)
            return task_artifacts.listing(db, task_id)
        return self._read(read)

    def artifact_bytes(self, task_id: str, path: str) -> bytes | Path:
        """One artifact: its bytes (a small one, kept in the database) or the file holding them.
        Raises NotFoundError."""
        def read(db: sqlite3.Connection) -> bytes | Path:
            sha = task_artifacts.find(db, task_id, path)
            data = task_artifacts.inline_bytes(db, sha)
            return task_artifacts.blob_path(self.db_path, sha) if data is None else data
        return self._read(read)
