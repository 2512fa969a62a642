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

import base64
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from ckagent.containment.egress.errors import EgressError
from ckagent.containment.egress.kernel import (
    create_table,
    judge_nftables,
    nft_backend,
    read_file,
    run_probe,
    v2_depth,
)
from ckagent.containment.egress.nft import Nft, NftError
from ckagent.containment.egress.owners import legacy_table_name, remove_legacy, remove_orphans, table_name
from ckagent.containment.egress.proxy import (
    Dialer,
    FdStore,
    ProxyServer,
    Resolve,
    TaskProxy,
    routes_from_env,
    system_resolve,
)
from ckagent.containment.egress.repair import LostRules, TableKeeper
from ckagent.containment.egress.table import AgentPorts, EgressTable, Refusal, TaskRules
from ckagent.containment.filewatch import DIRECTORY_CHANGES, FileWatch
from ckagent.node.agentports import PortRegistry
from ckagent.node.egress_policy import (
    DEFAULT_DENY,
    GROUPS,
    EgressPolicy,
    PolicyError,
    is_this_host,
    parse_text,
)
from ckagent.node.levels import AUTO, Blocker, EgressLevel, Judged, Unavailable, decide

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
_T = TypeVar("_T")

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


class Egress(AgentPorts):
    """The node's egress level (see module docstring). ``level`` the level; ``details`` one line for
    the log and /status; ``policy`` the node's default policy; ``passed_over`` the stronger levels
    this node did not get, each with why (set by :func:`open_egress`)."""

    def __init__(self, level: EgressLevel, details: str, policy: EgressPolicy, *, table: EgressTable | None = None,
                 v2_root: Path | None = None, agent_port: int | None = None,
                 resolvers: tuple[tuple[str, int], ...] = (), work_dir: Path | None = None,
                 registry: PortRegistry | None = None) -> None:
        self.level, self.details, self.policy = level, details, policy
        self.passed_over: tuple[Unavailable, ...] = ()
        self.table, self.v2_root, self.agent_port, self.resolvers = table, v2_root, agent_port, resolvers
        self.registry = registry
        self.keeper = TableKeeper(table, self.agent_ports) if table is not None else None
        """At ``nftables``: the table made again when someone else deletes it (:mod:`.repair`)."""
        self.server = ProxyServer(fdstore=FdStore.from_environ()) if level.uses_proxy else None
        """At ``proxy``: the forward proxy (:mod:`.proxy`, its listeners kept in a store: :mod:`.proxy.fdstore`)."""
        self._proxied: dict[str, TaskProxy] = {}
        """At the ``proxy`` level: the rules' chain (the task's proxy user name) → its side of the proxy."""
        self._key = _proxy_key(work_dir) if level.uses_proxy else b""
        self.resolve: Resolve = system_resolve
        """At the ``proxy`` level: how names are resolved for the tasks attached from now on (tests
        put a fixed table here)."""

    async def serve(self, *, lost: LostRules | None = None, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the level's service until cancelled (startable: ``started()`` once tasks can be attached):
        at ``proxy`` the forward proxy; at ``nftables`` :meth:`watch_agent_ports` and the table's keeper
        (:mod:`.repair`: the table made again when deleted; ``lost`` told when it cannot be); at ``off``
        it returns at once."""
        if self.server is not None:
            await self.server.run(task_status=task_status)
            return
        async with trio.open_nursery() as nursery:
            if self.keeper is not None:
                await nursery.start(self.keeper.watch, lost)
            task_status.started()
            await self.watch_agent_ports()

    async def watch_agent_ports(self) -> None:
        """Keep the table's set of agent ports up to date while tasks run: the registry's directories
        are watched (inotify), so an agent that starts after a task was added is refused to it at once
        (a dead agent's port goes at the next change or task). Until cancelled; returns at once
        without a table or a registry, or when no directory of it can be watched."""
        if self.table is None or self.registry is None:
            return

        async def follow(watch: FileWatch) -> None:
            while True:
                await watch.changed()
                await trio.to_thread.run_sync(self.refresh_agent_ports)

        with contextlib.ExitStack() as watches:
            async with trio.open_nursery() as nursery:
                for directory in self.registry.read_dirs:
                    with contextlib.suppress(OSError):  # (not there: an agent that starts later makes it)
                        nursery.start_soon(follow, watches.enter_context(FileWatch(directory, DIRECTORY_CHANGES)))

    def effective(self, task_policy: EgressPolicy | None) -> EgressPolicy:
        """The node's policy with the task's denials and exceptions added."""
        return self.policy if task_policy is None else self.policy.merged(task_policy)

    def attach(self, jail: TaskJail | None, task_id: str, task_policy: EgressPolicy | None = None, *,
               proxy_port: int = 0, uid: int | None = None) -> TaskRules | None:
        """Put the task under its policy before its first process: at ``nftables`` its cgroup (blocking,
        ~0.3 ms); at ``proxy`` a listener of its own (``proxy_port``: the one its processes already
        name, for a task re-adopted after a restart; 0 = a new one; ``uid``: the uid its processes run
        as where it is its own — connections of another uid are then not served); None at ``off``. Callable from a
        Trio worker thread or the Trio thread. Raises EgressError when the rules cannot be added (the
        task must not run unprotected)."""
        if self.server is not None:  # (the proxy level)
            user = _proxy_user(task_id)
            policy = self.effective(task_policy)
            task = TaskProxy(task_id, user, self._password(task_id), Dialer(partial(self.blocked, policy), self.resolve),
                             uid=uid)
            try:
                _on_trio_thread(self.server.open, task, proxy_port)
            except (OSError, RuntimeError) as exc:
                where = f"127.0.0.1:{proxy_port}" if proxy_port else "127.0.0.1"
                raise EgressError(f"egress: cannot listen for task {task_id}'s proxy on {where} ({exc})") from exc
            self._proxied[user] = task
            if self.registry is not None:  # other agents' tasks must not reach it (the agent group)
                with contextlib.suppress(ValueError):
                    self.registry.register([task.port])
            return TaskRules(task_id, "", user, policy)
        if self.keeper is None:
            return None
        if jail is None:
            raise EgressError("egress: the nftables level needs the task's jail")
        self.refresh_agent_ports()  # (agents that came or went since the last task)
        try:  # (pinned: the node's policy chain, most tasks')
            return self.keeper.attach(jail, task_id, self.effective(task_policy), self.agent_port, self.resolvers,
                                      pin=task_policy is None)
        except (NftError, ValueError) as exc:
            raise EgressError(f"egress: cannot add the rules of task {task_id}: {exc}") from exc

    def blocked(self, policy: EgressPolicy, address: str, port: int) -> bool:
        """The proxy's check of one address: True when ``policy`` denies ``address``:``port``, or it is
        the proxy's own listener (a request to itself would loop)."""
        local = _is_local(address)
        if self.server is not None and port in self.server.ports and (local or is_this_host(address)):
            return True
        return policy.blocks(address, port, agent_ports=self.agent_ports(), local=local)

    def proxy_port(self, rules: TaskRules | None) -> int:
        """The port of the task's proxy listener (0: none; the ``proxy`` level only)."""
        task = self._proxied.get(rules.chain) if rules is not None else None
        return task.port if task is not None else 0

    def proxy_outcomes(self, rules: TaskRules | None) -> dict[str, int]:
        """At ``proxy``: what became of the task's requests so far, by outcome ({} otherwise)."""
        task = self._proxied.get(rules.chain) if rules is not None else None
        return dict(task.outcomes) if task is not None else {}

    def refusals(self, rules: TaskRules | None) -> list[Refusal]:
        """What the task was refused so far (blocking), most refused first. [] at ``off`` or when
        nft fails."""
        if rules is not None and rules.chain in self._proxied:
            counts = self._proxied[rules.chain].refused
            return sorted((Refusal(a, p, n) for (a, p), n in counts.items()), key=lambda r: (-r.count, r.address))
        if rules is None or self.table is None or rules.removed:
            return []
        try:
            return self.table.refusals(rules)
        except NftError as exc:
            log.warning("egress: cannot read the counters of task %s: %s", rules.task_id, exc)
            return []

    def detach(self, rules: TaskRules | None, refused: list[Refusal] | None = None) -> None:
        """Remove the task's rules (blocking; before its cgroup goes): at ``proxy`` its listener, its
        connections and its pool close. Never raises; callable from a worker thread or the Trio thread."""
        task = self._proxied.pop(rules.chain, None) if rules is not None else None
        if task is not None and self.server is not None:
            with contextlib.suppress(RuntimeError, trio.RunFinishedError):
                _on_trio_thread(self.server.close, task.task_id)
            if self.registry is not None:
                self.registry.unregister([task.port])
        if rules is not None and self.keeper is not None:
            self.keeper.remove(rules, refused or [])  # (never raises: nft's refusals are logged)

    def chain(self, rules: TaskRules | None, env: Mapping[str, str],
              notice: Callable[[str], None] | None = None) -> None:
        """At ``proxy``: keep the task's own proxies (``HTTP_PROXY``… in ``env``, the environment the
        task would have had) behind the agent's, and say so once in its log through ``notice`` (which
        also gets the proxy's later notes on the task). On the Trio thread."""
        task = self._proxied.get(rules.chain) if rules is not None else None
        if task is None:
            return
        task.routes, task.notice = routes_from_env(env), notice
        if notice is not None:
            if task.routes.chained:
                notice(f"egress: the task's own proxy is kept, behind the agent's: {task.routes.describe()}")
            for problem in task.routes.problems:
                notice(f"egress: the task's proxy setting cannot be followed ({problem}); its requests fail with 502")

    def task_env(self, rules: TaskRules | None, env: Mapping[str, str] | None = None,
                 notice: Callable[[str], None] | None = None) -> dict[str, str]:
        """Variables a task's environment gets at the ``proxy`` level ({} otherwise): every proxy
        variable names the task's own listener with its user name and secret password; ``NO_PROXY``
        holds only :data:`NO_PROXY_LOOPBACK` (the agent's proxy honours the task's own NO_PROXY);
        ``NODE_USE_ENV_PROXY=1`` asks Node's fetch to use them (Node ≥ 24.5; older Node ignores proxy
        variables). ``env``: the environment the task would have had (its own proxies are chained:
        :meth:`chain`). On the Trio thread."""
        task = self._proxied.get(rules.chain) if rules is not None else None
        if task is None:
            return {}
        self.chain(rules, env or {}, notice)
        url = task.url()
        out = {name: url for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                                      "all_proxy")}
        out["NO_PROXY"] = out["no_proxy"] = NO_PROXY_LOOPBACK
        out["NODE_USE_ENV_PROXY"] = "1"
        return out

    def _password(self, task_id: str) -> str:
        """The task's proxy password: derived from the agent's key (a re-adopted task keeps it)."""
        digest = hmac.new(self._key, b"egress-proxy\0" + task_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest[:18]).decode("ascii")

    def to_json(self) -> dict[str, Any]:
        """``{"level", "details", "policy", "deny", "allow"}`` for registration and /status."""
        wire = self.policy.to_json()
        return {"level": self.level.value, "details": self.details, "policy": self.policy.describe(),
                "deny": wire["deny"], "allow": wire["allow"]}

    def close(self, handed: int = 0) -> None:
        """Delete the agent's table (the tasks are gone; unless ``handed`` tasks were left running for
        the next agent: their rules stay in force) and its entry in the registry. Never raises."""
        self.leave()
        if handed:
            log.info("egress: the table stays for the %d task(s) left running", handed)
        elif self.keeper is not None:
            with contextlib.suppress(NftError):
                self.keeper.close()
            self.table = self.keeper = None


def _on_trio_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """Call ``fn`` on the Trio thread, from it or from one of its worker threads."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return trio.from_thread.run_sync(fn, *args)
    return fn(*args)


def _is_local(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


NO_PROXY_LOOPBACK = "<-loopback>"
"""A task's ``NO_PROXY`` at the ``proxy`` level: Chromium's rule that takes loopback out of its
implicit bypass list (it reads ``no_proxy`` from the environment and otherwise never proxies
127.0.0.1 or localhost, so a page could reach the agent's port around the policy); to every other
client it is a host name that matches nothing."""

PROXY_KEY_FILE = "egress-proxy.key"
"""In the agent's work dir (mode 0600): the key the tasks' proxy passwords are derived from."""


def _proxy_key(work_dir: Path | None) -> bytes:
    """The agent's proxy key, kept in ``work_dir`` so a later agent derives the same passwords for the
    tasks it re-adopts (a random one per process without a work dir, or when it cannot be kept)."""
    if work_dir is None:
        return secrets.token_bytes(32)
    path = work_dir / PROXY_KEY_FILE
    try:
        key = path.read_bytes()
        if len(key) == 32:
            return key
    except OSError:
        pass
    key = secrets.token_bytes(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key)
    except OSError as exc:
        log.warning("egress: cannot keep the proxy key in %s (%s): tasks re-adopted by the next agent "
                    "cannot use their proxy", path, exc)
    return key


def _proxy_user(task_id: str) -> str:
    from ckagent.containment.egress.table import policy_key

    return "t" + policy_key(EgressPolicy(), None, ((task_id, 0),))


def open_egress(setting: str | EgressLevel, containment: Containment | None, group_name: str, policy: EgressPolicy,
                *, agent_port: int | None = None, nft: Nft | None = None, probe: bool = True,
                work_dir: Path | None = None, registry: PortRegistry | None = None) -> Egress:
    """The egress level for this agent: ``setting`` ``auto`` or a level (or its text), decided by
    :func:`~ckagent.node.levels.decide` (as :func:`judge_egress` does); the result's ``passed_over``
    lists the stronger levels not had, each with its :class:`~ckagent.node.levels.Blocker`.

    Blocking (nft batches, and at ``nftables`` a probe: a short child process in a throw-away cgroup
    connects to a loopback socket of the agent and must be refused). ``work_dir`` (the agent's) is
    written into the table's comment; the tables of other work dirs that no longer exist (a removed
    test directory, an uninstalled agent killed before its stop) are deleted: no agent can come back
    for their tasks. ``registry``: the host's agents' ports (:mod:`ckagent.node.agentports`), refused
    with ``agent_port`` where the ``agent`` group is denied. Logs one line naming the level.
    Raises EgressError when a forced level cannot be used (the message says why, its ``blocker`` in
    a word); ``auto`` never raises (it falls back to ``proxy``).
    """
    forced = _parse_setting(setting)
    resolvers = _resolvers()
    group = None if containment is None else containment.v2_group()
    where = "none" if containment is None else str(containment.level)

    def attempt(level: EgressLevel) -> Egress:
        if level is EgressLevel.NFTABLES:
            return _open_nftables(group, where, group_name, policy, agent_port, nft, probe, resolvers, work_dir,
                                  registry)
        if level is EgressLevel.PROXY:
            return Egress(EgressLevel.PROXY, PROXY_DETAILS, policy, agent_port=agent_port, resolvers=resolvers,
                          work_dir=work_dir, registry=registry)
        return Egress(EgressLevel.OFF, "no network policy (task.egress: off)", EgressPolicy(), registry=registry)

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
            return judge_nftables(base, where, nft)
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
                   resolvers: tuple[tuple[str, int], ...], work_dir: Path | None = None,
                   registry: PortRegistry | None = None) -> Egress:
    """The ``nftables`` level for task cgroups below ``group`` (the containment's, at level ``where``)."""
    if group is None:
        raise EgressError(f"the tasks have no cgroup in a cgroup v2 tree (containment {where})", Blocker.NO_TASK_CGROUP)
    point, depth = v2_depth(group)
    backend = nft_backend(nft)
    table = EgressTable(backend, table_name(group_name), depth, "" if work_dir is None else str(work_dir))
    for orphan in remove_orphans(keep=table.name):
        log.info("egress: removed the table inet %s: its agent's work dir no longer exists", orphan)
    if work_dir is not None and remove_legacy(group_name, str(work_dir)):
        log.info("egress: removed the table inet %s an older agent made for this work dir",
                 legacy_table_name(group_name))
    create_table(table)
    egress = Egress(EgressLevel.NFTABLES, f"nftables table inet {table.name} ({backend.kind}), task cgroups at "
                    f"level {depth} below {group}", policy, table=table, v2_root=point,
                    agent_port=agent_port, resolvers=resolvers, registry=registry)
    if probe:
        try:
            run_probe(table, group)
        except EgressError:
            egress.close()
            raise
    return egress


def _resolvers() -> tuple[tuple[str, int], ...]:
    """The name servers of /etc/resolv.conf (port 53): tasks reach them whatever is denied."""
    found = []
    for line in read_file("/etc/resolv.conf").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "nameserver":
            address = parts[1].split("%")[0]
            with contextlib.suppress(ValueError):
                found.append((str(ipaddress.ip_address(address)), 53))
    return tuple(dict.fromkeys(found))
