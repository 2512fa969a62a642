"""The node's levels as types: how tasks are contained, how their network policy is enforced, whom
their processes run as, and why a stronger level is not available here.

:class:`ContainmentLevel`, :class:`EgressLevel` and :class:`IdentityLevel` list each concern's levels,
strongest first (the order of the class), each member saying what it guarantees and what it needs; code
asks a level's properties (``level.has_cgroup``, ``level is EgressLevel.PROXY``, ``level.per_spider``),
never its text. :class:`Blocker`
is why a level cannot be had on this node, with what would lift it; :class:`Unavailable` ties the
two together with the message of the refusal.

Which level a node gets is decided by one rule, :func:`decide` (auto: the first level of the host's
order that can be had; a named level: that one or an error saying why), applied by
``ckagent.containment.open_containment`` and ``ckagent.containment.egress.open_egress`` (and
``ckagent.node.identity.open_identities``) to levels they open, and by their ``judge_*`` twins (``ckagent config check``) to levels judged without changing the
machine. A level that cannot be had raises a :class:`LevelError` carrying its :class:`Blocker`.

Edges: a member's ``value`` is the text of the settings, the wire (registration, /status), the state
store, the metric label and the log, unchanged from when levels were strings; read it back with
:meth:`ContainmentLevel.parse` / :meth:`EgressLevel.parse` / :meth:`IdentityLevel.parse` (or
``ContainmentLevel(text)``).
``str(level)`` and ``f"{level}"`` are that text too, so log lines and messages read as before.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

__all__ = ["AUTO", "Blocker", "ContainmentLevel", "EgressLevel", "IdentityLevel", "Judged", "Level", "LevelError",
           "Unavailable", "decide"]

AUTO = "auto"
"""The setting that asks for the strongest level this node allows (a setting, not a level)."""

_L = TypeVar("_L", bound="_Level")


class _Level(enum.Enum):
    """A level: its value is its text at every edge (see module docstring)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls: type[_L], text: str) -> _L:
        """The level named ``text`` (exactly, as the settings and the wire write it). Raises
        ValueError naming the levels there are."""
        for level in cls:
            if level.value == text:
                return level
        raise ValueError(f"unknown level {text!r}; expected one of {', '.join(level.value for level in cls)}")

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        """``auto`` and every level's text, strongest first (the setting's choices)."""
        return (AUTO, *(str(level.value) for level in cls))

    @property
    def guarantees(self) -> str:
        """What a task gets at this level (one sentence, for `config check` and the docs)."""
        raise NotImplementedError  # pragma: no cover - each concern answers

    @property
    def needs(self) -> str:
        """What the node must give the agent for this level (one sentence)."""
        raise NotImplementedError  # pragma: no cover - each concern answers


class ContainmentLevel(_Level):
    """How a task's processes are held (``task.containment``), strongest first."""

    CGROUP_V2 = "cgroup-v2"
    CGROUP_V1 = "cgroup-v1"
    PROCESS_GROUP = "process-group"

    @property
    def has_cgroup(self) -> bool:
        """Each task has a cgroup of its own: every descendant is caught, limits and figures can be had,
        an emptied task needs no kill."""
        return self is not ContainmentLevel.PROCESS_GROUP

    @property
    def guarantees(self) -> str:
        return _CONTAINMENT[self][0]

    @property
    def needs(self) -> str:
        return _CONTAINMENT[self][1]


_CONTAINMENT = {
    ContainmentLevel.CGROUP_V2: (
        "every process of a task is in the task's cgroup before it runs: nothing escapes (setsid, double "
        "fork, a cleared environment); memory/pids/cpu limits where the controllers are delegated; OOM "
        "kills and resource figures counted by the kernel",
        "a writable cgroup of the agent's own in the cgroup v2 tree: root, or systemd Delegate=yes, or a "
        "container with its own writable cgroup namespace"),
    ContainmentLevel.CGROUP_V1: (
        "as cgroup-v2 (every process in the task's cgroups before it runs; limits, OOM kills, figures), "
        "from the v1 controllers; on a hybrid host the v2 tree gives cgroup.kill and populated events",
        "writable cgroup v1 memory or pids hierarchies (root: systemd delegates v1 to root units only)"),
    ContainmentLevel.PROCESS_GROUP: (
        "process groups, the task marker and the agent as child subreaper: ordinary spiders and browsers "
        "are caught, a process that leaves its group, clears its environment and double-forks is not; "
        "no limits, no OOM attribution, no resource figures",
        "nothing (always available)"),
}


