"""Egress: a network policy per task, enforced by the kernel on the task's cgroup.

Levels (:class:`ckagent.node.levels.EgressLevel`), strongest first (``task.egress``: ``auto`` picks the
first that works here; :func:`open_egress` alone decides, and says why a stronger one was passed over):

``nftables``  the task's cgroup has a directory in the cgroup v2 tree (pure v2, or a hybrid host's
              ``unified`` tree), the agent may change nftables (CAP_NET_ADMIN) and the kernel's
              ``socket cgroupv2`` match answers a probe at start. Every socket of every process of
              the task is filtered, whatever the process does to its session, environment or proxy
              variables (:mod:`.table`).
``proxy``     no kernel help (no v2 tree, no CAP_NET_ADMIN, no nft): the task's proxy variables point
              at the agent's filtering proxy (:mod:`.proxy`). **Advisory**: a program that ignores
              ``HTTP_PROXY``/``HTTPS_PROXY`` or opens sockets itself is not stopped.
``off``       no policy (``task.egress: off``).

Use::

    egress = open_egress("auto", containment, group_name, policy, agent_port=9000)   # at start
    rules = egress.attach(jail, task_id, task_policy)       # blocking, before the task's first process
    refused = egress.refusals(rules)                        # blocking: [Refusal], most refused first
    egress.detach(rules, refused)                           # blocking, before the jail is removed
    egress.close()

Exceptions: :class:`EgressError` (a forced level is not available; a task's rules cannot be added).
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckagent.containment.egress.nft import Nft, NftError, open_nft
from ckagent.containment.egress.table import (
    NFT_CGROUP_ROOT,
    TABLE_PREFIX,
    EgressTable,
    Refusal,
    TaskRules,
    remove_orphans,
    table_name,
)
from ckagent.node.egress_policy import DEFAULT_DENY, GROUPS, EgressPolicy, PolicyError, parse_text
from ckagent.node.levels import AUTO, Blocker, EgressLevel, Judged, LevelError, Unavailable, decide

if TYPE_CHECKING:  # (the containment imports Trio: the protocol module imports this package's policy)
    from ckagent.containment import Containment, TaskJail

__all__ = [
    "DEFAULT_DENY",
    "GROUPS",
    "Egress",
    "EgressError",
    "EgressLevel",
    "EgressPolicy",
    "PolicyError",
    "Refusal",
    "TaskRules",
    "describe_refusals",
    "judge_egress",
    "open_egress",
    "parse_text",
    "report_refusals",
]

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 5.0
"""Seconds the start-up probe's child may take."""


class EgressError(LevelError):
    """A forced egress level is not available here, or a task's rules cannot be added. ``blocker``
    says why a level is not available in a word (:class:`ckagent.node.levels.Blocker`)."""


def describe_refusals(refused: list[Refusal]) -> str:
    """``egress: 3 connections refused: 169.254.169.254:80 ×3`` ('' when nothing was refused)."""
    total = sum(r.count for r in refused)
    if not total:
        return ""
    shown = ", ".join(f"{r} ×{r.count}" for r in refused[:10])
    more = f", … ({len(refused) - 10} more destinations)" if len(refused) > 10 else ""
    return f"egress: {total} connection{'s' if total != 1 else ''} refused: {shown}{more}"


def report_refusals(task_id: str, refused: list[Refusal], notice: Callable[[str], None] | None = None) -> None:
    """Log one line per refused destination of a task, and put :func:`describe_refusals`'s line into
    the task's log through ``notice``."""
    for r in refused:
        log.warning("task %s: egress policy refused %d connection(s) to %s", task_id, r.count, r)
    line = describe_refusals(refused)
    if line and notice is not None:
        notice(line)


