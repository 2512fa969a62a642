"""Level ``cgroup-v2``: each task in its own cgroup of the unified hierarchy.

Layout (``<own>`` = the agent's cgroup, e.g. ``/sys/fs/cgroup/system.slice/ckagent.service``)::

    <own>/ckagent-agent/            the agent itself, when controllers must be enabled in <own>
    <own>/ckagent-<work-dir hash>/  this agent's tasks (controllers enabled in its subtree)
        task-<task id>/             one task: its installers and its spider; limits; figures

Membership: every child writes "0" to the task's ``cgroup.procs`` between fork and exec (an fd the
agent opened), so no process of the task ever runs outside it. Kill: ``cgroup.kill`` (Linux ≥ 5.14;
older: ``cgroup.freeze`` + SIGKILL each + thaw). Empty: ``populated 0`` in ``cgroup.events``, waited
for with inotify. OOM: ``memory.events`` ``oom_kill``. Figures: ``cpu.stat`` user+system,
``memory.peak`` (≥ 5.19), ``pids.peak``, ``io.stat`` rbytes/wbytes.

The same class serves the hybrid level (:mod:`ckagent.containment.cgroup_v1`) for membership, kill
and events from a v2 tree without controllers.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
from pathlib import Path

import trio

from ckagent.containment.base import (
    NOT_WRITABLE,
    Containment,
    ContainmentError,
    Figures,
    Limits,
    TaskJail,
    kill_pids,
    read_int,
    read_keyed,
    read_procs,
    read_text,
    rmdir_quietly,
    throwaway_cgroup,
)
from ckagent.containment.filewatch import FileWatch
from ckagent.containment.hierarchy import AGENT_LEAF, task_cgroup_name
from ckagent.node.levels import Blocker, ContainmentLevel

log = logging.getLogger(__name__)

KILL_TIMEOUT = 5.0
"""Seconds to wait for a killed cgroup to become empty (a process stuck in the kernel, state D, cannot
die); then the agent logs it and moves on."""

CPU_PERIOD_US = 100_000
LIMITABLE = ("memory", "pids", "cpu", "io")


class V2Cgroup:
    """One task's cgroup in a v2 tree: the kernel files and the operations on them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.procs_fd = -1

    def create(self) -> None:
        """mkdir (an existing one is a leftover: emptied first) and open cgroup.procs for joining."""
        with contextlib.suppress(FileExistsError):
            self.path.mkdir()
        self.procs_fd = os.open(self.path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)

    def populated(self) -> bool:
        events = read_keyed(self.path / "cgroup.events")
        if "populated" in events:
            return events["populated"] == 1
        return bool(read_procs(self.path / "cgroup.procs"))

    async def wait_empty(self) -> None:
        if not self.populated():  # the usual case at a task's end (a cgroup gone counts as empty): no watch
            return
        try:
            watch = FileWatch(self.path / "cgroup.events")
        except OSError:
            if not self.path.exists():
                return
            raise
        with watch:
            while self.populated():
                await watch.changed()

    async def kill_all(self) -> int:
        before = read_procs(self.path / "cgroup.procs")
        if not before and not self.populated():
            return 0
        kill_file = self.path / "cgroup.kill"
        if kill_file.exists():
            try:
                kill_file.write_text("1")
            except FileNotFoundError:
                return 0
        else:  # Linux < 5.14: freeze, kill each, thaw
            await self._freeze_kill_thaw()
        with trio.move_on_after(KILL_TIMEOUT) as scope:
            await self.wait_empty()
        if scope.cancelled_caught:
            log.error("cgroup %s still has processes %s %g s after the kill (stuck in the kernel?)",
                      self.path, read_procs(self.path / "cgroup.procs"), KILL_TIMEOUT)
        return len(before)

    async def _freeze_kill_thaw(self) -> None:
        freeze = self.path / "cgroup.freeze"
        freeze.write_text("1")
        # (ASYNC912: an already frozen cgroup needs no wait, so no checkpoint.)
        with trio.move_on_after(1.0), FileWatch(self.path / "cgroup.events") as watch:  # noqa: ASYNC912
            while read_keyed(self.path / "cgroup.events").get("frozen") != 1:
                await watch.changed()
        procs = self.path / "cgroup.procs"
        kill_pids(read_procs(procs), lambda: read_procs(procs), signal.SIGKILL)
        freeze.write_text("0")

    def memory_now(self) -> tuple[int, str] | None:
        """The cgroup's working set (memory.current less inactive file pages, as the kubelet counts it)."""
        current = read_int(self.path / "memory.current")
        if current is None:
            return None
        inactive = read_keyed(self.path / "memory.stat").get("inactive_file", 0)
        return max(0, current - inactive), "the cgroup's working set"

    def figures(self) -> Figures:
        cpu = read_keyed(self.path / "cpu.stat")
        io_read = io_write = None
        io_text = read_text(self.path / "io.stat")
        if io_text is not None:
            io_read = io_write = 0
            for line in io_text.splitlines():
                for kv in line.split()[1:]:
                    key, _, value = kv.partition("=")
                    if key == "rbytes":
                        io_read += int(value)
                    elif key == "wbytes":
                        io_write += int(value)
        events = read_keyed(self.path / "memory.events")
        cpu_us = cpu["user_usec"] + cpu["system_usec"] if "user_usec" in cpu and "system_usec" in cpu else None
        return Figures(
            cpu_seconds=None if cpu_us is None else cpu_us / 1e6,
            memory_peak_bytes=read_int(self.path / "memory.peak"),
            pids_peak=read_int(self.path / "pids.peak"),
            io_read_bytes=io_read, io_write_bytes=io_write,
            oom_kills=events.get("oom_kill") if events else None,
        )

    def set_limits(self, limits: Limits) -> None:
        try:
            if limits.memory_bytes is not None:
                (self.path / "memory.max").write_text(str(limits.memory_bytes))
                swap = self.path / "memory.swap.max"
                if swap.exists():
                    swap.write_text("0")  # the limit is the memory, not memory + swap
            if limits.pids is not None:
                (self.path / "pids.max").write_text(str(limits.pids))
            if limits.cpus is not None:
                quota = max(1000, int(limits.cpus * CPU_PERIOD_US))
                (self.path / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
        except OSError as exc:
            raise ContainmentError(f"cannot set the limits ({limits.describe()}) of {self.path}: {exc}") from exc

    def close(self) -> None:
        if self.procs_fd >= 0:
            os.close(self.procs_fd)
            self.procs_fd = -1
        rmdir_quietly(self.path)


class V2Jail(TaskJail):
    """A task in its v2 cgroup (see module docstring)."""

    level = ContainmentLevel.CGROUP_V2

    def __init__(self, cgroup: V2Cgroup, task_id: str, limits: Limits) -> None:
        self.cgroup, self.task_id, self.limits = cgroup, task_id, limits

    def join_paths(self) -> list[Path]:
        return [self.cgroup.path / "cgroup.procs"]

    def join_fds(self) -> list[int]:
        return [self.cgroup.procs_fd]

    def v2_path(self) -> Path | None:
        return self.cgroup.path

    def populated(self) -> bool:
        return self.cgroup.populated()

    async def wait_empty(self) -> None:
        await self.cgroup.wait_empty()

    async def kill_all(self) -> int:
        return await self.cgroup.kill_all()

    def figures(self) -> Figures:
        return self.cgroup.figures()

    def memory_now(self) -> tuple[int, str] | None:
        return self.cgroup.memory_now()

    def close(self) -> None:
        self.cgroup.close()


def enable_controllers(parent: Path, wanted: list[str]) -> None:
    """Write ``+c`` for each controller into ``parent/cgroup.subtree_control``. Raises OSError."""
    if wanted:
        (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))


