"""A file's modifications as the kernel reports them (inotify), without a thread or a poll.

:class:`FileWatch` watches one file (``cgroup.events``, a task's ``output.log``) for modifications,
or a directory for entries that come and go (``mask`` :data:`DIRECTORY_CHANGES`: the registry of
agents' ports). Its inotify
instances are kept for reuse: closing one makes the kernel wait for a grace period of its
read-copy-update machinery before the call returns (10–22 ms measured on this project's 2-core
machine, on the Trio loop, twice per task), while taking a watch off a kept instance
(``inotify_rm_watch``) returns at once. At most :data:`KEPT_INSTANCES` idle instances are kept
(they count against the user's ``fs.inotify.max_user_instances``, 128 by default).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from pathlib import Path

import trio

from ckagent.containment.base import libc

__all__ = ["DIRECTORY_CHANGES", "KEPT_INSTANCES", "FileWatch"]

IN_MODIFY = 0x00000002
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x00000040, 0x00000080, 0x00000100, 0x00000200
DIRECTORY_CHANGES = IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
"""The events of a directory whose entries are made, renamed in or out, or removed."""
IN_IGNORED = 0x00008000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then len bytes of name)

KEPT_INSTANCES = 8
"""Idle inotify instances kept for the next watch (see the module docstring)."""
_kept: list[int] = []
_kept_lock = threading.Lock()  # watches are made and closed on the loop and in worker threads


def _discard_events(fd: int) -> None:
    """Read away whatever is queued on ``fd`` (an instance about to be kept or reused)."""
    while True:
        try:
            if not os.read(fd, 4096):
                return
        except BlockingIOError:
            return


class FileWatch:
    """An inotify watch on one file: ``await changed()`` returns after the kernel reported a
    modification of it (or another of the events in ``mask``). Close it with :meth:`close` (or ``with``); its instance is kept for reuse.

    Raises OSError (with the errno of ``inotify_init1``/``inotify_add_watch``) when the watch cannot
    be set up, e.g. the file does not exist or the user's inotify limits are reached."""

    def __init__(self, path: Path, mask: int = IN_MODIFY) -> None:
        c = libc()
        with _kept_lock:
            fd = _kept.pop() if _kept else -1
        if fd < 0:
            fd = c.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
            if fd < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        wd = c.inotify_add_watch(fd, os.fsencode(path), mask)
        if wd < 0:
            err = ctypes.get_errno()
            self._keep(fd)
            raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}")
        self.fd = fd
        """The inotify instance's descriptor (readable when events are queued); -1 once closed."""
        self._wd, self._mask = wd, mask

    async def changed(self) -> None:
        """Wait for the next modification(s) and consume them. Cancellation: as usual (nothing is
        consumed by a cancelled wait)."""
        while True:
            await trio.lowlevel.wait_readable(self.fd)  # at once when events are already queued
            if self.drain():
                return

    def drain(self) -> bool:
        """Consume the events queued now without waiting; True when one was a modification of the
        watched file (an earlier user's leftovers on a reused instance do not count)."""
        seen = False
        while True:
            try:
                data = os.read(self.fd, 4096)
            except BlockingIOError:
                return seen
            if not data:
                return seen
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                if wd == self._wd and mask & self._mask:
                    seen = True

    def close(self) -> None:
        """Stop watching (idempotent): the watch is taken off and the instance kept for reuse (closed
        when :data:`KEPT_INSTANCES` are kept already). Only after every wait on it has ended."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        libc().inotify_rm_watch(fd, self._wd)
        self._keep(fd)

    @staticmethod
    def _keep(fd: int) -> None:
        _discard_events(fd)
        with _kept_lock:
            if len(_kept) < KEPT_INSTANCES:
                _kept.append(fd)
                return
        os.close(fd)

    def __enter__(self) -> FileWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
