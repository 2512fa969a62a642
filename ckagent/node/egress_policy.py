"""A task's network policy: the destinations it may not reach, and the exceptions that it may.

Entries of a deny list are group names or networks; entries of an allow list are networks, each
optionally with a port. Text form (settings, ``AGENT_TASK_EGRESS_DENY``): comma-separated.

=============  ===============================================================================
group          destinations
=============  ===============================================================================
``metadata``   cloud metadata services: 169.254.169.254 (AWS, GCP, Azure, OCI, DigitalOcean…),
               169.254.170.2 (AWS ECS), fd00:ec2::254 and fd00:ec2::23 (AWS IPv6),
               100.100.100.200 (Alibaba), 168.63.129.16 (Azure wire server), 169.254.0.23 (Tencent)
``link-local`` 169.254.0.0/16, fe80::/10
``agent``      every ckagent agent's ports on this host (status ports, proxy listeners) on every
               address of this host
``private``    10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, 100.64.0.0/10 (carrier-grade NAT), fc00::/7
``loopback``   127.0.0.0/8, ::1
=============  ===============================================================================

Examples: ``metadata,link-local,agent`` (the default), ``metadata,link-local,agent,private``,
``192.0.2.0/24``; allow: ``10.0.0.5:3128``, ``[fd12::1]:8080``, ``10.1.0.0/16``.

An allow entry beats every deny entry. A task's own policy from the master (``egress`` of the task)
adds denials and exceptions to the node's. Exceptions: :class:`PolicyError` (a ValueError) names the
entry that is wrong and what is expected.

An address is judged as what a connection to it reaches (:func:`reached`), the same at both levels
(the proxy's :meth:`EgressPolicy.blocks`, the kernel rules of :mod:`ckagent.containment.egress.table`):

- ``0.0.0.0`` and ``::`` (and ``::ffff:0.0.0.0``) connect to this host: they are judged as
  ``127.0.0.1`` / ``::1`` (the kernel rewrites the destination so: its rules see the loopback address);
- an IPv4-mapped address (``::ffff:169.254.169.254``) is its IPv4 address: a dual-stack socket sends
  IPv4 packets to it (measured: the kernel's ``ip daddr`` rule counts them, an ``ip6 daddr`` rule
  does not; a v6-only socket cannot connect to it at all);
- an address that embeds an IPv4 address a translator or tunnel delivers to — IPv4-compatible
  ``::a.b.c.d``, NAT64's well-known prefix ``64:ff9b::/96`` (RFC 6052), 6to4 ``2002::/16`` — is
  refused when either it or the IPv4 address is (each judged with its own allow entries): a
  denied IPv4 network is denied in each of those forms too (:func:`embedding_networks`).
  Not judged so: Teredo (``2001::/32``; its client address is stored inverted, not as a prefix the
  kernel rules can match, and only a Teredo relay delivers to it, from the relay's own network),
  and NAT64 network-specific prefixes (``64:ff9b:1::/48`` and an operator's own: where the IPv4
  address sits depends on the prefix length chosen there) — deny those prefixes by name;
- numeric host forms that ``getaddrinfo`` accepts (``2852039166``, ``0251.0376.0251.0376``,
  ``0xa9fea9fe``, ``169.254.43518``) are names to resolve: the check is on the resolved address, and
  :meth:`EgressPolicy.blocks` refuses anything but an address (ValueError) rather than judge a name.

The ``agent`` group refuses the ports of every ckagent agent on this host (the caller passes them:
:mod:`ckagent.node.agentports`) on this host's addresses (:func:`is_this_host`).
"""

from __future__ import annotations

import functools
import ipaddress
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

GROUPS: dict[str, tuple[str, ...]] = {
    "metadata": ("169.254.169.254/32", "169.254.170.2/32", "169.254.0.23/32", "100.100.100.200/32",
                 "168.63.129.16/32", "fd00:ec2::254/128", "fd00:ec2::23/128"),
    "link-local": ("169.254.0.0/16", "fe80::/10"),
    "private": ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"),
    "loopback": ("127.0.0.0/8", "::1/128"),
    "agent": (),
}
"""The named groups of a deny list (``agent`` is a port, not networks)."""

DEFAULT_DENY = "metadata,link-local,agent"
"""The node default of ``task.egress_deny``."""


class PolicyError(ValueError):
    """An entry of a policy is not a group, a network or ``network:port`` (the message says which)."""


