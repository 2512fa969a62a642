"""Which task fills the work dir's disk, and when to stop it (before the disk is full, where it can be).

The outbox's disk loop looks at the free space of the work dir's filesystem and at the size of each
running task's directory (its spool and whatever the spider writes into ``CK_TASK_DIR``) every
``SCAN_INTERVAL`` — sooner while the free space falls fast: the next look comes before the fastest
fall seen could cross the floor (:meth:`DiskWatch.next_interval`, at least ``MIN_INTERVAL`` apart),
so a fast writer does not outrun the floor between two looks.

:meth:`DiskWatch.observe` is pure logic (no I/O, no clock of its own): given the time, the free bytes
and each running task's directory bytes, it returns the tasks to stop, each once, with the reason.
A task is stopped (FAILED ``DISK_FULL``) when it is the one whose directory grew most since the last
look and

- the free space is below the floor (``task.min_free_disk_bytes``; with no floor: below
  ``FULL_BYTES``) and it grew by at least ``MIN_GROWTH_BYTES`` — or by anything, once the disk is
  full (below ``FULL_BYTES``, or the agent had to release its space reserve: ``disk_was_full``); or
- at its rate of growth it would take the free space below the floor within ``interval`` (what
  it can write between two usual looks).

A disk that fills while no task grows (another program) stops nothing: new tasks wait for the floor
(ckagent.node.intake) and the log says so once.
"""

from __future__ import annotations

import logging
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ckagent.node import beneath

log = logging.getLogger(__name__)

MIN_INTERVAL = 0.05
"""Shortest time between two looks (seconds), however fast the free space falls."""
FULL_BYTES = 4 * 1024 * 1024
"""Free bytes below which the disk counts as full (the agent's own writes need a little room)."""
MIN_GROWTH_BYTES = 1024 * 1024
"""Growth of a task's directory between two looks below which a task is not blamed for a low disk
(while the disk is not yet full): a spider's log trickling on is not what filled it."""
SAFETY = 2.0
"""While the free space falls, the next look comes before 1/SAFETY of the room above the floor is gone."""
MAX_TREE_ENTRIES = 20_000
"""Most entries of a task's directory measured per look (:func:`tree_bytes`)."""


@dataclass
class DiskWatch:
    """See module docstring. ``floor_bytes``: task.min_free_disk_bytes (0 = none); ``interval``: the
    usual seconds between looks."""

    floor_bytes: int
    interval: float = 1.0
    _last_time: float | None = None
    _last_free: int | None = None
    _sizes: dict[str, int] = field(default_factory=dict)
    _stopped: set[str] = field(default_factory=set)
    _fall_rate: float = 0.0  # bytes per second the free space fell between the last two looks
    _warned: bool = False

    @property
    def critical_bytes(self) -> int:
        """Free bytes below which writers are stopped: the floor, or FULL_BYTES without one."""
        return max(self.floor_bytes, FULL_BYTES)

    def observe(self, now: float, free_bytes: int | None, task_bytes: dict[str, int],
                disk_was_full: bool = False) -> list[tuple[str, str]]:
        """One look: ``now`` (seconds, any monotonic clock), the free bytes (None = unknown), each running
        task's directory bytes. Returns ``[(task_id, reason)]`` to stop (each task at most once)."""
        last_time, last_free = self._last_time, self._last_free
        previous, self._sizes = self._sizes, dict(task_bytes)
        self._last_time, self._last_free = now, free_bytes
        self._stopped &= set(task_bytes)
        if last_time is None or free_bytes is None or now <= last_time:
            return []
        elapsed = now - last_time
        self._fall_rate = max(0.0, (last_free - free_bytes) / elapsed) if last_free is not None else 0.0
        growth = {task: size - previous[task] for task, size in task_bytes.items()
                  if task in previous and size > previous[task] and task not in self._stopped}
        critical = self.critical_bytes
        full = disk_was_full or free_bytes < FULL_BYTES
        if not growth:
            if free_bytes < critical and not self._warned:
                self._warned = True
                log.warning("the work dir's free space (%s) is below %s and no running task's directory grows; "
                            "new tasks wait until space is freed", _mib(free_bytes), _mib(critical))
            elif free_bytes >= critical:
                self._warned = False
            return []
        task, grown = max(growth.items(), key=lambda pair: pair[1])
        rate = grown / elapsed
        below = (free_bytes < critical or full) and (full or grown >= MIN_GROWTH_BYTES)
        outrun = grown >= MIN_GROWTH_BYTES and free_bytes - rate * self.interval < critical
        if not (below or outrun):
            return []
        self._stopped.add(task)
        what = "the disk was full" if full else (
            f"the free space was below {_mib(critical)} (task.min_free_disk_bytes)" if below
            else f"at that rate it would go below {_mib(critical)} (task.min_free_disk_bytes) within "
                 f"{self.interval:g} s")
        reason = (f"disk full: the task wrote {_mib(grown)} into its directory in {elapsed:.1f} s "
                  f"({_mib(rate)}/s); {_mib(free_bytes)} free on the work dir's filesystem: {what}")
        return [(task, reason)]

    def next_interval(self, free_bytes: int | None = None) -> float:
        """Seconds until the next look: ``interval``, or less while the free space falls fast (see module
        docstring)."""
        free = self._last_free if free_bytes is None else free_bytes
        if free is None or self._fall_rate <= 0:
            return self.interval
        room = free - self.critical_bytes
        if room <= 0:
            return MIN_INTERVAL
        return min(self.interval, max(MIN_INTERVAL, room / self._fall_rate / (2 * SAFETY)))


def tree_bytes(path: Path, max_entries: int = MAX_TREE_ENTRIES) -> int:
    """Bytes allocated to the files under ``path`` (st_blocks), counting at most ``max_entries``
    entries (a task with more is measured by its first ones). The tree is the spider's: walked by
    descriptors, no link followed (a folder swapped for a link mid-walk is not entered). Blocking;
    unreadable entries count 0."""
    total = seen = 0
    try:
        for _rel_dir, dirs, entries in beneath.walk(path):
            for _name, st in (*dirs, *entries):
                seen += 1
                if seen > max_entries:
                    return total
                if not stat.S_ISDIR(st.st_mode):
                    total += st.st_blocks * 512
    except OSError:
        pass
    return total


def _mib(size: float) -> str:
    return f"{size / 1024**2:.1f} MiB"
