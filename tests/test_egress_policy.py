"""The egress policy per address (pure logic): every form that reaches a denied address is refused.

What a connection to an address reaches is what counts (ckagent.node.egress_policy): ``0.0.0.0`` and
``::`` reach this host; an IPv4-mapped address is its IPv4 address; the IPv4-compatible, NAT64
(well-known prefix) and 6to4 forms also reach the IPv4 address they embed; numeric host forms
(``2852039166``, ``0251.0376.0251.0376``) are names whose resolved address is judged. No test here
opens a socket to anything (``getaddrinfo`` with AI_NUMERICHOST resolves without a query).
"""

from __future__ import annotations

import ipaddress
import socket

import psutil
import pytest

from ckagent.node.egress_policy import (
    DEFAULT_DENY,
    embedding_networks,
    is_this_host,
    local_addresses,
    parse_text,
    reached,
)

METADATA = "169.254.169.254"
ELSEWHERE = "198.51.100.7"  # TEST-NET-2: never this host's, never denied by a group


def _interface_addresses() -> list[str]:
    """This host's own non-loopback interface addresses (as psutil lists them)."""
    found = []
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            try:
                ip = ipaddress.ip_address(entry.address.split("%")[0])
            except ValueError:
                continue
            if not ip.is_loopback:
                found.append(entry.address)
    return found


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "::ffff:0.0.0.0", "127.0.0.1", "127.3.4.5", "::1",
                                     "::ffff:127.0.0.1"])
def test_this_host_in_every_form_is_denied_by_the_loopback_group_and_the_agent_ports(address: str) -> None:
    loopback = parse_text("loopback", "")
    agent = parse_text("agent", "")
    assert is_this_host(address)
    assert loopback.blocks(address, 80)
    assert agent.blocks(address, 9000, agent_ports={9000, 9100}) and agent.blocks(address, 9100, agent_ports={9000, 9100})
    assert agent.blocks(address, 9000, agent_port=9000)  # (the older call shape)
    assert not agent.blocks(address, 9001, agent_ports={9000, 9100})
    assert not parse_text(DEFAULT_DENY, "").blocks(address, 8080, agent_ports={9000})


def test_the_unspecified_addresses_are_judged_as_the_loopback_they_reach() -> None:
    assert reached("0.0.0.0") == (ipaddress.ip_address("127.0.0.1"), ())
    assert reached("::") == (ipaddress.ip_address("::1"), ())
    assert reached("::ffff:0.0.0.0") == (ipaddress.ip_address("127.0.0.1"), ())
    # An allow entry for the loopback address allows the unspecified one, which reaches it.
    assert not parse_text("loopback", "127.0.0.1:8080").blocks("0.0.0.0", 8080)
    assert parse_text("loopback", "127.0.0.1:8080").blocks("0.0.0.0", 8081)


def test_this_hosts_interface_addresses_are_the_agent_groups_and_nothing_else_is() -> None:
    agent = parse_text("agent", "")
    mine = _interface_addresses()
    assert mine, "this host has no interface address besides loopback"
    for address in mine:
        assert is_this_host(address), address
        assert agent.blocks(address, 9000, agent_ports={9000}), address
        assert not agent.blocks(address, 9001, agent_ports={9000}), address
    v4 = [a for a in mine if ipaddress.ip_address(a.split("%")[0]).version == 4]
    if v4:
        assert agent.blocks("::ffff:" + v4[0], 9000, agent_ports={9000})  # mapped: the same address
    assert not is_this_host(ELSEWHERE) and not agent.blocks(ELSEWHERE, 9000, agent_ports={9000})
    assert agent.blocks(ELSEWHERE, 9000, agent_ports={9000}, local=True)  # the caller knows better
    assert local_addresses() is local_addresses()  # cached between calls


@pytest.mark.parametrize(("address", "embeds"), [
    ("::ffff:169.254.169.254", None),  # IPv4-mapped: exactly the IPv4 address
    ("::ffff:a9fe:a9fe", None),
    ("::169.254.169.254", METADATA),  # IPv4-compatible (deprecated; sit0's automatic tunnels)
    ("64:ff9b::169.254.169.254", METADATA),  # NAT64, well-known prefix
    ("64:ff9b::a9fe:a9fe", METADATA),
    ("2002:a9fe:a9fe::", METADATA),  # 6to4
    ("2002:a9fe:a9fe:1234::5", METADATA),
])
def test_every_ipv6_form_of_a_metadata_address_is_refused(address: str, embeds: str | None) -> None:
    policy = parse_text(DEFAULT_DENY, "")
    direct, embedded = reached(address)
    if embeds is None:
        assert direct == ipaddress.ip_address(METADATA) and embedded == ()
    else:
        assert embedded == (ipaddress.ip_address(embeds),)
    assert policy.blocks(address, 80) and policy.blocks(address, 443)


