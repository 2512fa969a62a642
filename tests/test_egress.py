"""Egress: a task's network policy, enforced by the kernel on its cgroup (nftables ``socket cgroupv2``).

Only loopback is ever a target: a rule that failed would let a packet out, so no test sends one to
any other address, not even to show that it is blocked. The policy is proved with loopback aliases
(this host routes all of 127/8 to ``lo``): deny ``127.0.0.2``, serve on it, show that a task cannot
connect while the agent and a task under another policy can. The metadata and private-range rules
are proved by reading back what the agent wrote (``nft -j list table``) and by the same rule shape
matching a locally served socket (the ``loopback`` and ``agent`` groups). Every table a test makes
is deleted in a ``finally`` (the ``tables`` fixture), also when the test fails.

Levels: this machine is systemd hybrid (v1 controllers + a v2 tree without controllers): the
``cgroup-v2`` and ``cgroup-v1`` containment levels both give tasks a v2 cgroup, so both run at the
``nftables`` egress level; pure v1 (``use_unified=False``) and ``process-group`` have no v2 cgroup
and fall back to the ``proxy`` level, which is what those tests assert.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    LEVEL,
    RecordingMaster,
    agent_process,
    another_agent,
    connect_from,
    containment_at,
    egress_kernel_missing,
    eventually,
    loopback_listener,
    no_strays,
    running_agent,
    settings_for,
    spider_zip,
    submit,
    wait_exit,
    wait_for_log,
    wait_registered,
)

from ckagent.containment import (
    ContainmentLevel,
    Limits,
    available_levels,
)
from ckagent.containment.egress import EgressError, EgressLevel, describe_refusals, open_egress, parse_text
from ckagent.containment.egress.nft import BinaryNft, LibNft, NftError, open_nft
from ckagent.containment.egress.owners import owner_comment, table_name
from ckagent.containment.egress.table import Refusal
from ckagent.containment.hierarchy import agent_group_name
from ckagent.master.protocol import ProtocolError, Task, TaskResult
from ckagent.node.agentports import PortRegistry
from ckagent.node.egress_policy import PolicyError, from_wire, parse_allowed
from ckagent.node.levels import Blocker

LEVELS_HERE = [level.value for level in available_levels(Path(tempfile.gettempdir()) / "ckagent-levels-probe")]
V2_LEVELS = [lvl for lvl in LEVELS_HERE if ContainmentLevel(lvl).has_cgroup]


needs_kernel = pytest.mark.skipif(egress_kernel_missing() is not None, reason=str(egress_kernel_missing()))


def _list_table(name: str) -> dict[str, Any] | None:
    done = subprocess.run(["nft", "-j", "list", "table", "inet", name], capture_output=True, text=True, check=False)
    return json.loads(done.stdout) if done.returncode == 0 else None


def _tables() -> set[str]:
    done = subprocess.run(["nft", "-j", "list", "tables"], capture_output=True, text=True, check=True)
    return {o["table"]["name"] for o in json.loads(done.stdout)["nftables"] if "table" in o}


@pytest.fixture
def tables() -> Iterator[list[str]]:
    """Names of nft tables (family inet) the test makes: all deleted at the end, also on failure."""
    made: list[str] = []
    try:
        yield made
    finally:
        for name in made:
            subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True, check=False)


# ------------------------------------------------------------------------------ the policy (pure logic)


def test_policy_groups_networks_and_allow_entries() -> None:
    policy = parse_text("metadata, link-local,agent,192.0.2.0/24", "10.0.0.5:3128, [fd12::1]:8080,10.9.0.0/16")
    assert policy.describe() == ("deny metadata, link-local, agent, 192.0.2.0/24; "
                                 "allow 10.0.0.5:3128, [fd12::1]:8080, 10.9.0.0/16")
    assert policy.blocks("169.254.169.254", 80)
    assert policy.blocks("::ffff:169.254.169.254", 80)  # an IPv4-mapped address is the IPv4 one
    assert policy.blocks("fd00:ec2::254", 80) and policy.blocks("100.100.100.200", 80)
    assert policy.blocks("168.63.129.16", 80) and policy.blocks("fe80::1", 22)
    assert policy.blocks("192.0.2.9", 443)
    assert not policy.blocks("10.0.0.5", 22)  # private ranges are one setting away, not default
    assert policy.blocks("127.0.0.1", 9000, agent_port=9000) and not policy.blocks("127.0.0.1", 9001, agent_port=9000)
    private = parse_text("private", "10.0.0.5:3128")
    assert private.blocks("10.0.0.5", 22) and not private.blocks("10.0.0.5", 3128)  # allow beats deny
    assert private.blocks("172.20.1.1", 80) and private.blocks("fd12::3", 80) and not private.blocks("8.8.8.8", 53)


@pytest.mark.parametrize(("deny", "allow", "expected"), [
    ("metadata,bogus", "", "'bogus' is neither a group"),
    ("", "10.0.0.5:0", "the port must be 1..65535"),
    ("", "example.com:80", "is not an IP network"),
    ("", "[fd12::1:80", "expected [IPv6]:port"),
])
def test_bad_policy_entries_say_what_is_wrong(deny: str, allow: str, expected: str) -> None:
    with pytest.raises(PolicyError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        parse_text(deny, allow)


def test_a_tasks_egress_on_the_wire_adds_to_the_nodes_policy() -> None:
    task = Task.from_json({"id": "t1", "spiderId": "s", "framework": "python",
                           "egress": {"deny": ["private"], "allow": ["10.0.0.5:3128"]}})
    assert task.egress is not None and task.to_json()["egress"] == {"deny": ["private"], "allow": ["10.0.0.5:3128"]}
    node = parse_text("metadata,agent", "")
    assert node.merged(task.egress).describe() == "deny metadata, agent, private; allow 10.0.0.5:3128"
    with pytest.raises(ProtocolError, match=r"task\.egress\.deny"):
        Task.from_json({"id": "t1", "spiderId": "s", "framework": "python", "egress": {"deny": ["10.0.0.0/33"]}})
    with pytest.raises(ProtocolError, match="unknown field"):
        Task.from_json({"id": "t1", "spiderId": "s", "framework": "python", "egress": {"block": []}})
    with pytest.raises(PolicyError):
        from_wire({"allow": "10.0.0.1"}, "egress")
    result = TaskResult.from_json({"status": "SUCCESS", "egressRefused": [
        {"address": "169.254.169.254", "port": 80, "count": 3}]})
    assert result.to_json()["egressRefused"] == [{"address": "169.254.169.254", "port": 80, "count": 3}]
    assert str(parse_allowed("[fd12::1]:8080")) == "[fd12::1]:8080"


def test_the_refusal_line() -> None:
    assert describe_refusals([]) == ""
    assert describe_refusals([Refusal("169.254.169.254", 80, 3)]) == \
        "egress: 3 connections refused: 169.254.169.254:80 ×3"
    assert describe_refusals([Refusal("fd00:ec2::254", 443, 1), Refusal("127.0.0.2", 0, 1)]) == \
        "egress: 2 connections refused: [fd00:ec2::254]:443 ×1, 127.0.0.2 ×1"


# ------------------------------------------------------------------------------ the kernel rules


@needs_kernel
@pytest.mark.parametrize("level", V2_LEVELS)
def test_a_task_is_refused_while_the_agent_and_another_task_connect(
    tmp_path: Path, tables: list[str], level: str
) -> None:
    policy = parse_text("metadata,link-local,agent,127.0.0.2", "")
    with containment_at(level, tmp_path) as containment, loopback_listener("127.0.0.2") as port:
        egress = open_egress("nftables", containment, agent_group_name(tmp_path), policy, agent_port=9)
        tables.append(table_name(agent_group_name(tmp_path)))
        denied = containment.jail("denied", Limits())
        other = containment.jail("other", Limits())
        try:
            rules = egress.attach(denied, "denied")
            # The other task's own policy allows 127.0.0.2 (the allow entry beats the node's denial).
            other_rules = egress.attach(other, "other", from_wire({"allow": ["127.0.0.2"]}, "egress"))
            assert connect_from(denied, "127.0.0.2", port) == 7
            assert connect_from(denied, "127.0.0.2", port) == 7
            assert connect_from(other, "127.0.0.2", port) == 0
            socket.create_connection(("127.0.0.2", port), timeout=5).close()  # the agent itself
            assert egress.refusals(rules) == [Refusal("127.0.0.2", port, 2)]
            assert egress.refusals(other_rules) == []
            egress.detach(rules, egress.refusals(rules))
            egress.detach(other_rules)
            assert connect_from(denied, "127.0.0.2", port) == 0  # the rules went with the task
            table = _list_table(egress.table.name if egress.table else "")
            assert table is not None
            leftovers = [o for o in table["nftables"] if "chain" in o and o["chain"]["name"].startswith(("p_", "e_"))]
            elements = [o for o in table["nftables"] if ("set" in o and o["set"].get("elem")
                                                         and o["set"]["name"] != "agent_ports")
                        or ("map" in o and o["map"].get("elem"))]
            # The node's default policy chain stays for the next task (pinned); a task's own goes with it.
            assert [c["chain"]["name"] for c in leftovers] == [rules.chain] and elements == [], table
        finally:
            for jail in (denied, other):
                jail.close()
            egress.close()
    assert table_name(agent_group_name(tmp_path)) not in _tables()


@needs_kernel
def test_the_rules_read_back_deny_metadata_link_local_private_and_the_agent_port(
    tmp_path: Path, tables: list[str]
) -> None:
    policy = parse_text("metadata,link-local,agent,private", "10.0.0.5:3128")
    level = V2_LEVELS[0]
    with containment_at(level, tmp_path) as containment:
        egress = open_egress("nftables", containment, agent_group_name(tmp_path), policy, agent_port=9000)
        name = table_name(agent_group_name(tmp_path))
        tables.append(name)
        jail = containment.jail("readback", Limits())
        try:
            egress.attach(jail, "readback")
            text = subprocess.run(["nft", "list", "table", "inet", name], capture_output=True, text=True,
                                  check=True).stdout
            table = _list_table(name)
        finally:
            jail.close()
            egress.close()
    assert table is not None
    for network in ("169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                    "168.63.129.16", "fc00::/7", "fe80::/10"):
        assert network in text, (network, text)
    # 169.254.169.254 and fd00:ec2::254 are inside the link-local / ULA ranges the set holds.
    assert "10.0.0.5 tcp dport 3128 accept" in text or "10.0.0.5 meta l4proto { tcp, udp } th dport 3128 accept" in text
    assert "fib daddr type local meta l4proto { tcp, udp } th dport @agent_ports goto refuse" in text
    [ports] = [o["set"] for o in table["nftables"] if "set" in o and o["set"]["name"] == "agent_ports"]
    assert ports["elem"] == [9000], ports
    assert "reject with tcp reset" in text
    # The IPv6 forms that embed a denied IPv4 address (IPv4-compatible, NAT64, 6to4) are refused too,
    # except those of an IPv4 allow entry (with its port), judged on in chain e_<P>.
    for network in ("::169.254.0.0/112", "64:ff9b::a9fe:0/112", "2002:a9fe::/32", "64:ff9b::a00:0/104",
                    "2002:a00::/24", "::10.0.0.0/104"):
        assert network in text, (network, text)
    assert "ip6 daddr 64:ff9b::a00:5 meta l4proto { tcp, udp } th dport 3128 return" in text, text
    assert '"unified/' in text or '"' + str(jail.v2_path()).removeprefix("/sys/fs/cgroup/") in text
    chains = [o["chain"] for o in table["nftables"] if "chain" in o]
    [hook] = [c for c in chains if c.get("hook")]
    assert (hook["hook"], hook["policy"]) == ("output", "accept")


@needs_kernel
def test_the_agent_port_and_loopback_groups_match_a_local_socket(tmp_path: Path, tables: list[str]) -> None:
    """The same rule shapes as for the metadata addresses, matched for real on loopback."""
    with containment_at(V2_LEVELS[0], tmp_path) as containment, loopback_listener("127.0.0.1") as agent_port, \
            loopback_listener("127.0.0.3") as other_port:
        egress = open_egress("nftables", containment, agent_group_name(tmp_path), parse_text("agent", ""),
                             agent_port=agent_port)
        tables.append(table_name(agent_group_name(tmp_path)))
        jail = containment.jail("ports", Limits())
        loop_jail = containment.jail("loop", Limits())
        try:
            egress.attach(jail, "ports")
            egress.attach(loop_jail, "loop", from_wire({"deny": ["loopback"]}, "egress"))
            assert connect_from(jail, "127.0.0.1", agent_port) == 7  # the agent's own port
            assert connect_from(jail, "127.0.0.3", other_port) == 0  # another local port
            assert connect_from(loop_jail, "127.0.0.3", other_port) == 7  # the whole loopback range
        finally:
            jail.close()
            loop_jail.close()
            egress.close()


@needs_kernel
def test_this_host_in_every_form_and_every_agents_port_are_refused_by_the_kernel(
    tmp_path: Path, tables: list[str]
) -> None:
    """The ``agent`` group refuses the ports of every agent in the registry (this one's on 127.0.0.1,
    another process's on 127.0.0.3), also through ``0.0.0.0`` and the IPv4-mapped form; the
    ``loopback`` group refuses ``0.0.0.0`` and ``::``; a denied address is refused in its mapped form
    (the packets are IPv4: the refusal is counted for the IPv4 address). An agent that goes is
    forgotten when the next task is added."""
    directory = tmp_path / "ports"
    registry = PortRegistry(directory, liveness_interval=0)
    with containment_at(V2_LEVELS[0], tmp_path) as containment, loopback_listener("127.0.0.1") as own, \
            loopback_listener("127.0.0.1") as plain, loopback_listener("::1") as plain6, loopback_listener("127.0.0.2") as denied, \
            loopback_listener("127.0.0.3") as theirs, loopback_listener("127.0.0.3") as free:
        registry.register([own])
        egress = open_egress("nftables", containment, agent_group_name(tmp_path), parse_text("agent", ""),
                             agent_port=own, registry=registry)
        tables.append(table_name(agent_group_name(tmp_path)))
        jails = {name: containment.jail(name, Limits()) for name in ("agent", "loop", "addr", "later")}
        try:
            with another_agent(directory, [theirs]) as other:
                rules = egress.attach(jails["agent"], "agent")
                loop = egress.attach(jails["loop"], "loop", from_wire({"deny": ["loopback"]}, "egress"))
                addr = egress.attach(jails["addr"], "addr", from_wire({"deny": ["127.0.0.2"]}, "egress"))
                assert egress.table is not None and egress.table.agent_ports == {own, theirs}
                for address in ("127.0.0.1", "0.0.0.0", "::ffff:127.0.0.1", "::ffff:0.0.0.0"):
                    assert connect_from(jails["agent"], address, own) == 7, address  # this agent's port
                assert connect_from(jails["agent"], "127.0.0.3", theirs) == 7  # the other agent's
                assert connect_from(jails["agent"], "::ffff:127.0.0.3", theirs) == 7
                assert connect_from(jails["agent"], "127.0.0.3", free) == 0  # not an agent's port
                assert connect_from(jails["agent"], "0.0.0.0", plain) == 0 and connect_from(jails["agent"], "::", plain6) == 0
                assert connect_from(jails["loop"], "0.0.0.0", plain) == 7 and connect_from(jails["loop"], "::", plain6) == 7
                assert connect_from(jails["loop"], "::ffff:127.0.0.3", free) == 7
                assert connect_from(jails["addr"], "::ffff:127.0.0.2", denied) == 7
                assert connect_from(jails["addr"], "127.0.0.3", free) == 0
                assert egress.refusals(addr) == [Refusal("127.0.0.2", denied, 1)]  # IPv4 packets
                refused = egress.refusals(rules)
                assert {(r.address, r.port) for r in refused} == {("127.0.0.1", own), ("127.0.0.3", theirs)}, refused
                assert sum(r.count for r in refused) == 6
                other.kill()  # an agent that crashed: its entry is judged dead
                other.wait()
                later = egress.attach(jails["later"], "later")  # the set is brought up to date
                assert egress.table.agent_ports == {own}
                assert connect_from(jails["later"], "127.0.0.3", theirs) == 0
                assert connect_from(jails["later"], "0.0.0.0", own) == 7
            for r in (rules, loop, addr, later):
                egress.detach(r)
        finally:
            for jail in jails.values():
                jail.close()
            egress.close()
            registry.close()


@needs_kernel
async def test_an_agent_that_starts_while_a_task_runs_is_refused_to_it_at_once(tmp_path: Path, tables: list[str]) -> None:
    """The nftables level's service watches the registry: another agent's port joins the set when
    its entry appears (no new task needed) and leaves it when its entry goes."""
    directory = tmp_path / "ports"
    with containment_at(V2_LEVELS[0], tmp_path) as containment, loopback_listener("127.0.0.3") as theirs:
        egress = open_egress("nftables", containment, agent_group_name(tmp_path), parse_text("agent", ""),
                             registry=PortRegistry(directory))
        tables.append(table_name(agent_group_name(tmp_path)))
        egress.listening(9)  # (this agent's port: its entry makes the directory)
        jail = containment.jail("running", Limits())
        assert egress.table is not None
        try:
            rules = egress.attach(jail, "running")
            assert await trio.to_thread.run_sync(connect_from, jail, "127.0.0.3", theirs) == 0
            async with trio.open_nursery() as service:
                await service.start(egress.serve)
                table = egress.table

                async def refused() -> bool:
                    return theirs in table.agent_ports

                async def reachable() -> bool:
                    return theirs not in table.agent_ports

                with another_agent(directory, [theirs]):
                    await eventually(refused, 10, "the other agent's port in the set", interval=0.01)
                    assert await trio.to_thread.run_sync(connect_from, jail, "127.0.0.3", theirs) == 7
                await eventually(reachable, 10, "the port gone with the entry", interval=0.01)
                assert await trio.to_thread.run_sync(connect_from, jail, "127.0.0.3", theirs) == 0
                service.cancel_scope.cancel()
            egress.detach(rules)
        finally:
            jail.close()
            egress.close()


@needs_kernel
def test_a_stale_table_is_replaced_and_other_tables_are_untouched(tmp_path: Path, tables: list[str]) -> None:
    name = table_name(agent_group_name(tmp_path))
    foreign = f"ck_foreign_{os.getpid()}"
    tables.extend([name, foreign])
    subprocess.run(["nft", "-f", "-"], input=f"add table inet {name}\nadd chain inet {name} stale_from_a_crash\n"
                   f"add table inet {foreign}\nadd chain inet {foreign} theirs\n", text=True, check=True)
    with containment_at(V2_LEVELS[0], tmp_path) as containment:
        egress = open_egress("auto", containment, agent_group_name(tmp_path), parse_text("metadata", ""))
        try:
            assert egress.level is EgressLevel.NFTABLES and egress.passed_over == ()
            mine = _list_table(name)
            assert mine is not None
            assert not [o for o in mine["nftables"] if "chain" in o and o["chain"]["name"] == "stale_from_a_crash"]
            theirs = _list_table(foreign)
            assert theirs is not None and [o["chain"]["name"] for o in theirs["nftables"] if "chain" in o] == ["theirs"]
        finally:
            egress.close()
    assert name not in _tables() and foreign in _tables()


@needs_kernel
def test_a_tasks_elements_go_over_netlink_read_back_like_nft_and_go_after_its_cgroup(
    tmp_path: Path, tables: list[str]
) -> None:
    """The per-task changes skip nft (its refresh of the whole host ruleset costs ~0.35 ms per
    table): the kernel holds the same element nft would write, the refusals read the same as nft's
    JSON listing, and the elements are removed by the cgroup's id even after its directory is gone."""
    policy = parse_text("metadata,127.0.0.2", "")
    with containment_at(V2_LEVELS[0], tmp_path) as containment, loopback_listener("127.0.0.2") as port:
        egress = open_egress("nftables", containment, agent_group_name(tmp_path), policy, work_dir=tmp_path)
        name = table_name(agent_group_name(tmp_path))
        tables.append(name)
        assert egress.table is not None and egress.table.elements is not None
        first, fast = containment.jail("first", Limits()), containment.jail("fast", Limits())
        try:
            first_rules = egress.attach(first, "first")  # (adds the policy's chain: through nft)
            rules = egress.attach(fast, "fast")  # the chain exists: one netlink message
            assert rules is not None and first_rules is not None and rules.key
            listed = subprocess.run(["nft", "list", "map", "inet", name, "tasks"], capture_output=True, text=True,
                                    check=True).stdout
            assert f'"{rules.cgroup}" : jump {rules.chain}' in listed, listed
            assert connect_from(fast, "127.0.0.2", port) == 7
            assert connect_from(fast, "127.0.0.2", port) == 7
            assert connect_from(first, "127.0.0.2", port) == 7
            refused = egress.refusals(rules)
            assert refused == [Refusal("127.0.0.2", port, 2)]
            elements, egress.table.elements = egress.table.elements, None
            try:
                assert egress.refusals(rules) == refused  # nft's JSON listing reads the same
            finally:
                egress.table.elements = elements
            fast.close()  # the cgroup goes first: nft could not name it any more
            egress.detach(rules, refused)
            listed = subprocess.run(["nft", "list", "table", "inet", name], capture_output=True, text=True,
                                    check=True).stdout
            assert rules.cgroup not in listed and f'"{first_rules.cgroup}" : jump' in listed, listed
            assert listed.count(f". 127.0.0.2 . {port}") == 1, listed  # the first task's hit stays
        finally:
            first.close()
            fast.close()
            egress.close()
    assert name not in _tables()


@needs_kernel
def test_a_starting_agent_removes_the_tables_of_work_dirs_that_are_gone(tmp_path: Path, tables: list[str]) -> None:
    """An agent killed with -9 and never started again in its work dir (a test's directory, an
    uninstalled agent) leaves its table: the next agent to start anywhere deletes it when the work
    dir named in its comment no longer exists, and touches nothing else."""
    pid = os.getpid()
    gone, alive, old, foreign = (f"ckagent_t{pid}gone", f"ckagent_t{pid}alive", f"ckagent_t{pid}old",
                                 f"ck_foreign_{pid}")
    tables.extend([gone, alive, old, foreign])
    (tmp_path / "alive").mkdir()
    subprocess.run(["nft", "-f", "-"], check=True, text=True, input=(
        f'add table inet {gone} {{ comment "ckagent work_dir={tmp_path / "gone"}"; }}\n'
        f'add table inet {alive} {{ comment "ckagent work_dir={tmp_path / "alive"}"; }}\n'
        f"add table inet {old}\n"
        f'add table inet {foreign} {{ comment "ckagent work_dir={tmp_path / "gone"}"; }}\n'))
    work_dir = tmp_path / "agent"
    work_dir.mkdir()  # as an agent's is: a table naming a work dir that does not exist is any agent's to delete
    name = table_name(agent_group_name(work_dir))
    tables.append(name)
    with containment_at(V2_LEVELS[0], tmp_path) as containment:
        egress = open_egress("nftables", containment, agent_group_name(work_dir), parse_text("metadata", ""),
                             work_dir=work_dir)
        try:
            left = _tables()
            mine = subprocess.run(["nft", "list", "table", "inet", name], capture_output=True, text=True,
                                  check=True).stdout
        finally:
            egress.close()
    assert gone not in left and {alive, old, foreign, name} <= left
    assert f'comment "{owner_comment(str(work_dir))}"' in mine  # (legacy comments above are read too)


@needs_kernel
def test_the_nft_program_is_the_fallback_of_the_library(tmp_path: Path, tables: list[str]) -> None:
    assert open_nft().kind == "libnftables"
    with pytest.raises(NftError, match="cannot be loaded"):
        LibNft("libnftables-missing.so.9")
    with containment_at(V2_LEVELS[0], tmp_path) as containment, loopback_listener("127.0.0.2") as port:
        egress = open_egress("nftables", containment, agent_group_name(tmp_path), parse_text("127.0.0.2", ""),
                             nft=BinaryNft())
        tables.append(table_name(agent_group_name(tmp_path)))
        jail = containment.jail("binary", Limits())
        try:
            rules = egress.attach(jail, "binary")
            assert connect_from(jail, "127.0.0.2", port) == 7
            assert egress.refusals(rules) == [Refusal("127.0.0.2", port, 1)]
            egress.detach(rules)
        finally:
            jail.close()
            egress.close()


# ------------------------------------------------------------------------------ the levels without the kernel


@pytest.mark.skipif("cgroup-v1" not in LEVELS_HERE, reason="no cgroup v1 hierarchy here")
def test_pure_v1_and_process_groups_fall_back_to_the_proxy_level(tmp_path: Path) -> None:
    policy = parse_text("metadata", "")
    with containment_at("cgroup-v1", tmp_path, use_unified=False) as v1:
        egress = open_egress("auto", v1, agent_group_name(tmp_path), policy)
        assert egress.level is EgressLevel.PROXY and "no cgroup in a cgroup v2 tree" in egress.details
        assert [(u.level, u.blocker) for u in egress.passed_over] == [(EgressLevel.NFTABLES, Blocker.NO_TASK_CGROUP)]
        with pytest.raises(EgressError, match=r"task\.egress=nftables is not available here") as raised:
            open_egress("nftables", v1, agent_group_name(tmp_path), policy)
        assert raised.value.blocker is Blocker.NO_TASK_CGROUP
    with containment_at("process-group", tmp_path) as groups:
        assert open_egress("auto", groups, agent_group_name(tmp_path), policy).level is EgressLevel.PROXY
    off = open_egress("off", None, agent_group_name(tmp_path), policy)
    assert off.level is EgressLevel.OFF and off.attach(groups.jail("x", Limits()), "x") is None
    assert [(u.level, u.blocker) for u in off.passed_over] == [(EgressLevel.NFTABLES, Blocker.SETTING),
                                                               (EgressLevel.PROXY, Blocker.SETTING)]
    assert off.to_json()["level"] == "off"


def test_without_nft_rights_the_level_is_the_proxy(tmp_path: Path) -> None:
    class Refusing(BinaryNft):
        def __init__(self) -> None:
            self.program = "nft"

        def run(self, commands: str) -> None:
            raise NftError("Error: Could not process rule: Operation not permitted")

    level = V2_LEVELS[0] if V2_LEVELS else "process-group"
    with containment_at(level, tmp_path) as containment:
        egress = open_egress("auto", containment, agent_group_name(tmp_path), parse_text("metadata", ""),
                             nft=Refusing())
    assert egress.level is EgressLevel.PROXY
    if V2_LEVELS:
        assert "CAP_NET_ADMIN" in egress.details
        assert [(u.level, u.blocker) for u in egress.passed_over] == [(EgressLevel.NFTABLES, Blocker.NO_NET_ADMIN)]
        assert "CAP_NET_ADMIN" in egress.passed_over[0].blocker.remedy


# ------------------------------------------------------------------------------ the agent end to end


@needs_kernel
@pytest.mark.parametrize("level", V2_LEVELS)
async def test_the_agent_refuses_reports_and_shows_a_tasks_connections(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, tables: list[str], level: str,
) -> None:
    LEVEL["current"] = level
    tables.append(table_name(agent_group_name(tmp_path / "agent")))
    admin = recording_master.admin
    spider = ("import os, socket, sys, time\n"
              "port = int(os.environ['TARGET_PORT'])\n"
              "for _ in range(3):\n"
              "    try:\n"
              "        socket.create_connection(('127.0.0.2', port), timeout=5)\n"
              "        print('connected', flush=True)\n"
              "    except ConnectionRefusedError:\n"
              "        print('refused', flush=True)\n"
              "time.sleep(30)\n")
    with loopback_listener("127.0.0.2") as port:
        settings = settings_for(tmp_path, recording_master, AGENT_TASK_EGRESS="nftables",
                                AGENT_TASK_EGRESS_DENY="metadata,link-local,agent,127.0.0.2")
        async with running_agent(nursery, settings) as agent:
            task_id = await submit(admin, "egress", {"main.py": spider}, env={"TARGET_PORT": str(port)})
            await wait_for_log(admin, task_id, "refused")
            with trio.fail_after(20):
                while True:
                    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}") as client:
                        status = (await client.get("/status")).json()
                        metrics_before = (await client.get("/metrics")).text
                    [running] = status["runningTasks"]
                    if running["egress"] and running["egress"]["refused"] and \
                            running["egress"]["refused"][0]["count"] == 3:
                        break
                    await trio.sleep(0.1)
            await admin.cancel_task(task_id)
            with trio.fail_after(20):
                task = await admin.wait_task_final(task_id, 20)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}") as client:
                metrics = (await client.get("/metrics")).text
            nodes = await admin.list_nodes()
        lines = await admin.get_logs(task_id)
    assert status["egress"]["level"] == "nftables"
    assert status["egress"]["deny"] == ["metadata", "link-local", "agent", "127.0.0.2/32"]
    assert running["egress"]["summary"] == f"egress: 3 connections refused: 127.0.0.2:{port} ×3"
    assert 'ckagent_egress_level{level="nftables"} 1.0' in metrics_before
    assert "ckagent_egress_refused_total 3.0" in metrics
    assert task["egressRefused"] == [{"address": "127.0.0.2", "port": port, "count": 3}], task
    assert lines.count("refused") == 3
    assert any(line.endswith(f"egress: 3 connections refused: 127.0.0.2:{port} ×3") for line in lines), lines
    [node] = [n for n in nodes if n["name"] == "test-node"]
    assert node["egress"]["level"] == "nftables"
    assert table_name(agent_group_name(tmp_path / "agent")) not in _tables()  # removed at the agent's stop