class Egress:
    """The node's egress level (see module docstring). ``level`` the level; ``details`` one line for
    the log and /status; ``policy`` the node's default policy; ``passed_over`` the stronger levels
    this node did not get, each with why (set by :func:`open_egress`)."""

    def __init__(self, level: EgressLevel, details: str, policy: EgressPolicy, *, table: EgressTable | None = None,
                 v2_root: Path | None = None, agent_port: int | None = None,
                 resolvers: tuple[tuple[str, int], ...] = ()) -> None:
        self.level, self.details, self.policy = level, details, policy
        self.passed_over: tuple[Unavailable, ...] = ()
        self.table, self.v2_root, self.agent_port, self.resolvers = table, v2_root, agent_port, resolvers
        self.proxy_url: str | None = None
        """At the ``proxy`` level: the filtering proxy's URL (set when the proxy listens)."""
        self._proxied: dict[str, tuple[TaskRules, collections.Counter[tuple[str, int]]]] = {}
        """At the ``proxy`` level: proxy user name → (the task's rules, its refusals)."""

    def effective(self, task_policy: EgressPolicy | None) -> EgressPolicy:
        """The node's policy with the task's denials and exceptions added."""
        return self.policy if task_policy is None else self.policy.merged(task_policy)

    def attach(self, jail: TaskJail, task_id: str, task_policy: EgressPolicy | None = None) -> TaskRules | None:
        """Put the task's cgroup under its policy (blocking, ~0.3 ms); at the ``proxy`` level register
        it with the proxy; None at ``off``. Raises EgressError when the rules cannot be added (the task
        must not run unprotected)."""
        if self.level.uses_proxy:
            user = _proxy_user(task_id)
            rules = TaskRules(task_id, "", user, self.effective(task_policy))
            self._proxied[user] = (rules, collections.Counter())
            return rules
        if self.table is None:
            return None
        path = jail.v2_path()
        if path is None:
            raise EgressError(f"egress: the task's jail ({jail.level}) has no cgroup in the v2 tree to filter")
        policy = self.effective(task_policy)
        try:
            return self.table.add(task_id, str(path.relative_to(NFT_CGROUP_ROOT)), policy, self.agent_port,
                                  self.resolvers, pin=task_policy is None)  # (the node's: most tasks')
        except (NftError, ValueError) as exc:
            raise EgressError(f"egress: cannot add the rules of task {task_id}: {exc}") from exc

    def refusals(self, rules: TaskRules | None) -> list[Refusal]:
        """What the task was refused so far (blocking), most refused first. [] at ``off`` or when
        nft fails."""
        if rules is not None and rules.chain in self._proxied:
            counts = self._proxied[rules.chain][1]
            return sorted((Refusal(a, p, n) for (a, p), n in counts.items()), key=lambda r: (-r.count, r.address))
        if rules is None or self.table is None or rules.removed:
            return []
        try:
            return self.table.refusals(rules)
        except NftError as exc:
            log.warning("egress: cannot read the counters of task %s: %s", rules.task_id, exc)
            return []

    def detach(self, rules: TaskRules | None, refused: list[Refusal] | None = None) -> None:
        """Remove the task's rules (blocking; before its cgroup goes). Never raises."""
        if rules is not None:
            self._proxied.pop(rules.chain, None)
        if rules is None or self.table is None:
            return
        try:
            self.table.remove(rules, refused or [])
        except NftError as exc:  # pragma: no cover - remove() logs and swallows nft's refusals
            log.warning("egress: cannot remove the rules of task %s: %s", rules.task_id, exc)

    def proxy_lookup(self, user: str) -> tuple[EgressPolicy, Callable[[str, int], None]] | None:
        """For the proxy: the policy of the task a proxy user name stands for, and its refusal counter."""
        found = self._proxied.get(user)
        if found is None:
            return None
        rules, counts = found

        def count(address: str, port: int) -> None:
            if counts[(address, port)] == 0:
                log.warning("task %s: egress policy refused a connection to %s (proxy)", rules.task_id,
                            Refusal(address, port, 1))
            counts[(address, port)] += 1

        return rules.policy, count

    def task_env(self, rules: TaskRules | None) -> dict[str, str]:
        """Variables a task's environment gets at the ``proxy`` level ({} otherwise)."""
        if not self.level.uses_proxy or self.proxy_url is None or rules is None:
            return {}
        # user:password (the password says nothing): Python's urllib sends no credentials without one.
        url = self.proxy_url.replace("://", f"://{rules.chain}:task@", 1)
        env = {name: url for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                                      "all_proxy")}
        env["NO_PROXY"] = env["no_proxy"] = ""
        return env

    def to_json(self) -> dict[str, Any]:
        """``{"level", "details", "policy", "deny", "allow"}`` for registration and /status."""
        wire = self.policy.to_json()
        return {"level": self.level.value, "details": self.details, "policy": self.policy.describe(),
                "deny": wire["deny"], "allow": wire["allow"]}

    def close(self) -> None:
        """Delete the agent's table (the tasks are gone). Never raises."""
        if self.table is not None:
            with contextlib.suppress(NftError):
                self.table.close()
            self.table = None