class EgressLevel(_Level):
    """How a task's network policy is enforced (``task.egress``), strongest first."""

    NFTABLES = "nftables"
    PROXY = "proxy"
    OFF = "off"

    @property
    def kernel_enforced(self) -> bool:
        """The kernel refuses what the policy denies, whatever the task's processes do."""
        return self is EgressLevel.NFTABLES

    @property
    def uses_proxy(self) -> bool:
        """The tasks' proxy variables point at the agent's filtering proxy (it runs while the agent does)."""
        return self is EgressLevel.PROXY

    @property
    def has_policy(self) -> bool:
        """Tasks are under a network policy at all (enforced or advisory)."""
        return self is not EgressLevel.OFF

    @property
    def guarantees(self) -> str:
        return _EGRESS[self][0]

    @property
    def needs(self) -> str:
        return _EGRESS[self][1]


_EGRESS = {
    EgressLevel.NFTABLES: (
        "enforced by the kernel on every socket of every process of the task, whatever it does to its "
        "session, environment or proxy variables",
        "the tasks' cgroups in the cgroup v2 tree (containment cgroup-v2, or cgroup-v1 on a hybrid host), "
        "CAP_NET_ADMIN (root), the nftables package (libnftables or nft), a kernel whose socket cgroupv2 "
        "match answers the start-up probe"),
    EgressLevel.PROXY: (
        "advisory: the tasks' proxy variables name the agent's filtering proxy, which checks every "
        "request; a program that ignores the variables or opens sockets itself is not stopped (in "
        "Kubernetes the NetworkPolicy of config/k8s enforces the default denials)",
        "nothing (always available)"),
    EgressLevel.OFF: (
        "no network policy",
        "task.egress: off"),
}


class IdentityLevel(_Level):
    """Whom a task's processes run as (``task.run_as_user``, and whether the agent is root), strongest
    first. Installers run as the node's builder identity (``ckagent.node.identity.Identities.builder``)."""

    SPIDER_UIDS = "spider-uids"
    ONE_USER = "one-user"
    AGENT_USER = "agent-user"
    ROOT = "root"

    @property
    def per_spider(self) -> bool:
        """Each spider has a uid (and gid) of its own: spiders cannot signal, trace or read each other."""
        return self is IdentityLevel.SPIDER_UIDS

    @property
    def switches_user(self) -> bool:
        """Spiders run under another uid than the agent's (the agent is root and drops to it)."""
        return self in (IdentityLevel.SPIDER_UIDS, IdentityLevel.ONE_USER)

    @property
    def as_root(self) -> bool:
        """Spiders run as root: they can read the node's files and the agent's memory and credentials."""
        return self is IdentityLevel.ROOT

    @property
    def guarantees(self) -> str:
        return _IDENTITY[self][0]

    @property
    def needs(self) -> str:
        return _IDENTITY[self][1]


_IDENTITY = {
    IdentityLevel.SPIDER_UIDS: (
        "each spider runs under a uid and gid of its own (from task.spider_uids, no /etc/passwd entry, the "
        "same on this node across tasks and restarts): a spider cannot signal, trace or read the /proc "
        "entries of another spider's processes or of the agent, nor write another spider's files",
        "the agent runs as root, task.run_as_user unset, free uids in task.spider_uids, and every uid can "
        "reach the work dir and execute the spiders' interpreter (deps.python) and the bundled SDK"),
    IdentityLevel.ONE_USER: (
        "every spider runs as the one user task.run_as_user names: spiders cannot read the agent's files "
        "or memory, but they share one uid, so one spider can signal, trace and write another's files",
        "the agent runs as root and task.run_as_user names an existing user"),
    IdentityLevel.AGENT_USER: (
        "spiders run as the agent's own uid; the agent is non-dumpable (its memory, fds and environ are "
        "closed to them), but spiders can read and write the agent's files and each other's",
        "nothing (the agent does not run as root)"),
    IdentityLevel.ROOT: (
        "none: spiders run as root and can read the node's files, the agent's memory and its credentials",
        "task.run_as_user: root (or a root agent where spider-uids cannot be had)"),
}


Level = ContainmentLevel | EgressLevel | IdentityLevel
"""A level of any concern."""


