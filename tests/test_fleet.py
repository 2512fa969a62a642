"""A fleet: one identity per node (nodeUid), protocol version and features at registration, and the
master's minimum / desired agent versions (ckagent.master.fleet, the reference master's side in devmaster)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import httpx
import pytest
import trio
from harness import agent_settings, eventually, running_agent, submit

from ckagent import __version__
from ckagent.agent import Agent
from ckagent.devmaster.errors import ConflictError
from ckagent.devmaster.store import NODE_LIVE_SECONDS, Store
from ckagent.master.fleet import NODE_UID_FILE, VersionWatch, load_node_uid
from ckagent.master.protocol import FEATURES, PROTOCOL_VERSION, Heartbeat, RegisterRequest, VersionPolicy
from ckagent.node.intake import IntakeGate


def test_node_uid_is_created_once_and_kept(tmp_path: Path) -> None:
    uid = load_node_uid(tmp_path / "work")
    assert len(uid) == 32 and int(uid, 16) >= 0
    assert load_node_uid(tmp_path / "work") == uid
    (tmp_path / "work" / NODE_UID_FILE).write_text("garbage\n")
    assert load_node_uid(tmp_path / "work") not in (uid, "garbage")


def _request(name: str, uid: str | None) -> RegisterRequest:
    return RegisterRequest(name=name, ip="127.0.0.1", port=1, version="0.1.0", os="linux", arch="x86_64",
                           python="3.11", cpu_count=1, memory_total_bytes=1 << 30, max_workers=2, node_uid=uid)


def _beat() -> Heartbeat:
    return Heartbeat(status="RUNNING", cpu_percent=1, memory_percent=1, disk_percent=1, memory_used_bytes=1,
                     disk_free_bytes=1, load1=0, running_task_ids=[], running_spider_ids=[], max_workers=2,
                     free_slots=2, version="0.1.0", uptime_seconds=1)


def test_a_second_live_agent_with_the_same_name_is_refused_not_given_the_key(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node, _ = store.register_node(_request("n1", "a" * 32))
        assert store.register_node(_request("n1", "a" * 32))[0] == node  # the same agent again: fine
        store.heartbeat(node, _beat())
        with pytest.raises(ConflictError, match=r"belongs to another live agent .* agent\.name"):
            store.register_node(_request("n1", "b" * 32))
        # once the first one's heartbeats stop, the name may move to the new agent (a reinstall)
        later = time.time() + NODE_LIVE_SECONDS + 1
        assert store.register_node(_request("n1", "b" * 32), at=later)[0] == node
        # agents that send no nodeUid keep the old rule (re-registration by name)
        assert store.register_node(_request("n1", None))[0] == node
    finally:
        store.close()


async def test_two_agents_with_one_name_the_second_waits_with_a_clear_message(
    dev_master, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The second agent with the name is refused (409) and waits for the name (issue 39: no exit 1),
    saying why; the first keeps its key: no ping-pong."""
    first = agent_settings(tmp_path / "one", dev_master.base_url, dev_master.registration_token, AGENT_NAME="twin")
    second = agent_settings(tmp_path / "two", dev_master.base_url, dev_master.registration_token, AGENT_NAME="twin")
    async with trio.open_nursery() as nursery, running_agent(nursery, first) as agent:
        async def beating() -> bool:
            return agent.heartbeat.last_success is not None

        await eventually(beating)
        waiting = Agent(second)
        with trio.fail_after(30):
            async with trio.open_nursery() as inner:
                inner.start_soon(waiting.run)

                async def says_why() -> str | None:
                    return waiting.master.connectivity.problem

                problem = await eventually(says_why)
                waiting.drain()  # a stop while it waits: it ends, exit 0, nothing sent
        assert "waiting for the name twin" in problem and "belongs to another live agent" in problem
        assert "AGENT_NAME" in problem
        assert not waiting.master.registered
        [node] = await dev_master.admin.list_nodes()
        assert node["name"] == "twin"
        assert agent.master.registered  # the first keeps its key: no ping-pong
        assert await agent.heartbeat.beat_once()


async def test_registration_sends_protocol_version_features_and_node_uid(dev_master, tmp_path: Path) -> None:
    settings = agent_settings(tmp_path / "w", dev_master.base_url, dev_master.registration_token)
    async with trio.open_nursery() as nursery, running_agent(nursery, settings) as agent:
        body = agent._register_body().to_json()
    assert body["protocolVersion"] == PROTOCOL_VERSION and body["features"] == list(FEATURES)
    assert body["nodeUid"] == (tmp_path / "w" / NODE_UID_FILE).read_text().strip()


def test_version_watch_gates_below_the_minimum_and_opens_when_lowered(caplog: pytest.LogCaptureFixture) -> None:
    gate = IntakeGate()
    watch = VersionWatch(gate, auto_upgrade=False, version="1.2.0")
    caplog.set_level(logging.INFO, "ckagent.master.fleet")
    watch.apply(VersionPolicy("1.10.0", None))  # PEP 440: 1.10 > 1.2 (not a string comparison)
    assert gate.reason is not None and "older than the master's minimum 1.10.0" in gate.reason
    watch.apply(VersionPolicy("1.10.0", None))
    watch.apply(VersionPolicy("1.2.0rc1", None))
    assert gate.reason is None
    watch.apply(VersionPolicy("banana", "2.0"))  # not PEP 440: ignored with one warning
    watch.apply(VersionPolicy("banana", "2.0"))
    assert gate.reason is None
    messages = [r.getMessage() for r in caplog.records]
    assert sum("older than the master's minimum" in m for m in messages) == 1
    assert sum("'banana' is not a PEP 440 version" in m for m in messages) == 1
    assert sum("agent.auto_upgrade is off" in m for m in messages) == 1