def _proxy_user(task_id: str) -> str:
    from ckagent.containment.egress.table import policy_key

    return "t" + policy_key(EgressPolicy(), None, ((task_id, 0),))


def open_egress(setting: str | EgressLevel, containment: Containment | None, group_name: str, policy: EgressPolicy,
                *, agent_port: int | None = None, nft: Nft | None = None, probe: bool = True,
                work_dir: Path | None = None) -> Egress:
    """The egress level for this agent: ``setting`` ``auto`` or a level (or its text), decided by
    :func:`~ckagent.node.levels.decide` (as :func:`judge_egress` does); the result's ``passed_over``
    lists the stronger levels not had, each with its :class:`~ckagent.node.levels.Blocker`.

    Blocking (nft batches, and at ``nftables`` a probe: a short child process in a throw-away cgroup
    connects to a loopback socket of the agent and must be refused). ``work_dir`` (the agent's) is
    written into the table's comment; the tables of other work dirs that no longer exist (a removed
    test directory, an uninstalled agent killed before its stop) are deleted: no agent can come back
    for their tasks. Logs one line naming the level.
    Raises EgressError when a forced level cannot be used (the message says why, its ``blocker`` in
    a word); ``auto`` never raises (it falls back to ``proxy``).
    """
    forced = _parse_setting(setting)
    resolvers = _resolvers()
    group = None if containment is None else containment.v2_group()
    where = "none" if containment is None else str(containment.level)

    def attempt(level: EgressLevel) -> Egress:
        if level is EgressLevel.NFTABLES:
            return _open_nftables(group, where, group_name, policy, agent_port, nft, probe, resolvers, work_dir)
        if level is EgressLevel.PROXY:
            return Egress(EgressLevel.PROXY, PROXY_DETAILS, policy, agent_port=agent_port, resolvers=resolvers)
        return Egress(EgressLevel.OFF, "no network policy (task.egress: off)", EgressPolicy())

    egress, passed_over = decide(forced, AUTO_ORDER, attempt, setting="task.egress", error=EgressError)
    egress.passed_over = passed_over
    kernel = [u.message for u in passed_over if u.blocker is not Blocker.SETTING]
    if egress.level.uses_proxy and kernel:
        egress.details += f"; the kernel cannot: {kernel[0]}"
    log.info("egress: %s — %s; %s", egress.level, egress.details, egress.policy.describe())
    return egress


AUTO_ORDER = (EgressLevel.NFTABLES, EgressLevel.PROXY)
"""What ``auto`` tries, strongest first (``off`` only when named)."""

PROXY_DETAILS = "filtering proxy in the tasks' proxy variables (advisory: a program may ignore them)"


def judge_egress(setting: str | EgressLevel, containment: Judged | None, policy: EgressPolicy, *,
                 nft: Nft | None = None) -> Judged:
    """The level :func:`open_egress` would give with ``setting`` next to the judged ``containment``
    (:func:`ckagent.containment.judge_containment`; None: it cannot be had), judged without changing
    the machine: the same decision, ``nftables`` judged by each of its conditions (every unmet one is a
    ``passed_over`` entry with its blocker) and, when all are met, by the start-up probe in a throw-away
    cgroup below ``containment.v2_base`` with a throw-away table (``inet ckagent_check_<pid>``, no
    agent's), both removed also on failure; other agents' tables are not looked at. Every stronger
    level is judged, also past a forced one. Blocking (the probe's child: ~0.1 s). Raises EgressError
    as :func:`open_egress` would (a forced level not available)."""
    base = None if containment is None else containment.v2_base
    where = "none" if containment is None else str(containment.level)

    def attempt(level: EgressLevel) -> Judged:
        if level is EgressLevel.NFTABLES:
            return _judge_nftables(base, where, nft)
        if level is EgressLevel.PROXY:
            return Judged(level, PROXY_DETAILS)
        return Judged(level, "no network policy (task.egress: off)")

    judged, passed_over = decide(_parse_setting(setting), AUTO_ORDER, attempt, setting="task.egress",
                                 error=EgressError, judge_stronger=True)
    return Judged(judged.level, judged.details, passed_over)


