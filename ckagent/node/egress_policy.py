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
``agent``      the agent's own port (its /status, /metrics server) on every address of this host
``private``    10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, 100.64.0.0/10 (carrier-grade NAT), fc00::/7
``loopback``   127.0.0.0/8, ::1
=============  ===============================================================================

Examples: ``metadata,link-local,agent`` (the default), ``metadata,link-local,agent,private``,
``192.0.2.0/24``; allow: ``10.0.0.5:3128``, ``[fd12::1]:8080``, ``10.1.0.0/16``.

An allow entry beats every deny entry. A task's own policy from the master (``egress`` of the task)
adds denials and exceptions to the node's. Exceptions: :class:`PolicyError` (a ValueError) names the
entry that is wrong and what is expected.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

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

    def blocks(self, address: str, port: int, *, agent_port: int | None = None, local: bool = False) -> bool:
        """True when a connection to ``address``:``port`` is refused by this policy (the user-space
        check of the filtering proxy; the kernel rules say the same). ``local``: the address is one of
        this host's (for the ``agent`` group)."""
        ip = ipaddress.ip_address(address)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        for entry in self.allow:
            if ip.version == entry.network.version and ip in entry.network and entry.port in (None, port):
                return False
        if self.denies_agent_port and agent_port is not None and port == agent_port and (local or ip.is_loopback):
            return True
        return any(ip.version == net.version and ip in net for net in self.denied_networks())


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
