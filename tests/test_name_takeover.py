"""The pod's name (issue 39): a registration refused with 409 — another live agent, another nodeUid, holds
the node's name — is waited out, never fatal (ckagent.master.registration); ``agent.name_exclusive``
takes the name over at once (the reference master's rule in ckagent.devmaster.store.nodes)."""

from __future__ import annotations

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
    AgentProcess,
    agent_settings,
    eventually,
    readyz,
    running_agent,
    short_live_master,
    status_port,
    wait_exit,
    wait_registered,
)

from ckagent.agent import Agent, AgentState
from ckagent.master.client import MasterClient, NameHeld
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


# ---------------------------------------------------------------------------- real agents, the real master


async def test_a_second_agent_with_the_name_waits_says_why_and_starts_once_the_first_left(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Two agents, one name, two work dirs: the second does not exit; its /readyz and /status say it waits
    for the name; once the first drained and left, the same second agent registers and runs."""
    first = agent_settings(tmp_path / "one", dev_master.base_url, dev_master.registration_token, AGENT_NAME="twin")
    second = agent_settings(tmp_path / "two", dev_master.base_url, dev_master.registration_token, AGENT_NAME="twin")
    with trio.fail_after(60):
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

            text = await eventually(says_why, 20, "the second agent's /readyz says it waits for the name")
            assert "belongs to another live agent" in text  # the master's reason
            assert not codes and waiting.state is AgentState.STARTING
            assert holder.master.registered and await holder.heartbeat.beat_once()  # the holder keeps its key
            holder.drain()
        await waiting.started.wait()  # the first left: the name is free
        assert waiting.master.registered and not codes
        [node] = await dev_master.admin.list_nodes()
        assert node["leftAt"] is None
        waiting.terminate()
        await eventually(lambda: _true(codes), 30, "the second agent's exit")
    assert codes == [0]


@pytest.mark.slow
async def test_a_rescheduled_pod_after_a_kill_waits_for_the_name_then_registers_and_never_exits(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The issue's row without ``agent.name_exclusive``: the pod is killed (no leaving call), its
    replacement (same name, fresh work dir) waits until the master counts the first one's heartbeats old
    (here 4 s instead of 90 s), then registers: no exit 1, /readyz said why meanwhile."""
    master = await short_live_master(nursery, tmp_path, node_live_after=4.0)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    settings = {"agent__name": "crawler-0", "deps__uv_index_url": "http://127.0.0.1:9/simple"}
    async with AgentProcess(tmp_path / "first", master.base_url, master.registration_token, **settings) as first:
        await first.start()
        await wait_registered(master.admin, first, "crawler-0")
        await first.kill()
        killed = time.monotonic()
        [before] = await master.admin.list_nodes()
    async with AgentProcess(tmp_path / "second", master.base_url, master.registration_token, **settings) as second:
        await second.start()
        port = await status_port(second)

        async def waiting() -> str | None:
            code, text = await readyz(port)
            return text if code == 503 and "waiting for the name crawler-0: another agent holds it" in text else None

        await eventually(waiting, 20, "the replacement's /readyz says it waits for the name")
        await wait_registered(master.admin, second, "crawler-0")

        async def registered_again() -> bool:
            [node] = await master.admin.list_nodes()
            return bool(node["registeredAt"] != before["registeredAt"])

        await eventually(registered_again, 10, "the replacement's registration")
        took = time.monotonic() - killed
        assert took <= master.node_live_after + REGISTER_WAIT_MAX + 5, took
        assert second.process is not None and second.process.returncode is None
        log = second.log_text()
        assert log.count("waiting for the name crawler-0") == 1, log
        assert "the node's name is this agent's now" in log
        await eventually(lambda: _ready(port), 20, "the replacement ready")
        second.signal(signal.SIGTERM)
        assert await wait_exit(second, 30) == 0


async def _ready(port: int) -> bool:
    code, _text = await readyz(port)
    return code == 200


async def _true(value: object) -> bool:
    return bool(value)