class Blocker(enum.Enum):
    """Why a level is not available on this node; :attr:`remedy` says what would lift it. The value is
    a short stable name (for tests and logs); :attr:`summary` the sentence a person reads."""

    SETTING = "setting"
    NO_V2_TREE = "no-v2-tree"
    NO_V1_HIERARCHY = "no-v1-hierarchy"
    CGROUP_NOT_WRITABLE = "cgroup-not-writable"
    NO_TASK_CGROUP = "no-task-cgroup"
    V2_TREE_ELSEWHERE = "v2-tree-elsewhere"
    NO_NFTABLES = "no-nftables"
    NO_NET_ADMIN = "no-net-admin"
    KERNEL_NO_MATCH = "kernel-no-match"
    RUN_AS_USER = "run-as-user"
    NOT_ROOT = "not-root"
    NO_FREE_UIDS = "no-free-uids"
    UNREACHABLE = "unreachable"
    FAILED = "failed"

    @property
    def summary(self) -> str:
        """What stands in the way (one short clause)."""
        return _BLOCKERS[self][0]

    @property
    def remedy(self) -> str:
        """What would lift it, as concretely as the node can be told."""
        return _BLOCKERS[self][1]


_BLOCKERS = {
    Blocker.SETTING: (
        "the settings ask for a lower level",
        "set it to auto (or name this level); a named level that is not available fails the start"),
    Blocker.NO_V2_TREE: (
        "no cgroup v2 tree is mounted where this process is",
        "a kernel with cgroup2 mounted (systemd's unified or hybrid layout); in a container, the host's "
        "cgroup v2 with a private cgroup namespace"),
    Blocker.NO_V1_HIERARCHY: (
        "no cgroup v1 memory or pids hierarchy is mounted",
        "nothing to do on a cgroup v2 host: cgroup-v2 is the stronger level"),
    Blocker.CGROUP_NOT_WRITABLE: (
        "the agent's cgroup cannot be written",
        "run the agent as root, or under systemd with Delegate=yes (config/ckagent.service; on a hybrid "
        "host v1 is delegated to root units only), or in a container with a writable cgroup namespace (a "
        "privileged pod or container; Kubernetes mounts the pod's cgroup read-only otherwise)"),
    Blocker.NO_TASK_CGROUP: (
        "the tasks have no cgroup in the cgroup v2 tree",
        "raise the containment level to cgroup-v2 (or cgroup-v1 on a hybrid host with a v2 tree): see its line"),
    Blocker.V2_TREE_ELSEWHERE: (
        "the cgroup v2 tree is not below /sys/fs/cgroup, where nftables looks",
        "mount cgroup2 at /sys/fs/cgroup (or /sys/fs/cgroup/unified on a hybrid host)"),
    Blocker.NO_NFTABLES: (
        "neither libnftables nor the nft program is installed",
        "install the nftables package (Debian/Ubuntu: apt-get install nftables)"),
    Blocker.NO_NET_ADMIN: (
        "the agent may not change nftables (no CAP_NET_ADMIN)",
        "run the agent as root, or grant CAP_NET_ADMIN (systemd: AmbientCapabilities=CAP_NET_ADMIN; a pod: "
        "securityContext.capabilities.add: [NET_ADMIN]); in a pod that cannot, the NetworkPolicy of "
        "config/k8s enforces the default denials"),
    Blocker.KERNEL_NO_MATCH: (
        "the kernel did not refuse the probe (nftables' socket cgroupv2 match does not work here)",
        "a kernel with nft_socket's cgroupv2 match (Linux 5.13 or later) and the tasks' cgroups in the v2 tree"),
    Blocker.RUN_AS_USER: (
        "task.run_as_user names the user spiders run as",
        "unset task.run_as_user (AGENT_TASK_RUN_AS_USER; run.sh: --spider-user=off)"),
    Blocker.NOT_ROOT: (
        "the agent does not run as root (only root can start a process as another uid)",
        "run the agent as root (config/ckagent.service's root variant; in a container, runAsUser 0), leaving "
        "task.run_as_user unset"),
    Blocker.NO_FREE_UIDS: (
        "no uid of task.spider_uids is free on this node",
        "set task.spider_uids (AGENT_TASK_SPIDER_UIDS) to a range of uids and gids that /etc/passwd, "
        "/etc/group and the node's directory services (LDAP, sssd) do not use"),
    Blocker.UNREACHABLE: (
        "a spider's uid cannot reach what every spider needs",
        "give every parent directory of task.work_dir search permission for others (chmod o+x; or move "
        "task.work_dir, e.g. to /var/lib/ckagent), and install the agent where every user can execute it "
        "(e.g. /opt/ckagent, not under /root) or set deps.python (AGENT_DEPS_PYTHON) to an interpreter "
        "every user can run, e.g. /usr/bin/python3"),
    Blocker.FAILED: (
        "the level failed to start",
        "see the message"),
}