# Connects once to each "address:port" of its argv and prints what happened.
PROBE = """
import socket, sys
for target in sys.argv[1:]:
    address, port = target.rsplit(":", 1)
    try:
        socket.create_connection((address, int(port)), timeout=5).close()
        print("connected", target, flush=True)
    except ConnectionRefusedError:
        print("refused", target, flush=True)
"""


@needs_kernel
@pytest.mark.parametrize("level", V2_LEVELS[:1])
async def test_a_spiders_egress_from_the_reference_master_reaches_the_agent(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, tables: list[str], level: str,
) -> None:
    """The spider's ``egress`` (set through the admin API) travels in its tasks to the agent and is
    enforced by the kernel: its deny entry refuses 127.0.0.2, its allow entry beats the node's denial
    of 127.0.0.3; a task with its own ``egress`` replaces the spider's (127.0.0.2 reachable, the node's
    127.0.0.3 denial back)."""
    LEVEL["current"] = level
    tables.append(table_name(agent_group_name(tmp_path / "agent")))
    admin = recording_master.admin
    with loopback_listener("127.0.0.2") as port2, loopback_listener("127.0.0.3") as port3:
        targets = [f"127.0.0.2:{port2}", f"127.0.0.3:{port3}"]
        settings = settings_for(tmp_path, recording_master, AGENT_TASK_EGRESS="nftables",
                                AGENT_TASK_EGRESS_DENY="metadata,link-local,agent,127.0.0.3")
        async with running_agent(nursery, settings):
            spider_id = await admin.create_spider(name="spider-egress", framework="python",
                                                  command=["python", "main.py", *targets],
                                                  egress={"deny": ["127.0.0.2"], "allow": ["127.0.0.3"]})
            await admin.upload_package(spider_id, spider_zip({"main.py": PROBE}))
            copied = await admin.create_task(spider_id)
            own = await admin.create_task(spider_id, egress={"deny": []})
            with trio.fail_after(60):
                first = await admin.wait_task_final(copied, 60)
                second = await admin.wait_task_final(own, 60)
        first_lines, second_lines = await admin.get_logs(copied), await admin.get_logs(own)
    assert first["status"] == second["status"] == "SUCCESS", (first, second)
    assert first["egress"] == {"deny": ["127.0.0.2/32"], "allow": ["127.0.0.3"]}
    assert [line for line in first_lines if line.startswith(("connected", "refused"))] == \
        [f"refused {targets[0]}", f"connected {targets[1]}"], first_lines
    assert first["egressRefused"] == [{"address": "127.0.0.2", "port": port2, "count": 1}], first
    assert [line for line in second_lines if line.startswith(("connected", "refused"))] == \
        [f"connected {targets[0]}", f"refused {targets[1]}"], second_lines
    assert second["egressRefused"] == [{"address": "127.0.0.3", "port": port3, "count": 1}], second
    assert table_name(agent_group_name(tmp_path / "agent")) not in _tables()


