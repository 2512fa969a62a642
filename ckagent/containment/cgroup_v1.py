"""Level ``cgroup-v1``: v1 controllers (memory, pids, cpu, cpuacct, freezer), plus the v2 tree of a
hybrid host for membership, kill and events when it is writable.

Per task, below the agent's own cgroup in each hierarchy used (``<hier>/<own>/ckagent-<hash>/task-<id>``):

==========  ============================================  ===========================================
hierarchy   used for                                      joined
==========  ============================================  ===========================================
memory      limit (memory.limit_in_bytes), peak            always
            (memory.max_usage_in_bytes), OOM kills
            (memory.oom_control ``oom_kill``)
pids        limit (pids.max), peak (pids.peak)             always
cpu         limit (cpu.cfs_quota_us)                       only when the task has a cpus limit
cpuacct     cpu seconds (cpuacct.stat)                     only without a v2 tree
freezer     kill: freeze, SIGKILL each, thaw               only without a v2 tree
unified     membership, cgroup.kill, populated events,     when a writable v2 tree is mounted
            cpu seconds (cpu.stat)                         (systemd's hybrid layout)
==========  ============================================  ===========================================

Without a v2 tree, "empty" is waited for with pidfds of the cgroup's processes (the kernel says when
each exits; the list is read again until it stays empty), and the freeze waits for ``FROZEN`` by
re-reading ``freezer.state`` every millisecond (v1 has no notification for it; bounded to 1 s).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import trio

from ckagent.containment.base import (
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
    wait_pids_gone,
)
from ckagent.containment.cgroup_v2 import CPU_PERIOD_US, KILL_TIMEOUT, V2Cgroup, prepare_group
from ckagent.containment.hierarchy import AGENT_LEAF, task_cgroup_name
from ckagent.node.levels import Blocker, ContainmentLevel

log = logging.getLogger(__name__)

USER_HZ = os.sysconf("SC_CLK_TCK")


class V1Jail(TaskJail):
    """A task in its v1 cgroups (and its v2 cgroup on a hybrid host)."""

    level = ContainmentLevel.CGROUP_V1

    def __init__(self, dirs: dict[str, Path], unified: V2Cgroup | None, task_id: str, limits: Limits) -> None:
        self.dirs, self.unified, self.task_id, self.limits = dirs, unified, task_id, limits
        self.fds: list[int] = []

    def open(self) -> None:
        """Create the cgroups, set the limits, open cgroup.procs of each. Raises ContainmentError."""
        try:
            for name, path in self.dirs.items():
                path.mkdir(exist_ok=True)
                if name == "memory" and self.limits.memory_bytes is not None:
                    (path / "memory.limit_in_bytes").write_text(str(self.limits.memory_bytes))
                    memsw = path / "memory.memsw.limit_in_bytes"
                    if memsw.exists():
                        memsw.write_text(str(self.limits.memory_bytes))  # no swapping past the limit
                elif name == "pids" and self.limits.pids is not None:
                    (path / "pids.max").write_text(str(self.limits.pids))
                elif name == "cpu" and self.limits.cpus is not None:
                    (path / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                    (path / "cpu.cfs_quota_us").write_text(str(max(1000, int(self.limits.cpus * CPU_PERIOD_US))))
                self.fds.append(os.open(path / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
            if self.unified is not None:
                self.unified.create()
                self.fds.append(self.unified.procs_fd)
        except OSError as exc:
            self.close()
            raise ContainmentError(f"cannot create the task's cgroups ({exc.filename or ''}): {exc}") from exc

    def join_paths(self) -> list[Path]:
        paths = [path / "cgroup.procs" for path in self.dirs.values()]
        if self.unified is not None:
            paths.append(self.unified.path / "cgroup.procs")
        return paths

    def join_fds(self) -> list[int]:
        return list(self.fds)

    def v2_path(self) -> Path | None:
        return None if self.unified is None else self.unified.path

    def _primary(self) -> Path:
        return self.dirs.get("freezer") or self.dirs.get("memory") or next(iter(self.dirs.values()))

    def _pids(self) -> list[int]:
        found: set[int] = set()
        for path in self.dirs.values():
            found.update(read_procs(path / "cgroup.procs"))
        return sorted(found)

    def populated(self) -> bool:
        if self.unified is not None:
            return self.unified.populated()
        return bool(self._pids())

    async def wait_empty(self) -> None:
        if self.unified is not None:
            await self.unified.wait_empty()
            return
        while pids := self._pids():
            await wait_pids_gone(pids)

    async def kill_all(self) -> int:
        if self.unified is not None:
            return await self.unified.kill_all()
        before = self._pids()
        if not before:
            return 0
        killed: set[int] = set()
        freezer = self.dirs.get("freezer")
        state = None if freezer is None else freezer / "freezer.state"
        # (ASYNC912: when the cgroup is already empty there is nothing to wait for, so no checkpoint.)
        with trio.move_on_after(KILL_TIMEOUT) as scope:  # noqa: ASYNC912
            while pids := self._pids():
                if state is not None:
                    state.write_text("FROZEN")  # no fork can race the kill
                    await _until_frozen(state)
                kill_pids(pids, self._pids, signal.SIGKILL)
                killed.update(pids)
                if state is not None:
                    state.write_text("THAWED")
                await wait_pids_gone(pids)
        if scope.cancelled_caught:
            log.error("cgroups of task %s still hold %s %g s after the kill (stuck in the kernel?)",
                      self.task_id, self._pids(), KILL_TIMEOUT)
        return len(killed)

    def memory_now(self) -> tuple[int, str] | None:
        """The memory cgroup's working set (usage less inactive file pages), else the v2 cgroup's."""
        if "memory" in self.dirs:
            usage = read_int(self.dirs["memory"] / "memory.usage_in_bytes")
            if usage is not None:
                inactive = read_keyed(self.dirs["memory"] / "memory.stat").get("total_inactive_file", 0)
                return max(0, usage - inactive), "the cgroup's working set"
        return self.unified.memory_now() if self.unified is not None else None

    def figures(self) -> Figures:
        figures = Figures()
        if self.unified is not None:
            figures.cpu_seconds = self.unified.figures().cpu_seconds
        elif "cpuacct" in self.dirs:
            stat = read_keyed(self.dirs["cpuacct"] / "cpuacct.stat")
            if "user" in stat and "system" in stat:
                figures.cpu_seconds = (stat["user"] + stat["system"]) / USER_HZ
        if "memory" in self.dirs:
            figures.memory_peak_bytes = read_int(self.dirs["memory"] / "memory.max_usage_in_bytes")
            oom = read_keyed(self.dirs["memory"] / "memory.oom_control")
            figures.oom_kills = oom.get("oom_kill")
        if "pids" in self.dirs:
            figures.pids_peak = read_int(self.dirs["pids"] / "pids.peak")
        return figures

    def close(self) -> None:
        for fd in self.fds:
            if self.unified is None or fd != self.unified.procs_fd:
                os.close(fd)
        self.fds = []
        if self.unified is not None:
            self.unified.close()
        for path in self.dirs.values():
            rmdir_quietly(path)


def check_v1(own: dict[str, Path], *, use_unified: bool = True) -> tuple[str, Path | None]:
    """Judge the ``cgroup-v1`` level for a process whose cgroups are ``own`` without changing the
    machine: a throw-away child cgroup is made and removed in each hierarchy the level uses. Returns
    (one line of details, the v2 directory the tasks' cgroups would be below, None without a usable
    v2 tree). Blocking. Raises ContainmentError (blocker NO_V1_HIERARCHY or CGROUP_NOT_WRITABLE)."""
    writable, problems = [], []
    for name in ("memory", "pids", "cpu"):
        if name not in own:
            continue
        try:
            with throwaway_cgroup(own[name]):
                writable.append(name)
        except ContainmentError as exc:
            problems.append(f"{name}: {exc}")
    if "memory" not in writable and "pids" not in writable:
        raise ContainmentError("no writable cgroup v1 memory or pids hierarchy"
                               + (f" ({'; '.join(problems)})" if problems else ""),
                               Blocker.CGROUP_NOT_WRITABLE if problems else Blocker.NO_V1_HIERARCHY)
    unified = None
    if use_unified and "unified" in own:
        base = own["unified"].parent if own["unified"].name == AGENT_LEAF else own["unified"]
        try:
            with throwaway_cgroup(base) as probe:
                if (probe / "cgroup.kill").exists() and (probe / "cgroup.events").exists():
                    unified = base
        except ContainmentError:
            pass
    membership = f"v2 tree below {unified} (cgroup.kill, populated events)" if unified else "v1, pidfd waits"
    return (f"cgroup v1 ({', '.join(sorted(writable))}) below {own.get('memory') or own['pids']}; "
            f"membership/kill: {membership}; limits: {', '.join(sorted(writable))}"), unified


class CgroupV1(Containment):
    """The ``cgroup-v1`` level. ``own`` maps hierarchy names to the agent's cgroup directories
    (:func:`ckagent.containment.hierarchy.own_dirs`); ``use_unified`` False ignores a v2 tree (tests
    of the pure-v1 paths). Raises ContainmentError when neither memory nor pids is writable."""

    level = ContainmentLevel.CGROUP_V1

    def __init__(self, own: dict[str, Path], group_name: str, *, use_unified: bool = True) -> None:
        self.unified_group: Path | None = None
        if use_unified and "unified" in own:
            try:
                self.unified_group, _ = prepare_group(own["unified"], group_name, with_controllers=False)
                if not _has_kill(self.unified_group):
                    self.unified_group = None
            except ContainmentError as exc:
                log.info("v2 tree not usable for membership/kill (%s); using v1 only", exc)
        wanted = ["memory", "pids", "cpu"]
        if self.unified_group is None:
            wanted += ["cpuacct", "freezer"]
        self.groups: dict[str, Path] = {}
        problems = []
        for name in wanted:
            if name not in own:
                continue
            group = own[name] / group_name
            try:
                group.mkdir(exist_ok=True)
            except OSError as exc:
                problems.append(f"{name}: {exc}")
                continue
            self.groups[name] = group
        if "memory" not in self.groups and "pids" not in self.groups:
            raise ContainmentError(
                "no writable cgroup v1 memory or pids hierarchy"
                + (f" ({'; '.join(problems)})" if problems else ""),
                Blocker.CGROUP_NOT_WRITABLE if problems else Blocker.NO_V1_HIERARCHY,
            )
        if self.unified_group is None and "freezer" not in self.groups:
            log.warning("cgroup-v1 without a freezer or a v2 tree: a task forking during its kill may need "
                        "several passes")
        self.can_limit = frozenset(n for n in ("memory", "pids", "cpu") if n in self.groups)
        membership = (f"v2 tree {self.unified_group} (cgroup.kill, populated events)" if self.unified_group
                      else "v1 " + ("freezer + SIGKILL" if "freezer" in self.groups else "SIGKILL passes")
                      + ", pidfd waits")
        self.details = (f"cgroup v1 ({', '.join(sorted(self.groups))}) below {self.groups.get('memory') or '?'}"
                        f"; membership/kill: {membership}; limits: {', '.join(sorted(self.can_limit))}")

    def _jail(self, task_id: str, limits: Limits) -> V1Jail:
        name = task_cgroup_name(task_id)
        dirs = {h: g / name for h, g in self.groups.items() if h != "cpu" or limits.cpus is not None}
        unified = None if self.unified_group is None else V2Cgroup(self.unified_group / name)
        return V1Jail(dirs, unified, task_id, limits)

    def jail(self, task_id: str, limits: Limits) -> TaskJail:
        effective = Limits(
            memory_bytes=limits.memory_bytes if "memory" in self.can_limit else None,
            pids=limits.pids if "pids" in self.can_limit else None,
            cpus=limits.cpus if "cpu" in self.can_limit else None,
        )
        jail = self._jail(task_id, effective)
        jail.open()
        return jail

    async def recover(self, task_id: str, pgid: int | None) -> int:
        jail = self._jail(task_id, Limits(cpus=1.0))  # cpus: include the cpu hierarchy
        jail.dirs = {h: p for h, p in jail.dirs.items() if p.exists()}
        if jail.unified is not None and not jail.unified.path.exists():
            jail.unified = None
        if not jail.dirs and jail.unified is None:
            return 0
        killed = await jail.kill_all()
        jail.close()
        return killed

    async def sweep_stale(self, keep: set[str] | None = None) -> int:
        names: set[str] = set()
        for group in [*self.groups.values(), *([self.unified_group] if self.unified_group else [])]:
            names.update(p.name for p in group.glob("task-*"))
        names -= {task_cgroup_name(task_id) for task_id in keep or ()}
        for name in sorted(names):
            jail = V1Jail({h: g / name for h, g in self.groups.items() if (g / name).exists()},
                          V2Cgroup(self.unified_group / name) if self.unified_group and
                          (self.unified_group / name).exists() else None, name, Limits())
            await jail.kill_all()
            jail.close()
        return len(names)

    def v2_group(self) -> Path | None:
        return self.unified_group

    def close(self) -> None:
        for group in self.groups.values():
            rmdir_quietly(group)
        if self.unified_group is not None:
            rmdir_quietly(self.unified_group)


async def _until_frozen(state: Path) -> None:
    """v1 has no notification for FREEZING → FROZEN: re-read freezer.state every millisecond, ≤ 1 s."""
    with trio.move_on_after(1.0):
        for _ in range(1000):
            if (read_text(state) or "").strip() == "FROZEN":
                return
            await trio.sleep(0.001)


def _has_kill(group: Path) -> bool:
    probe = group / "ckagent-probe"
    try:
        probe.mkdir(exist_ok=True)
        return (probe / "cgroup.kill").exists() and (probe / "cgroup.events").exists()
    except OSError:
        return False
    finally:
        rmdir_quietly(probe)
