"""Containment: every task (its installers too) in a box the agent can count, limit and empty.

This package also holds the processes in the box: :mod:`.stopping` (the one stop sequence of
every supervisor: stop signal → grace → kill all), :mod:`.process` (a process on pipes: installers),
:mod:`.stoptarget` (which processes a stop signal goes to), :mod:`.monitor` (a spider that needs no
living agent), :mod:`.tails` (the last lines of a stream), :mod:`.filewatch` (a file's modifications from
inotify, its instances kept for reuse: closing one costs the loop 10–20 ms), and
:mod:`.egress` (the task's network policy, on its cgroup). May import :mod:`ckagent.node` and
:mod:`ckagent.master` (ids) only.

Levels (:class:`ckagent.node.levels.ContainmentLevel`), strongest first (``task.containment``: ``auto``
picks the first that works here; :func:`open_containment` alone decides, and says why a stronger one
was passed over):

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
from ckagent.node.levels import AUTO, Blocker, ContainmentLevel, Unavailable

__all__ = [
    "AGENT_OOM_SCORE_ADJ",
    "SPIDER_OOM_SCORE_ADJ",
    "Containment",
    "ContainmentError",
    "ContainmentLevel",
    "Figures",
    "Limits",
    "TaskJail",
    "Unavailable",
    "format_bytes",
    "open_containment",
]

log = logging.getLogger(__name__)


def open_containment(setting: str | ContainmentLevel, work_dir: Path, *, use_unified: bool = True) -> Containment:
    """The containment level for this agent: ``setting`` is ``auto`` or a level (or its text).

    The one place that decides the level. Blocking (a few reads and mkdirs in cgroupfs). Lowers the
    agent's own oom_score_adj where it may. Logs one line naming the level. The result's
    ``passed_over`` lists the stronger levels not had, each with its :class:`~ckagent.node.levels.Blocker`.
    Raises ContainmentError when a forced level cannot be used here (the message says why, its
    ``blocker`` in a word); ``auto`` never raises (it falls back to ``process-group``).
    ``use_unified`` False: ``cgroup-v1`` ignores a v2 tree (tests of the pure-v1 paths).
    """
    forced = _parse_setting(setting)
    own = own_dirs()
    group = agent_group_name(work_dir)
    passed_over: list[Unavailable] = []
    containment: Containment | None = None
    order = [forced] if forced is not None else _auto_order(own)
    for level in order:
        try:
            containment = _open(level, own, group, use_unified)
            break
        except ContainmentError as exc:
            if forced is not None:
                raise ContainmentError(f"task.containment={level} is not available here: {exc}", exc.blocker) from exc
            passed_over.append(Unavailable(level, exc.blocker, str(exc)))
    if containment is None:
        containment = ProcessGroup(why="; ".join(f"{u.level}: {u.message}" for u in passed_over))
    containment.passed_over = tuple(passed_over) + _not_tried(forced)
    adj = lower_own_oom_score_adj()
    log.info("containment: %s — %s; agent oom_score_adj %s, spiders +%d", containment.level,
             containment.details, adj, SPIDER_OOM_SCORE_ADJ)
    return containment


def _parse_setting(setting: str | ContainmentLevel) -> ContainmentLevel | None:
    """None for ``auto``, else the level; raises ContainmentError for an unknown text."""
    if isinstance(setting, ContainmentLevel):
        return setting
    if setting == AUTO:
        return None
    try:
        return ContainmentLevel.parse(setting)
    except ValueError:
        raise ContainmentError(f"task.containment: unknown level {setting!r}; expected auto or one of "
                               f"{', '.join(level.value for level in ContainmentLevel)}") from None


def _not_tried(forced: ContainmentLevel | None) -> tuple[Unavailable, ...]:
    """The levels stronger than a forced one: passed over by the setting (not tried)."""
    if forced is None:
        return ()
    stronger = list(ContainmentLevel)[:list(ContainmentLevel).index(forced)]
    return tuple(Unavailable(level, Blocker.SETTING, f"task.containment is {forced}") for level in stronger)


def _auto_order(own: dict[str, Path]) -> list[ContainmentLevel]:
    v1 = any(name in own for name in ("memory", "pids"))
    if "unified" in own and not v1:
        return [ContainmentLevel.CGROUP_V2, ContainmentLevel.PROCESS_GROUP]
    return [ContainmentLevel.CGROUP_V1, ContainmentLevel.CGROUP_V2, ContainmentLevel.PROCESS_GROUP]


def _open(level: ContainmentLevel, own: dict[str, Path], group: str, use_unified: bool) -> Containment:
    if level is ContainmentLevel.CGROUP_V2:
        if "unified" not in own:
            raise ContainmentError("no cgroup v2 tree is mounted (or this process is outside it)", Blocker.NO_V2_TREE)
        return CgroupV2(own["unified"], group)
    if level is ContainmentLevel.CGROUP_V1:
        if not any(name in own for name in ("memory", "pids")):
            raise ContainmentError("no cgroup v1 memory or pids hierarchy is mounted", Blocker.NO_V1_HIERARCHY)
        return CgroupV1(own, group, use_unified=use_unified)
    return ProcessGroup()


def available_levels(work_dir: Path) -> list[ContainmentLevel]:
    """The levels this machine can run (for tests: each is opened and closed once)."""
    found = []
    for level in ContainmentLevel:
        try:
            containment = _open(level, own_dirs(), agent_group_name(work_dir), True)
        except ContainmentError:
            continue
        containment.close()
        found.append(level)
    return found