@pytest.mark.slow
@needs_kernel
def test_the_egress_benchmark_runs() -> None:
    """bench/egress.py in its quick mode (its figures mean nothing here; it must not rot)."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "bench.egress", "--quick"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "add + remove (netlink, 64 other tasks)" in done.stdout, done.stdout
    assert "add + remove (libnftables, 64 other tasks)" in done.stdout, done.stdout
    assert "from a task (default policy)" in done.stdout
    assert not [t for t in _tables() if t.startswith("ckagent_bench")]


# ------------------------------------------------------------------------------ the advisory proxy


async def _http_ok(stream: trio.SocketStream) -> None:
    """A one-answer HTTP server: reads a request head, answers 200 ``ok``."""
    async with stream:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            data += chunk
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")


async def test_the_proxy_level_refuses_denied_destinations_and_counts_them(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    with containment_at("process-group", tmp_path) as groups:
        egress = open_egress("auto", groups, agent_group_name(tmp_path), parse_text("metadata,agent,127.0.0.2", ""),
                             agent_port=9)
    assert egress.level is EgressLevel.PROXY
    denied = await nursery.start(partial(trio.serve_tcp, _http_ok, 0, host="127.0.0.2"))
    allowed = await nursery.start(partial(trio.serve_tcp, _http_ok, 0, host="127.0.0.3"))
    denied_port, allowed_port = (listeners[0].socket.getsockname()[1] for listeners in (denied, allowed))
    await nursery.start(egress.serve)
    rules = await trio.to_thread.run_sync(egress.attach, groups.jail("t1", Limits()), "t1")
    other = await trio.to_thread.run_sync(egress.attach, None, "t2")
    env = egress.task_env(rules, {})
    url = env["HTTP_PROXY"]
    assert env["HTTP_PROXY"] == env["https_proxy"] == env["ALL_PROXY"] and env["NO_PROXY"] == "<-loopback>"
    user, password = url.split("//")[1].split("@")[0].split(":")
    port = egress.proxy_port(rules)
    assert user.startswith("t") and len(password) >= 20 and url.endswith(f"@127.0.0.1:{port}")
    assert egress.task_env(other, {})["HTTP_PROXY"] != url and egress.proxy_port(other) != port
    with trio.fail_after(20):
        async with httpx.AsyncClient(proxy=url) as client:
            ok = await client.get(f"http://127.0.0.3:{allowed_port}/x?y=1")
            refused = await client.get(f"http://127.0.0.2:{denied_port}/")
            agent = await client.get("http://127.0.0.1:9/")
        async with httpx.AsyncClient(proxy=f"http://127.0.0.1:{port}") as client:  # no credentials: the port's task
            anonymous = await client.get(f"http://127.0.0.3:{allowed_port}/")
        wrong = egress.task_env(other, {})["HTTP_PROXY"].rsplit(":", 1)[0] + f":{port}"  # t2's credentials, t1's port
        async with httpx.AsyncClient(proxy=wrong) as client:
            impostor = await client.get(f"http://127.0.0.3:{allowed_port}/")
        # CONNECT (what HTTPS uses): the tunnel opens to an allowed destination only.
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        auth = base64.b64encode(f"{user}:{password}".encode()).decode()
        await stream.send_all(f"CONNECT 127.0.0.2:{denied_port} HTTP/1.1\r\nHost: 127.0.0.2:{denied_port}\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
                              .encode())
        tunnel = await stream.receive_some(4096)
        await stream.aclose()
    assert (ok.status_code, ok.text) == (200, "ok")
    assert refused.status_code == 403 and "egress policy" in refused.text
    assert agent.status_code == 403  # the agent's own port
    assert (anonymous.status_code, anonymous.text) == (200, "ok")
    assert impostor.status_code == 407 and "not this task's" in impostor.text
    assert tunnel.startswith(b"HTTP/1.1 403")
    assert egress.refusals(rules) == [Refusal("127.0.0.2", denied_port, 2), Refusal("127.0.0.1", 9, 1)]
    egress.detach(rules)
    egress.detach(other)
    with pytest.raises(OSError):  # the task's listener is closed with its rules
        await trio.open_tcp_stream("127.0.0.1", port)


def test_ckagent_exec_prints_the_refusal_line() -> None:
    from ckagent.cli.localrun import _summary

    lines = _summary({"status": "SUCCESS", "egressRefused": [{"address": "169.254.169.254", "port": 80, "count": 3}]},
                     None, Path("items.jsonl"), 1.0)
    assert lines[-1] == "[ckagent exec] egress: 3 connections refused: 169.254.169.254:80 ×3"


HANDED = """
import os, socket, time
port = int(os.environ["TARGET_PORT"])
print("ready", flush=True)
go = os.path.join(os.environ["CK_TASK_DIR"], "go")
for _ in range(600):  # bounded: at most a minute
    if os.path.exists(go):
        break
    time.sleep(0.1)
