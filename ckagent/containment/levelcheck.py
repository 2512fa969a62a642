"""Which containment, egress and identity levels this node gets with its settings, why, and what would
raise each — judged without changing the machine, for ``ckagent config check``.

The levels are judged by :func:`ckagent.containment.judge_containment` and
:func:`ckagent.containment.egress.judge_egress`: the same decision the agent's start makes
(:func:`ckagent.node.levels.decide`), with probes that remove what they create (a throw-away cgroup
``ckagent-check-<pid>-<hex>``, a throw-away table ``inet ckagent_check_<pid>``), also on failure. They
are judged for a process like this one (its user, its cgroups): an agent started the same way. The
identity level (whom spiders run as) is judged by :func:`ckagent.node.identity.judge_identities`: its probe
runs the spiders' interpreter as the first free uid of ``task.spider_uids`` and records no uid. An agent
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
    identity: spider-uids (task.run_as_user: unset)
      guarantees: each spider runs under a uid and gid of its own ...
      here: each spider its own uid and gid from task.spider_uids 61184-65519 (4336 ids, ...)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ckagent.containment import ContainmentError, judge_containment
from ckagent.containment.egress import EgressError, judge_egress
from ckagent.containment.hierarchy import own_dirs
from ckagent.node.config import Settings
from ckagent.node.egress_policy import PolicyError, parse_text
from ckagent.node.identity import IdentityError, judge_identities
from ckagent.node.levels import Blocker, Judged, LevelError, Unavailable

__all__ = ["LevelReport", "check_levels"]


@dataclass
class LevelReport:
    """What :func:`check_levels` found: ``lines`` to print (stdout), ``errors`` the settings the agent's
    start would refuse (a named level this node cannot have), each with what would make it available."""

    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def check_levels(settings: Settings, *, sdk_dir: Path | None = None) -> LevelReport:
    """Judge the containment, egress and identity levels of ``settings`` on this node (see module
    docstring); ``sdk_dir`` is the bundled SDK's directory, which every spider's uid must reach (None:
    not checked). Blocking (cgroupfs reads, a throw-away cgroup and table, the egress probe's child, the
    identity probe's child: ~0.2 s). Never raises for what it finds: an unavailable named level, or a
    ``task.run_as_user`` the start would refuse, is an entry of ``errors``."""
    report = LevelReport()
    _containment_and_egress(settings, report)
    report.lines += _identity(settings, sdk_dir, report)
    report.lines.append(_judged_for())
    return report


def _containment_and_egress(settings: Settings, report: LevelReport) -> None:
    """The containment and egress lines (egress is judged on the containment judged)."""
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
        return
    try:
        policy = parse_text(settings.task.egress_deny, settings.task.egress_allow)
        egress = judge_egress(settings.task.egress, containment, policy)
    except PolicyError as exc:  # (parsed once already by the settings: not expected)
        report.errors.append(f"task.egress_deny / task.egress_allow: {exc}")
        return
    except EgressError as exc:
        report.errors.append(_refusal(exc))
        report.lines.append(f"egress: none (task.egress: {settings.task.egress}): {exc}")
        return
    report.lines += explain(egress, "task.egress", settings.task.egress)


def _identity(settings: Settings, sdk_dir: Path | None, report: LevelReport) -> list[str]:
    """The identity lines: the level ``task.run_as_user`` (unset: the best this node gives) leads to,
    each stronger level not had with why and what would give it; a user the start would refuse is an
    error."""
    value = settings.task.run_as_user or "unset"
    python = str(settings.deps.python) if settings.deps.python is not None else sys.executable
    try:
        judged = judge_identities(settings.task.run_as_user, settings.task.spider_uids, settings.task.work_dir,
                                  python=python, sdk_dir=sdk_dir)
    except IdentityError as exc:  # (an unknown user's message says what to do itself)
        report.errors.append(str(exc) if exc.blocker is Blocker.FAILED else _refusal(exc))
        return [f"identity: none (task.run_as_user: {value}): {exc}"]
    return explain(judged, "task.run_as_user", value, concern="identity")


def explain(judged: Judged, setting: str, value: str, *, concern: str | None = None) -> list[str]:
    """The lines that explain one judged level: what it is, guarantees, what it is here, and each
    stronger level passed over with why and what would lift that. ``concern`` heads them (default: the
    setting's last part, ``containment``/``egress``)."""
    concern = concern or setting.split(".")[-1]
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