def test_the_embedded_forms_of_allowed_and_private_addresses() -> None:
    private = parse_text("private", "")
    for address in ("::ffff:10.0.0.5", "::10.0.0.5", "64:ff9b::10.0.0.5", "2002:a00:5::1", "64:ff9b::192.168.1.1"):
        assert private.blocks(address, 80), address
    for address in ("64:ff9b::8.8.8.8", "2002:808:808::1", "::8.8.8.8", "2001:db8::1"):
        assert not private.blocks(address, 80), address
    # Not IPv4-compatible: the unspecified and loopback addresses (::, ::1) are in ::/96 too.
    assert reached("::1") == (ipaddress.ip_address("::1"), ())
    assert not parse_text("0.0.0.0/0", "").blocks("::1", 80) and parse_text("0.0.0.0/0", "").blocks("::2", 80)
    # An IPv4 allow entry allows its embedded forms (with its port); an IPv6 one that covers them
    # does not allow the denied IPv4 address inside (each form is judged with its own entries).
    allowed = parse_text("private", "10.0.0.5:3128")
    assert not allowed.blocks("64:ff9b::10.0.0.5", 3128) and allowed.blocks("64:ff9b::10.0.0.5", 80)
    wide = parse_text(DEFAULT_DENY, "2000::/3")
    assert wide.blocks("2002:a9fe:a9fe::", 80) and not wide.blocks("2002:808:808::", 80)
    # The IPv6 form itself denied: the IPv4 allow entry does not help it.
    assert parse_text("64:ff9b::/96", "10.0.0.5").blocks("64:ff9b::10.0.0.5", 80)


def test_teredo_and_network_specific_nat64_prefixes_are_not_judged_by_what_they_embed() -> None:
    """Documented limits (ckagent.node.egress_policy): Teredo stores its client inverted, NAT64's
    local-use and operators' prefixes put the IPv4 address where the prefix length says."""
    teredo = "2001:0:4136:e378:8000:63bf:5601:5601"  # client 169.254.169.254 (inverted: 0x5601_5601)
    assert ipaddress.IPv6Address(teredo).teredo[1] == ipaddress.ip_address(METADATA)
    assert not parse_text(DEFAULT_DENY, "").blocks(teredo, 80)
    assert not parse_text(DEFAULT_DENY, "").blocks("64:ff9b:1::a9fe:a9fe", 80)
    assert parse_text("metadata,64:ff9b:1::/48", "").blocks("64:ff9b:1::a9fe:a9fe", 80)  # deny it by name


@pytest.mark.parametrize("host", ["2852039166", "0251.0376.0251.0376", "0xa9fea9fe", "0xa9.0xfe.0xa9.0xfe",
                                  "169.254.43518", "0xa9.0376.43518", "::ffff:169.254.169.254"])
def test_numeric_host_forms_are_judged_by_the_address_getaddrinfo_gives(host: str) -> None:
    policy = parse_text(DEFAULT_DENY, "")
    infos = socket.getaddrinfo(host, 80, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    addresses = {str(info[4][0]) for info in infos}
    assert addresses and all(policy.blocks(a, 80) for a in addresses), addresses
    if ":" not in host:
        with pytest.raises(ValueError):  # a host name is never judged as such: resolve it first
            policy.blocks(host, 80)


def test_a_scoped_link_local_address_and_other_values() -> None:
    policy = parse_text(DEFAULT_DENY, "")
    assert policy.blocks("fe80::1%eth0", 80) and reached("fe80::1%lo")[0] == ipaddress.ip_address("fe80::1")
    assert policy.blocks(ipaddress.ip_address(METADATA), 80)  # an address object works too
    for bad in ("", "example.com", "127.1", "1.2.3.4.5", "[::1]"):
        with pytest.raises(ValueError):
            policy.blocks(bad, 80)
    # The policy stays a value: asking it leaves its equality and hash alone.
    again = parse_text(DEFAULT_DENY, "")
    assert policy == again and hash(policy) == hash(again)


def test_the_kernel_forms_of_a_denied_ipv4_network() -> None:
    assert [str(n) for n in embedding_networks(ipaddress.IPv4Network("169.254.0.0/16"))] == \
        ["::a9fe:0/112", "64:ff9b::a9fe:0/112", "2002:a9fe::/32"]
    assert [str(n) for n in embedding_networks(ipaddress.IPv4Network("169.254.169.254/32"))] == \
        ["::a9fe:a9fe/128", "64:ff9b::a9fe:a9fe/128", "2002:a9fe:a9fe::/48"]
    everything = embedding_networks(ipaddress.IPv4Network("0.0.0.0/0"))
    assert not any(ipaddress.ip_address(a) in n for n in everything for a in ("::", "::1"))
    assert all(any(ipaddress.ip_address(a) in n for n in everything) for a in ("::2", "::a9fe:a9fe", "64:ff9b::1"))
    assert embedding_networks(ipaddress.IPv4Network("0.0.0.1/32")) == [
        ipaddress.IPv6Network("64:ff9b::1/128"), ipaddress.IPv6Network("2002:0:1::/48")]
