"""A graceful stop releases the node's name (issue 36, item 4): the ``leaving`` call, the reference
master's side of it, the agent's (once, bounded, never re-registering), and the row of the issue's
table — a replacement with a new work dir and the same name registers at once after a graceful stop,
and still waits for the name after a ``kill -9`` (no exit 1 since issue 39)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from faultproxy import FaultProxy
from harness import (
    AgentProcess,
    agent_settings,
    eventually,
    register_body,
    running_agent,
    submit,
    wait_exit,
    wait_for_log,
    wait_registered,
)

from ckagent.agent import Agent
from ckagent.devmaster.errors import ConflictError, UnauthorizedError
from ckagent.devmaster.store import NODE_LIVE_SECONDS, Store
from ckagent.master.client import MasterClient, RegistrationRefused
from ckagent.master.fleet import FINAL_BEAT_TIMEOUT, LEAVE_TIMEOUT
from ckagent.master.protocol import Heartbeat, NodeLeaving, RegisterRequest


def _request(name: str, uid: str | None) -> RegisterRequest:
    return RegisterRequest(name=name, ip="127.0.0.1", port=1, version="0.1.0", os="linux", arch="x86_64",
                           python="3.11", cpu_count=1, memory_total_bytes=1 << 30, max_workers=2, node_uid=uid)


def _beat() -> Heartbeat:
    return Heartbeat(status="STOPPED", cpu_percent=1, memory_percent=1, disk_percent=1, memory_used_bytes=1,
                     disk_free_bytes=1, load1=0, running_task_ids=[], running_spider_ids=[], max_workers=2,
                     free_slots=2, version="0.1.0", uptime_seconds=1)


A, B = "a" * 32, "b" * 32


# --------------------------------------------------------------------------- the reference master's store


def test_leaving_releases_the_name_at_once_and_revokes_the_key(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node, key = store.register_node(_request("n1", A))
        store.heartbeat(node, _beat())
        with pytest.raises(ConflictError):  # live, not left: guarded as before
            store.register_node(_request("n1", B))
        store.leave_node(node, key, NodeLeaving(node_uid=A, reason="drained"))
        assert store.node_for_key(key) is None  # revoked
        [listed] = store.list_nodes()
        assert listed["leftAt"] is not None
        again, new_key = store.register_node(_request("n1", B))  # at once, not after NODE_LIVE_SECONDS
        assert again == node and store.node_for_key(new_key) == node
        [listed] = store.list_nodes()
        assert listed["leftAt"] is None  # the new holder's name is guarded again
        store.heartbeat(node, _beat())
        with pytest.raises(ConflictError):
            store.register_node(_request("n1", A))
    finally:
        store.close()


def test_a_crashed_agent_sends_nothing_and_its_name_stays_guarded(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node, _ = store.register_node(_request("n1", A))
        store.heartbeat(node, _beat())
        with pytest.raises(ConflictError, match="another live agent"):
            store.register_node(_request("n1", B))
        assert store.register_node(_request("n1", B), at=time.time() + NODE_LIVE_SECONDS + 1)[0] == node
    finally:
        store.close()


def test_a_late_leaving_of_an_earlier_holder_releases_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node, old_key = store.register_node(_request("n1", A))
        _, key = store.register_node(_request("n1", A))  # the same agent again (after a 401): a new key
        store.heartbeat(node, _beat())
        with pytest.raises(UnauthorizedError, match="no longer holds"):
            store.leave_node(node, old_key, NodeLeaving(node_uid=A))
        with pytest.raises(ConflictError):  # still guarded: the stale key released nothing
            store.register_node(_request("n1", B))
        # the name moved on (A's heartbeats stopped long ago); A's leaving comes late: B keeps it
        _, b_key = store.register_node(_request("n1", B), at=time.time() + NODE_LIVE_SECONDS + 1)
        with pytest.raises(UnauthorizedError):
            store.leave_node(node, key, NodeLeaving(node_uid=A))
        store.heartbeat(node, _beat())
        assert store.node_for_key(b_key) == node
        with pytest.raises(ConflictError):
            store.register_node(_request("n1", A))
    finally:
        store.close()


def test_leaving_in_the_name_of_another_node_uid_releases_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node, key = store.register_node(_request("n1", A))
        store.heartbeat(node, _beat())
        with pytest.raises(ConflictError, match="not the holder"):
            store.leave_node(node, key, NodeLeaving(node_uid=B))
        assert store.node_for_key(key) == node  # nothing changed
        with pytest.raises(ConflictError):
            store.register_node(_request("n1", B))
        store.leave_node(node, key, NodeLeaving())  # no nodeUid (an agent that sends none): the key decides
        assert store.register_node(_request("n1", B))[0] == node
    finally:
        store.close()


def test_leaving_racing_a_registration_never_leaves_two_holders(tmp_path: Path) -> None:
    """The leaving of A and the registration of B (another nodeUid) in two threads, many times: either
    B was refused (it came first) and A released, or A released first and B got the name. Never does B
    hold the name while A's key still works."""
    store = Store(tmp_path / "m.sqlite")
    seen: set[tuple[str, str]] = set()
    try:
        for round_ in range(60):
            name = f"n{round_}"
            node, key = store.register_node(_request(name, A))
            store.heartbeat(node, _beat())
            outcome: dict[str, str] = {}
            start = threading.Barrier(2)

            def leave(node: str = node, key: str = key, outcome: dict[str, str] = outcome,
                      start: threading.Barrier = start) -> None:
                start.wait()
                try:
                    store.leave_node(node, key, NodeLeaving(node_uid=A))
                    outcome["leave"] = "released"
                except (UnauthorizedError, ConflictError) as exc:
                    outcome["leave"] = type(exc).__name__

            def register(name: str = name, outcome: dict[str, str] = outcome,
                         start: threading.Barrier = start) -> None:
                start.wait()
                try:
                    store.register_node(_request(name, B))
                    outcome["register"] = "registered"
                except ConflictError:
                    outcome["register"] = "refused"

            threads = [threading.Thread(target=leave), threading.Thread(target=register)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert outcome["leave"] == "released", outcome
            seen.add((outcome["leave"], outcome["register"]))
            if outcome["register"] == "registered":
                assert store.node_for_key(key) is None
            else:  # refused before the release: B's retry gets the name now
                store.register_node(_request(name, B))
        assert seen <= {("released", "registered"), ("released", "refused")}
    finally:
        store.close()


# --------------------------------------------------------------------------- the route


async def test_the_route_checks_the_key_the_path_and_the_body(dev_master: Any) -> None:
    with trio.fail_after(20):
        async with httpx.AsyncClient(base_url=dev_master.base_url) as http:
            token = {"X-Registration-Token": dev_master.registration_token}
            one = (await http.post("/api/nodes/register", json={**register_body("one"), "nodeUid": A},
                                   headers=token)).json()
            two = (await http.post("/api/nodes/register", json={**register_body("two"), "nodeUid": B},
                                   headers=token)).json()
            auth = {"Authorization": f"Bearer {one['apiKey']}"}
            other = await http.post(f"/api/nodes/{two['nodeId']}/leaving", json={}, headers=auth)
            assert other.status_code == 403  # one's key on two's path
            assert (await http.post(f"/api/nodes/{one['nodeId']}/leaving", json={})).status_code == 401
            bad = await http.post(f"/api/nodes/{one['nodeId']}/leaving", json={"nodeUid": 7}, headers=auth)
            assert bad.status_code == 422 and bad.json()["field"] == "nodeUid"
            assert (await http.post(f"/api/nodes/{one['nodeId']}/leaving", content=b"\xff{",
                                    headers=auth)).status_code == 400
            ok = await http.post(f"/api/nodes/{one['nodeId']}/leaving", json={"nodeUid": A, "reason": "drained"},
                                 headers=auth)
            assert ok.status_code == 200 and ok.json() == {"released": True}
            again = await http.post(f"/api/nodes/{one['nodeId']}/leaving", json={}, headers=auth)
            assert again.status_code == 401  # left: the key is revoked
            beat = await http.post(f"/api/nodes/{one['nodeId']}/heartbeat", json={}, headers=auth)
            assert beat.status_code == 401
            two_auth = {"Authorization": f"Bearer {two['apiKey']}"}
            assert (await http.post(f"/api/nodes/{two['nodeId']}/heartbeat", json={**_beat().to_json()},
                                    headers=two_auth)).status_code == 200  # the other node is untouched
            nodes = {n["name"]: n for n in await dev_master.admin.list_nodes()}
            assert nodes["one"]["leftAt"] and nodes["two"]["leftAt"] is None


# --------------------------------------------------------------------------- the agent's client


def _client(base_url: str, token: str, name: str = "leaver", uid: str = A) -> MasterClient:
    return MasterClient(base_url, token, lambda: _request(name, uid), request_timeout=5, max_backoff_interval=0.5)


@pytest.mark.parametrize("mode", ["404_html", "404_json", "404_spring"])
async def test_an_older_master_without_the_call_is_fine_and_said_once(
    dev_master: Any, nursery: trio.Nursery, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = FaultProxy(int(dev_master.base_url.rsplit(":", 1)[1]))
    port = await nursery.start(proxy.serve)
    proxy.set(mode, ["leaving"])
    client = _client(f"http://127.0.0.1:{port}", dev_master.registration_token)
    caplog.set_level(logging.INFO)
    with trio.fail_after(20):
        await client.register()
        assert await client.leave(NodeLeaving(node_uid=A)) == "unsupported"
        await client.aclose()
    lines = [r.getMessage() for r in caplog.records if "leaving" in r.getMessage()]
    assert len(lines) == 1 and "older master" in lines[0], lines
    assert proxy.faulted("register") == 0 and proxy.faulted("leaving") == 1


async def test_a_refused_leaving_does_not_register_again(dev_master: Any, nursery: trio.Nursery) -> None:
    """A 401 to leaving (the key no longer holds the name) is not answered by registering again: that
    would take the name back from whoever holds it now."""
    proxy = FaultProxy(int(dev_master.base_url.rsplit(":", 1)[1]))
    port = await nursery.start(proxy.serve)
    client = _client(f"http://127.0.0.1:{port}", dev_master.registration_token)
    with trio.fail_after(20):
        await client.register()
        proxy.set("401", ["leaving"])
        registered_at = [n["registeredAt"] for n in await dev_master.admin.list_nodes()]
        assert await client.leave(NodeLeaving(node_uid=A)) == "refused"
        assert [n["registeredAt"] for n in await dev_master.admin.list_nodes()] == registered_at
        with pytest.raises(RegistrationRefused, match="leaving"):  # and it never registers again
            await client.register()
        await client.aclose()


@pytest.mark.parametrize(("mode", "said"), [
    ("timeout", "did not answer the leaving call within"),
    ("reset", "could not tell the master this node is leaving"),
    ("503", "could not tell the master this node is leaving"),
    ("html", "could not tell the master this node is leaving"),  # a 200 that is not the protocol's
])
async def test_the_master_down_at_leave_time_costs_one_line_and_a_bounded_wait(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str, said: str
) -> None:
    """A master that holds the leaving call unanswered, resets it, answers 503 or a portal's page holds
    the agent's stop for LEAVE_TIMEOUT at most, never retried; it exits 0 and its name stays guarded
    by the heartbeat rule."""
    proxy = FaultProxy(int(dev_master.base_url.rsplit(":", 1)[1]))
    port = await nursery.start(proxy.serve)
    proxy.set(mode, ["leaving"])
    settings = agent_settings(tmp_path / "w", f"http://127.0.0.1:{port}", dev_master.registration_token,
                              AGENT_NAME="hung")
    caplog.set_level(logging.INFO)
    agent = Agent(settings)
    codes: list[int] = []
    done = trio.Event()
    async with trio.open_nursery() as inner:
        async def run() -> None:
            codes.append(await agent.run())
            done.set()

        inner.start_soon(run)
        with trio.fail_after(30):
            await agent.started.wait()
            await eventually(lambda: _true(agent.heartbeat is not None and agent.heartbeat.last_success))
            agent.drain()
            began = trio.current_time()
            await done.wait()
        took = trio.current_time() - began
    assert codes == [0]
    assert took < FINAL_BEAT_TIMEOUT + LEAVE_TIMEOUT + 3, took
    assert proxy.faulted("leaving") == 1
    assert sum(said in r.getMessage() for r in caplog.records) == 1
    [node] = await dev_master.admin.list_nodes()
    assert node["leftAt"] is None


async def _true(value: Any) -> bool:
    return bool(value)


async def test_a_hand_over_that_leaves_no_task_running_leaves_and_a_drain_says_drained(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    settings = agent_settings(tmp_path / "w", dev_master.base_url, dev_master.registration_token,
                              AGENT_NAME="quiet")
    with trio.fail_after(30):
        async with running_agent(nursery, settings) as agent:
            await eventually(lambda: _true(agent.heartbeat is not None and agent.heartbeat.last_success))
            agent.hand_over()  # nothing runs: nothing is left for a successor
        [node] = await dev_master.admin.list_nodes()
        assert node["leftAt"] is not None and node["lastHeartbeat"]["status"] == "STOPPED"


# --------------------------------------------------------------------------- real agent processes


async def _start_replacement(tmp_path: Path, dev_master: Any, where: str) -> AgentProcess:
    (tmp_path / where).mkdir()
    agent = AgentProcess(tmp_path / where, dev_master.base_url, dev_master.registration_token,
                         **{"deps__uv_index_url": "http://127.0.0.1:9/simple"})
    await agent.start()
    return agent


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
async def test_a_replacement_with_a_new_work_dir_registers_at_once_after_a_graceful_stop(
    dev_master: Any, tmp_path: Path, stop: signal.Signals
) -> None:
    """The issue's row: an agent stopped gracefully (drain, or terminate), replaced by one with a new work
    dir and the same name (a pod rescheduled with an empty dir) — the replacement registers, first try."""
    admin = dev_master.admin
    async with await _start_replacement(tmp_path, dev_master, "first") as first:
        await wait_registered(admin, first)
        first.signal(stop)
        assert await wait_exit(first, 30) == 0
        assert "told the master this node is leaving" in first.log_text()
    [left] = await admin.list_nodes()
    assert left["leftAt"] is not None and left["lastHeartbeat"]["status"] == "STOPPED"
    async with await _start_replacement(tmp_path, dev_master, "second") as second:
        async def replaced() -> bool:
            assert second.process is not None and second.process.returncode is None, second.log_text()[-2000:]
            [node] = await admin.list_nodes()
            return node["registeredAt"] != left["registeredAt"] and node["lastHeartbeatAt"] != left["lastHeartbeatAt"]

        await eventually(replaced, what="the replacement registered and beat")  # (a 409 would exit 1)
        [node] = await admin.list_nodes()
        assert node["leftAt"] is None and node["lastHeartbeat"]["status"] == "RUNNING"
        assert "belongs to another live agent" not in second.log_text()
        assert "registered with" in second.log_text()
        second.signal(signal.SIGTERM)
        assert await wait_exit(second, 30) == 0


@pytest.mark.slow
async def test_a_replacement_after_a_kill_still_waits_for_the_name(dev_master: Any, tmp_path: Path) -> None:
    """A crashed agent (kill -9) said nothing: its name stays guarded, the replacement with a new work
    dir is refused (409) — two live agents must not share a name — and waits for the name (issue 39: no
    exit 1), saying so once; a stop ends the wait (exit 0)."""
    admin = dev_master.admin
    async with await _start_replacement(tmp_path, dev_master, "first") as first:
        await wait_registered(admin, first)
        await first.kill()
    [before] = await admin.list_nodes()
    async with await _start_replacement(tmp_path, dev_master, "second") as second:
        await eventually(lambda: _true("waiting for the name proc-node" in second.log_text()), 30,
                         "the replacement waits for the name")
        assert "belongs to another live agent" in second.log_text()
        assert second.process is not None and second.process.returncode is None
        second.signal(signal.SIGTERM)
        assert await wait_exit(second, 30) == 0
        assert second.log_text().count("waiting for the name proc-node") == 1
    [node] = await admin.list_nodes()
    assert node["leftAt"] is None and node["registeredAt"] == before["registeredAt"]  # still the first's


async def test_a_waiting_replacement_starts_once_the_first_agent_drained_and_left(dev_master: Any, nursery: trio.Nursery,
                                                                     tmp_path: Path) -> None:
    """While the first agent runs, a second with another work dir waits for the name; once the first
    drained and left, the same second agent starts."""
    first = agent_settings(tmp_path / "one", dev_master.base_url, dev_master.registration_token, AGENT_NAME="twin")
    second = agent_settings(tmp_path / "two", dev_master.base_url, dev_master.registration_token, AGENT_NAME="twin")
    with trio.fail_after(60):
        async with running_agent(nursery, first) as agent:
            await eventually(lambda: _true(agent.heartbeat is not None and agent.heartbeat.last_success))
            replacement = Agent(second)
            ended = trio.Event()

            async def run_replacement() -> None:
                await replacement.run()
                ended.set()

            nursery.start_soon(run_replacement)
            await eventually(lambda: _true(replacement.master.connectivity.problem), 20, "the second one waiting")
            assert "another live agent" in str(replacement.master.connectivity.problem)
            agent.drain()
        await replacement.started.wait()
        assert replacement.master.registered
        replacement.terminate()
        await ended.wait()


@pytest.mark.slow
async def test_a_hand_over_with_a_running_task_keeps_the_name_for_the_next_agent(dev_master: Any,
                                                                                  tmp_path: Path) -> None:
    """SIGUSR2 (``run.sh restart``/``upgrade``) leaves a running task to the next agent on the same work
    dir: that is this node coming back, so no leaving call — a stranger with the name and a new work dir
    is refused; the node's own next agent registers, finishes the task, and leaves on its drain."""
    admin = dev_master.admin
    spider = "import time\nfor i in range(30):\n    print('tick', i, flush=True)\n    time.sleep(0.1)\n"
    async with await _start_replacement(tmp_path, dev_master, "node") as agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "handed", {"main.py": spider})
        await wait_for_log(admin, task_id, "tick 3", 30)
        agent.signal(signal.SIGUSR2)
        assert await wait_exit(agent, 15) == 0
        assert "told the master this node is leaving" not in agent.log_text()
        [node] = await admin.list_nodes()
        assert node["leftAt"] is None
        async with await _start_replacement(tmp_path, dev_master, "stranger") as stranger:
            await eventually(lambda: _true("belongs to another live agent" in stranger.log_text()), 30,
                             "the stranger waits for the name")
            stranger.signal(signal.SIGTERM)
            assert await wait_exit(stranger, 30) == 0
        await agent.start()  # the same work dir: the same nodeUid
        task = await admin.wait_task_final(task_id, 30)
        assert (task["status"], task["exitCode"]) == ("SUCCESS", 0), task
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 30) == 0
        assert agent.log_text().count("told the master this node is leaving") == 1