for _ in range(3):
    try:
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
        print("connected", flush=True)
    except ConnectionRefusedError:
        print("refused", flush=True)
"""


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("level", V2_LEVELS)
async def test_a_task_handed_over_to_the_next_agent_stays_under_its_policy(
    recording_master: RecordingMaster, tmp_path: Path, tables: list[str], level: str,
) -> None:
    """SIGUSR2 leaves the task running and its rules in the kernel; the next agent re-adopts it and
    puts it under its policy again: every connection the task makes after the restart is refused."""
    admin = recording_master.admin
    table = table_name(agent_group_name(tmp_path / "node" / "data"))
    tables.append(table)
    with loopback_listener("127.0.0.2") as port:
        agent = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token,
                              task__containment=level, task__egress="nftables",
                              task__egress_deny="metadata,link-local,agent,127.0.0.2")
        await agent.start()
        async with agent:
            await wait_registered(admin, agent)
            task_id = await submit(admin, "handed-egress", {"main.py": HANDED}, env={"TARGET_PORT": str(port)})
            await wait_for_log(admin, task_id, "ready")
            agent.signal(signal.SIGUSR2)
            assert await wait_exit(agent, 15) == 0
            assert table in _tables()  # the handed-over task stays filtered while no agent runs
            await agent.start()
            await wait_for_log(admin, task_id, "re-adopted")
            (tmp_path / "node" / "data" / "tasks" / task_id / "go").write_text("")
            task = await admin.wait_task_final(task_id, 30)
            agent.signal(signal.SIGTERM)
            assert await wait_exit(agent, 30) == 0
    lines = await admin.get_logs(task_id)
    assert task["status"] == "SUCCESS", task
    assert [line for line in lines if line in ("refused", "connected")] == ["refused"] * 3, lines
    assert task["egressRefused"] == [{"address": "127.0.0.2", "port": port, "count": 3}], task
    assert table not in _tables()  # a drain (SIGTERM) removes the table


PROXIED = """
import os, time, urllib.error, urllib.request
print("ready", flush=True)
go = os.path.join(os.environ["CK_TASK_DIR"], "go")
for _ in range(600):  # bounded: at most a minute
    if os.path.exists(go):
        break
    time.sleep(0.1)