@dataclass(frozen=True)
class Unavailable:
    """A level this node does not get: ``blocker`` why, ``message`` the refusal's own words (paths,
    errno text). ``level`` is a :class:`ContainmentLevel`, an :class:`EgressLevel` or an :class:`IdentityLevel`."""

    level: Level
    blocker: Blocker
    message: str

    def describe(self) -> str:
        """``cgroup-v2: <message>; to get it: <remedy>`` (one line)."""
        return f"{self.level}: {self.message}; to get it: {self.blocker.remedy}"


@dataclass(frozen=True)
class Judged:
    """The level a node would get for one concern with its settings, judged without changing the
    machine (``ckagent.containment.judge_containment``, ``ckagent.containment.egress.judge_egress``,
    ``ckagent.node.identity.judge_identities``).

    ``details`` as the level's start line would say them (as far as they can be known before the
    start); ``passed_over`` every stronger level not had, each with why (a level may appear once per
    blocker: everything that stands in its way); ``v2_base`` for containment: the directory of the
    cgroup v2 tree the tasks' cgroups would be made below (None: none there).
    """

    level: Level
    details: str
    passed_over: tuple[Unavailable, ...] = ()
    v2_base: Path | None = None


class LevelError(Exception):
    """A level cannot be had here (the concern's subclasses: ``ContainmentError``, ``EgressError``,
    ``IdentityError``).
    ``blocker`` says why in a word; ``also`` what else stands in the way, when a check found more than
    one thing (``config check`` lists them all)."""

    def __init__(self, message: str, blocker: Blocker = Blocker.FAILED, *, also: tuple[LevelError, ...] = ()) -> None:
        super().__init__(message)
        self.blocker = blocker
        self.also = also

    def unavailable(self, level: Level) -> list[Unavailable]:
        """This error and those of ``also`` as the reasons ``level`` is not had."""
        return [Unavailable(level, error.blocker, str(error)) for error in (self, *self.also)]


_T = TypeVar("_T")
_Lv = TypeVar("_Lv", ContainmentLevel, EgressLevel, IdentityLevel)


def decide(forced: _Lv | None, order: Sequence[_Lv], attempt: Callable[[_Lv], _T], *, setting: str,
           error: type[LevelError], judge_stronger: bool = False) -> tuple[_T, tuple[Unavailable, ...]]:
    """The rule that picks a level, for every concern. Returns what ``attempt`` gave for the level
    picked and the stronger levels passed over, each with why.

    ``order`` is this host's order for ``auto``, strongest first; its last level must never fail.
    ``forced`` None (``auto``): the first level ``attempt`` gets (it raises ``error`` for one it cannot),
    each one before it passed over with its error's blockers. A forced level: that one, or ``error``
    ``"<setting>=<level> is not available here: <why>"`` with the same blocker; the levels stronger than
    it are passed over by the setting (:attr:`Blocker.SETTING`) — with ``judge_stronger`` each is
    attempted first, so one this node could not have anyway says its own blockers (for judging only:
    an attempt that opens a level would leave it open)."""
    passed_over: list[Unavailable] = []
    if forced is None:
        for level in order[:-1]:
            try:
                return attempt(level), tuple(passed_over)
            except error as exc:
                passed_over += exc.unavailable(level)
        return attempt(order[-1]), tuple(passed_over)
    rank = list(type(forced))
    stronger = [level for level in order if rank.index(level) < rank.index(forced)]
    if forced in order:
        stronger = list(order[:order.index(forced)])
    for level in stronger:
        if judge_stronger:
            try:
                attempt(level)
            except error as exc:
                passed_over += exc.unavailable(level)
                continue
        passed_over.append(Unavailable(level, Blocker.SETTING, f"{setting} is {forced}"))
    try:
        return attempt(forced), tuple(passed_over)
    except error as exc:
        raise error(f"{setting}={forced} is not available here: {exc}", exc.blocker, also=exc.also) from exc
