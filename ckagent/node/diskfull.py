"""A full disk is a task's failure, not the agent's: recognising it, and the space the agent keeps for its books.

Every write the agent makes on the work dir's filesystem (the state store, a task's log journal,
output.log, the shipped positions) can meet a full disk: ``ENOSPC`` or ``EDQUOT`` from the kernel,
``sqlite3.OperationalError: database or disk is full`` (SQLITE_FULL) from SQLite. :func:`is_disk_full`
tells those apart from other errors, for every writer, in one place.

:class:`SpaceReserve` is a file of ``size_bytes`` real (allocated) bytes in the work dir, made while
there is room. When a write of the state store meets a full disk, the reserve is deleted and the
write tried again: the agent can still record positions and results while it stops the task that
filled the disk (ckagent.delivery.diskwatch), instead of dying on an unhandled error. The reserve is
made again once the free space is back above the floor (:meth:`SpaceReserve.restore`). Its methods
are blocking (a few syscalls) and thread-safe: the state store calls them from its worker threads.

Errors: nothing here raises; a reserve that cannot be made is logged once and simply not there.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

RESERVE_FILE = ".space-reserve"
"""Name of the reserve file in the work dir."""
RESERVE_BYTES = 8 * 1024 * 1024
"""Bytes the reserve holds: many thousands of state store writes (positions, results) and journal records."""
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_SQLITE_FULL = 13  # SQLITE_FULL, the primary result code of "database or disk is full"


def is_disk_full(exc: BaseException) -> bool:
    """True for an error that means "no space left" (ENOSPC, EDQUOT, SQLite's SQLITE_FULL), wherever
    it was raised; False for anything else."""
    if isinstance(exc, OSError):
        return exc.errno in _FULL_ERRNOS
    if isinstance(exc, sqlite3.OperationalError):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None:
            return code & 0xFF == _SQLITE_FULL
        return "database or disk is full" in str(exc)
    return False


class SpaceReserve:
    """The agent's reserve of disk space in ``work_dir`` (see module docstring).

    ``released_at`` is the ``time.monotonic()`` of the last :meth:`release` that freed space (None
    before any): the disk watch reads it to know that the disk was full, at once.
    """

    def __init__(self, work_dir: Path, size_bytes: int = RESERVE_BYTES) -> None:
        self.path = work_dir / RESERVE_FILE
        self.size_bytes = size_bytes
        self.released_at: float | None = None
        self._lock = threading.Lock()
        self._warned = False

    @property
    def held(self) -> bool:
        """True while the reserve file exists with its full size."""
        try:
            return self.path.stat().st_size >= self.size_bytes
        except OSError:
            return False

    def restore(self) -> bool:
        """Make the reserve (allocated bytes, not a sparse file) unless it is there; returns True when it
        is held afterwards. A disk too full for it leaves none (no partial file), logged once."""
        with self._lock:
            if self.held:
                return True
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    _allocate(fd, self.size_bytes)
                finally:
                    os.close(fd)
            except OSError as exc:
                _unlink(self.path)
                if not self._warned:
                    self._warned = True
                    log.warning("cannot keep %d MiB of disk space in reserve at %s (%s); the state store "
                                "has none to fall back on when the disk fills", self.size_bytes // 1024**2,
                                self.path, exc.strerror or exc)
                return False
            self._warned = False
            return True

    def release(self) -> bool:
        """Delete the reserve (the disk is full); returns True when that freed space."""
        with self._lock:
            if not self.path.exists():
                return False
            _unlink(self.path)
            self.released_at = time.monotonic()
            log.error("the work dir's disk is full: released the agent's %d MiB reserve (%s) to keep its state "
                      "store writable", self.size_bytes // 1024**2, self.path)
            return True


def _allocate(fd: int, size: int) -> None:
    """Give ``fd`` ``size`` allocated bytes: posix_fallocate where the filesystem has it, else zeros."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    chunk = b"\0" * (1024 * 1024)
    written = 0
    while written < size:
        written += os.write(fd, chunk[: min(len(chunk), size - written)])


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
