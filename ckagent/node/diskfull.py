"""A full disk is a task's failure, not the agent's: recognising it, and space the agent owns beforehand.

Every write the agent makes on the work dir's filesystem (the state store, a task's log journal,
output.log's notices, the shipped positions) can meet a full disk: ``ENOSPC`` or ``EDQUOT`` from the
kernel, ``sqlite3.OperationalError: database or disk is full`` (SQLITE_FULL) from SQLite.
:func:`is_disk_full` tells those apart from other errors, for every writer, in one place.

**Space owned beforehand, not a race.** A spare file deleted when the disk is full frees bytes that
a spider writing at the same moment takes as well as the agent (the burst that filled the disk is
still writing). So the agent's writes that must go on through a full disk go into blocks that
*already belong to the file they write*, where no other process can take them:

- **the state store** keeps free pages of its own (:data:`STORE_RESERVE_BYTES`): SQLite reuses
  pages on its freelist before it grows the file (``auto_vacuum`` off), and its write-ahead log
  is never truncated while the agent runs (``journal_size_limit = -1``): after a checkpoint the
  next transaction writes over the log's existing frames. :func:`grow_store_reserve` pre-grows
  both (a blob of that size written and deleted in one go, while there is room) and grows them
  back when the freelist has been used (ckagent.node.state.StateStore.keep_reserve);
- **a task's spool files that are appended to** (output.log, items.jsonl, the log journals) get
  blocks allocated beyond their end (:func:`preallocate`, ``fallocate(FALLOC_FL_KEEP_SIZE)``; the
  file's size does not change): an append lands in them without asking the filesystem for space,
  so the spider's own ``write`` to its stdout or items file and the agent's journal records go on
  while another task holds the rest of the disk. :func:`release_beyond` gives them back at the
  task's end.

Where the filesystem cannot preallocate (``EOPNOTSUPP``) nothing is held and the writers fall back
on keeping what they could not write in memory (docs/operations.md, "When the disk fills").
Nothing here raises unless said so.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)

STORE_RESERVE_BYTES = 4 * 1024 * 1024
"""Free pages (bytes) the state store keeps: many thousands of positions and results."""
SPOOL_HEADROOM_BYTES = 1024 * 1024
"""Bytes allocated beyond the end of a running task's output.log and items.jsonl."""
JOURNAL_HEADROOM_BYTES = 64 * 1024
"""Bytes allocated beyond the end of a running task's log journal (records are ~20 bytes)."""
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_SQLITE_FULL = 13  # SQLITE_FULL, the primary result code of "database or disk is full"
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


OLD_RESERVE_FILE = ".space-reserve"
"""The spare file earlier agents kept in the work dir (8 MiB): removed at start (:func:`remove_old_reserve`)."""


def remove_old_reserve(work_dir: Path) -> None:
    """Remove the spare file an earlier agent kept in ``work_dir`` (its space is the disk's again). Blocking;
    never raises."""
    with contextlib.suppress(OSError):
        os.unlink(work_dir / OLD_RESERVE_FILE)


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


def _libc_fallocate() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        func = libc.fallocate
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    func.restype = ctypes.c_int
    return func


_fallocate = _libc_fallocate()


def _call(fd: int, mode: int, offset: int, length: int) -> None:
    if _fallocate is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available")
    if _fallocate(fd, mode, offset, length) != 0:  # type: ignore[operator]
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def preallocate(fd: int, headroom_bytes: int) -> int:
    """Allocate ``headroom_bytes`` beyond the end of the open file ``fd`` without changing its size
    (``FALLOC_FL_KEEP_SIZE``; already allocated blocks stay as they are). Returns the bytes held
    beyond the end afterwards (0: the filesystem cannot, or has no room for them now — an all or
    nothing call, so a full disk leaves what was held). Blocking (one or two system calls)."""
    try:
        size = os.fstat(fd).st_size
        _call(fd, _FALLOC_FL_KEEP_SIZE, size, headroom_bytes)
    except OSError as exc:
        if exc.errno not in (*_FULL_ERRNOS, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF,
                             errno.ENODEV, errno.EPERM):
            log.debug("cannot preallocate beyond the end of fd %d: %s", fd, exc)
        return 0
    return headroom_bytes


def release_beyond(fd: int) -> None:
    """Give back the blocks allocated beyond the end of the open file ``fd`` (:func:`preallocate`):
    the file cut to its own size (ext4 and tmpfs free what lies beyond then), else a hole punched
    past its end. Only when no other process writes the file any more (a concurrent append between
    the size read and the cut would be cut). Blocking; never raises."""
    try:
        st = os.fstat(fd)
        if st.st_blocks * 512 - st.st_size <= 4096:
            return
        os.ftruncate(fd, st.st_size)
        st = os.fstat(fd)
        beyond = st.st_blocks * 512 - st.st_size
        if beyond > 4096:
            _call(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, st.st_size, beyond + (1 << 20))
    except OSError as exc:
        log.debug("cannot release the blocks beyond the end of fd %d: %s", fd, exc)


def grow_store_reserve(db: sqlite3.Connection, target_bytes: int = STORE_RESERVE_BYTES) -> int:
    """Make the SQLite database ``db`` (WAL mode, autocommit) hold at least ``target_bytes`` of free
    pages of its own, and its write-ahead log as many bytes of frames, when it holds less than half
    of that: a blob of ``target_bytes`` is inserted and deleted (two transactions). Returns the free
    bytes it holds afterwards. Raises sqlite3.Error (SQLITE_FULL: no room for it now — nothing is
    left half done: the insert is rolled back). Blocking; the caller serialises use of ``db``."""
    page = int(db.execute("PRAGMA page_size").fetchone()[0])
    held = int(db.execute("PRAGMA freelist_count").fetchone()[0]) * page
    if held * 2 >= target_bytes:
        return held
    db.execute("CREATE TABLE IF NOT EXISTS space_reserve (blob BLOB)")
    chunk = 256 * 1024
    try:
        db.execute("BEGIN")
        db.executemany("INSERT INTO space_reserve (blob) VALUES (zeroblob(?))",
                       [(chunk,)] * max(1, -(-target_bytes // chunk)))
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("DELETE FROM space_reserve")
    return int(db.execute("PRAGMA freelist_count").fetchone()[0]) * page


class StoreReserve:
    """The state store's own free pages (module docstring): :meth:`keep` grows them back; a disk too
    full for it is logged once (until it succeeds). ``held_bytes``: the bytes held at the last keep."""

    def __init__(self, path: object) -> None:
        self.path = path
        self.held_bytes = 0
        self._warned = False

    def keep(self, db: sqlite3.Connection, target_bytes: int = STORE_RESERVE_BYTES) -> int:
        """:func:`grow_store_reserve` on ``db`` (the caller holds its lock); returns the bytes held.
        Never raises (an sqlite3.Error leaves what there is, logged once)."""
        try:
            self.held_bytes = grow_store_reserve(db, target_bytes)
        except sqlite3.Error as exc:
            if not self._warned:
                self._warned = True
                log.warning("the state store %s cannot keep %d MiB of free pages of its own (%s); its writes on "
                            "a full disk may fail until there is room", self.path, target_bytes // 1024**2, exc)
            return self.held_bytes
        self._warned = False
        return self.held_bytes
