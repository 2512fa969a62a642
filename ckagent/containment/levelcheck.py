"""Which containment and egress levels this node gets with its settings, why, and what would raise
each — judged without changing the machine, for ``ckagent config check``.

The levels are judged by :func:`ckagent.containment.judge_containment` and
:func:`ckagent.containment.egress.judge_egress`: the same decision the agent's start makes
(:func:`ckagent.node.levels.decide`), with probes that remove what they create (a throw-away cgroup
``ckagent-check-<pid>-<hex>``, a throw-away table ``inet ckagent_check_<pid>``), also on failure. They
are judged for a process like this one (its user, its cgroups): an agent started the same way. An agent
under systemd runs in its unit's cgroup instead (``Delegate=yes`` makes that one writable), so a check
from a login shell may judge the cgroup levels lower than the service gets.

Example (root on a hybrid host)::

    containment: cgroup-v1 (task.containment: auto)
      guarantees: every process of a task is in the task's cgroups before it runs ...
      here: cgroup v1 (cpu, memory, pids) below /sys/fs/cgroup/memory/...
    egress: proxy (task.egress: proxy)
      guarantees: advisory: the tasks' proxy variables name the agent's filtering proxy ...
      here: filtering proxy in the tasks' proxy variables (advisory: a program may ignore them)
      not nftables: task.egress is proxy
        to get it: set it to auto (or name this level); ...
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ckagent.containment import ContainmentError, judge_containment
from ckagent.containment.egress import EgressError, judge_egress
from ckagent.containment.hierarchy import own_dirs
from ckagent.node.config import Settings
from ckagent.node.egress_policy import PolicyError, parse_text
from ckagent.node.levels import Judged, LevelError, Unavailable

__all__ = ["LevelReport", "check_levels"]


@dataclass
class LevelReport:
    """What :func:`check_levels` found: ``lines`` to print (stdout), ``errors`` the settings the agent's
    start would refuse (a named level this node cannot have), each with what would make it available."""

    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def check_levels(settings: Settings) -> LevelReport:
    """Judge the containment and egress levels of ``settings`` on this node (see module docstring).
    Blocking (cgroupfs reads, a throw-away cgroup and table, the egress probe's child: ~0.1 s). Never
    raises for what it finds: an unavailable named level is an entry of ``errors``."""
    report = LevelReport()
    containment: Judged | None = None
    try:
        containment = judge_containment(settings.task.containment)
    except ContainmentError as exc:
        report.errors.append(_refusal(exc))
        report.lines.append(f"containment: none (task.containment: {settings.task.containment}): {exc}")
    if containment is not None:
        report.lines += explain(containment, "task.containment", settings.task.containment)
    if containment is None:
        report.lines.append("egress: not judged (the containment setting must be fixed first)")
        return report
    try:
        policy = parse_text(settings.task.egress_deny, settings.task.egress_allow)
        egress = judge_egress(settings.task.egress, containment, policy)
    except PolicyError as exc:  # (parsed once already by the settings: not expected)
        report.errors.append(f"task.egress_deny / task.egress_allow: {exc}")
        return report
    except EgressError as exc:
        report.errors.append(_refusal(exc))
        report.lines.append(f"egress: none (task.egress: {settings.task.egress}): {exc}")
        return report
    report.lines += explain(egress, "task.egress", settings.task.egress)
    report.lines.append(_judged_for())
    return report


def explain(judged: Judged, setting: str, value: str) -> list[str]:
    """The lines that explain one judged level: what it is, guarantees, what it is here, and each
    stronger level passed over with why and what would lift that."""
    concern = setting.split(".")[-1]
    lines = [f"{concern}: {judged.level} ({setting}: {value})",
             f"  guarantees: {judged.level.guarantees}",
             f"  here: {judged.details}"]
    for unavailable in judged.passed_over:
        lines += _passed_over(unavailable)
    return lines


def _passed_over(unavailable: Unavailable) -> list[str]:
    return [f"  not {unavailable.level}: {unavailable.message}",
            f"    to get it: {unavailable.blocker.remedy}"]


def _refusal(exc: LevelError) -> str:
    """A named level the start would refuse: the refusal, then what would lift each blocker."""
    remedies = dict.fromkeys(error.blocker.remedy for error in (exc, *exc.also))
    also = "".join(f"; also: {error}" for error in exc.also)
    return f"{exc}{also}; to get it: {' / '.join(remedies)}"


def _judged_for() -> str:
    """Whom the levels were judged for (this process: its user and cgroup)."""
    own = own_dirs()
    where = [f"{name} {own[name]}" for name in ("unified", "memory") if name in own]
    return (f"(judged for an agent started as this command is: uid {os.geteuid()}, cgroups "
            f"{', '.join(where) or 'none'}; nothing was left changed on this machine)")
