"""Containment: every task (its installers too) in a box the agent can count, limit and empty.

This package also holds the processes in the box: :mod:`.stopping` (the one stop sequence of
every supervisor: stop signal → grace → kill all), :mod:`.process` (a process on pipes: installers),
:mod:`.stoptarget` (which processes a stop signal goes to), :mod:`.monitor` (a spider that needs no
living agent), :mod:`.tails` (the last lines of a stream), :mod:`.filewatch` (a file's modifications from
inotify, its instances kept for reuse: closing one costs the loop 10–20 ms), and
:mod:`.egress` (the task's network policy, on its cgroup). May import :mod:`ckagent.node` and
:mod:`ckagent.master` (ids) only.

Levels, strongest first (``task.containment``: ``auto`` picks the first that works here):

``cgroup-v2``      (:mod:`.cgroup_v2`) the agent's own cgroup in the unified tree is writable
                   (systemd ``Delegate=yes``, or a container with its own cgroup namespace): a child
                   cgroup per task with memory/pids/cpu limits where those controllers are delegated.
``cgroup-v1``      (:mod:`.cgroup_v1`) v1 controllers are mounted and writable (memory, pids, cpu,
                   cpuacct, freezer); on a hybrid host the v2 tree gives membership, ``cgroup.kill``
                   and ``populated`` events.
``process-group``  (:mod:`.process_group`) no cgroup rights: process groups, the marker sweep, the
                   agent as child subreaper. No limits, no figures; see its docstring for what escapes.

``auto`` prefers ``cgroup-v1`` over ``cgroup-v2`` when the v2 tree has no controllers (hybrid hosts:
the limits live in v1). Every process of a task joins its cgroup before it execs its command (a
``/bin/sh`` shim that writes to ``cgroup.procs`` and execs, so Popen keeps its cheap vfork spawn;
under ``run_as`` a ``preexec_fn`` writing to fds the agent opened), so no fork can escape first.

Use::

    containment = open_containment("auto", work_dir)   # once, at agent start (logs one line)
    jail = containment.jail(task_id, limits)            # per task, before its first installer
    argv, options = jail.spawn(argv, env)               # joins before exec (a /bin/sh shim or preexec_fn)
    proc = open_process(argv, env=env, start_new_session=True, **options, ...); jail.watch(proc.pid)
    ...; await jail.kill_all(); figures = jail.figures(); jail.close()

Exceptions: :class:`ContainmentError` (a forced level is not available; a task's cgroup cannot be made).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ckagent.containment.base import (
    AGENT_OOM_SCORE_ADJ,
    LEVELS,
    SPIDER_OOM_SCORE_ADJ,
    Containment,
    ContainmentError,
    Figures,
    Limits,
    TaskJail,
    format_bytes,
    lower_own_oom_score_adj,
)
from ckagent.containment.cgroup_v1 import CgroupV1
from ckagent.containment.cgroup_v2 import CgroupV2
from ckagent.containment.hierarchy import agent_group_name, own_dirs
from ckagent.containment.process_group import ProcessGroup

__all__ = [
    "AGENT_OOM_SCORE_ADJ",
    "LEVELS",
    "SPIDER_OOM_SCORE_ADJ",
    "Containment",
    "ContainmentError",
    "Figures",
    "Limits",
    "TaskJail",
    "format_bytes",
    "open_containment",
]

log = logging.getLogger(__name__)


def open_containment(setting: str, work_dir: Path, *, use_unified: bool = True) -> Containment:
    """The containment level for this agent: ``setting`` is ``auto`` or one of :data:`LEVELS`.

    Blocking (a few reads and mkdirs in cgroupfs). Lowers the agent's own oom_score_adj where it
    may. Logs one line naming the level. Raises ContainmentError when a forced level cannot be used
    here (the message says why); ``auto`` never raises (it falls back to ``process-group``).
    ``use_unified`` False: ``cgroup-v1`` ignores a v2 tree (tests of the pure-v1 paths).
    """
    if setting != "auto" and setting not in LEVELS:
        raise ContainmentError(f"task.containment: unknown level {setting!r}; expected auto or one of {', '.join(LEVELS)}")
    own = own_dirs()
    group = agent_group_name(work_dir)
    tried: list[str] = []
    containment: Containment | None = None
    order = [setting] if setting != "auto" else _auto_order(own)
    for level in order:
        try:
            containment = _open(level, own, group, use_unified)
            break
        except ContainmentError as exc:
            if setting != "auto":
                raise ContainmentError(f"task.containment={setting} is not available here: {exc}") from exc
            tried.append(f"{level}: {exc}")
    if containment is None:
        containment = ProcessGroup(why="; ".join(tried))
    adj = lower_own_oom_score_adj()
    log.info("containment: %s — %s; agent oom_score_adj %s, spiders +%d", containment.level,
             containment.details, adj, SPIDER_OOM_SCORE_ADJ)
    return containment


def _auto_order(own: dict[str, Path]) -> list[str]:
    v1 = any(name in own for name in ("memory", "pids"))
    if "unified" in own and not v1:
        return ["cgroup-v2", "process-group"]
    return ["cgroup-v1", "cgroup-v2", "process-group"]


def _open(level: str, own: dict[str, Path], group: str, use_unified: bool) -> Containment:
    if level == "cgroup-v2":
        if "unified" not in own:
            raise ContainmentError("no cgroup v2 tree is mounted (or this process is outside it)")
        return CgroupV2(own["unified"], group)
    if level == "cgroup-v1":
        if not any(name in own for name in ("memory", "pids")):
            raise ContainmentError("no cgroup v1 memory or pids hierarchy is mounted")
        return CgroupV1(own, group, use_unified=use_unified)
    return ProcessGroup()


def available_levels(work_dir: Path) -> list[str]:
    """The levels this machine can run (for tests: each is opened and closed once)."""
    found = []
    for level in LEVELS:
        try:
            containment = _open(level, own_dirs(), agent_group_name(work_dir), True)
        except ContainmentError:
            continue
        containment.close()
        found.append(level)
    return found
