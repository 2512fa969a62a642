"""The pod's name (issue 39): a registration refused with 409 — another live agent, another nodeUid, holds
the node's name — is waited out, never fatal (ckagent.master.registration); ``agent.name_exclusive``
takes the name over at once (the reference master's rule in ckagent.devmaster.store.nodes)."""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import (
    EXAMPLES,
    LEVEL_PAIRS,
    AgentProcess,
    CrawlSite,
    agent_settings,
    eventually,
    heartbeat_of,
    page_counts,
    readyz,
    register_body,
    running_agent,
    short_live_master,
    status_port,
    store_spider,
    store_task,
    wait_beating,
    wait_exit,
)

from ckagent.agent import Agent, AgentState
from ckagent.devmaster.client import zip_directory
from ckagent.devmaster.errors import ConflictError
from ckagent.devmaster.store import Store
from ckagent.master.client import MasterClient, NameHeld, RegistrationRefused
from ckagent.master.fleet import register_request
from ckagent.master.protocol import RegisterRequest
from ckagent.master.registration import REGISTER_WAIT_MAX

TOKEN = "reg-token-SECRET-0123456789"


def _body() -> RegisterRequest:
    return RegisterRequest(name="crawler-0", ip="127.0.0.1", port=9000, version="0", os="linux", arch="x86_64",
                           python="3.11", cpu_count=2, memory_total_bytes=1 << 30, max_workers=2, node_uid="b" * 32)


def _master_holding_the_name(refusals: int, times: list[float]) -> httpx.MockTransport:
    """A master that answers 409 to the first ``refusals`` registrations, then registers; ``times``
    gets the trio time of each registration."""
    def answer(request: httpx.Request) -> httpx.Response:
        times.append(trio.current_time())
        if len(times) <= refusals:
            return httpx.Response(409, json={"error": "node name 'crawler-0' belongs to another live agent"})
        return httpx.Response(200, json={"nodeId": "7", "apiKey": "nk_fresh-key-SECRET"})

    return httpx.MockTransport(answer)


# ---------------------------------------------------------------------------- the agent's side, unit


async def test_a_409_at_registration_is_waited_out_with_backoff_and_said_once(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    times: list[float] = []
    client = MasterClient("http://master.test", TOKEN, _body, transport=_master_holding_the_name(12, times))
    problems: list[str | None] = []

    async def watch() -> None:
        while True:
            problems.append(client.connectivity.problem)
            await trio.sleep(5)

    caplog.set_level(logging.INFO)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        answer = await client.register()
        nursery.cancel_scope.cancel()
    await client.aclose()
    assert answer.node_id == "7" and client.registered
    assert len(times) == 13
    gaps = [b - a for a, b in pairwise(times)]
    assert max(gaps) <= REGISTER_WAIT_MAX + 1e-6 and gaps[-1] >= 15  # backed off, up to 30 s and no more
    waiting = [p for p in problems if p]
    assert waiting and waiting[0] == ("waiting for the name crawler-0: another agent holds it (the master: node "
                                      "name 'crawler-0' belongs to another live agent)")
    assert client.connectivity.problem is None  # registered: the episode is over
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("ckagent")]
    assert warnings == [waiting[0] + "; retrying with backoff"]  # one line for the whole wait
    assert any("the node's name is this agent's now" in r.getMessage() and "after 12 failed attempts" in r.getMessage()
               for r in caplog.records)
    assert TOKEN not in caplog.text and "fresh-key-SECRET" not in caplog.text


async def test_the_wait_for_the_name_ends_on_cancellation(autojump_clock: Any) -> None:
    times: list[float] = []
    client = MasterClient("http://master.test", TOKEN, _body, transport=_master_holding_the_name(10**6, times))
    with trio.move_on_after(600) as bound:
        await client.register()
    await client.aclose()
    assert bound.cancelled_caught and not client.registered
    assert 20 <= len(times) <= 40  # about one try per 30 s after the first minute


async def test_the_409_error_is_a_name_held_and_other_4xx_stay_fatal(autojump_clock: Any) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"error": "held"})

    client = MasterClient("http://master.test", TOKEN, _body, transport=httpx.MockTransport(answer))
    with pytest.raises(NameHeld) as held:
        await client._register_once()
    assert held.value.name == "crawler-0" and "another agent holds it (the master: held)" in str(held.value)
    await client.aclose()
    client = MasterClient("http://master.test", TOKEN, _body,
                          transport=httpx.MockTransport(lambda r: httpx.Response(403, json={"error": "banned"})))
    with pytest.raises(RegistrationRefused, match="banned"):
        await client.register()
    await client.aclose()