@dataclass(frozen=True)
class Allowed:
    """One allow entry: a network and optionally one port (None = every port)."""

    network: Network
    port: int | None = None

    def __str__(self) -> str:
        net = str(self.network.network_address) if self.network.num_addresses == 1 else str(self.network)
        if self.port is None:
            return net
        return f"[{net}]:{self.port}" if self.network.version == 6 else f"{net}:{self.port}"


@dataclass(frozen=True)
class EgressPolicy:
    """What a task may not reach. ``deny_groups`` are names of :data:`GROUPS`; ``deny_networks``
    extra networks; ``allow`` exceptions that beat every denial."""

    deny_groups: tuple[str, ...] = ()
    deny_networks: tuple[Network, ...] = ()
    allow: tuple[Allowed, ...] = ()

    @property
    def denies_agent_port(self) -> bool:
        """True when the agent's own port is denied."""
        return "agent" in self.deny_groups

    def denied_networks(self) -> list[Network]:
        """Every denied network (groups expanded), without duplicates, in order."""
        out: list[Network] = []
        for group in self.deny_groups:
            out.extend(ipaddress.ip_network(n) for n in GROUPS[group])
        out.extend(self.deny_networks)
        return list(dict.fromkeys(out))

    def merged(self, other: EgressPolicy) -> EgressPolicy:
        """This policy with ``other``'s denials and exceptions added."""
        return EgressPolicy(
            deny_groups=tuple(dict.fromkeys((*self.deny_groups, *other.deny_groups))),
            deny_networks=tuple(dict.fromkeys((*self.deny_networks, *other.deny_networks))),
            allow=tuple(dict.fromkeys((*self.allow, *other.allow))),
        )

    def describe(self) -> str:
        """``deny metadata, link-local, agent; allow 10.0.0.5:3128`` (one line for logs and /status)."""
        deny = [*self.deny_groups, *(str(n) for n in self.deny_networks)]
        text = "deny " + (", ".join(deny) or "nothing")
        if self.allow:
            text += "; allow " + ", ".join(str(a) for a in self.allow)
        return text

    def to_json(self) -> dict[str, Any]:
        """``{"deny": [...], "allow": [...]}`` (the wire form of a task's ``egress``)."""
        return {"deny": [*self.deny_groups, *(str(n) for n in self.deny_networks)],
                "allow": [str(a) for a in self.allow]}

    @functools.cached_property
    def _denied(self) -> tuple[tuple[ipaddress.IPv4Network, ...], tuple[ipaddress.IPv6Network, ...]]:
        """The denied networks by family (computed once: the proxy asks per request)."""
        networks = self.denied_networks()
        return (tuple(n for n in networks if isinstance(n, ipaddress.IPv4Network)),
                tuple(n for n in networks if isinstance(n, ipaddress.IPv6Network)))

    def blocks(self, address: str | Address, port: int, *, agent_port: int | None = None,
               agent_ports: Collection[int] = (), local: bool = False) -> bool:
        """True when a connection to ``address``:``port`` is refused by this policy (the user-space
        check of the filtering proxy; the kernel rules say the same).

        ``address``: an IP address as ``getaddrinfo`` returns it (a scope ``%eth0`` is allowed), never
        a host name: judge what the name resolved to. It is judged as what it reaches (:func:`reached`).
        ``agent_ports`` (and ``agent_port``): the ports of every agent on this host, refused on this
        host's addresses when the ``agent`` group is denied; ``local``: the caller knows the address is
        this host's (else :func:`is_this_host` says, asked only when the port is an agent's).
        Raises ValueError when ``address`` is not an IP address. Non-blocking (an interface list at
        most every few seconds, ~40 µs)."""
        direct, embedded = reached(address)
        if self._refuses(direct, port, agent_port, agent_ports, local):
            return True
        return any(self._refuses(ip, port, agent_port, agent_ports, False) for ip in embedded)

    def _refuses(self, ip: Address, port: int, agent_port: int | None, agent_ports: Collection[int],
                 local: bool) -> bool:
        """One destination: an allow entry beats every denial; then the agent ports on this host; then
        the denied networks."""
        for entry in self.allow:
            if ip.version == entry.network.version and ip in entry.network and entry.port in (None, port):
                return False
        if self.denies_agent_port and (port == agent_port or port in agent_ports) and (local or is_this_host(ip)):
            return True
        v4, v6 = self._denied
        return any(ip in net for net in (v4 if ip.version == 4 else v6))

