"""Capture: the spider's pipes into output.log, within the disk budget (DiskGuard, LogSink).

See the package docstring (ckagent.delivery) for the whole design.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import trio

from ckagent.delivery.spool import open_spool

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- capture


class DiskGuard:
    """Free space of the filesystem holding ``path`` (bytes), refreshed by :meth:`refresh`.

    Writers call :meth:`allows` before and :meth:`consumed` after writing, so the estimate follows
    fast writers between refreshes. ``min_free_bytes`` 0 disables the floor.
    """

    def __init__(self, path: Path, min_free_bytes: int) -> None:
        self.path = path
        self.min_free_bytes = min_free_bytes
        self.free_bytes: int | None = None
        self.measured_at: float | None = None
        """``trio.current_time()`` of the last figure measured (None: never)."""

    def allows(self, size: int) -> bool:
        """True if writing ``size`` more bytes keeps the free space at or above the floor."""
        if not self.min_free_bytes or self.free_bytes is None:
            return True
        return self.free_bytes - size >= self.min_free_bytes

    def consumed(self, size: int) -> None:
        """``size`` bytes were written."""
        if self.free_bytes is not None:
            self.free_bytes -= size

    async def refresh(self) -> None:
        """Measure the free space again (in a worker thread). OSError leaves the last figure."""
        self.measured(await trio.to_thread.run_sync(self.measure))

    def measure(self) -> int | None:
        """The free bytes now, or None when they cannot be measured (logged). Blocking: in a hop the
        caller makes anyway, then :meth:`measured` on the loop."""
        try:
            return shutil.disk_usage(self.path).free
        except OSError as exc:
            log.debug("cannot measure free space of %s: %s", self.path, exc)
            return None

    def measured(self, free: int | None) -> None:
        """Take what :meth:`measure` returned (None leaves the last figure). On the Trio thread."""
        if free is not None:
            self.free_bytes = free
            self.measured_at = trio.current_time()


LATE_NOTICES = 20
"""Agent notices kept past the log budget and written after the truncation marker."""
LOG_CUT_SLACK_BYTES = 1 << 20
"""Bytes past the log budget gathered before output.log is cut back (see LogSink.grown)."""


class LogSink:
    """Appends the spider's stdout/stderr bytes to ``output.log`` as they arrive (never blocks on the network).

    Writes are plain ``os.write`` calls on an O_APPEND descriptor: page-cache writes of pipe-sized
    chunks take microseconds, so the pipe readers never wait on a thread hop. ``on_write`` is called
    after every write. Disk budget: once the file would exceed ``max_bytes`` (0 = no limit), or the
    ``guard`` says the free-space floor is reached, or a write fails (ENOSPC, EIO...), later bytes
    are counted and dropped; :meth:`close` then appends one marker line with the count.
    ``size`` is the file's size (bytes), ``dropped_bytes`` what was not written.

    Raises OSError only from the constructor (the file cannot be created).
    """

    def __init__(
        self,
        path: Path,
        on_write: Callable[[], None] | None = None,
        *,
        max_bytes: int = 0,
        guard: DiskGuard | None = None,
    ) -> None:
        self.path = path
        self._fd = open_spool(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)  # read: the last byte (grown)
        self.size = os.fstat(self._fd).st_size
        self._on_write = on_write
        self._max = max_bytes
        self._guard = guard
        self.bytes_written = 0
        self.dropped_bytes = 0
        self.truncated: str | None = None  # why output is being dropped
        self._seen = self.size  # the file's end at the last look (beyond ``size``: dropped bytes not cut yet)
        self._cut_waits = False  # past the budget: bytes beyond it are cut when LOG_CUT_SLACK_BYTES gathered
        self._ends_line = True
        if self.size:  # an output.log a spider went on writing while no agent ran (re-adoption)
            with contextlib.suppress(OSError):
                self._ends_line = os.pread(self._fd, 1, self.size - 1) == b"\n"
        self._late_notices: list[bytes] = []

    def write(self, data: bytes | bytearray) -> None:
        """Append ``data`` (as much as the budget allows; the rest is counted as dropped)."""
        if self._fd < 0:
            return
        n = len(data)
        if self.truncated is not None:
            self.dropped_bytes += n
            return
        allowed = n
        reason = None
        if self._max and self.size + n > self._max:
            allowed = max(0, self._max - self.size)
            reason = f"the task's log budget of {self._max} bytes (task.max_log_bytes) was reached"
        if allowed and self._guard is not None and not self._guard.allows(allowed):
            allowed = 0
            reason = (f"free disk space fell below {self._guard.min_free_bytes} bytes "
                      "(task.min_free_disk_bytes)")
        written = 0
        if allowed:
            view = memoryview(data)[:allowed]
            try:
                while view:
                    k = os.write(self._fd, view)
                    view = view[k:]
                    written += k
            except OSError as exc:
                reason = f"writing output.log failed: {exc.strerror or exc}"
        if written:
            self.size += written
            self.bytes_written += written
            self._ends_line = data[written - 1] == 0x0A
            if self._guard is not None:
                self._guard.consumed(written)
        if written < n:
            self.dropped_bytes += n - written
            self.truncated = reason or "output dropped"
            log.warning("%s: output truncated: %s", self.path, self.truncated)
        if self._on_write is not None:
            self._on_write()

    def grown(self, final: bool = False) -> int:
        """Take in what others appended to ``output.log`` since the last look: the spider writes there
        itself (its stdout and stderr are this file, see ckagent.containment.monitor). Within the budget the bytes
        count as written; past ``max_bytes`` or the free-space floor the file is cut back (ftruncate
        to the budget) and the cut bytes are counted as dropped.

        Past the budget (not the disk floor) the cut waits until :data:`LOG_CUT_SLACK_BYTES` have
        gathered beyond it, or for the last look (``final``, when the spider is gone): a cut is not
        atomic with the size it counts, and a write the spider makes between the two system calls
        would be cut uncounted — rare cuts make that rare (a spider that floods stops racing a cut on
        every look), and the last cut, with no writer left, counts exactly. The disk holds at most
        the budget + that slack. Returns how many new bytes were found (0: none). Never raises.
        """
        if self._fd < 0:
            return 0
        try:
            end = os.fstat(self._fd).st_size
        except OSError:
            return 0
        new = end - self.size
        if new <= 0:
            return 0
        fresh = end - max(self.size, self._seen)  # not seen by an earlier look (the cut may wait)
        self._seen = max(self._seen, end)
        keep = new
        reason = None
        if self.truncated is not None:
            keep = 0
        elif self._max and end > self._max:
            keep = max(0, self._max - self.size)
            reason = f"the task's log budget of {self._max} bytes (task.max_log_bytes) was reached"
        if keep and self.truncated is None and self._guard is not None and not self._guard.allows(keep):
            keep = 0
            reason = (f"free disk space fell below {self._guard.min_free_bytes} bytes "
                      "(task.min_free_disk_bytes)")
        if keep < new and self.truncated is None:
            self.truncated = reason or "output dropped"
            self._cut_waits = reason is not None and "task.max_log_bytes" in reason  # the disk floor: cut now
            log.warning("%s: output truncated: %s", self.path, self.truncated)
        if keep:
            self.size += keep
            self.bytes_written += keep
            if self._guard is not None:
                self._guard.consumed(keep)
            with contextlib.suppress(OSError):
                self._ends_line = os.pread(self._fd, 1, self.size - 1) == b"\n"
        over = new - keep
        if over and (final or not self._cut_waits or over >= LOG_CUT_SLACK_BYTES):
            try:
                # Look again just before the cut: what the spider wrote since the first look is cut too.
                with contextlib.suppress(OSError):
                    over = max(over, os.fstat(self._fd).st_size - self.size)
                os.ftruncate(self._fd, self.size)
            except OSError as exc:  # cannot cut: the bytes stay, and count as written
                log.warning("%s: cannot cut the log back to its budget: %s", self.path, exc)
                self.size += over
                self.bytes_written += over
            else:
                self.dropped_bytes += over
            self._seen = self.size
        if fresh > 0 and self._on_write is not None:
            self._on_write()
        return max(fresh, 0)

    def write_line(self, data: bytes) -> None:
        """Append one line of the agent's own (a notice): on a line of its own even when the spider's
        output so far ends without a newline. Counts against the budget like the spider's output;
        once output is being dropped, notices are kept (at most LATE_NOTICES) and written after the
        truncation marker, so the log still says how the task ended."""
        self.grown()  # the spider's own writes first: the notice lands after them, on a line of its own
        if self.truncated is not None:
            if len(self._late_notices) < LATE_NOTICES:
                self._late_notices.append(data[:4096])
            return
        self.write(data if self._ends_line else b"\n" + data)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (nothing more is written)."""
        return self._fd < 0

    def close(self) -> None:
        """Write the truncation marker (if output was dropped), close the file (idempotent)."""
        if self._fd < 0:
            return
        self.grown(final=True)
        if self.dropped_bytes:
            stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            marker = (f"{'' if self._ends_line else chr(10)}[ckagent {stamp}] output truncated: "
                      f"{self.dropped_bytes} bytes dropped because {self.truncated}\n").encode()
            marker += b"".join(self._late_notices)
            try:
                os.write(self._fd, marker)
                self.size += len(marker)
            except OSError as exc:
                log.error("%s: cannot write the truncation marker: %s", self.path, exc)
        os.close(self._fd)
        self._fd = -1
        if self._on_write is not None:
            self._on_write()
