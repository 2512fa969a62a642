"""The agent's own nftables table: a task's sockets are looked up by their cgroup v2 id.

Layout (family ``inet``, IPv4 and IPv6 alike; ``<P>`` = 12 hex of a policy's hash)::

    table inet ckagent_<hash>                         this agent's only table (never another's): the
                                                      hash of its work dir and its mount namespace
        map tasks { type cgroupsv2 : verdict }        task cgroup → jump p_<P>   (one per task)
        chain output  hook output, priority filter:   socket cgroupv2 level <L> vmap @tasks
        set agent_ports { type inet_service }   the ports of every agent on this host (its own
                      and those of :mod:`ckagent.node.agentports`), refreshed when a task is added
                      and when the registry changes (``Egress.watch_agent_ports``)
        chain p_<P>   one per policy in use: IPv6 forms of denied IPv4 networks → goto refuse (through
                      chain e_<P> when IPv4 allow entries make exceptions); allow entries → accept;
                      denied networks, and the agent ports on local addresses → goto refuse
        chain refuse  record (cgroup . address . port) in @h4/@h6, (cgroup . address) in @x4/@x6
                      for what is not TCP/UDP, each element with its counter; then reject
        sets h4 h6 x4 x6   the refused destinations of every task, per task cgroup

An address is judged as what it reaches (:mod:`ckagent.node.egress_policy`): ``0.0.0.0``/``::`` need
no rule (the kernel rewrites them to the loopback address before the hook), an IPv4-mapped address
is sent as IPv4 (the ``ip daddr`` rules see it), and the IPv6 forms that embed an IPv4 address
(IPv4-compatible, NAT64 ``64:ff9b::/96``, 6to4) of a denied IPv4 network are refused like it.

Adding a task is one map element, removing it deletes that element and the task's hit elements:
the cost does not grow with the policy, the number of tasks or the rest of the host's ruleset
(bench/egress.py): those element changes and the read of the hit sets go straight over nfnetlink
(:mod:`.netlink`, a message and its ack), while the table, its sets and the policy chains (once
per policy in use) are written by nft. Only packets of sockets whose cgroup is (below) a task's are
looked at; everything else on the host passes the one vmap lookup untouched. TCP is refused with a
reset (the spider sees "connection refused" at once), everything else with ICMP admin-prohibited.

A task's elements are keyed by its cgroup's id, taken when it is added: they can be removed after
its cgroup is gone (nft alone names a cgroup by its path, and cannot once the directory is gone).
The table's name and comment (its mount namespace and work dir), and which tables a starting agent
deletes: :mod:`.owners`.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import logging
import struct
import threading
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckagent.containment.egress.netlink import Netlink, NetlinkError, cgroup_key
from ckagent.containment.egress.nft import Nft, NftError
from ckagent.containment.egress.owners import owner_comment
from ckagent.node.agentports import PortRegistry
from ckagent.node.egress_policy import EgressPolicy, Network, embedding_networks

log = logging.getLogger(__name__)

NFT_CGROUP_ROOT = Path("/sys/fs/cgroup")
"""nft resolves ``socket cgroupv2`` paths below this directory (hard-coded in nftables)."""

HITS_SET_SIZE = 65536
"""Distinct refused (task, destination) pairs remembered per family (beyond: refused, not itemised)."""

HIT_SETS = ("h4", "h6", "x4", "x6")
AGENT_PORTS_SET = "agent_ports"
NETLINK_PORTS_BATCH = 256
"""At most this many agent-port changes go over netlink in one batch; more (a flood of planted
registry entries) are written whole through nft."""
MAX_COMMENT_CHARS = 120


def policy_key(policy: EgressPolicy, agent_port: int | None, resolvers: tuple[tuple[str, int], ...]) -> str:
    """12 hex naming the chain of one policy (the same policy → the same chain)."""
    text = repr((policy.to_json(), agent_port if policy.denies_agent_port else None, resolvers))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass
class TaskRules:
    """One task's entry in the table: ``cgroup`` is the path nft knows it by (relative to
    /sys/fs/cgroup), ``chain`` the policy chain it jumps to."""

    task_id: str
    cgroup: str
    chain: str
    policy: EgressPolicy
    removed: bool = False
    key: bytes = b""
    """The cgroup's id as the kernel keys it (b"" when it could not be read: nft names it by path)."""
    hits: dict[str, list[bytes]] = field(default_factory=dict)
    """The task's elements in the hit sets, as the last :meth:`EgressTable.refusals` read them."""


