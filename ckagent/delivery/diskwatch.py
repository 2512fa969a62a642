"""Who filled the work dir's disk: each task's accounted disk use, judged against its share.

**Accounting.** A task's disk use is what it holds on the work dir's filesystem: its task dir (spool,
``CK_TASK_DIR``, its private ``TMPDIR``), its working copy and its spider's data dir (``CK_DATA_DIR``,
less ``outputs/``: earlier tasks' kept files) — allocated bytes (``st_blocks``), a hard link counted
once (:func:`tree_bytes`). The outbox's disk loop looks every ``SCAN_INTERVAL`` (one thread hop for
all) — sooner while the free space falls fast: the next look comes before the fastest fall seen could
cross the floor (:meth:`DiskWatch.next_interval`, at least ``MIN_INTERVAL`` apart) — and measures
every running task's use at each look while the disk is low or falling fast, else every
``FULL_MEASURE_EVERY`` looks (ckagent.delivery.outbox).

**Judgement** (:meth:`DiskWatch.observe`, :meth:`DiskWatch.judge_end`: pure logic, no I/O, no clock
of its own). The *critical* level is the floor (``task.min_free_disk_bytes``), at least
``FULL_BYTES``. Space that is about to come back — the use of tasks already blamed (being stopped,
or ended and waiting for their scratch to be removed) — counts as free. When the free space is below
the critical level, the room the running tasks may hold together is ``sum(use) + free - critical``
(what they hold, less what is missing above the floor); a task's *share* is that room divided by the
number of running tasks. A task is blamed (FAILED
``DISK_FULL``) when its use is over its share **and** at least the deficit (``critical - free``,
and at least ``MIN_CULPRIT_BYTES``): removing what it holds could bring the disk back; the largest
such task first, one per look. A disk filled by another program (no task holds the deficit) blames
nobody: new tasks wait (ckagent.node.intake) and the log says so once.

- **Before the floor** (a writer the looks can see coming): when at the rate the free space fell
  it would cross the critical level within ``interval``, the task that grew fastest since the last
  look (at least ``MIN_GROWTH_BYTES``) is judged as above against the free space it is heading for.
- **Too fast for the watch**: a task that filled the disk between two looks and has already exited
  is judged at its end by the runner (:meth:`judge_end`, with its use and the free space measured
  then), before its result is recorded: over its share on a disk below the critical level, it ends
  FAILED ``DISK_FULL`` whatever its exit status.
- **A limit of its own**: a task whose use exceeds its ``resources.diskBytes`` (or the node's
  ``task.disk_limit_bytes``) is blamed at once, whatever the free space.

Who grew between two looks decides nothing except the "before the floor" prediction: a burst writer
that exited is blamed by what it holds, a neighbour that went on trickling is never blamed for it.
The last task blamed is kept for the status page (:attr:`DiskWatch.last_culprit`).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ckagent.containment.monitor import STATUS_FILE
from ckagent.delivery.artifacts import SENT_FILE
from ckagent.delivery.crawlstats import STATS_FILE
from ckagent.delivery.outputs.files import ARTIFACTS_DIR, MANIFEST
from ckagent.delivery.spool import AGENT_FILES, ITEM_FILES_DIR, ITEMS_FILE, OUTPUT_LOG
from ckagent.node import beneath
from ckagent.node.diskfull import release_beyond

log = logging.getLogger(__name__)

MIN_INTERVAL = 0.05
"""Shortest time between two looks (seconds), however fast the free space falls."""
FULL_BYTES = 4 * 1024 * 1024
"""Free bytes below which the disk counts as full (the agent's own writes need a little room)."""
MIN_GROWTH_BYTES = 1024 * 1024
"""Growth between two looks below which a task is not predicted to cross the floor (a log trickling on)."""
MIN_CULPRIT_BYTES = 1024 * 1024
"""Least use (bytes) for which a task can be blamed for a full disk."""
SAFETY = 2.0
"""While the free space falls, the next look comes before 1/SAFETY of the room above the floor is gone."""
MAX_TREE_ENTRIES = 20_000
"""Most entries of a tree measured per look (:func:`tree_bytes`)."""
KEPT_OUTPUTS_DIR = "outputs"
"""The data dir's folder of files kept from earlier tasks (not the running task's use)."""


@dataclass(frozen=True)
class DiskCulprit:
    """The last task blamed for a full disk (or for its own limit), for the status page.

    ``task_id``: the task; ``used_bytes``: its accounted use when blamed (bytes); ``at``: when (epoch
    seconds); ``reason``: the text of its result's errorMessage."""

    task_id: str
    used_bytes: int
    at: float
    reason: str


@dataclass(frozen=True)
class Accounted:
    """What a running task is accounted for: the roots of its trees (``paths``: task dir, working
    copy, data dir) and its own limit (``limit_bytes``, None = none)."""

    paths: tuple[Path, ...]
    limit_bytes: int | None = None


@dataclass
class DiskWatch:
    """See module docstring. ``floor_bytes``: task.min_free_disk_bytes (0 = none); ``interval``: the
    usual seconds between looks; ``clock``: the wall clock of :attr:`last_culprit` (epoch seconds).
    Use from one thread (the Trio loop)."""

    floor_bytes: int
    interval: float = 1.0
    clock: Callable[[], float] = time.time
    last_culprit: DiskCulprit | None = None
    """The last task blamed DISK_FULL (None before any): read-only for others (the status page)."""
    _last_time: float | None = None
    _last_free: int | None = None
    _sizes: dict[str, int] = field(default_factory=dict)
    _limits: dict[str, int] = field(default_factory=dict)
    _blamed: dict[str, int] = field(default_factory=dict)  # task → bytes it held when blamed (coming back)
    _reasons: dict[str, str] = field(default_factory=dict)
    _fall_rate: float = 0.0  # bytes per second the free space fell between the last two looks
    _warned: bool = False

    @property
    def critical_bytes(self) -> int:
        """Free bytes below which tasks are judged: the floor, or FULL_BYTES without one."""
        return max(self.floor_bytes, FULL_BYTES)

    def set_limit(self, task_id: str, limit_bytes: int | None) -> None:
        """The task's own disk limit (bytes; None = none)."""
        if limit_bytes:
            self._limits[task_id] = limit_bytes
        else:
            self._limits.pop(task_id, None)

    def blamed(self, task_id: str) -> str | None:
        """The reason the task was blamed for, or None."""
        return self._reasons.get(task_id)

    def reclaimed(self, task_id: str) -> None:
        """The blamed task's scratch is removed (or will never be): its bytes no longer count as coming
        back; the task is forgotten."""
        self._blamed.pop(task_id, None)
        self._reasons.pop(task_id, None)
        self._limits.pop(task_id, None)

    def forget(self, task_id: str) -> None:
        """A task that was not blamed has ended: forget its limit."""
        if task_id not in self._blamed:
            self._limits.pop(task_id, None)

    def observe(self, now: float, free_bytes: int | None, task_bytes: dict[str, int]) -> list[tuple[str, str]]:
        """One look: ``now`` (seconds, any monotonic clock), the free bytes (None = unknown), each running
        task's accounted bytes. Returns ``[(task_id, reason)]`` to stop (each task at most once)."""
        last_time, last_free = self._last_time, self._last_free
        previous, self._sizes = self._sizes, dict(task_bytes)
        self._last_time, self._last_free = now, free_bytes
        stops: list[tuple[str, str]] = []
        for task, used in task_bytes.items():
            over = self._over_limit(task, used)
            if over:
                stops.append((task, self._blame(task, used, over)))
        if free_bytes is None:
            return stops
        if last_time is not None and last_free is not None and now > last_time:
            self._fall_rate = max(0.0, (last_free - free_bytes) / (now - last_time))
        critical = self.critical_bytes
        coming = self._coming_back(task_bytes)
        free = free_bytes + coming
        if free < critical:
            verdict = over_share(self._judged(task_bytes), free, critical, set(self._blamed))
            if verdict is None:
                if not self._warned:
                    self._warned = True
                    log.warning("the work dir's free space (%s) is below %s and no running task holds the space "
                                "missing (%s); new tasks wait until space is freed", _mib(free_bytes),
                                _mib(critical), _mib(critical - free))
                return stops
            task, share = verdict
            what = "the disk was full" if free < FULL_BYTES else f"below {_mib(critical)} (task.min_free_disk_bytes)"
            stops.append((task, self._blame(task, task_bytes[task], (
                f"disk full: the task held {_mib(task_bytes[task])} (its task dir, working copy and data dir), "
                f"over its share of {_mib(share)} among {len(task_bytes)} running task(s); {_mib(free_bytes)} "
                f"free on the work dir's filesystem: {what}"))))
            return stops
        self._warned = False
        if last_time is None or now <= last_time or self._fall_rate <= 0:
            return stops
        heading = free - self._fall_rate * self.interval
        if heading >= critical:
            return stops
        growth = {task: size - previous[task] for task, size in task_bytes.items()
                  if task in previous and size - previous[task] >= MIN_GROWTH_BYTES and task not in self._blamed}
        if not growth:
            return stops
        task = max(growth, key=lambda t: growth[t])
        verdict = over_share(self._judged(task_bytes), int(heading), critical, set(self._blamed), only=task)
        if verdict is None:
            return stops
        rate = growth[task] / (now - last_time)
        stops.append((task, self._blame(task, task_bytes[task], (
            f"disk full: the task held {_mib(task_bytes[task])} (its task dir, working copy and data dir) and "
            f"wrote {_mib(rate)}/s; {_mib(free_bytes)} free on the work dir's filesystem: at that rate it would "
            f"go below {_mib(critical)} (task.min_free_disk_bytes) within {self.interval:g} s"))))
        return stops

    def judge_end(self, task_id: str, used_bytes: int, free_bytes: int | None) -> str | None:
        """A task's end (its processes gone, before its result is recorded): the reason it is blamed
        (FAILED DISK_FULL) — already blamed while it ran, over its own limit, or over its share on a
        disk below the critical level (see module docstring) — else None. ``used_bytes``: its
        accounted use now; ``free_bytes``: the free space now (None = unknown)."""
        if task_id in self._reasons:
            return self._reasons[task_id]
        over = self._over_limit(task_id, used_bytes)
        if over:
            return self._blame(task_id, used_bytes, over)
        if free_bytes is None:
            return None
        sizes = {**{t: s for t, s in self._sizes.items() if t != task_id}, task_id: used_bytes}
        critical = self.critical_bytes
        free = free_bytes + self._coming_back(sizes)
        if free >= critical:
            return None
        verdict = over_share(self._judged(sizes), free, critical, set(self._blamed), only=task_id)
        if verdict is None:
            return None
        what = "the disk was full" if free < FULL_BYTES else f"below {_mib(critical)} (task.min_free_disk_bytes)"
        return self._blame(task_id, used_bytes, (
            f"disk full: the task held {_mib(used_bytes)} (its task dir, working copy and data dir) when it "
            f"ended, over its share of {_mib(verdict[1])}; {_mib(free_bytes)} free on the work dir's "
            f"filesystem: {what}"))

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

    def _over_limit(self, task_id: str, used: int) -> str | None:
        limit = self._limits.get(task_id)
        if limit is None or used <= limit or task_id in self._blamed:
            return None
        return (f"disk full: the task held {_mib(used)} (its task dir, working copy and data dir), over its "
                f"disk limit of {_mib(limit)} (resources.diskBytes / task.disk_limit_bytes)")

    def _coming_back(self, sizes: dict[str, int]) -> int:
        """Bytes of blamed tasks that are about to be freed (their last known use)."""
        return sum(max(held, sizes.get(task, 0)) for task, held in self._blamed.items())

    def _judged(self, sizes: dict[str, int]) -> dict[str, int]:
        """The tasks whose use is shared out: those not blamed already (their bytes count as free)."""
        return {task: used for task, used in sizes.items() if task not in self._blamed}

    def _blame(self, task_id: str, used: int, reason: str | None) -> str:
        assert reason is not None
        self._blamed[task_id] = used
        self._reasons[task_id] = reason
        self.last_culprit = DiskCulprit(task_id, used, self.clock(), reason)
        return reason


def over_share(sizes: dict[str, int], free_bytes: int, critical_bytes: int, blamed: Iterable[str] = (),
               only: str | None = None) -> tuple[str, float] | None:
    """The task to blame for a disk below ``critical_bytes`` and its share (bytes), or None (module
    docstring): the largest task over its share of ``sum(sizes) + free - critical`` whose
    use is at least the deficit (and MIN_CULPRIT_BYTES). ``blamed`` are never chosen; ``only``: judge
    that task alone (still shared out among all of ``sizes``). Pure."""
    if not sizes:
        return None
    room = sum(sizes.values()) + free_bytes - critical_bytes  # what they may hold together above the floor
    share = room / len(sizes)
    least = max(MIN_CULPRIT_BYTES, critical_bytes - free_bytes)
    skip = set(blamed)
    candidates = [(used, task) for task, used in sizes.items()
                  if task not in skip and (only is None or task == only) and used > share and used >= least]
    if not candidates:
        return None
    _used, task = max(candidates)
    return task, share


def tree_bytes(path: Path, max_entries: int = MAX_TREE_ENTRIES, skip_top: Iterable[str] = (),
               seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes allocated to the files under ``path`` (st_blocks), counting at most ``max_entries``
    entries (a tree with more is measured by its first ones). A file with several links is counted
    once per ``seen`` (pass one set for the trees of one task). ``skip_top``: names of folders right
    below ``path`` left out. The tree is the spider's: walked by descriptors, no link followed (a
    folder swapped for a link mid-walk is not entered). Blocking; unreadable entries count 0."""
    total = count = 0
    links = seen if seen is not None else set()
    skipped = set(skip_top)
    try:
        for _rel_dir, dirs, entries in beneath.walk(path, skip_dir=(lambda rel: rel in skipped) if skipped else None):
            for _name, st in (*dirs, *entries):
                count += 1
                if count > max_entries:
                    return total
                if stat.S_ISDIR(st.st_mode):
                    continue
                if st.st_nlink > 1:
                    key = (st.st_dev, st.st_ino)
                    if key in links:
                        continue
                    links.add(key)
                total += st.st_blocks * 512
    except OSError:
        pass
    return total


def accounted_bytes(accounted: Accounted) -> int:
    """A task's accounted use (module docstring): the sum of :func:`tree_bytes` of its trees, a hard
    link counted once, the data dir's kept outputs left out (its third tree). Blocking."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for index, path in enumerate(accounted.paths):
        total += tree_bytes(path, skip_top=(KEPT_OUTPUTS_DIR,) if index == 2 else (), seen=seen)
    return total


def _mib(size: float) -> str:
    return f"{size / 1024**2:.1f} MiB"


SPOOL_NAMES = frozenset({*AGENT_FILES, ITEM_FILES_DIR, STATS_FILE, STATUS_FILE, ARTIFACTS_DIR, MANIFEST, SENT_FILE,
                         "kept"})
"""Names of a task dir that are its spool (what its delivery still reads), never removed as scratch."""


def reclaim_scratch(accounted: Accounted, keep: Iterable[str] = ()) -> tuple[list[str], int]:
    """Remove a blamed task's scratch (module docstring of ckagent.task.runner's ``reclaim_if_blamed``):
    its working copy (``accounted.paths[1]``), everything in its data dir (``paths[2]``) but
    ``outputs/``, and every entry of its task dir (``paths[0]``) that is not the spool (SPOOL_NAMES,
    and the first component of each path in ``keep``: its log journal's sources). Walked by
    descriptors, no link followed (ckagent.node.beneath). Returns (what was removed, in words; the
    bytes freed). Blocking; raises OSError only for a tree it cannot open at all."""
    task_dir, work, data_dir = accounted.paths
    spool = SPOOL_NAMES | {rel.split("/", 1)[0] for rel in keep}
    removed: list[str] = []
    freed = 0
    targets: list[tuple[Path, str, str]] = []  # (top, name, words)
    for top, leave, words in ((task_dir, spool, "task dir"), (data_dir, {KEPT_OUTPUTS_DIR}, "data dir")):
        try:
            names = sorted(entry.name for entry in os.scandir(top))
        except FileNotFoundError:
            continue
        targets += [(top, name, f"{words} {name!r}") for name in names if name not in leave]
    if work.exists():
        targets.append((work.parent, work.name, "working copy"))
    for top, name, words in targets:
        try:
            st = beneath.stat_entry(top, name)
            size = tree_bytes(top / name) if stat.S_ISDIR(st.st_mode) else st.st_blocks * 512
            beneath.remove(top, name)
        except OSError as exc:
            log.warning("cannot remove %s of %s: %s", words, top, exc)
            continue
        removed.append(f"{words} ({_mib(size)})")
        freed += size
    return removed, freed


def release_spool_headroom(task_dir: Path) -> None:
    """Give back the blocks held beyond the end of a task's appended spool files (output.log,
    items.jsonl: ckagent.node.diskfull.preallocate) once its processes are gone. Blocking; never raises."""
    for name in (OUTPUT_LOG, ITEMS_FILE):
        try:
            fd = beneath.open_file(task_dir, name, os.O_WRONLY)
        except OSError:
            continue
        try:
            release_beyond(fd)
        finally:
            os.close(fd)
