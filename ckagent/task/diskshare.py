"""A task's part in a full disk: what its use is measured over, its judgement at its end, and the
removal of a blamed task's scratch once its result is recorded (the rules: ckagent.delivery.diskwatch).

- :func:`accounted_of`: its task dir, working copy and spider's data dir; its own limit
  (``resources.diskBytes``, else the node's ``task.disk_limit_bytes``);
- :func:`judge_end` (on the loop, from the runner's end hop): a task that filled the disk too fast for
  the outbox's looks and has exited is blamed here, before its result (FAILED DISK_FULL);
- :func:`reclaim_if_blamed`: its working copy, its data dir (less ``outputs/``) and the files of its
  task dir that are not the spool removed, with one agent log line, so the node recovers by itself.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import trio

from ckagent.code.workcopy import spider_paths
from ckagent.delivery.diskwatch import (
    Accounted,
    DiskWatch,
    accounted_bytes,
    reclaim_scratch,
    release_spool_headroom,
)
from ckagent.master.ids import task_dir as task_dir_of
from ckagent.master.protocol import Task
from ckagent.task.admission import RunningTask
from ckagent.task.runconfig import RunnerConfig
from ckagent.task.stop import StopReason

log = logging.getLogger(__name__)


def accounted_of(config: RunnerConfig, task: Task, work: Path) -> Accounted:
    """What the task's disk use is measured over: its task dir, its working copy ``work``, its spider's
    data dir; its own limit (bytes; None = none). Pure."""
    data_dir, _home = spider_paths(config.work_dir, task.spider_id)
    limit = task.resources.disk_bytes if task.resources.disk_bytes is not None else config.default_disk_bytes
    return Accounted((task_dir_of(config.work_dir, task.id), work, data_dir), limit)


def measure_end(accounted: Accounted, work_dir: Path) -> tuple[int, int | None]:
    """At the task's end, its processes gone: the blocks held beyond its appended spool files given
    back, then (its accounted use, the free bytes of the work dir's filesystem; None when unknown).
    Blocking (the runner's end hop)."""
    release_spool_headroom(accounted.paths[0])
    used = accounted_bytes(accounted)
    try:
        return used, shutil.disk_usage(work_dir).free
    except OSError:
        return used, None


def judge_end(watch: DiskWatch, rt: RunningTask, used_bytes: int, free_bytes: int | None) -> bool:
    """Whether the ended task is blamed for a full disk (:meth:`DiskWatch.judge_end`, with its use and
    the free space measured in the end hop). A task nothing else stopped is stopped DISK_FULL now
    (its result says so whatever its exit status); one stopped for another reason first keeps that
    reason and is not blamed. On the Trio thread; never raises."""
    if rt.stop.reason is StopReason.DISK_FULL:
        return True
    reason = watch.judge_end(rt.task.id, used_bytes, free_bytes)
    if reason is None:
        return False
    if rt.stop.reason is None:
        log.error("task %s: %s; it has exited already: FAILED (DISK_FULL)", rt.task.id, reason)
        rt.stop.request(StopReason.DISK_FULL, reason)
        return True
    watch.reclaimed(rt.task.id)  # stopped for another reason first: that one stands
    return False


async def reclaim_if_blamed(watch: DiskWatch, config: RunnerConfig, work: Path, rt: RunningTask) -> None:
    """After the result of a task blamed for a full disk (FAILED DISK_FULL) is recorded: remove its
    scratch (ckagent.delivery.diskwatch.reclaim_scratch: its working copy ``work``, its spider's data
    dir less ``outputs/``, the files of its task dir that are not the spool — its log journal's
    sources stay) with one log line saying what and how much, so the node recovers by itself; the
    watch then stops counting those bytes as coming back. Nothing for any other task. Shielded (one
    thread hop); never raises."""
    task = rt.task
    if rt.stop.reason is not StopReason.DISK_FULL and watch.blamed(task.id) is None:
        return
    keep = set(rt.delivery.journal.paths.values()) if rt.delivery is not None else set()
    with trio.CancelScope(shield=True):  # noqa: ASYNC912 - shielded cleanup
        try:
            removed, freed = await trio.to_thread.run_sync(reclaim_scratch, accounted_of(config, task, work), keep)
        except Exception:  # a task's files never end the agent
            log.exception("task %s: cannot remove its scratch after DISK_FULL", task.id)
            removed, freed = [], 0
        finally:
            watch.reclaimed(task.id)
    log.warning("task %s: its result (FAILED DISK_FULL) is recorded; removed its scratch to free the disk: %s "
                "(%.1f MiB freed); its log, items and artifacts stay until delivered",
                task.id, ", ".join(removed) or "nothing was left", freed / 1024**2)