async def test_auto_upgrade_runs_run_sh_upgrade_once_for_a_newer_desired_version(tmp_path: Path) -> None:
    fake = tmp_path / "run.sh"
    record = tmp_path / "calls"
    fake.write_text(f'#!/bin/bash\necho "$* auto=$AGENT_UPGRADE_AUTO" >> {record}\nexit 1\n')
    async with trio.open_nursery() as nursery:
        watch = VersionWatch(IntakeGate(), auto_upgrade=True, version="1.0.0", run_sh=str(fake),
                             log_dir=tmp_path / "logs")
        nursery.start_soon(watch.run)  # returns once the upgrade it is asked for has run
        watch.apply(VersionPolicy(None, "1.0.0"))  # not newer: nothing
        watch.apply(VersionPolicy(None, "1.1.0"))
        watch.apply(VersionPolicy(None, "1.1.0"))
        watch.apply(VersionPolicy(None, "1.2.0"))  # once per process: the restarted agent asks again
    assert record.read_text() == "upgrade 1.1.0 auto=on\n"
    assert watch.upgrade_requested == "1.1.0"


async def test_auto_upgrade_to_an_older_desired_version_asks_run_sh_for_a_downgrade(tmp_path: Path) -> None:
    fake = tmp_path / "run.sh"
    record = tmp_path / "calls"
    fake.write_text(f'#!/bin/bash\necho "$*" >> {record}\nexit 1\n')
    async with trio.open_nursery() as nursery:
        watch = VersionWatch(IntakeGate(), auto_upgrade=True, version="1.2.0", run_sh=str(fake),
                             log_dir=tmp_path / "logs")
        nursery.start_soon(watch.run)  # returns once the upgrade it is asked for has run
        watch.apply(VersionPolicy(None, "1.1.0"))  # the master points back to a good release
    assert record.read_text() == "upgrade --downgrade 1.1.0\n"


async def test_a_forced_minimum_stops_task_intake_and_says_why_until_it_is_lowered(dev_master, tmp_path: Path) -> None:
    admin = dev_master.admin
    settings = agent_settings(tmp_path / "w", dev_master.base_url, dev_master.registration_token)
    await admin.set_agent_versions("99.0", None)
    async with trio.open_nursery() as nursery, running_agent(nursery, settings) as agent:
        assert agent.intake.reason is not None and f"version {__version__}, older than the master's minimum 99.0" in (
            agent.intake.reason)
        task_id = await submit(admin, "needs-new-agent", {"main.py": "print('ran')\n"})
        async with httpx.AsyncClient(timeout=5) as client:
            url = f"http://127.0.0.1:{agent.status_port}/readyz"

            async def paused_at_master() -> bool:
                return any("minimum 99.0" in (n.get("pausedReason") or "") for n in await admin.list_nodes())

            await eventually(paused_at_master)
            ready = await client.get(url)
            assert ready.status_code == 503 and "older than the master's minimum 99.0" in ready.text
            await trio.sleep(2)
            assert (await admin.get_task(task_id))["status"] == "PENDING"
            assert agent.heartbeat.beats > 0  # it keeps heartbeating
            await admin.set_agent_versions(None, None)  # lowered: the next heartbeat answer opens the gate
            task = await admin.wait_task_final(task_id, 40)
            assert task["status"] == "SUCCESS", task
            assert (await client.get(url)).status_code == 200


async def test_the_master_refuses_a_version_policy_that_is_not_pep_440(dev_master) -> None:
    from ckagent.devmaster.client import AdminApiError

    with pytest.raises(AdminApiError, match="not a PEP 440 version"):
        await dev_master.admin.set_agent_versions("banana", None)
    assert await dev_master.admin.set_agent_versions("0.1.0", "0.2.0") == {"minAgentVersion": "0.1.0",
                                                                           "desiredAgentVersion": "0.2.0"}


async def test_the_master_keeps_working_with_agents_that_send_no_version(dev_master) -> None:
    """An agent older than protocolVersion/features/nodeUid: registers, heartbeats, and gets the policy."""
    await dev_master.admin.set_agent_versions("0.0.1", None)
    body = {"name": "old-agent", "port": 9000, "cpuCount": 1, "memoryTotalBytes": 1 << 30, "maxWorkers": 2}
    async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=10) as client:
        answer = await client.post("/api/nodes/register", json=body,
                                   headers={"X-Registration-Token": dev_master.registration_token})
        assert answer.status_code == 200 and answer.json()["minAgentVersion"] == "0.0.1"
        again = await client.post("/api/nodes/register", json=body,  # same name, no nodeUid: the old rule
                                  headers={"X-Registration-Token": dev_master.registration_token})
        assert again.status_code == 200 and again.json()["nodeId"] == answer.json()["nodeId"]
        beat = _beat().to_json()
        del beat["version"]
        hb = await client.post(f"/api/nodes/{answer.json()['nodeId']}/heartbeat", json=beat,
                               headers={"Authorization": f"Bearer {again.json()['apiKey']}"})
        assert hb.status_code == 200 and hb.json() == {"cancelTaskIds": [], "minAgentVersion": "0.0.1"}
