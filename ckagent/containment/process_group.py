"""Level ``process-group``: no cgroup rights. Each spider and installer runs in its own session
(own process group); the agent is the child subreaper of its descendants.

Kill-all = SIGKILL each process group of the task whose leader still lives (held by its pidfd,
proven: ckagent.node.procid — once a leader has been reaped its number may be a stranger's, and its
group then counts only when a member carries the marker), then a sweep of ``/proc`` for processes
carrying the task's marker variable (``CK_TASK_ID=<id>`` in ``/proc/<pid>/environ``) and their
descendants (by parent pid), repeated until a pass finds none.

What this level cannot catch (docs/operations.md, "Containment"): a process that leaves the group
(``setsid``/``setpgid``) **and** drops or replaces its environment (``env -i``, ``execve`` with a new
environment) **and** whose parent chain up to a task process is broken (double fork: it is re-parented
to the agent, which cannot tell which task it came from). Such a process outlives its task; so does
one that stays in the group but drops its environment and loses its parent chain, once the group's
leader and every marked member are gone (nothing proves the group's number is the task's any more). Limits,
OOM attribution and resource figures need cgroups: at this level results carry none of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any

import trio

from ckagent.containment.base import (
    SPIDER_OOM_SCORE_ADJ,
    Containment,
    Figures,
    Limits,
    TaskJail,
    is_zombie,
    make_preexec,
    rss_bytes,
    set_child_subreaper,
    wait_pids_gone,
)
from ckagent.node.levels import ContainmentLevel
from ckagent.node.procid import (
    ProcessIdentity,
    ProvenProcess,
    boot_id,
    children,
    has_environ_entry,
    scan_stat,
)

log = logging.getLogger(__name__)

MARKER_VAR = "CK_TASK_ID"
"""The variable every spider (and installer) process inherits; the sweep finds escaped processes by it."""


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``. Returns False when the group no longer exists.

    Raises ValueError for ``pgid`` <= 1 (never our own group or init by accident).
    """
    if pgid <= 1:
        raise ValueError(f"refusing to signal process group {pgid}")
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("not allowed to signal process group %d", pgid)
        return False
    return True


def _ppid(pid: int) -> int | None:
    found = scan_stat(pid)
    return None if found is None else found[0]


def find_marked(
    task_id: str, pgid: int | None = None, exclude: Iterable[int] = (), *, verify_group: bool = False,
    pgids: Iterable[int] = (), verify_pgids: Iterable[int] = (),
) -> list[int]:
    """The pids of :func:`find_marked_identities` (same arguments), sorted."""
    return sorted(identity.pid for identity in find_marked_identities(
        task_id, pgid, exclude, verify_group=verify_group, pgids=pgids, verify_pgids=verify_pgids))


def find_marked_identities(
    task_id: str, pgid: int | None = None, exclude: Iterable[int] = (), *, verify_group: bool = False,
    pgids: Iterable[int] = (), verify_pgids: Iterable[int] = (),
) -> list[ProcessIdentity]:
    """Pids of live processes of the task: in group ``pgid`` (or any of ``pgids``), carrying
    ``CK_TASK_ID=<task_id>``, or descending (by parent pid) from one of those.

    ``verify_group``: count members of ``pgid`` (and ``pgids``) only when at least one of them carries
    the marker (after an agent restart a recorded pgid may have been reused by an unrelated process
    group); ``verify_pgids``: groups counted that way whatever ``verify_group`` says (groups whose
    leader has exited: their number may be a stranger's now). Each group is judged on its own.
    Each process's identity (ckagent.node.procid) is read in the same read as its parent: a kill
    proves it before it signals. Blocking (reads /proc): call it through ``trio.to_thread``.
    Zombies are ignored.
    """
    marker = f"{MARKER_VAR}={task_id}".encode()
    skip = {os.getpid(), *exclude}
    groups = {g for g in (pgid, *pgids) if g is not None and g > 1}
    verified = {g for g in verify_pgids if g > 1} | (groups if verify_group else set())
    trusted = set() if verify_group else groups - verified
    marked: set[int] = set()
    members: set[int] = set()
    maybe: dict[int, set[int]] = {}
    confirmed: set[int] = set()
    parents: dict[int, int] = {}
    starts: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        pid = int(name)
        try:
            group = os.getpgid(pid) if trusted or verified else 0
        except OSError:  # gone meanwhile
            continue
        stat = scan_stat(pid)
        if stat is None:
            continue
        parents[pid], starts[pid], state = stat
        has_marker = has_environ_entry(pid, marker)  # a zombie's environ reads empty
        if not (has_marker or group in trusted or group in verified) or state in "ZXx":
            continue
        if has_marker:
            marked.add(pid)
            if group in verified:
                confirmed.add(group)
        elif group in trusted:
            members.add(pid)
        else:
            maybe.setdefault(group, set()).add(pid)
    found = marked | members
    for group in confirmed:
        found |= maybe.get(group, set())
    # Descendants of what was found (an escaped child that scrubbed its environment, parent alive).
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in found and pid not in found and pid not in skip and not is_zombie(pid):
                found.add(pid)
                grew = True
    boot = boot_id()
    return [ProcessIdentity(pid, starts[pid], boot) for pid in sorted(found)]


