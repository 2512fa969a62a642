"""Retention: a delivered task's directory (and the files kept on the node) go ``task.retention`` seconds
after the master acknowledged its result; never earlier, never outside the tasks directory. A spider's
Scrapy data (ckagent.code.scrapydata) goes when it has had no task here for ``task.retention``."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import trio

from ckagent.code.scrapydata import remove_unused
from ckagent.delivery.outputs import cleanup_kept
from ckagent.node.state import AsyncStateStore

log = logging.getLogger(__name__)


async def retention_loop(store: AsyncStateStore, work_dir: Path, retention: float,
                         busy: Callable[[], set[str]] | None = None) -> None:
    """Every ``retention / 4`` seconds (1 s to 1 h): delete the task directories acknowledged more than
    ``retention`` seconds ago, the files kept on the node as old and the Scrapy data of spiders with no
    task begun here for as long (``busy()``: the safe names of spiders with a task here now: kept).
    Runs until cancelled (nothing to undo)."""
    interval = min(3600.0, max(1.0, retention / 4))
    while True:
        await cleanup_task_dirs(store, work_dir / "tasks", retention)
        # Files kept on the node (over the artifact budget, ...) follow the same retention.
        await trio.to_thread.run_sync(cleanup_kept, work_dir, retention)
        running = busy() if busy is not None else set()  # (read on the loop)
        await trio.to_thread.run_sync(remove_unused, work_dir, retention, running)
        await trio.sleep(interval)


async def cleanup_task_dirs(store: AsyncStateStore, tasks_dir: Path, older_than: float) -> int:
    """Delete the directories of tasks fully acknowledged more than ``older_than`` seconds ago.

    ``older_than`` 0 deletes every acknowledged task's directory (``--cleanup-temp-files`` at start).
    Never touches a task whose result the master has not acknowledged, nor anything outside
    ``tasks_dir``. Returns how many were deleted; errors are logged, not raised.
    """
    cutoff = time.time() - older_than
    deleted = 0
    root = await trio.to_thread.run_sync(tasks_dir.resolve)
    for record in await store.delivered_before(cutoff if older_than > 0 else time.time() + 1):
        target = record.task_dir
        if target.resolve().parent != root:
            log.warning("task %s: not deleting %s (outside %s)", record.task_id, target, tasks_dir)
            await store.forget(record.task_id)
            continue
        try:
            await trio.to_thread.run_sync(_rmtree, target)
        except OSError as exc:
            log.warning("task %s: cannot delete %s: %s", record.task_id, target, exc)
            continue
        await store.forget(record.task_id)
        deleted += 1
    if deleted:
        log.info("deleted %d delivered task director%s", deleted, "y" if deleted == 1 else "ies")
    return deleted


def _rmtree(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
