"""Whether the node takes new tasks: an intake gate the poller consults, and what closes it.

A node that cannot work says so instead of taking tasks it would fail. Each cause closes the gate under
its own key, with a one-line reason, and opens it again when it is gone:

- ``disk``: free space of the work dir's filesystem below ``task.min_free_disk_bytes``
  (:class:`DiskFloorWatch`; the tasks already running go on: the one that filled the disk is
  stopped and its scratch removed, ckagent.delivery.diskwatch, so the gate opens by itself);
- ``version``: the master requires a newer agent (registration's ``minAgentVersion``, see
  ckagent.master.fleet);
- ``max-tasks``, ``exit-when-idle``: an ephemeral worker is done (ckagent.node.ephemeral); the latter
  *soft*: a poll answer already in hand is still settled (its tasks run), nothing is handed back.
  ``max-tasks`` is *busy*: the node works on what it claimed, so it stays ready (below).

While the gate is closed the poller does not poll; heartbeats go on and carry the reason
(``pausedReason``), and /readyz answers 503 with it — but for a *busy* cause (``max-tasks``): a
one-task Job's pod that claimed its task is doing its work, and KEDA's ScaledJob (``scalingStrategy:
accurate`` with ``pendingPodConditions: [Ready]``) counts a Job whose pod is not Ready as one still
waiting for a task, so a not-ready busy pod would hold back a new Job for every task queued.
Reasons never hold secrets.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import trio

log = logging.getLogger(__name__)

DISK_CHECK_INTERVAL = 5.0
"""Seconds between two looks at the work dir's free space while tasks run (or the gate is closed)."""
IDLE_DISK_CHECK_INTERVAL = 30.0
"""The same while the node is idle (nothing of the agent's fills the disk then; a task's start ends
the wait at once): an idle agent wakes for it twice a minute instead of twelve times."""


class IntakeGate:
    """Open (tasks are taken) unless some cause has closed it. Use from the Trio loop only.

    ``reason`` is None when open, else the reasons of every cause, joined with "; ".
    """

    def __init__(self) -> None:
        self._closed: dict[str, str] = {}
        self._soft: set[str] = set()
        self._busy: set[str] = set()
        self._opened = trio.Event()
        self._opened.set()
        self._closed_event = trio.Event()
        self._cut: set[trio.CancelScope] = set()  # see cancel_on_close

    @property
    def reason(self) -> str | None:
        """Why no tasks are taken now, or None."""
        return "; ".join(self._closed.values()) if self._closed else None

    @property
    def unready_reason(self) -> str | None:
        """The reasons of the causes that make the node not ready (/readyz): every cause but the busy
        ones. None when there is none."""
        unready = [reason for key, reason in self._closed.items() if key not in self._busy]
        return "; ".join(unready) if unready else None

    @property
    def refusal(self) -> str | None:
        """The reasons of the causes that also refuse a poll answer already in hand (its claimed tasks are
        given back): every cause but the soft ones. None when there is none."""
        hard = [reason for key, reason in self._closed.items() if key not in self._soft]
        return "; ".join(hard) if hard else None

    def close(self, key: str, reason: str, *, soft: bool = False, busy: bool = False) -> None:
        """Close the gate for cause ``key`` (idempotent; a new ``reason`` replaces the old one). ``soft``: no
        new poll and a poll in flight is cut short, but an answer already in hand is settled as if open.
        ``busy``: the node takes nothing more but is working, not unwell: it stays ready (/readyz)."""
        self._closed[key] = reason
        if soft:
            self._soft.add(key)
        else:
            self._soft.discard(key)
        if busy:
            self._busy.add(key)
        else:
            self._busy.discard(key)
        if self._opened.is_set():
            self._opened = trio.Event()
        self._closed_event.set()
        for scope in self._cut:
            scope.cancel()

    def open(self, key: str) -> None:
        """Withdraw cause ``key``; the gate opens when no cause is left (idempotent)."""
        self._closed.pop(key, None)
        self._soft.discard(key)
        self._busy.discard(key)
        if not self._closed:
            self._opened.set()
            if self._closed_event.is_set():
                self._closed_event = trio.Event()

    def is_closed(self, key: str) -> bool:
        """Whether cause ``key`` holds the gate closed."""
        return key in self._closed

    @contextlib.contextmanager
    def cancel_on_close(self, scope: trio.CancelScope) -> Iterator[None]:
        """While in the block, a cause closing the gate cancels ``scope`` (at once when it is closed
        already): a poll in flight is cut short without a task of its own waiting for the close."""
        if self._closed:
            scope.cancel()
        self._cut.add(scope)
        try:
            yield
        finally:
            self._cut.discard(scope)

    async def wait_closed(self) -> None:
        """Return at once when closed, else when a cause closes it (a poll in flight is then cut short:
        what it would claim must not run here). Cancellation: as usual."""
        while not self._closed:
            await self._closed_event.wait()

    async def wait_open(self) -> None:
        """Return at once when open, else when the last cause is withdrawn. Cancellation: as usual."""
        while self._closed:
            await self._opened.wait()