def _kill_proven(identities: Iterable[ProcessIdentity]) -> list[ProvenProcess]:
    """SIGKILL each process, proven first (never a later owner of its pid); the proven ones (the
    caller waits on them and closes them)."""
    killed = []
    for identity in identities:
        proven = identity.prove()
        if proven is not None:
            proven.send_signal(signal.SIGKILL)
            killed.append(proven)
    return killed


SPAWNED: set[int] = set()
"""Pids of the agent's own children that trio waits for (spiders, installers): never reaped here."""


def reap_adopted_zombies() -> int:
    """Reap zombie children of the agent that it did not spawn: orphans of tasks re-parented to it
    as child subreaper (blocking: reads /proc). Returns how many were reaped."""
    me = os.getpid()
    reaped = 0
    for pid in set(children(me, every_thread=True)) - SPAWNED:
        if is_zombie(pid) and _ppid(pid) == me and pid not in SPAWNED:
            with contextlib.suppress(ChildProcessError, OSError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped += 1
    return reaped


def _reap_adopted(pids: Iterable[int], keep: set[int]) -> None:
    """Reap killed orphans the agent adopted as subreaper (never a process trio waits for)."""
    me = os.getpid()
    for pid in pids:
        if pid in keep or pid in SPAWNED or _ppid(pid) != me:
            continue
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


async def sweep(task_id: str, pgid: int | None, *, verify_group: bool = False, max_passes: int = 20,
                pgids: Iterable[int] = (), keep: Iterable[int] = (), leaders: Iterable[ProvenProcess] = ()) -> int:
    """SIGKILL the task's group(s) and every marked process (and their descendants), repeating until
    a pass finds none.

    Returns how many processes were killed (0 when the task left nothing behind). Each pass reads
    /proc in a worker thread. ``verify_group`` (crash recovery): the group is only killed when one
    of its members carries the task's marker (see :func:`find_marked`). ``keep``: pids the caller
    reaps itself (trio's children). ``leaders``: proven leaders of groups of the task
    (ckagent.node.procid): their groups count in full, and are signalled, only while they live;
    after, as ``verify_pgids`` of :func:`find_marked`. Cancellation stops between passes; callers
    run it shielded when it must complete. Gives up (with a warning) after ``max_passes`` passes.
    """
    pgids = list(pgids)
    groups = [g for g in (pgid, *pgids) if g is not None and g > 1]
    leaders = list(leaders)
    keep_set = set(keep)
    killed = 0
    for _ in range(max_passes):
        # Find first (descendants are found through their live parents), then kill groups and finds.
        live = [leader.pid for leader in leaders if not leader.exited()]
        ended = [leader.pid for leader in leaders if leader.pid not in live]
        found = await trio.to_thread.run_sync(partial(
            find_marked_identities, task_id, pgid, verify_group=verify_group, pgids=[*pgids, *live],
            verify_pgids=ended))
        pids = [identity.pid for identity in found]
        if not verify_group:
            for group in groups:
                signal_group(group, signal.SIGKILL)
        for leader in leaders:
            leader.signal_group(signal.SIGKILL)  # (only while it lives)
        if not pids:
            return killed
        log.info("task %s: killing %d leftover process(es): %s", task_id, len(pids), pids)
        proven = _kill_proven(found)
        killed += len(pids)
        try:
            with trio.move_on_after(1.0):
                await _wait_all(proven)
        finally:
            for process in proven:
                process.close()
        _reap_adopted(pids, keep_set)
    log.warning("task %s: processes still appear after %d sweep passes", task_id, max_passes)
    return killed


async def _wait_all(processes: list[ProvenProcess]) -> None:
    """Wait for each of ``processes`` to end (their pidfds). Cancellation: returns at once, leaving the rest."""
    for process in processes:
        await process.wait()


class ProcessGroupJail(TaskJail):
    """A task held by its process groups and its marker (see module docstring)."""

    level = ContainmentLevel.PROCESS_GROUP

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.limits = Limits()
        self.leaders: list[ProvenProcess] = []
        self._owned: list[ProvenProcess] = []

    @property
    def pgids(self) -> list[int]:
        """The task's process groups (their leaders' pids; a group counts in full only while its
        leader lives)."""
        return [leader.pid for leader in self.leaders]

    def spawn(self, argv: list[str], env: Mapping[str, str], *, forking: bool = False) -> tuple[list[str], dict[str, Any]]:
        """No cgroup to join: the command as it is (vfork spawn); :meth:`watch` raises the main
        process's oom_score_adj right after the spawn (a spider's and an installer's alike: both are
        supervised the same way, ckagent.containment.process and .monitor)."""
        if forking:
            return argv, {"preexec_fn": make_preexec([])}
        return argv, {}

    def watch(self, pid: int) -> None:
        """Our child, not reaped yet (spawned with start_new_session: pgid == pid): proven now, its
        pidfd held until :meth:`close` — its group is signalled only while it lives (once trio has
        reaped it, the number may be a stranger's)."""
        identity = ProcessIdentity.of(pid)
        proven = None if identity is None else identity.prove()
        if proven is None:
            log.warning("task %s: process %d is gone before it could be watched", self.task_id, pid)
            return
        self.leaders.append(proven)
        self._owned.append(proven)
        proven.set_oom_score_adj(SPIDER_OOM_SCORE_ADJ)

    def adopt(self, leader: ProvenProcess) -> None:
        self.leaders.append(leader)  # (its oom_score_adj was set at its spawn; the caller owns it)

    def _find(self) -> list[int]:
        live = [leader.pid for leader in self.leaders if not leader.exited()]
        return find_marked(self.task_id, pgids=live, verify_pgids=[p for p in self.pgids if p not in live])

    def _find_or_reap(self) -> list[int]:
        """The task's live processes; when none is left, the agent's adopted zombies (orphans of
        tasks that ended on their own) are reaped in the same pass, as :meth:`kill_all` does."""
        pids = self._find()
        if not pids:
            reap_adopted_zombies()
        return pids

    def populated(self) -> bool:
        return bool(self._find())

    def memory_now(self) -> tuple[int, str]:
        """The resident set sizes of the task's processes, summed (shared pages count in each)."""
        return rss_bytes(self._find()), "its processes' RSS summed"

    async def wait_empty(self) -> None:
        """Return when a scan of /proc finds no process of the task (one thread hop per scan: one in
        all when nothing was left), waiting on the pidfds of what a scan found between scans. The
        last scan reaps the adopted zombies too, so nothing is left for :meth:`kill_all` to do: its
        sweep's first scan is this one again, and the groups it would signal have no live member."""
        while pids := await trio.to_thread.run_sync(self._find_or_reap):
            await wait_pids_gone(pids)

    async def kill_all(self) -> int:
        killed = await sweep(self.task_id, None, keep=[p.pid for p in self._owned], leaders=self.leaders)
        await trio.to_thread.run_sync(reap_adopted_zombies)  # orphans that ended on their own
        return killed

    def figures(self) -> Figures:
        return Figures()

    def close(self) -> None:
        """Let go of the pidfds of the processes it spawned (idempotent)."""
        for leader in self._owned:
            leader.close()


class ProcessGroup(Containment):
    """The ``process-group`` level; ``subreaper`` makes the agent the child subreaper."""

    level = ContainmentLevel.PROCESS_GROUP

    def __init__(self, *, subreaper: bool = True, why: str = "") -> None:
        reaper = self._subreaper = subreaper and set_child_subreaper()
        self.details = ("process groups + marker sweep" + ("; agent is child subreaper" if reaper else "")
                        + "; no limits, no resource figures" + (f" ({why})" if why else ""))

    def jail(self, task_id: str, limits: Limits) -> TaskJail:
        return ProcessGroupJail(task_id)

    async def recover(self, task_id: str, pgid: int | None) -> int:
        return await sweep(task_id, pgid, verify_group=True)

    def close(self) -> None:
        """Stop being the child subreaper (an agent run inside a longer-lived process, e.g. tests)."""
        if self._subreaper:
            set_child_subreaper(False)
            reap_adopted_zombies()