@dataclass(frozen=True)
class Refusal:
    """Connections refused to one destination: ``address``, ``port`` (0 = not TCP/UDP), ``count``
    (packets: one per refused TCP connection)."""

    address: str
    port: int
    count: int

    def __str__(self) -> str:
        if not self.port:
            return self.address
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


def quote(text: str) -> str:
    """``text`` as an nft string; raises NftError for what nft cannot quote."""
    if any(c in text for c in '"\\\n\r\0'):
        raise NftError(f"{text!r} cannot be named in an nft command")
    return f'"{text}"'


def _set(items: Iterable[str]) -> str:
    return "{ " + ", ".join(items) + " }"


class EgressTable:
    """The table (see module docstring). ``level`` is the depth of task cgroups in the v2 tree.
    Methods are blocking (netlink round trips, ~0.1-0.3 ms each with libnftables); call them from a
    worker thread. They raise :class:`NftError`."""

    def __init__(self, nft: Nft, name: str, level: int, owner: str = "", *, netlink: bool = True) -> None:
        self.nft, self.name, self.level, self.owner = nft, name, level, owner
        self.ref = f"inet {name}"
        self.chains: dict[str, int] = {}
        """Policy chains in the table → how many tasks use them."""
        self.pinned: set[str] = set()
        """Chains kept when their last task goes (the node's default policy: most tasks use it, and
        adding a chain goes through nft, whose cost grows with the host's ruleset)."""
        self.elements: Netlink | None = None
        """The nfnetlink path of the per-task changes (None: nft does them; see :mod:`.netlink`)."""
        self.agent_ports: frozenset[int] = frozenset()
        """The ports in the table's ``agent_ports`` set (refused on local addresses where a policy
        denies the ``agent`` group)."""
        self._ports_lock = threading.Lock()  # (tasks' adds and the watch of the registry, in threads)
        self.subchains: dict[str, str] = {}
        """Policy chain → its chain of IPv4 exceptions for embedded forms (``e_<P>``), where it has one."""
        self._netlink = netlink

    def create(self) -> None:
        """Start clean: delete this agent's stale table (a crashed run's) and create it afresh."""
        self.delete()
        cg = f"socket cgroupv2 level {self.level}"
        comment = owner_comment(self.owner)
        shown = f" {{ comment {quote(comment)}; }}" if self.owner and len(comment) <= MAX_COMMENT_CHARS and \
            not any(c in comment for c in '"\\\n\r\0') else ""
        sets = "".join(
            f"add set {self.ref} {name} {{ typeof {cg} . {key}; flags dynamic; counter; size {HITS_SET_SIZE}; }}\n"
            for name, key in (("h4", "ip daddr . th dport"), ("h6", "ip6 daddr . th dport"),
                              ("x4", "ip daddr"), ("x6", "ip6 daddr")))
        self.nft.run(
            f"add table {self.ref}{shown}\n"
            f"add map {self.ref} tasks {{ type cgroupsv2 : verdict; }}\n"
            f"add set {self.ref} {AGENT_PORTS_SET} {{ type inet_service; }}\n" + sets +
            f"add chain {self.ref} refuse\n"
            f"add rule {self.ref} refuse meta nfproto ipv4 meta l4proto {{ tcp, udp }} add @h4 {{ {cg} . ip daddr . th dport }}\n"
            f"add rule {self.ref} refuse meta nfproto ipv6 meta l4proto {{ tcp, udp }} add @h6 {{ {cg} . ip6 daddr . th dport }}\n"
            f"add rule {self.ref} refuse meta nfproto ipv4 meta l4proto != {{ tcp, udp }} add @x4 {{ {cg} . ip daddr }}\n"
            f"add rule {self.ref} refuse meta nfproto ipv6 meta l4proto != {{ tcp, udp }} add @x6 {{ {cg} . ip6 daddr }}\n"
            f"add rule {self.ref} refuse meta l4proto tcp counter reject with tcp reset\n"
            f"add rule {self.ref} refuse counter reject with icmpx type admin-prohibited\n"
            f"add chain {self.ref} output {{ type filter hook output priority filter; policy accept; }}\n"
            f"add rule {self.ref} output {cg} vmap @tasks\n"
        )
        self.chains.clear()
        self.subchains.clear()
        self.agent_ports = frozenset()
        if self._netlink and self.elements is None:
            try:
                self.elements = Netlink(self.name)
            except NetlinkError as exc:
                log.info("egress: per-task changes go through nft (%s)", exc)

    def delete(self) -> bool:
        """Delete the whole table if it exists. Returns True when there was one."""
        self.chains.clear()
        self.subchains.clear()
        return _delete_table(self.nft, self.name)

    def close(self) -> None:
        """Delete the table and close the netlink socket. Raises NftError (the socket is closed anyway)."""
        try:
            self.delete()
        finally:
            if self.elements is not None:
                self.elements.close()
                self.elements = None

    def policy_text(self, chain: str, policy: EgressPolicy, agent_port: int | None = None,
                    resolvers: Iterable[tuple[str, int]] = ()) -> str:
        """The batch that adds the chain of one policy (and its ``e_`` chain when it needs one).
        ``agent_port`` is unused (the ``agent_ports`` set holds every agent's: :meth:`set_agent_ports`)."""
        ref = self.ref
        lines = [f"add chain {ref} {chain}"]
        for address, dns_port in resolvers:  # name resolution keeps working whatever is denied
            family = "ip" if ipaddress.ip_address(address).version == 4 else "ip6"
            lines.append(f"add rule {ref} {chain} {family} daddr {address} meta l4proto {{ tcp, udp }} "
                         f"th dport {dns_port} accept")
        v4, v6 = _split(policy.denied_networks())
        # The IPv6 forms that embed a denied IPv4 address, judged before the allow entries (an IPv6
        # allow entry such as 2000::/3 does not allow 6to4's 2002:a9fe:a9fe:: = 169.254.169.254);
        # an IPv4 allow entry makes its own forms an exception (e_<P>: return = judge on).
        embedded = [str(n) for n in ipaddress.collapse_addresses(
            e for net in v4 for e in embedding_networks(ipaddress.IPv4Network(net)))]
        excepted = [(e, entry.port) for entry in policy.allow if isinstance(entry.network, ipaddress.IPv4Network)
                    for e in embedding_networks(entry.network)]
        if embedded and excepted:
            sub = "e" + chain[1:]
            lines.insert(0, f"add chain {ref} {sub}")
            for network, only in excepted:
                ports = "" if only is None else f" meta l4proto {{ tcp, udp }} th dport {only}"
                lines.append(f"add rule {ref} {sub} ip6 daddr {network}{ports} return")
            lines.append(f"add rule {ref} {sub} goto refuse")
            lines.append(f"add rule {ref} {chain} ip6 daddr {_set(embedded)} jump {sub}")
        elif embedded:
            lines.append(f"add rule {ref} {chain} ip6 daddr {_set(embedded)} goto refuse")
        for entry in policy.allow:
            family = "ip" if entry.network.version == 4 else "ip6"
            port = "" if entry.port is None else f" meta l4proto {{ tcp, udp }} th dport {entry.port}"
            lines.append(f"add rule {ref} {chain} {family} daddr {entry.network}{port} accept")
        if v4:
            lines.append(f"add rule {ref} {chain} ip daddr {_set(v4)} goto refuse")
        if v6:
            lines.append(f"add rule {ref} {chain} ip6 daddr {_set(v6)} goto refuse")
        if policy.denies_agent_port:
            lines.append(f"add rule {ref} {chain} fib daddr type local meta l4proto {{ tcp, udp }} "
                         f"th dport @{AGENT_PORTS_SET} goto refuse")
        return "\n".join(lines) + "\n"

    def set_agent_ports(self, ports: Collection[int]) -> bool:
        """Make the ``agent_ports`` set hold exactly ``ports`` (those outside 1..65535 are left out):
        the difference in one netlink batch (~50 µs), or the whole set through nft. Returns True when
        it changed. Blocking, thread-safe; raises NftError (the set is then as it was)."""
        with self._ports_lock:
            return self._set_agent_ports(frozenset(p for p in ports if isinstance(p, int) and 0 < p < 65536))

    def _set_agent_ports(self, wanted: frozenset[int]) -> bool:
        if wanted == self.agent_ports:
            return False
        added, gone = sorted(wanted - self.agent_ports), sorted(self.agent_ports - wanted)
        if self.elements is not None and len(added) + len(gone) <= NETLINK_PORTS_BATCH:
            try:
                self.elements.update(AGENT_PORTS_SET, [struct.pack(">H", p) for p in added],
                                     [struct.pack(">H", p) for p in gone])
            except NetlinkError as exc:
                log.debug("egress: the agent ports go through nft (%s)", exc)
            else:
                self.agent_ports = wanted
                return True
        text = f"flush set {self.ref} {AGENT_PORTS_SET}\n"
        ordered = sorted(wanted)
        for start in range(0, len(ordered), 4096):
            text += f"add element {self.ref} {AGENT_PORTS_SET} {_set(str(p) for p in ordered[start:start + 4096])}\n"
        self.nft.run(text)
        self.agent_ports = wanted
        return True

    def add(self, task_id: str, cgroup: str, policy: EgressPolicy, agent_port: int | None,
            resolvers: tuple[tuple[str, int], ...] = (), *, pin: bool = False) -> TaskRules:
        """Put a task (its cgroup path relative to /sys/fs/cgroup) under ``policy``: one atomic
        batch (with the policy's chain when no task uses it yet; ``pin``: the chain stays when its
        last task goes)."""
        chain = "p_" + policy_key(policy, agent_port, resolvers)
        if pin:
            self.pinned.add(chain)
        if agent_port is not None and agent_port not in self.agent_ports:
            self.set_agent_ports(self.agent_ports | {agent_port})
        try:
            key = cgroup_key(NFT_CGROUP_ROOT / cgroup)
        except OSError:
            key = b""  # (nft says what is wrong with the path)
        if self.elements is not None and key and chain in self.chains:  # the common case: one message
            try:
                self.elements.add_jump("tasks", key, chain)
            except NetlinkError as exc:
                raise NftError(str(exc)) from exc
        else:
            text = "" if chain in self.chains else self.policy_text(chain, policy, agent_port, resolvers)
            self.nft.run(text + f"add element {self.ref} tasks {{ {quote(cgroup)} : jump {chain} }}\n")
            if f"add chain {self.ref} e{chain[1:]}\n" in text:
                self.subchains[chain] = "e" + chain[1:]
        self.chains[chain] = self.chains.get(chain, 0) + 1
        return TaskRules(task_id, cgroup, chain, policy, key=key)

    def refusals(self, rules: TaskRules) -> list[Refusal]:
        """The task's refused destinations with their counts, most refused first."""
        found: list[Refusal] = []
        if self.elements is not None and rules.key:
            hits: dict[str, list[bytes]] = {}
            try:
                for name in HIT_SETS:
                    for key, packets in self.elements.dump(name):
                        refusal = _refusal_of_key(name, key, packets, rules.key)
                        if refusal is not None:
                            hits.setdefault(name, []).append(key)
                            found.append(refusal)
            except NetlinkError as exc:
                raise NftError(str(exc)) from exc
            rules.hits = hits
            return sorted(found, key=lambda r: (-r.count, r.address, r.port))
        for name in HIT_SETS:
            answer = self.nft.run_json(f"list set {self.ref} {name}")
            for obj in answer.get("nftables", []):
                for elem in (obj.get("set", {}) if isinstance(obj, dict) else {}).get("elem", []) or []:
                    parsed = _refusal(elem, rules.cgroup)
                    if parsed is not None:
                        found.append(parsed[0])
        return sorted(found, key=lambda r: (-r.count, r.address, r.port))

    def remove(self, rules: TaskRules, refused: Iterable[Refusal] = ()) -> None:
        """Remove a task's map element and its hit elements (idempotent; never raises): by the
        cgroup's id over netlink (the hits the last :meth:`refusals` read), else through nft by its
        path (the ``refused`` ones). The policy chain goes with its last task, unless pinned. Through nft, a cgroup
        already gone cannot be named: its element stays (a dead cgroup id matches no socket) until
        the table is recreated."""
        if rules.removed:
            return
        left = self.chains.get(rules.chain, 1) - 1
        drop_chain = left <= 0 and rules.chain not in self.pinned
        ref, cg = self.ref, quote(rules.cgroup)
        lines: list[str] = []
        if self.elements is not None and rules.key:  # by id: one batch, also when the cgroup is gone
            try:
                self._delete_elements({"tasks": [rules.key], **rules.hits})
            except NetlinkError as exc:
                log.debug("egress: cannot remove the elements of task %s (%s)", rules.task_id, exc)
        else:
            lines.append(f"delete element {ref} tasks {{ {cg} }}")
            for r in refused:
                family = "6" if ":" in r.address else "4"
                if r.port:
                    lines.append(f"delete element {ref} h{family} {{ {cg} . {r.address} . {r.port} }}")
                else:
                    lines.append(f"delete element {ref} x{family} {{ {cg} . {r.address} }}")
        if drop_chain:
            lines.append(f"delete chain {ref} {rules.chain}")
            if rules.chain in self.subchains:
                lines.append(f"delete chain {ref} {self.subchains[rules.chain]}")
        try:
            if lines:
                self.nft.run("\n".join(lines) + "\n")
        except NftError as exc:
            log.debug("egress: cannot remove the rules of task %s (%s)", rules.task_id, exc)
        else:
            if drop_chain:
                self.chains.pop(rules.chain, None)
                self.subchains.pop(rules.chain, None)
            else:
                self.chains[rules.chain] = max(left, 0)
        rules.removed = True

    def _delete_elements(self, keys: dict[str, list[bytes]]) -> None:
        """Delete elements by key in one batch; when one is gone already (the batch is refused
        whole), each set again on its own, what is gone skipped."""
        assert self.elements is not None
        try:
            self.elements.delete(keys)
        except NetlinkError as exc:
            if exc.errno != errno.ENOENT:
                raise
            for name, found in keys.items():
                for key in found:
                    try:
                        self.elements.delete({name: [key]})
                    except NetlinkError as again:
                        if again.errno != errno.ENOENT:
                            raise