def _parse_setting(setting: str | EgressLevel) -> EgressLevel | None:
    """None for ``auto``, else the level; raises EgressError for an unknown text."""
    if isinstance(setting, EgressLevel):
        return setting
    if setting == AUTO:
        return None
    try:
        return EgressLevel.parse(setting)
    except ValueError:
        raise EgressError(f"task.egress: unknown level {setting!r}; expected auto or one of "
                          f"{', '.join(level.value for level in EgressLevel)}") from None


def _open_nftables(group: Path | None, where: str, group_name: str, policy: EgressPolicy,
                   agent_port: int | None, nft: Nft | None, probe: bool,
                   resolvers: tuple[tuple[str, int], ...], work_dir: Path | None = None) -> Egress:
    """The ``nftables`` level for task cgroups below ``group`` (the containment's, at level ``where``)."""
    if group is None:
        raise EgressError(f"the tasks have no cgroup in a cgroup v2 tree (containment {where})", Blocker.NO_TASK_CGROUP)
    point, depth = _v2_depth(group)
    backend = _backend(nft)
    table = EgressTable(backend, table_name(group_name), depth, "" if work_dir is None else str(work_dir))
    for orphan in remove_orphans(keep=table.name):
        log.info("egress: removed the table inet %s: its agent's work dir no longer exists", orphan)
    _create(table)
    egress = Egress(EgressLevel.NFTABLES, f"nftables table inet {table.name} ({backend.kind}), task cgroups at "
                    f"level {depth} below {group}", policy, table=table, v2_root=point,
                    agent_port=agent_port, resolvers=resolvers)
    if probe:
        try:
            _probe(table, group)
        except EgressError:
            egress.close()
            raise
    return egress


def _judge_nftables(base: Path | None, where: str, nft: Nft | None) -> Judged:
    """Judge ``nftables`` for task cgroups that would be below ``base`` (see :func:`judge_egress`).
    Raises EgressError with every unmet condition (``also``)."""
    from ckagent.containment.base import ContainmentError, throwaway_cgroup  # (imports Trio)

    found: list[EgressError] = []
    if base is None:
        found.append(EgressError(f"the tasks have no cgroup in a cgroup v2 tree (containment {where})",
                                 Blocker.NO_TASK_CGROUP))
    else:
        try:
            _v2_depth(base / "ckagent-x")
        except EgressError as exc:
            found.append(exc)
    backend = None
    try:
        backend = _backend(nft)
    except EgressError as exc:
        found.append(exc)
    if backend is not None and not _has_net_admin():
        found.append(EgressError(f"this process (uid {os.geteuid()}) has no CAP_NET_ADMIN: it may not change "
                                 "nftables", Blocker.NO_NET_ADMIN))
    elif backend is not None:  # the rights, where the capability says yes: a table of the check's own
        table = EgressTable(backend, f"{TABLE_PREFIX}check_{os.getpid()}", 1, netlink=False)
        try:
            _create(table)
        except EgressError as exc:
            found.append(exc)
        else:
            _drop(table)
    if found:
        raise EgressError(str(found[0]), found[0].blocker, also=tuple(found[1:]))
    assert base is not None and backend is not None
    try:
        with throwaway_cgroup(base) as group:
            _, depth = _v2_depth(group)
            table = EgressTable(backend, f"{TABLE_PREFIX}check_{os.getpid()}", depth, netlink=False)
            _create(table)
            try:
                _probe(table, group)
            finally:
                _drop(table)
    except ContainmentError as exc:
        raise EgressError(f"no cgroup for the probe: {exc}", exc.blocker) from exc
    return Judged(EgressLevel.NFTABLES, f"nftables ({backend.kind}), task cgroups at level {depth} below "
                  f"{base}; the probe was refused by the kernel")


CAP_NET_ADMIN = 12


def _has_net_admin() -> bool:
    """Whether this process's effective capabilities hold CAP_NET_ADMIN (/proc/self/status ``CapEff``;
    True when it cannot be read: the table's creation then tells)."""
    for line in _read("/proc/self/status").splitlines():
        if line.startswith("CapEff:"):
            with contextlib.suppress(ValueError):
                return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    return True