UNSPECIFIED_REACHES: dict[int, Address] = {4: ipaddress.IPv4Address("127.0.0.1"), 6: ipaddress.IPv6Address("::1")}
"""What a connection to ``0.0.0.0`` / ``::`` reaches: the kernel connects it to this host's loopback."""

EMBEDDING_PREFIXES: tuple[tuple[ipaddress.IPv6Network, int], ...] = (
    (ipaddress.IPv6Network("::/96"), 0),  # IPv4-compatible ::a.b.c.d (RFC 4291, deprecated): low 32 bits
    (ipaddress.IPv6Network("64:ff9b::/96"), 0),  # NAT64's well-known prefix (RFC 6052): low 32 bits
    (ipaddress.IPv6Network("2002::/16"), 80),  # 6to4 (RFC 3056): bits 16..47, i.e. shifted left by 80
)
"""IPv6 ranges whose addresses carry an IPv4 address a translator or tunnel delivers to: (range,
how far left the IPv4 address is shifted inside it)."""

_COMPATIBLE = ipaddress.IPv6Network("::/96")
_NOT_COMPATIBLE = (ipaddress.IPv4Network("0.0.0.0/31"),)
"""``::`` and ``::1`` are in ``::/96`` but are the unspecified and loopback addresses, not IPv4-compatible."""


def reached(address: str | Address) -> tuple[Address, tuple[ipaddress.IPv4Address, ...]]:
    """What a connection to ``address`` reaches: (the destination itself, IPv4 addresses it embeds).

    ``0.0.0.0``/``::``/``::ffff:0.0.0.0`` → this host's loopback; ``::ffff:a.b.c.d`` → ``a.b.c.d``; a
    scope (``fe80::1%eth0``) is dropped; IPv4-compatible, NAT64 (well-known prefix) and 6to4
    addresses also reach the IPv4 address they embed (see the module docstring). Raises ValueError
    when ``address`` is not an IP address (a host name, ``0251.0376.0251.0376``: resolve it first)."""
    ip = address if isinstance(address, ipaddress.IPv4Address | ipaddress.IPv6Address) else \
        ipaddress.ip_address(address)
    embedded: tuple[ipaddress.IPv4Address, ...] = ()
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id is not None:
            ip = ipaddress.IPv6Address(int(ip))
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        else:
            embedded = _embedded(ip)
    if ip.is_unspecified:
        ip = UNSPECIFIED_REACHES[ip.version]
    return ip, embedded


def _embedded(ip: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...]:
    found = []
    for prefix, shift in EMBEDDING_PREFIXES:
        if ip in prefix:
            v4 = ipaddress.IPv4Address((int(ip) >> shift) & 0xFFFFFFFF)
            if prefix != _COMPATIBLE or not any(v4 in n for n in _NOT_COMPATIBLE):
                found.append(v4)
    return tuple(found)


def embedding_networks(network: ipaddress.IPv4Network) -> list[ipaddress.IPv6Network]:
    """The IPv6 networks whose addresses embed an address of ``network`` (:data:`EMBEDDING_PREFIXES`):
    what the kernel rules refuse besides a denied IPv4 network. ``::`` and ``::1`` are never among them."""
    out: list[ipaddress.IPv6Network] = []
    for prefix, shift in EMBEDDING_PREFIXES:
        parts = [network]
        if prefix == _COMPATIBLE:
            for skip in _NOT_COMPATIBLE:
                parts = [rest for part in parts for rest in
                         (part.address_exclude(skip) if skip.subnet_of(part) else
                          (() if part.subnet_of(skip) else (part,)))]
        for part in parts:
            base = int(prefix.network_address) | (int(part.network_address) << shift)
            out.append(ipaddress.IPv6Network((base, 128 - shift - (32 - part.prefixlen))))
    return out


LOCAL_ADDRESSES_TTL = 2.0
"""Seconds this host's interface addresses are cached by :func:`is_this_host`."""

_local_lock = threading.Lock()
_local: tuple[float, frozenset[Address]] = (float("-inf"), frozenset())