def prepare_group(own: Path, group_name: str, *, with_controllers: bool) -> tuple[Path, list[str]]:
    """Create the agent's task directory below its own v2 cgroup; with controllers, enable them on
    the way (moving the agent into a leaf of its own first when the no-internal-process rule asks
    for it). Returns (the directory, the controllers enabled for tasks). Raises ContainmentError."""
    base = own.parent if own.name == AGENT_LEAF else own
    available = (read_text(base / "cgroup.controllers") or "").split() if with_controllers else []
    wanted = [c for c in LIMITABLE if c in available]
    try:
        if wanted:
            try:
                enable_controllers(base, wanted)
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                # Processes in <own> forbid enabling controllers for its children: move into a leaf.
                leaf = base / AGENT_LEAF
                leaf.mkdir(exist_ok=True)
                (leaf / "cgroup.procs").write_text(str(os.getpid()))
                try:
                    enable_controllers(base, wanted)
                except OSError:
                    others = read_procs(base / "cgroup.procs")
                    log.info("moving %d other process(es) of %s into %s: %s", len(others), base, leaf, others)
                    for pid in others:
                        try:
                            (leaf / "cgroup.procs").write_text(str(pid))
                        except OSError as move_exc:
                            if move_exc.errno != errno.ESRCH:
                                raise
                    enable_controllers(base, wanted)
        group = base / group_name
        group.mkdir(exist_ok=True)
        if wanted:
            enable_controllers(group, wanted)
    except OSError as exc:
        raise ContainmentError(
            f"cannot prepare the task cgroups under {base}: {exc} (give the agent a delegated cgroup: "
            "systemd Delegate=yes, or a container with its own cgroup namespace; see docs/operations.md)",
            Blocker.CGROUP_NOT_WRITABLE if exc.errno in NOT_WRITABLE else Blocker.FAILED,
        ) from exc
    return group, wanted


