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

The agent's own processes (spiders and installers) start behind a monitor that joins the same way
(.monitor.spawn_monitored) and are supervised by one supervisor (.supervision.supervise); ``jail.spawn``
is the join alone, for a process that needs no monitor.

Exceptions: :class:`ContainmentError` (a forced level is not available; a task's cgroup cannot be made).
"""

from __future__ import annotations

import logging
import os
import sys
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
from ckagent.containment.cgroup_v1 import CgroupV1, check_v1
from ckagent.containment.cgroup_v2 import CgroupV2, check_v2
from ckagent.containment.hierarchy import agent_group_name, own_dirs
from ckagent.containment.private import needed_paths, open_privacy
from ckagent.containment.process_group import ProcessGroup
from ckagent.node.configschema import Settings
from ckagent.node.levels import AUTO, Blocker, ContainmentLevel, Judged, Unavailable, decide
from ckagent.node.workmodes import seal_work_dir, spiders_apart

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
    "judge_containment",
    "open_containment",
]

log = logging.getLogger(__name__)


def open_containment(setting: str | ContainmentLevel, work_dir: Path, *, use_unified: bool = True,
                     node: Settings | None = None) -> Containment:
    """The containment level for this agent: ``setting`` is ``auto`` or a level (or its text).

    Decides by :func:`~ckagent.node.levels.decide` (as :func:`judge_containment` does). Blocking (a few reads and mkdirs in
    cgroupfs). Lowers the agent's own oom_score_adj where it may. Logs one line naming the level. The
    result's ``passed_over`` lists the stronger levels not had, each with its
    :class:`~ckagent.node.levels.Blocker`. Raises ContainmentError when a forced level cannot be used
    here (the message says why, its ``blocker`` in a word); ``auto`` never raises (it falls back to
    ``process-group``). ``use_unified`` False: ``cgroup-v1`` ignores a v2 tree (tests of the pure-v1 paths).
    ``node`` (the node's settings: the agent's start): the work dir's modes are set first (the agent's
    own files unreadable to spiders: :func:`~ckagent.node.workmodes.seal_work_dir`), then the tasks'
    private /tmp, /dev/shm and /proc are proven (``task.private_tmp``:
    :func:`~ckagent.containment.private.open_privacy`, one log line; the result's ``privacy``), which
    raises ContainmentError for a named level not available.
    """
    forced = _parse_setting(setting)
    own = own_dirs()
    group = agent_group_name(work_dir)
    containment, passed_over = decide(forced, _auto_order(own), lambda level: _open(level, own, group, use_unified),
                                      setting="task.containment", error=ContainmentError)
    containment.passed_over = passed_over
    adj = lower_own_oom_score_adj()
    log.info("containment: %s — %s; agent oom_score_adj %s, spiders +%d", containment.level,
             containment.details, adj, SPIDER_OOM_SCORE_ADJ)
    if node is not None:
        shared = tuple(Path(p) for p in node.task.private_tmp_shared.split(",") if p)
        work_dir.mkdir(parents=True, exist_ok=True)
        seal_work_dir(work_dir, apart=spiders_apart(os.geteuid(), node.task.run_as_user), config_file=node.config_file)
        containment.privacy = open_privacy(work_dir, needed_paths(work_dir, node.deps.python or sys.executable)
                                           + shared, node.task.private_tmp)
    return containment


def judge_containment(setting: str | ContainmentLevel, *, use_unified: bool = True) -> Judged:
    """The level :func:`open_containment` would give with ``setting``, judged without changing the
    machine: the same decision (:func:`~ckagent.node.levels.decide`), each level judged by what can be read and by
    throw-away cgroups made and removed (:func:`~ckagent.containment.cgroup_v2.check_v2`,
    :func:`~ckagent.containment.cgroup_v1.check_v1`) instead of opened; every stronger level is judged,
    also past a forced one (``passed_over``: its real blocker, or SETTING when only the setting stands in
    the way). Judged for a process in this process's cgroups: an agent started as this command is.
    Blocking. Raises ContainmentError as :func:`open_containment` would (a forced level not available).
    """
    own = own_dirs()
    judged, passed_over = decide(_parse_setting(setting), _auto_order(own), lambda level: _check(level, own, use_unified),
                                 setting="task.containment", error=ContainmentError, judge_stronger=True)
    return Judged(judged.level, judged.details, passed_over, judged.v2_base)


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


def _auto_order(own: dict[str, Path]) -> list[ContainmentLevel]:
    v1 = any(name in own for name in ("memory", "pids"))
    if "unified" in own and not v1:
        return [ContainmentLevel.CGROUP_V2, ContainmentLevel.PROCESS_GROUP]
    return [ContainmentLevel.CGROUP_V1, ContainmentLevel.CGROUP_V2, ContainmentLevel.PROCESS_GROUP]


def _mounted(level: ContainmentLevel, own: dict[str, Path]) -> None:
    """Raise ContainmentError when the hierarchy ``level`` needs is not mounted where this process is."""
    if level is ContainmentLevel.CGROUP_V2 and "unified" not in own:
        raise ContainmentError("no cgroup v2 tree is mounted (or this process is outside it)", Blocker.NO_V2_TREE)
    if level is ContainmentLevel.CGROUP_V1 and not any(name in own for name in ("memory", "pids")):
        raise ContainmentError("no cgroup v1 memory or pids hierarchy is mounted", Blocker.NO_V1_HIERARCHY)


def _open(level: ContainmentLevel, own: dict[str, Path], group: str, use_unified: bool) -> Containment:
    _mounted(level, own)
    if level is ContainmentLevel.CGROUP_V2:
        return CgroupV2(own["unified"], group)
    if level is ContainmentLevel.CGROUP_V1:
        return CgroupV1(own, group, use_unified=use_unified)
    return ProcessGroup()


def _check(level: ContainmentLevel, own: dict[str, Path], use_unified: bool) -> Judged:
    _mounted(level, own)
    if level is ContainmentLevel.CGROUP_V2:
        details, base = check_v2(own["unified"])
        return Judged(level, details, v2_base=base)
    if level is ContainmentLevel.CGROUP_V1:
        details, unified = check_v1(own, use_unified=use_unified)
        return Judged(level, details, v2_base=unified)
    return Judged(level, "process groups + marker sweep; no limits, no resource figures")


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
