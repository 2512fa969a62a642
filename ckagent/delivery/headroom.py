"""Blocks held beyond the ends of a running task's appended spool files (ckagent.node.diskfull): the
outbox's disk loop tops them up at every look (:func:`headroom_fds` on the Trio thread, :func:`top_up`
in its thread hop); the task's delivery gives them back when its process is over, under the same
lock (:class:`Headroom`, ``Spooled.headroom``), so no look holds them again after.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from ckagent.delivery.diskwatch import release_spool_headroom
from ckagent.delivery.spool import ITEMS_FILE, open_spool
from ckagent.node.diskfull import JOURNAL_HEADROOM_BYTES, SPOOL_HEADROOM_BYTES, preallocate


class _Open(Protocol):
    def fileno(self) -> int: ...


class Spooled(Protocol):
    """What of a task's delivery (ckagent.delivery.taskdelivery.TaskDelivery) the top-up reads."""

    @property
    def task_dir(self) -> Path: ...
    @property
    def headroom(self) -> Headroom: ...
    @property
    def sink(self) -> _Open | None: ...
    @property
    def journal(self) -> _Open: ...
    @property
    def item_journal(self) -> _Open | None: ...


def headroom_fds(deliveries: Sequence[Spooled]) -> list[tuple[Spooled, list[tuple[int, int]]]]:
    """Per delivery, (a duplicate of the descriptor, the headroom it gets) for each open spool file the
    agent holds: output.log, the journals. On the Trio thread (dup: microseconds)."""
    found: list[tuple[Spooled, list[tuple[int, int]]]] = []
    for delivery in deliveries:
        held = [(delivery.sink.fileno() if delivery.sink is not None else -1, SPOOL_HEADROOM_BYTES),
                (delivery.journal.fileno(), JOURNAL_HEADROOM_BYTES)]
        if delivery.item_journal is not None:
            held.append((delivery.item_journal.fileno(), JOURNAL_HEADROOM_BYTES))
        fds: list[tuple[int, int]] = []
        for fd, size in held:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    fds.append((os.dup(fd), size))
        found.append((delivery, fds))
    return found


def top_up(spool: list[tuple[Spooled, list[tuple[int, int]]]]) -> None:
    """Blocks held beyond the end of every running task's appended spool files again (their writers
    used some): the agent's descriptors (closed here) and each items.jsonl — not once the task's
    delivery has given them back (its process is over). Blocking."""
    for delivery, fds in spool:
        with delivery.headroom.lock:
            try:
                if delivery.headroom.given_back:
                    continue
                for fd, size in fds:
                    preallocate(fd, size)
                try:
                    items = open_spool(delivery.task_dir / ITEMS_FILE, os.O_WRONLY)
                except OSError:
                    continue
                try:
                    preallocate(items, SPOOL_HEADROOM_BYTES)
                finally:
                    os.close(items)
            finally:
                for fd, _ in fds:
                    os.close(fd)


class Headroom:
    """A task's blocks beyond its appended spool files' ends: topped up by the outbox's looks
    (:func:`top_up`, under :attr:`lock`) until :meth:`give_back`. Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.given_back = False

    def give_back(self, task_dir: Path) -> None:
        """The task's process is over: the blocks beyond output.log's and items.jsonl's ends given back
        (ckagent.delivery.diskwatch.release_spool_headroom), and no look allocates them again. Blocking."""
        with self.lock:
            self.given_back = True
            release_spool_headroom(task_dir)