def local_addresses(max_age: float = LOCAL_ADDRESSES_TTL) -> frozenset[Address]:
    """This host's interface addresses (``psutil.net_if_addrs``, scopes dropped), read again when the
    last read is older than ``max_age`` seconds. Non-blocking in practice (~40 µs a read); never raises
    (an unreadable list counts as empty: loopback and unspecified addresses are judged without it)."""
    global _local
    read_at, found = _local
    now = time.monotonic()
    if now - read_at < max_age:
        return found
    with _local_lock:
        read_at, found = _local
        if now - read_at < max_age:
            return found
        import psutil  # (the protocol module imports this one: psutil only when an agent port is asked)

        addresses: set[Address] = set()
        try:
            interfaces = psutil.net_if_addrs()
        except (OSError, RuntimeError):
            interfaces = {}
        for entries in interfaces.values():
            for entry in entries:
                try:
                    ip = ipaddress.ip_address(entry.address.split("%")[0])
                except ValueError:  # (a MAC address)
                    continue
                addresses.add(ip)
        _local = (now, frozenset(addresses))
        return _local[1]


def is_this_host(address: str | Address) -> bool:
    """True when a connection to ``address`` reaches this host: a loopback address, an unspecified
    one (``0.0.0.0``, ``::``: the kernel connects them to loopback), their IPv4-mapped forms, or an
    address of one of this host's interfaces (:func:`local_addresses`). Raises ValueError when
    ``address`` is not an IP address. What the kernel rules say with ``fib daddr type local`` (they
    also know addresses routed locally without an interface, e.g. ``ip route add local``)."""
    ip, _ = reached(address)
    return ip.is_loopback or ip in local_addresses()


def parse_deny(entries: Iterable[str], where: str = "deny") -> EgressPolicy:
    """Deny entries (groups or networks) → a policy. Raises PolicyError naming ``where``."""
    groups: list[str] = []
    networks: list[Network] = []
    for raw in entries:
        entry = raw.strip()
        if not entry:
            continue
        if entry.lower() in GROUPS:
            groups.append(entry.lower())
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise PolicyError(
                f"{where}: {entry!r} is neither a group ({', '.join(GROUPS)}) nor an IP network "
                "(e.g. 192.0.2.0/24, fd00::/8, 203.0.113.7)") from None
    return EgressPolicy(deny_groups=tuple(dict.fromkeys(groups)), deny_networks=tuple(dict.fromkeys(networks)))


def parse_allowed(entry: str, where: str = "allow") -> Allowed:
    """``10.0.0.5``, ``10.0.0.0/8``, ``10.0.0.5:3128``, ``[fd12::1]:8080`` or ``fd12::/16`` → Allowed.
    Raises PolicyError."""
    text = entry.strip()
    port: int | None = None
    host = text
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise PolicyError(f"{where}: {entry!r}: expected [IPv6]:port")
        if rest:
            port = _port(rest[1:], entry, where)
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = _port(port_text, entry, where)
    try:
        network = ipaddress.ip_network(host, strict=False)
    except ValueError:
        raise PolicyError(f"{where}: {entry!r} is not an IP network, optionally with a port "
                          "(e.g. 10.0.0.5:3128, 10.1.0.0/16, [fd12::1]:8080)") from None
    return Allowed(network, port)


def _port(text: str, entry: str, where: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise PolicyError(f"{where}: {entry!r}: the port must be 1..65535")
    return int(text)


def parse_allow(entries: Iterable[str], where: str = "allow") -> EgressPolicy:
    """Allow entries → a policy with only exceptions. Raises PolicyError."""
    return EgressPolicy(allow=tuple(dict.fromkeys(parse_allowed(e, where) for e in entries if e.strip())))


def parse_text(deny: str, allow: str) -> EgressPolicy:
    """The node's settings (comma-separated text) → its policy. Raises PolicyError."""
    return parse_deny(deny.split(","), "task.egress_deny").merged(parse_allow(allow.split(","), "task.egress_allow"))


def from_wire(obj: Mapping[str, Any], path: str) -> EgressPolicy:
    """A task's ``egress`` object ``{"deny": [str], "allow": [str]}`` (both optional) → a policy.
    Raises PolicyError naming ``path``."""
    unknown = set(obj) - {"deny", "allow"}
    if unknown:
        raise PolicyError(f"{path}: unknown field(s) {', '.join(sorted(unknown))}; expected deny, allow")
    lists = {}
    for key in ("deny", "allow"):
        value = obj.get(key)
        if value is None:
            value = []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise PolicyError(f"{path}.{key}: expected a list of strings")
        if len(value) > 256:
            raise PolicyError(f"{path}.{key}: at most 256 entries")
        lists[key] = value
    return parse_deny(lists["deny"], f"{path}.deny").merged(parse_allow(lists["allow"], f"{path}.allow"))
