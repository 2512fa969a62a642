"""Capture: the spider's pipes into output.log, within the log budget (LogSink); the free-space figure (DiskGuard).

See the package docstring (ckagent.delivery) for the whole design.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import trio

from ckagent.delivery.spool import open_spool
from ckagent.node.diskfull import SPOOL_HEADROOM_BYTES, is_disk_full, preallocate

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- capture


class DiskGuard:
    """Free space of the filesystem holding ``path`` (bytes), refreshed by :meth:`refresh`.

    The status page and the intake read it; nothing is dropped for it (output.log is never cut at the
    floor: a full disk is the writer's problem, ckagent.delivery.diskwatch). ``min_free_bytes`` 0
    disables the floor of :meth:`allows`.
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


PENDING_MAX_BYTES = 4 * 1024 * 1024
"""Bytes of the agent's own writes to output.log (installer output, notices) kept in memory while the
disk is full; beyond them the rest is dropped and counted (the marker line says so)."""
LATE_NOTICES = 20
"""Agent notices kept past the log budget and written after the truncation marker."""
LOG_CUT_SLACK_BYTES = 1 << 20
"""Bytes past the log budget gathered before output.log is cut back (see LogSink.grown)."""


class LogSink:
    """Appends the spider's stdout/stderr bytes to ``output.log`` as they arrive (never blocks on the network).

    Writes are plain ``os.write`` calls on an O_APPEND descriptor: page-cache writes of pipe-sized
    chunks take microseconds, so the pipe readers never wait on a thread hop. ``on_write`` is called
    after every write. Log budget: once the file would exceed ``max_bytes`` (0 = no limit), or a write
    fails for another reason than a full disk (EIO...), later bytes are counted and dropped;
    :meth:`close` then appends one marker line with the count. A full disk drops nothing: what could
    not be written waits in memory (at most PENDING_MAX_BYTES) and is written, in order, at the next
    write or look (:meth:`grown`, :meth:`retry`). The spider's own writes (its stdout and stderr are
    this file) land in the blocks held beyond the end (``headroom``, ckagent.node.diskfull.preallocate),
    allocated when it opens and topped up by the outbox's looks; given back once the spider is gone
    (ckagent.delivery.diskwatch.release_spool_headroom, in the runner's end hop).
    ``size`` is the file's size (bytes), ``dropped_bytes`` what was not written.

    Raises OSError only from the constructor (the file cannot be created).
    """

    def __init__(
        self,
        path: Path,
        on_write: Callable[[], None] | None = None,
        *,
        max_bytes: int = 0,
        headroom: int = SPOOL_HEADROOM_BYTES,
    ) -> None:
        self.path = path
        self._fd = open_spool(path, os.O_RDWR | os.O_CREAT | os.O_APPEND)  # read: the last byte (grown)
        self.size = os.fstat(self._fd).st_size
        self.headroom = headroom
        if headroom:
            preallocate(self._fd, headroom)
        self._on_write = on_write
        self._max = max_bytes
        self._pending = bytearray()  # the agent's bytes a full disk refused (written before any later byte)
        self._agent_drop: str | None = None  # why bytes of the agent's own were dropped (a long full disk)
        self.full_since: float | None = None
        """``time.monotonic()`` since when a write of the agent's met a full disk (None: none waits)."""
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
        """Append ``data`` (as much as the budget allows; the rest is counted as dropped). On a full
        disk the bytes wait in memory for the next try (class docstring)."""
        if self._fd < 0:
            return
        if self.truncated is not None:
            self.dropped_bytes += len(data)
            return
        if self._pending and not self.retry():
            self._keep(data)
            return
        self._append(data)

    def fileno(self) -> int:
        """The open descriptor of output.log (-1 once closed): the outbox tops up its headroom."""
        return self._fd

    def retry(self) -> bool:
        """Write what a full disk refused earlier; True when nothing waits any more."""
        if not self._pending or self._fd < 0:
            return True
        data, self._pending = bytes(self._pending), bytearray()
        self._append(data)
        if not self._pending:
            self.full_since = None
        return not self._pending

    def _keep(self, data: bytes | bytearray) -> None:
        room = max(0, PENDING_MAX_BYTES - len(self._pending))
        self._pending += data[:room]
        if len(data) > room:
            self.dropped_bytes += len(data) - room
            if self._agent_drop is None:  # the agent's own bytes only: the spider's output is not cut for it
                self._agent_drop = (f"the disk was full and more than {PENDING_MAX_BYTES} bytes of the agent's "
                                    "own output waited for room")
                log.warning("%s: output truncated: %s", self.path, self._agent_drop)

    def _append(self, data: bytes | bytearray) -> None:
        n = len(data)
        allowed = n
        reason = None
        if self._max and self.size + n > self._max:
            allowed = max(0, self._max - self.size)
            reason = f"the task's log budget of {self._max} bytes (task.max_log_bytes) was reached"
        written = 0
        full = False
        if allowed:
            view = memoryview(data)[:allowed]
            try:
                while view:
                    k = os.write(self._fd, view)
                    view = view[k:]
                    written += k
            except OSError as exc:
                if is_disk_full(exc):
                    full = True
                else:
                    reason = f"writing output.log failed: {exc.strerror or exc}"
        if written:
            self.size += written
            self._seen = max(self._seen, self.size)
            self.bytes_written += written
            self._ends_line = data[written - 1] == 0x0A
        if full:
            if self.full_since is None:
                self.full_since = time.monotonic()
                log.warning("%s: the disk is full: the agent's output waits in memory for room", self.path)
            self._keep(memoryview(data)[written:allowed].tobytes())
            written = allowed
        if written < n:
            self.dropped_bytes += n - written
            self.truncated = reason or "output dropped"
            log.warning("%s: output truncated: %s", self.path, self.truncated)
        if self._on_write is not None:
            self._on_write()

    def grown(self, final: bool = False) -> int:
        """Take in what others appended to ``output.log`` since the last look: the spider writes there
        itself (its stdout and stderr are this file, see ckagent.containment.monitor). Within the budget the bytes
        count as written; past ``max_bytes`` the file is cut back (ftruncate to the budget) and the
        cut bytes are counted as dropped (never for a low or full disk). The agent's own bytes a full
        disk refused are written first (:meth:`retry`).

        Past the budget the cut waits until :data:`LOG_CUT_SLACK_BYTES` have
        gathered beyond it, or for the last look (``final``, when the spider is gone): a cut is not
        atomic with the size it counts, and a write the spider makes between the two system calls
        would be cut uncounted — rare cuts make that rare (a spider that floods stops racing a cut on
        every look), and the last cut, with no writer left, counts exactly. The disk holds at most
        the budget + that slack. Returns how many new bytes were found (0: none). Never raises.
        """
        if self._fd < 0:
            return 0
        if self._pending:
            self.retry()
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
        if keep < new and self.truncated is None:
            self.truncated = reason or "output dropped"
            self._cut_waits = reason is not None and "task.max_log_bytes" in reason
            log.warning("%s: output truncated: %s", self.path, self.truncated)
        if keep:
            self.size += keep
            self.bytes_written += keep
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
        if self._pending and not self.retry():  # the disk is still full at the end: counted, said if it can be
            self.dropped_bytes += len(self._pending)
            self._agent_drop = self._agent_drop or "the disk was still full when the task's log was closed"
            self._pending = bytearray()
        if self.dropped_bytes:
            stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            marker = (f"{'' if self._ends_line else chr(10)}[ckagent {stamp}] output truncated: "
                      f"{self.dropped_bytes} bytes dropped because {self.truncated or self._agent_drop}\n").encode()
            marker += b"".join(self._late_notices)
            try:
                os.write(self._fd, marker)
                self.size += len(marker)
            except OSError as exc:
                log.error("%s: cannot write the truncation marker: %s", self.path, exc)
        os.close(self._fd)  # (the blocks beyond its end: given back once the spider is gone, in the runner's end hop)
        self._fd = -1
        if self._on_write is not None:
            self._on_write()