def _free_bytes(path: Path) -> int:
    """Free bytes of the filesystem holding ``path`` (its nearest existing ancestor). Blocking."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


async def free_bytes_of(path: Path) -> int:
    """Free bytes of the filesystem holding ``path`` (read in a thread). Raises OSError."""
    return await trio.to_thread.run_sync(_free_bytes, path)


class DiskFloorWatch:
    """Closes ``gate`` (key "disk") while the work dir's filesystem has less than ``floor_bytes`` free.

    ``free_bytes(path)`` reads the free space (default :func:`free_bytes_of`); tests pass their own.
    One WARNING when the floor is crossed, one INFO when the space is back. Looks every ``interval``
    seconds; every ``idle_interval`` seconds instead while ``idle`` is given and says the node is
    idle — ``idle`` is ``(is_idle() -> bool, wait_busy() -> awaitable)``, and ``wait_busy`` returning
    (a task started) ends the idle wait at once.
    """

    def __init__(self, gate: IntakeGate, work_dir: Path, floor_bytes: int, *,
                 interval: float = DISK_CHECK_INTERVAL,
                 free_bytes: Callable[[Path], Awaitable[int]] = free_bytes_of,
                 idle: tuple[Callable[[], bool], Callable[[], Awaitable[None]]] | None = None,
                 idle_interval: float = IDLE_DISK_CHECK_INTERVAL) -> None:
        self._gate = gate
        self._work_dir = work_dir
        self.floor_bytes = floor_bytes
        self.interval = interval
        self._free_bytes = free_bytes
        self._idle = idle
        self.idle_interval = idle_interval

    async def check(self) -> int:
        """Look once and close or open the gate; returns the free bytes seen. OSError is logged, not raised
        (the gate stays as it was)."""
        try:
            free = await self._free_bytes(self._work_dir)
        except OSError as exc:
            log.warning("cannot read the free space of %s: %s", self._work_dir, exc)
            return -1
        if free < self.floor_bytes:
            reason = (f"free disk space of the work dir {self._work_dir} is {free // 1024**2} MiB, below "
                      f"task.min_free_disk_bytes ({self.floor_bytes // 1024**2} MiB): taking no tasks "
                      "until space is freed")
            if not self._gate.is_closed("disk"):
                log.warning("%s", reason)
            self._gate.close("disk", reason)
        elif self._gate.is_closed("disk"):
            log.info("free disk space of the work dir is back to %d MiB (floor %d MiB): taking tasks again",
                     free // 1024**2, self.floor_bytes // 1024**2)
            self._gate.open("disk")
        return free

    async def run(self) -> None:
        """Check every ``interval`` seconds until cancelled (nothing to do with a floor of 0)."""
        if self.floor_bytes <= 0:
            return
        while True:
            await self.check()
            if self._idle is not None and self._idle[0]() and not self._gate.is_closed("disk"):
                with trio.move_on_after(max(self.interval, self.idle_interval)):
                    await self._idle[1]()
                    await trio.sleep(self.interval)  # a task started: the next look comes at the busy pace
            else:
                await trio.sleep(self.interval)
