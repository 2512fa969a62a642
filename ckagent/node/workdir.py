"""One agent per work dir: an exclusive lock held for the agent's whole life.

Two agents sharing ``task.work_dir`` would each take the other's running tasks for leftovers of a
crash (crash recovery kills them and reports AGENT_LOST) and share one state store. The first agent
holds ``<work_dir>/agent.lock`` with ``flock(LOCK_EX | LOCK_NB)``; a second one is refused at start
with a message naming the holder's pid. The kernel drops the lock when the holding process ends,
however it ends (SIGKILL included), so a crash never leaves a stale lock behind; the file itself
stays and only carries the last holder's pid for the message.

Exceptions::

    WorkDirError        the work dir cannot be used (message names task.work_dir / AGENT_WORK_DIR)
    └── WorkDirInUse    another live process holds the lock
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "agent.lock"
SETTING = "task.work_dir (AGENT_WORK_DIR)"


class WorkDirError(Exception):
    """The work dir cannot be created, written or locked; the message says which and how to fix it."""


class WorkDirInUse(WorkDirError):
    """Another agent (a live process) holds the work dir's lock."""


class WorkDirLock:
    """The held lock of one work dir (see module docstring). Release with :meth:`release` (or let
    the process end). Blocking calls (mkdir, open, flock): call it before the event loop starts."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, work_dir: Path) -> WorkDirLock:
        """Create ``work_dir`` if needed and lock it for this process.

        Raises WorkDirInUse when another process holds it, WorkDirError when the directory cannot be
        created or the lock file cannot be opened (e.g. a path component is a file, no permission).
        """
        try:
            work_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(work_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise WorkDirError(f"{SETTING} {str(work_dir)!r} cannot be used: {exc.strerror or exc}; "
                               "point it at a directory this user can create and write") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise WorkDirInUse(
                f"{SETTING} {str(work_dir)!r} is in use by another agent ({who}); two agents must not "
                "share a work dir (each would kill the other's tasks as crash leftovers): stop that one "
                "or give this one its own work dir"
            ) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(work_dir, fd)

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _read_pid(fd: int) -> int | None:
    """The pid the holder wrote into the lock file, if readable."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