def check_v2(own: Path) -> tuple[str, Path]:
    """Judge the ``cgroup-v2`` level below ``own`` (the agent's cgroup in the v2 tree) without changing
    the machine: a throw-away child cgroup is made and removed (that the directory is this process's
    to write is what matters; ``os.access`` says yes to root on a read-only mount), the delegated
    controllers are read. Returns (one line of details, the directory the tasks' cgroups would be
    below). Blocking. Raises ContainmentError (blocker CGROUP_NOT_WRITABLE when it is not writable)."""
    base = own.parent if own.name == AGENT_LEAF else own
    with throwaway_cgroup(base) as probe:
        kill = "cgroup.kill" if (probe / "cgroup.kill").exists() else "freeze+kill"
    available = (read_text(base / "cgroup.controllers") or "").split()
    limits = [c for c in ("cpu", "memory", "pids") if c in available]
    if limits and not os.access(base / "cgroup.subtree_control", os.W_OK):
        limits = []
    return (f"cgroup v2 below {base}; kill: {kill}; limits: "
            f"{', '.join(limits) or 'none (no controllers delegated)'}"), base


class CgroupV2(Containment):
    """The ``cgroup-v2`` level (see module docstring). ``own`` is the agent's cgroup directory."""

    level = ContainmentLevel.CGROUP_V2

    def __init__(self, own: Path, group_name: str) -> None:
        self.group, enabled = prepare_group(own, group_name, with_controllers=True)
        self.can_limit = frozenset(c for c in enabled if c in ("memory", "pids", "cpu"))
        kill = "cgroup.kill" if (self.group / "cgroup.kill").exists() or _kill_supported(self.group) else "freeze+kill"
        self.details = (f"cgroup v2 at {self.group}; kill: {kill}; limits: "
                        f"{', '.join(sorted(self.can_limit)) or 'none (no controllers delegated)'}")

    def jail(self, task_id: str, limits: Limits) -> TaskJail:
        cgroup = V2Cgroup(self.group / task_cgroup_name(task_id))
        try:
            cgroup.create()
        except OSError as exc:
            raise ContainmentError(f"cannot create the task's cgroup {cgroup.path}: {exc}") from exc
        effective = Limits(
            memory_bytes=limits.memory_bytes if "memory" in self.can_limit else None,
            pids=limits.pids if "pids" in self.can_limit else None,
            cpus=limits.cpus if "cpu" in self.can_limit else None,
        )
        try:
            cgroup.set_limits(effective)
        except ContainmentError:
            cgroup.close()
            raise
        return V2Jail(cgroup, task_id, effective)

    async def recover(self, task_id: str, pgid: int | None) -> int:
        cgroup = V2Cgroup(self.group / task_cgroup_name(task_id))
        if not cgroup.path.exists():
            return 0
        killed = await cgroup.kill_all()
        cgroup.close()
        return killed

    async def sweep_stale(self, keep: set[str] | None = None) -> int:
        removed = 0
        kept = {task_cgroup_name(task_id) for task_id in keep or ()}
        for path in sorted(self.group.glob("task-*")):
            if path.name in kept:
                continue
            cgroup = V2Cgroup(path)
            await cgroup.kill_all()
            cgroup.close()
            removed += not path.exists()
        return removed

    def v2_group(self) -> Path | None:
        return self.group

    def close(self) -> None:
        rmdir_quietly(self.group)


def _kill_supported(group: Path) -> bool:
    """cgroup.kill exists in non-root cgroups only: probe with a throw-away child."""
    probe = group / "ckagent-probe"
    try:
        probe.mkdir(exist_ok=True)
        return (probe / "cgroup.kill").exists()
    except OSError:
        return False
    finally:
        rmdir_quietly(probe)