class AgentPorts:
    """The ``agent`` group's side of :class:`ckagent.containment.egress.Egress`: this agent's port
    (``agent_port``) and every other agent's on this host (``registry``, :mod:`ckagent.node.agentports`),
    in the table's ``agent_ports`` set (``table``) and for the proxy's check (:meth:`agent_ports`)."""

    agent_port: int | None
    registry: PortRegistry | None
    table: EgressTable | None

    def listening(self, port: int) -> None:
        """The agent's own port is ``port`` (the one picked for ``agent.port`` 0): refused as an
        agent's port, and recorded in the registry for the other agents on this host (blocking,
        ~0.1 ms; call it before any task is attached). Raises ValueError for a port outside 1..65535."""
        self.agent_port = port
        if self.registry is not None:
            self.registry.register([port])

    def agent_ports(self) -> frozenset[int]:
        """Every agent's port on this host (this agent's ``agent_port`` and the live entries of the
        registry): what the ``agent`` group refuses on this host's addresses. Cached (two ``lstat``
        calls when nothing changed); never raises."""
        ports = self.registry.live_ports() if self.registry is not None else frozenset()
        return ports | {self.agent_port} if self.agent_port is not None else ports

    def refresh_agent_ports(self) -> None:
        """Bring the table's set of agent ports up to date (blocking; nothing to do when the registry
        did not change). Never raises: a failure is logged, the set stays as it was."""
        if self.table is None:
            return
        try:
            self.table.set_agent_ports(self.agent_ports())
        except NftError as exc:
            log.warning("egress: cannot update the agent ports in table %s: %s", self.table.name, exc)

    def leave(self) -> None:
        """Remove this agent's entry from the registry (at its stop; never raises)."""
        if self.registry is not None:
            self.registry.close()