for name in ("DENIED", "ALLOWED"):
    url = os.environ[name]
    try:
        urllib.request.urlopen(url, timeout=10).read()
        print("ok", name, flush=True)
    except urllib.error.HTTPError as exc:
        print("http", exc.code, name, flush=True)
    except OSError as exc:
        print("failed", name, exc, flush=True)
"""


async def test_a_task_handed_over_at_the_proxy_level_keeps_its_proxy(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Where the kernel cannot filter, a task's proxy variables name its own proxy port: the next
    agent listens on that same port again (the port and the password survive the restart), so a
    re-adopted task's requests still go through its policy (denied: 403, allowed: through)."""
    admin = recording_master.admin
    denied = await nursery.start(partial(trio.serve_tcp, _http_ok, 0, host="127.0.0.2"))
    allowed = await nursery.start(partial(trio.serve_tcp, _http_ok, 0, host="127.0.0.3"))
    denied_port, allowed_port = (listeners[0].socket.getsockname()[1] for listeners in (denied, allowed))
    agent = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token,
                          task__egress="proxy", task__egress_deny="metadata,link-local,agent,127.0.0.2")
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "proxied", {"main.py": PROXIED},
                               env={"DENIED": f"http://127.0.0.2:{denied_port}/",
                                    "ALLOWED": f"http://127.0.0.3:{allowed_port}/"})
        await wait_for_log(admin, task_id, "ready")
        agent.signal(signal.SIGUSR2)
        assert await wait_exit(agent, 15) == 0
        await agent.start()
        await wait_for_log(admin, task_id, "re-adopted", 60)
        (tmp_path / "node" / "data" / "tasks" / task_id / "go").write_text("")
        task = await admin.wait_task_final(task_id, 60)
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 30) == 0
    lines = await admin.get_logs(task_id)
    assert task["status"] == "SUCCESS", task
    assert [line for line in lines if line.split(" ")[0] in ("ok", "http", "failed")] == \
        ["http 403 DENIED", "ok ALLOWED"], lines
    assert task["egressRefused"] == [{"address": "127.0.0.2", "port": denied_port, "count": 1}], task
