"""Crash recovery: what the agent does at start for tasks that were running when it died.

Before registering (no master needed): tasks whose spider still runs (or ended and recorded its
exit status) are re-adopted (ckagent.task.adoption) and left alone here. For every other task of the
state store without a final result: kill what is left of its process group and every process
carrying its marker, append a note to its log saying why it could not be re-adopted, and store
FAILED/AGENT_LOST. The outbox then delivers the rest of its logs and items and that result, once
the master answers.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import trio

from ckagent.containment import Containment
from ckagent.containment.process import sweep
from ckagent.delivery.lifecycle import Lifecycle, TaskLost
from ckagent.delivery.spool import open_spool
from ckagent.master.protocol import TaskResult, utc_iso, utc_now_iso
from ckagent.node.state import AsyncStateStore, TaskRecord
from ckagent.task.outcome import cause_fields

log = logging.getLogger(__name__)


async def recover_lost_tasks(store: AsyncStateStore,
                             lifecycle: Lifecycle | None = None,
                             containment: Containment | None = None,
                             keep: Collection[str] = (),
                             reasons: Mapping[str, str] | None = None) -> list[TaskRecord]:
    """At start, before registering: kill leftovers of tasks that ran when the agent died, note it in
    their logs, and store their AGENT_LOST results (the outbox delivers them after registering).
    Each such task's TaskLost record goes to ``lifecycle`` (metrics: a finished task like any other).

    A recorded process group is only killed when one of its members still carries the task's
    marker (after a reboot the number may belong to someone else); marked processes always are.
    With ``containment``, the task's cgroup is killed first (whatever its processes did to their
    session or environment), then stale task cgroups of this agent are emptied and removed.
    ``keep``: ids of re-adopted tasks (neither killed nor listed); ``reasons``: why a task could not
    be re-adopted (into its log note and result). Returns the tasks left to deliver (``keep`` excluded).
    """
    records = await store.pending_delivery()
    boot_time = await trio.to_thread.run_sync(psutil.boot_time)
    for record in records:
        if record.result is not None or record.task_id in keep:
            continue
        why = (reasons or {}).get(record.task_id)
        pgid = record.pgid if record.claimed_at >= boot_time else None
        with trio.CancelScope(shield=True):  # quick, and must finish even if a signal arrives
            killed = 0 if containment is None else max(0, await containment.recover(record.task_id, pgid))
            killed += await sweep(record.task_id, pgid, verify_group=True)
        log.warning("task %s was running when the agent stopped; killed %d leftover process(es); "
                    "reporting AGENT_LOST%s", record.task_id, killed, f" ({why})" if why else "")
        now = time.time()
        stamp = datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        note = (f"[ckagent {stamp}] the agent stopped while this task ran (crash, kill -9, OOM or power "
                f"loss); on restart it killed {killed} leftover process(es); task FAILED (AGENT_LOST)"
                f"{f': not re-adopted because {why}' if why else ''}\n")
        await trio.to_thread.run_sync(_append, record.task_dir / "output.log", note.encode())
        result = TaskResult(
            status="FAILED", error_code="AGENT_LOST",
            error_message="the agent stopped while the task ran (crash, kill or power loss)"
                          + (f"; not re-adopted: {why}" if why else ""),
            started_at=utc_iso_from(record.claimed_at), finished_at=utc_now_iso(),
            duration_ms=int((now - record.claimed_at) * 1000),
            attempt=recorded_attempt(record.task_json), **cause_fields("AGENT_LOST"),
        )
        await store.set_result(record.task_id, result.to_json())
        if lifecycle is not None:
            lifecycle.emit(TaskLost(record.task_id, result))
    if containment is not None:
        with trio.CancelScope(shield=True):
            stale = await containment.sweep_stale(keep=set(keep))
        if stale:
            log.warning("removed %d stale task cgroup(s) of an earlier run", stale)
    return [record for record in await store.pending_delivery() if record.task_id not in keep]


def recorded_attempt(task_json: dict[str, Any]) -> int | None:
    """The ``attempt`` of a task as the state store recorded it (None: absent, or not an integer ≥ 1)."""
    value = task_json.get("attempt") if isinstance(task_json, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _append(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path``, a task's output.log (blocking); a missing task directory is not an
    error. The task dir is the spider's: a link or a FIFO planted at the name is neither followed (as
    root, the note would land in a file of the spider's choosing) nor waited on (the start would hang):
    the note is left out then (logged)."""
    try:
        fd = open_spool(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    except FileNotFoundError:
        return
    except OSError as exc:
        log.warning("%s: cannot add the recovery note to %s: %s", path.parent.name, path.name, exc)
        return
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # the spider's last line was cut by the crash
            data = b"\n" + data
        os.write(fd, data)
    finally:
        os.close(fd)


def utc_iso_from(epoch: float) -> str:
    """Epoch seconds → protocol timestamp."""
    return utc_iso(datetime.fromtimestamp(epoch, timezone.utc))