def _delete_table(nft: Nft, name: str) -> bool:
    try:
        nft.run(f"delete table inet {name}")
    except NftError as exc:
        if "No such file" in str(exc) or "does not exist" in str(exc):
            return False
        raise
    return True


def _refusal_of_key(set_name: str, key: bytes, packets: int, cgroup: bytes) -> Refusal | None:
    """The Refusal an element of a hit set stands for, when it is ``cgroup``'s (keys: the cgroup id,
    then the address, then the port; each field padded to 4 bytes)."""
    if not key.startswith(cgroup):
        return None
    rest = key[len(cgroup):]
    width = 4 if set_name.endswith("4") else 16
    if len(rest) < width:
        return None
    address = str(ipaddress.ip_address(rest[:width]))
    port = struct.unpack(">H", rest[width:width + 2])[0] if set_name.startswith("h") and len(rest) >= width + 2 else 0
    return Refusal(address, port, packets)


def _split(networks: list[Network]) -> tuple[list[str], list[str]]:
    v4 = [n for n in networks if isinstance(n, ipaddress.IPv4Network)]
    v6 = [n for n in networks if isinstance(n, ipaddress.IPv6Network)]
    # Collapse overlaps: nft refuses overlapping interval elements in one set.
    return [str(n) for n in ipaddress.collapse_addresses(v4)], [str(n) for n in ipaddress.collapse_addresses(v6)]


def _refusal(elem: Any, cgroup: str) -> tuple[Refusal] | None:
    """``{"elem": {"val": {"concat": [cgroup, addr(, port)]}, "counter": {"packets": n}}}`` of
    ``cgroup`` → (Refusal,); None for another task's element or an unexpected shape."""
    inner = elem.get("elem") if isinstance(elem, dict) else None
    if not isinstance(inner, dict) or not isinstance(inner.get("val"), dict):
        return None
    concat = inner["val"].get("concat")
    if not isinstance(concat, list) or len(concat) not in (2, 3) or str(concat[0]) != cgroup:
        return None
    port = int(concat[2]) if len(concat) == 3 else 0
    packets = int((inner.get("counter") or {}).get("packets", 0))
    return (Refusal(str(concat[1]), port, packets),)
