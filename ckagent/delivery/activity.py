"""A task's signs of life, as the delivery sees them: recorded here, judged by the runner.

Signs of life are: a write to the task's output (stdout/stderr: :meth:`Activity.touch`, called by
the delivery on every write), and a change of its items file or stats file (their modification
time, looked at only when asked). The stall limit itself — ``task.stall_timeout`` (node setting,
``AGENT_TASK_STALL_TIMEOUT``) or the task's ``stallTimeoutSeconds``, off by default — is the
runner's watchdog (ckagent.task.stop.Watchdog), which asks :meth:`Activity.last` when its deadline
comes and stops the task (STALLED) through the task's stop.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import trio


class Activity:
    """The last sign of life of a task (``trio.current_time()`` seconds).

    :meth:`touch` records output now; :meth:`last` also looks at the modification times of
    ``files`` (the task's items and stats files: one ``stat`` each, page cache).
    """

    def __init__(self, files: tuple[Path, ...]) -> None:
        self._files = files
        self._last: float | None = None

    def touch(self) -> None:
        """Output was written just now."""
        self._last = trio.current_time()

    def last(self) -> float:
        """The latest sign of life in Trio's clock (now, when nothing was seen yet)."""
        now = trio.current_time()
        latest = self._last if self._last is not None else now
        wall = time.time()
        for path in self._files:
            try:
                mtime = os.lstat(path).st_mtime  # the spider's file: a symlink is not followed
            except OSError:
                continue
            latest = max(latest, now - max(0.0, wall - mtime))
        if self._last is None:
            self._last = latest
        return latest