def _drop(table: EgressTable) -> None:
    """Delete a check's table; a table that cannot be deleted is logged with how to remove it."""
    try:
        table.close()
    except NftError as exc:
        log.warning("egress: cannot delete the check's table inet %s (%s): nft delete table inet %s",
                    table.name, exc, table.name)


def _v2_depth(group: Path) -> tuple[Path, int]:
    """(the v2 tree's mount point, the level of the task cgroups below ``group`` in nft's terms).
    Raises EgressError."""
    from ckagent.containment.hierarchy import mounts  # (the containment package imports Trio)

    v2 = mounts(_read("/proc/self/mountinfo")).get("unified")
    if v2 is None:
        raise EgressError("no cgroup v2 tree is mounted", Blocker.NO_V2_TREE)
    point, root = v2
    try:
        group.relative_to(NFT_CGROUP_ROOT)
        return point, len(group.relative_to(point).parts) + len(Path(root).parts[1:]) + 1
    except ValueError:
        raise EgressError(f"the v2 tree {point} is not below {NFT_CGROUP_ROOT}, where nft looks",
                          Blocker.V2_TREE_ELSEWHERE) from None


def _backend(nft: Nft | None) -> Nft:
    """``nft``, or libnftables / the nft program. Raises EgressError (NO_NFTABLES)."""
    try:
        return nft or open_nft()
    except NftError as exc:
        raise EgressError(str(exc), Blocker.NO_NFTABLES) from exc


def _create(table: EgressTable) -> None:
    """Create ``table`` (afresh). Raises EgressError (NO_NET_ADMIN when nftables said not permitted)."""
    try:
        table.create()
    except NftError as exc:
        raise EgressError(f"cannot create the nftables table {table.name} ({exc}; the agent needs "
                          "CAP_NET_ADMIN: run it as root or grant the capability)",
                          Blocker.NO_NET_ADMIN if "not permitted" in str(exc) else Blocker.FAILED) from exc


def _probe(table: EgressTable, group: Path) -> None:
    """A child in a throw-away cgroup below ``group`` connects to a loopback listener of ours under
    a policy that denies it: the kernel must refuse it (a wrong cgroup level would let it through)."""
    from ckagent.node.egress_policy import parse_deny

    cgroup = group / "egress-probe"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        cgroup.mkdir(exist_ok=True)
        rules = None
        try:
            rules = table.add("probe", str(cgroup.relative_to(NFT_CGROUP_ROOT)),
                              parse_deny(["127.0.0.1/32"], "probe"), None)
            code = ("import socket,sys\ntry:\n socket.create_connection(('127.0.0.1', int(sys.argv[1])), 2)\n"
                    "except ConnectionRefusedError:\n sys.exit(0)\nsys.exit(3)")
            script = 'echo 0 >"$1/cgroup.procs" || exit 4\nshift\nexec "$@"'
            try:
                done = subprocess.run(["/bin/sh", "-c", script, "sh", str(cgroup), sys.executable, "-I", "-S",
                                       "-c", code, str(port)], timeout=PROBE_TIMEOUT, check=False,
                                      capture_output=True)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise EgressError(f"the probe child could not run: {exc}") from exc
            refused = table.refusals(rules)
            table.remove(rules, refused)
            if done.returncode != 0 or not refused:
                raise EgressError(f"the kernel did not refuse a probe connection from a task cgroup (exit "
                                  f"{done.returncode}, {len(refused)} counted): socket cgroupv2 does not match here",
                                  Blocker.KERNEL_NO_MATCH)
        except NftError as exc:
            raise EgressError(f"the probe's rules were refused: {exc}") from exc
        finally:
            if rules is not None:
                with contextlib.suppress(NftError):
                    table.remove(rules)
            with contextlib.suppress(OSError):
                cgroup.rmdir()


def _resolvers() -> tuple[tuple[str, int], ...]:
    """The name servers of /etc/resolv.conf (port 53): tasks reach them whatever is denied."""
    found = []
    for line in _read("/etc/resolv.conf").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            address = parts[1].split("%")[0]
            with contextlib.suppress(ValueError):
                found.append((str(ipaddress.ip_address(address)), 53))
    return tuple(dict.fromkeys(found))


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""