async def test_name_exclusive_is_sent_and_a_master_that_ignores_it_is_waited_out(
    autojump_clock: Any, tmp_path: Path
) -> None:
    """An older master ignores ``nameExclusive`` (unknown fields are ignored) and answers 409: the agent
    waits as without it, and says that the setting did not take the name over."""
    settings = agent_settings(tmp_path / "w", "http://master.test", TOKEN, AGENT_NAME="crawler-0",
                              AGENT_NAME_EXCLUSIVE="on")
    assert settings.agent.name_exclusive
    body = register_request(settings.agent, port=9000, max_workers=1, runtimes={}, node_uid="b" * 32,
                            containment={}, egress={})
    assert body.to_json()["nameExclusive"] is True and RegisterRequest.from_json(body.to_json()) == body
    plain = dataclasses.replace(body, name_exclusive=False)
    assert "nameExclusive" not in plain.to_json()  # sent only when true: older masters see today's body
    sent: list[Any] = []

    def older_master(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        if len(sent) < 4:
            return httpx.Response(409, json={"error": "node name 'crawler-0' belongs to another live agent"})
        return httpx.Response(200, json={"nodeId": "7", "apiKey": "k"})

    client = MasterClient("http://master.test", TOKEN, lambda: body, transport=httpx.MockTransport(older_master))
    seen: list[str | None] = []

    async def watch() -> None:
        await trio.sleep(0.1)
        seen.append(client.connectivity.problem)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await client.register()
    await client.aclose()
    assert all(b["nameExclusive"] is True for b in sent) and len(sent) == 4
    assert seen[0] is not None and "agent.name_exclusive is on, yet the master did not hand the name over" in seen[0]


# ---------------------------------------------------------------------------- real agents, the real master


@pytest.mark.slow
async def test_a_second_agent_with_the_name_waits_says_why_and_starts_once_the_first_left(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Two agents, one name, two work dirs: the second does not exit; its /readyz and /status say it waits
    for the name; once the first drained and left, the same second agent registers and runs."""
    first = agent_settings(tmp_path / "one", dev_master.base_url, dev_master.registration_token, AGENT_NAME="twin")
    second = agent_settings(tmp_path / "two", dev_master.base_url, dev_master.registration_token, AGENT_NAME="twin")
    with trio.fail_after(180):
        async with running_agent(nursery, first) as holder:
            await eventually(lambda: _true(holder.heartbeat is not None and holder.heartbeat.last_success))
            waiting = Agent(second)
            codes: list[int] = []

            async def run_second() -> None:
                codes.append(await waiting.run())

            nursery.start_soon(run_second)

            async def says_why() -> str | None:
                if waiting.status_port is None:
                    return None
                async with httpx.AsyncClient(timeout=5) as client:
                    ready = await client.get(f"http://127.0.0.1:{waiting.status_port}/readyz")
                    status = (await client.get(f"http://127.0.0.1:{waiting.status_port}/status")).json()
                if ready.status_code == 503 and "waiting for the name twin: another agent holds it" in ready.text:
                    assert "waiting for the name twin" in status["readyReason"], status
                    return ready.text
                return None

            text = await eventually(says_why, 60, "the second agent's /readyz says it waits for the name")
            assert "belongs to another live agent" in text  # the master's reason
            assert not codes and waiting.state is AgentState.STARTING
            assert holder.master.registered and await holder.heartbeat.beat_once()  # the holder keeps its key
            holder.drain()
        await waiting.started.wait()  # the first left: the name is free
        assert waiting.master.registered and not codes
        [node] = await dev_master.admin.list_nodes()
        assert node["leftAt"] is None
        waiting.terminate()
        await eventually(lambda: _true(codes), 60, "the second agent's exit")
    assert codes == [0]


@pytest.mark.slow
async def test_a_rescheduled_pod_after_a_kill_waits_for_the_name_then_registers_and_never_exits(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The issue's row without ``agent.name_exclusive``: a replacement (same name, fresh work dir) waits
    while the first agent's heartbeats are fresh — /readyz says why, no exit 1 — and once the first is
    killed (no leaving call) registers as soon as the master counts its heartbeats old (here 4 s
    instead of 90 s) plus at most one backoff step."""
    master = await short_live_master(nursery, tmp_path, node_live_after=4.0)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    settings = {"agent__name": "crawler-0", "deps__uv_index_url": "http://127.0.0.1:9/simple"}
    async with AgentProcess(tmp_path / "first", master.base_url, master.registration_token, **settings) as first, \
            AgentProcess(tmp_path / "second", master.base_url, master.registration_token, **settings) as second:
        await first.start()
        await wait_beating(master.admin, first, "crawler-0")
        [before] = await master.admin.list_nodes()
        await second.start()
        port = await status_port(second)

        async def waiting() -> str | None:
            code, text = await readyz(port)
            return text if code == 503 and "waiting for the name crawler-0: another agent holds it" in text else None

        await eventually(waiting, 120, "the replacement's /readyz says it waits for the name")
        await first.kill()
        killed = time.monotonic()

        async def registered_again() -> bool:
            [node] = await master.admin.list_nodes()
            return bool(node["registeredAt"] != before["registeredAt"])

        await eventually(registered_again, master.node_live_after + REGISTER_WAIT_MAX + 30, "the replacement's registration")
        took = time.monotonic() - killed
        print(f"figures: the replacement registered {took:.2f} s after the first agent's kill "
              f"(the master's window {master.node_live_after:g} s)")
        assert took <= master.node_live_after + REGISTER_WAIT_MAX + 15, took
        await wait_beating(master.admin, second, "crawler-0")
        assert second.process is not None and second.process.returncode is None
        log = second.log_text()
        assert log.count("waiting for the name crawler-0") == 1, log
        # the wait's end is said (or, when a timeout under load came between, "master reachable again")
        assert "registered with" in log, log[-3000:]
        await eventually(lambda: _ready(port), 60, "the replacement ready")
        second.signal(signal.SIGTERM)
        assert await wait_exit(second, 60) == 0


async def _ready(port: int) -> bool:
    code, _text = await readyz(port)
    return code == 200


async def _true(value: object) -> bool:
    return bool(value)


# ---------------------------------------------------------------------------- the reference master's rule

A, B, C = "a" * 32, "b" * 32, "c" * 32


def _request(uid: str | None, exclusive: bool = False, name: str = "crawler-0") -> RegisterRequest:
    return RegisterRequest(name=name, ip="127.0.0.1", port=1, version="0.1.0", os="linux", arch="x86_64",
                           python="3.11", cpu_count=1, memory_total_bytes=1 << 30, max_workers=2, node_uid=uid,
                           name_exclusive=exclusive)


def _beat(store: Store, node: str) -> None:
    store.heartbeat(node, heartbeat_of())


def test_an_exclusive_registration_takes_a_live_name_over_and_the_holders_key_stops_working(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node, key_a = store.register_node(_request(A, exclusive=True))
        _beat(store, node)
        with pytest.raises(ConflictError, match="belongs to another live agent"):
            store.register_node(_request(B))  # without nameExclusive: the 409 rule
        again, key_b = store.register_node(_request(B, exclusive=True))
        assert again == node and key_b != key_a
        assert store.node_for_key(key_a) is None and store.node_for_key(key_b) == node
        [listed] = store.list_nodes()
        assert listed["displacedNodeUids"] == [A]
    finally:
        store.close()


def test_a_displaced_agent_does_not_take_the_name_back_while_the_taker_is_live(tmp_path: Path) -> None:
    """Two (three) exclusive agents with one name: each 401 makes the loser register again; the name
    settles on the newest taker instead of moving at every registration."""
    store = Store(tmp_path / "m.sqlite")
    try:
        node, _ = store.register_node(_request(A, exclusive=True))
        _beat(store, node)
        store.register_node(_request(B, exclusive=True))  # B takes it over from A
        holders = []
        for _round in range(10):  # A and B each answer their 401 by registering again, exclusively
            for uid in (A, B):
                try:
                    store.register_node(_request(uid, exclusive=True))
                    holders.append(uid)
                except ConflictError as exc:
                    assert uid == A and "does not take a name back" in str(exc)
                _beat(store, node)
        assert set(holders) == {B}  # B keeps it: no ping-pong
        store.register_node(_request(C, exclusive=True))  # a third one (the newest pod) takes it over
        for uid in (A, B):
            with pytest.raises(ConflictError, match="does not take a name back"):
                store.register_node(_request(uid, exclusive=True))
        # once the holder's heartbeats are old, a displaced agent gets the name as anyone would ...
        later = time.time() + store.node_live_seconds + 1
        store.register_node(_request(A, exclusive=True), at=later)
        [listed] = store.list_nodes()
        assert listed["displacedNodeUids"] == [B, C]  # ... and is no longer displaced
        _beat(store, node)
        for uid in (B, C):
            with pytest.raises(ConflictError, match="does not take a name back"):
                store.register_node(_request(uid, exclusive=True))
    finally:
        store.close()


def test_the_name_moving_to_a_new_node_uid_ends_the_holders_running_attempts_agent_lost(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node, _ = store.register_node(_request(A))
        spider = store_spider(store, "s")
        task = store_task(store, spider)
        [claimed], _ = store.claim_pending(node, poll_id=1, limit=1, exclude_spider_ids=[], base_url="")
        assert claimed["id"] == task and store.get_task(task)["status"] == "RUNNING"
        _beat(store, node)
        store.register_node(_request(A))  # the same agent again (a restart): its task stays its own
        assert store.get_task(task)["status"] == "RUNNING"
        store.register_node(_request(B, exclusive=True))  # the pod rescheduled with a fresh work dir
        view = store.get_task(task)
        assert view["status"] == "PENDING" and view["attempt"] == 2, view
        first = view["attempts"][0]
        assert (first["status"], first["errorCode"], first["causeClass"], first["counted"]) == \
            ("FAILED", "AGENT_LOST", "disruption", False)
        assert A in first["errorMessage"] and B in first["errorMessage"]
        # the same when the name moves after the window (no nameExclusive): B's claim of attempt 2, then C
        [again], _ = store.claim_pending(node, poll_id=2, limit=1, exclude_spider_ids=[], base_url="")
        assert again["attempt"] == 2
        later = time.time() + store.node_live_seconds + 1
        store.register_node(_request(C), at=later)
        view = store.get_task(task)
        assert (view["status"], view["attempt"]) == ("PENDING", 3), view
        assert view["attempts"][1]["errorCode"] == "AGENT_LOST"
    finally:
        store.close()


def test_agents_without_node_uid_and_non_exclusive_ones_keep_the_old_rules(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node, _ = store.register_node(_request(None))
        _beat(store, node)
        assert store.register_node(_request(None, exclusive=True))[0] == node  # no nodeUid: by name, as before
        store.register_node(_request(A))
        _beat(store, node)
        with pytest.raises(ConflictError):
            store.register_node(_request(B))
        later = time.time() + store.node_live_seconds + 1
        assert store.register_node(_request(B), at=later)[0] == node
    finally:
        store.close()


# ---------------------------------------------------------------------------- agent.name_exclusive, real agents

POD = {"agent__name": "crawler-0", "agent__name_exclusive": True, "agent__max_workers": 1,
       "deps__uv_index_url": "http://127.0.0.1:9/simple"}
"""A StatefulSet pod's agent: its name is the pod's, at most one runs (the orchestrator's word)."""


async def _registered_at(admin: Any) -> str | None:
    nodes = [n for n in await admin.list_nodes() if n["name"] == "crawler-0"]
    return str(nodes[0]["registeredAt"]) if nodes else None


@pytest.mark.slow
async def test_a_rescheduled_pod_with_name_exclusive_registers_at_once(dev_master: Any, tmp_path: Path) -> None:
    """The issue's row with ``agent.name_exclusive``: the pod killed (no leaving call, its heartbeats
    fresh: the master's 90 s window), its replacement (fresh work dir) registers at once."""
    admin = dev_master.admin
    (tmp_path / "pod-a").mkdir()
    (tmp_path / "pod-b").mkdir()
    async with AgentProcess(tmp_path / "pod-a", dev_master.base_url, dev_master.registration_token, **POD) as first:
        await first.start()
        await wait_beating(admin, first, "crawler-0")
        await first.kill()
    before = await _registered_at(admin)
    async with AgentProcess(tmp_path / "pod-b", dev_master.base_url, dev_master.registration_token, **POD) as second:
        started = time.monotonic()
        await second.start()

        async def registered() -> bool:
            return await _registered_at(admin) != before

        await eventually(registered, 120, "the replacement registered")
        took = time.monotonic() - started
        await wait_beating(admin, second, "crawler-0")
        print(f"figures: the replacement registered {took:.2f} s after its start (the name's window: 90 s)")
        assert took < 60, took  # an agent's start (imports, the state store, the status port): seconds
        assert "waiting for the name" not in second.log_text()
        [node] = await admin.list_nodes()
        assert node["nameExclusive"] is True and len(node["displacedNodeUids"]) == 1
        second.signal(signal.SIGTERM)
        assert await wait_exit(second, 60) == 0


@pytest.mark.slow
async def test_a_partitioned_pod_loses_name_and_crawl_to_its_replacement_and_is_told_when_it_comes_back(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A StatefulSet pod partitioned away (its agent stopped: heartbeats gone, its spider crawling on) is
    replaced by a pod with a fresh work dir: the replacement takes the name over at once (the master's
    90 s window does not matter), the crawl's attempt ends AGENT_LOST and the replacement resumes it from
    the newest checkpoint — every page's item exactly once. The earlier pod, back, is told: 401, then
    409 at registration (a displaced agent does not take the name back), it waits, /readyz says why, the
    replacement keeps its key. Once the replacement left, the earlier one registers and its stale attempt
    is refused (the task is final; its batches are of a superseded attempt): the items stay exactly once."""
    site = CrawlSite(listings=10, per_listing=20, rate=40.0)
    await nursery.start(site.serve)
    master = await short_live_master(nursery, tmp_path, node_live_after=90.0)
    admin = master.admin
    containment, egress = LEVEL_PAIRS[0]
    pod = {**POD, "task__containment": containment, "task__egress": egress, "deps__uv_sync_timeout": 600}
    for where in ("pod-a", "pod-b"):
        (tmp_path / where).mkdir()
    spider = await admin.create_spider(name="python_resume", framework="python", command=["python", "main.py"],
                                       env={"START_URL": site.start_url})
    await admin.upload_package(spider, await trio.to_thread.run_sync(zip_directory, EXAMPLES / "python_resume"))
    async with AgentProcess(tmp_path / "pod-a", master.base_url, master.registration_token, **pod) as first, \
            AgentProcess(tmp_path / "pod-b", master.base_url, master.registration_token, **pod) as second:
        await first.start()
        await wait_beating(admin, first, "crawler-0")
        uid_a = (tmp_path / "pod-a" / "data" / "node_uid").read_text().strip()
        task_id = str(await admin.create_task(spider, checkpoint_interval_seconds=1.0))

        async def checkpointed() -> bool:
            view = await admin.get_task(task_id)
            assert view["status"] in ("PENDING", "RUNNING"), view
            return view["status"] == "RUNNING" and view.get("checkpoint") is not None

        await eventually(checkpointed, 120, "the crawl running on pod A with a checkpoint")
        first.signal(signal.SIGSTOP)  # partitioned: no heartbeat, no report; its spider crawls on
        started = time.monotonic()
        await second.start()

        async def taken_over() -> bool:
            [node] = await admin.list_nodes()
            return bool(node["displacedNodeUids"] == [uid_a])

        await eventually(taken_over, 120, "pod B took the name over")
        took = time.monotonic() - started
        lost = (await admin.get_task(task_id))["attempts"][0]
        assert (lost["errorCode"], lost["causeClass"], lost["counted"]) == ("AGENT_LOST", "disruption", False), lost
        final = await admin.wait_task_final(task_id, 180)
        attempts = final["attempts"]
        assert final["status"] == "SUCCESS" and len(attempts) == 2, final
        assert attempts[1]["status"] == "SUCCESS" and attempts[1]["resumedFrom"], attempts
        items = await admin.get_items(task_id)
        counts = page_counts(items)
        assert set(counts) == set(site.all_paths()) and set(counts.values()) == {1}, counts.most_common(3)
        print(f"figures: pod B registered {took:.2f} s after its start; the crawl resumed from checkpoint "
              f"{attempts[1]['resumedFrom']} ({attempts[1]['itemsKept']} items kept, {attempts[1]['itemsDropped']} "
              f"dropped); {site.fetched()} fetches for {site.pages} pages")

        first.signal(signal.SIGCONT)  # back: its next call gets 401, its registration 409
        port_a = await status_port(first)

        async def told() -> str | None:
            code, text = await readyz(port_a)
            return text if code == 503 and "waiting for the name crawler-0" in text else None

        text = await eventually(told, 120, "pod A says it waits for the name")
        assert "does not take a name back" in text, text
        [node] = await admin.list_nodes()
        beat = node["lastHeartbeatAt"]
        await eventually(lambda: _beat_after(admin, beat), 60, "pod B still beating")
        [node] = await admin.list_nodes()
        assert node["displacedNodeUids"] == [uid_a]  # pod B kept the name: no ping-pong
        assert "waiting for the name" not in second.log_text()
        assert first.log_text().count("waiting for the name crawler-0") == 1

        second.signal(signal.SIGTERM)  # pod B drains and leaves: the name is free
        assert await wait_exit(second, 60) == 0
        await eventually(lambda: _true("the node's name is this agent's now" in first.log_text()), 120,
                         "pod A registered again")
        await eventually(lambda: _true("the master moved this task on to attempt 2" in first.log_text()), 120,
                         "pod A's stale result dropped")

        async def settled() -> bool:
            [node] = await admin.list_nodes()
            beat = node.get("lastHeartbeat") or {}
            return beat.get("status") == "RUNNING" and not beat.get("runningTaskIds") \
                and not beat.get("reportingTaskIds")

        await eventually(settled, 120, "pod A beating with its stale attempt settled")
        after = await admin.get_task(task_id)
        assert after["status"] == "SUCCESS" and len(after["attempts"]) == 2, after
        assert page_counts(await admin.get_items(task_id)) == counts  # nothing of the stale attempt
        first.signal(signal.SIGTERM)
        assert await wait_exit(first, 60) == 0


async def _beat_after(admin: Any, moment: str) -> bool:
    [node] = await admin.list_nodes()
    return bool(node["lastHeartbeatAt"] and node["lastHeartbeatAt"] > moment)


async def test_an_agent_whose_name_was_taken_over_waits_and_still_stops_cleanly(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The holder of an exclusive name, taken over by another nodeUid (a raw registration here): its next
    heartbeat gets 401, its registration 409 — it waits (no exit, no taking back), /readyz says why, and a
    drain still stops it at once with exit 0, sending nothing (no final beat, no leaving: not its name)."""
    settings = agent_settings(tmp_path / "a", dev_master.base_url, dev_master.registration_token,
                              AGENT_NAME="crawler-0", AGENT_NAME_EXCLUSIVE="on")
    holder = Agent(settings)
    codes: list[int] = []

    async def run_holder() -> None:
        codes.append(await holder.run())

    with trio.fail_after(120):
        nursery.start_soon(run_holder)
        await holder.started.wait()
        await eventually(lambda: _true(holder.heartbeat is not None and holder.heartbeat.last_success), 60)
        body = {**register_body("crawler-0"), "nodeUid": C, "nameExclusive": True}
        async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=10) as http:
            taken = await http.post("/api/nodes/register", json=body,
                                    headers={"X-Registration-Token": dev_master.registration_token})
        assert taken.status_code == 200, taken.text

        async def waiting() -> str | None:
            problem = holder.master.connectivity.problem
            return problem if problem and "waiting for the name crawler-0" in problem else None

        problem = await eventually(waiting, 60, "the earlier holder waits for its name")
        assert "does not take a name back" in problem and not holder.master.registered
        async with httpx.AsyncClient(timeout=5) as client:
            ready = await client.get(f"http://127.0.0.1:{holder.status_port}/readyz")
        assert ready.status_code == 503 and "waiting for the name crawler-0" in ready.text
        [node] = await dev_master.admin.list_nodes()
        assert node["displacedNodeUids"] == [holder.node_uid]  # the taker keeps the name
        holder.drain()
        await eventually(lambda: _true(codes), 60, "the earlier holder's exit")
    assert codes == [0]
    [node] = await dev_master.admin.list_nodes()
    assert node["leftAt"] is None and node["displacedNodeUids"] == [holder.node_uid]
