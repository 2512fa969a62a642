"""The stall watchdog: a task that shows no sign of life for ``stall_timeout`` seconds is stopped (STALLED).

Signs of life are: a write to the task's output (stdout/stderr), and a change of its items file or
stats file (their modification time). ``task.stall_timeout`` (node setting, ``AGENT_TASK_STALL_TIMEOUT``)
or the task's ``stallTimeoutSeconds`` set the limit; 0 turns it off, and it is off by default: the
task's run-time limit (``task.execute_timeout``, 1 h by default) already bounds a hang, and only
the operator knows how quiet a legitimate crawl may be. Turn it on for long crawls (an hour is a
good start: Zyte cancels a job as "stalled" after an hour without logs, requests or items).

The watchdog sleeps until the deadline ``last sign of life + timeout`` and then looks again; it
wakes at most once per ``timeout`` of activity, never polls. When the deadline has really passed,
the task is stopped the graceful way (SIGTERM to the main process, grace, kill), like a
cancellation, and reported FAILED with errorCode STALLED.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
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


async def watch_stall(stall_timeout: float, last_activity: Callable[[], float], ended: trio.Event,
                      on_stall: Callable[[float], None]) -> None:
    """Call ``on_stall(idle_seconds)`` once when ``last_activity()`` is ``stall_timeout`` seconds old;
    return then, or when ``ended`` is set. ``stall_timeout`` <= 0 only waits for ``ended``.

    Cancellation: returns nothing, calls nothing.
    """
    if stall_timeout <= 0:
        await ended.wait()
        return
    while not ended.is_set():
        last = last_activity()
        deadline = last + stall_timeout
        now = trio.current_time()
        if now >= deadline:
            on_stall(now - last)
            return
        with trio.move_on_at(deadline):
            await ended.wait()
