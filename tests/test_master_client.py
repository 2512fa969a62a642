"""MasterClient's error classification, re-registration and retries (httpx.MockTransport, autojump clock)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from typing import Any

import httpx
import pytest
import trio

from ckagent.master.client import (
    MasterClient,
    MasterConflict,
    MasterRejected,
    MasterUnavailable,
    RegistrationRefused,
)
from ckagent.master.endpoints import HEARTBEAT, ITEMS, LOGS, POLL, Retry
from ckagent.master.protocol import HeartbeatResponse, RegisterRequest

TOKEN = "reg-token-SECRET-0123456789"
BASE = "http://master.test"

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def register_body() -> RegisterRequest:
    return RegisterRequest(name="n1", ip="127.0.0.1", port=9000, version="0", os="linux", arch="x86_64",
                           python="3.11", cpu_count=2, memory_total_bytes=1 << 30, max_workers=2)


@dataclass
class Seen:
    """What the fake master saw: (time, method, path, headers) per request."""

    requests: list[tuple[float, str, str, httpx.Headers]] = field(default_factory=list)

    def paths(self) -> list[str]:
        return [p for _, _, p, _ in self.requests]

    def times(self, path: str) -> list[float]:
        return [t for t, _, p, _ in self.requests if p == path]


def client_for(handler: Handler, seen: Seen) -> MasterClient:
    async def recording(request: httpx.Request) -> httpx.Response:
        seen.requests.append((trio.current_time(), request.method, request.url.path, request.headers))
        return await handler(request)

    return MasterClient(BASE, TOKEN, register_body, transport=httpx.MockTransport(recording))


def registered_as(node: str, key: str) -> httpx.Response:
    return httpx.Response(200, json={"nodeId": node, "apiKey": key})


# ---------------------------------------------------------------------------- 401 → re-register


async def test_401_re_registers_once_and_retries_with_the_new_key(autojump_clock: Any) -> None:
    keys = iter(["key-1", "key-2"])

    async def master(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            assert request.headers["X-Registration-Token"] == TOKEN
            return registered_as("node-7", next(keys))
        if request.headers["Authorization"] == "Bearer key-2":
            return httpx.Response(200, json={"cancelTaskIds": []})
        return httpx.Response(401, json={"error": "unknown api key"})

    seen = Seen()
    client = client_for(master, seen)
    answer = await client.call(HEARTBEAT, json={})
    await client.aclose()
    assert answer == HeartbeatResponse(cancel_task_ids=[])
    assert seen.paths() == ["/api/nodes/register", "/api/nodes/node-7/heartbeat",
                            "/api/nodes/register", "/api/nodes/node-7/heartbeat"]
    assert [h.get("Authorization") for _, _, p, h in seen.requests if "heartbeat" in p] == [
        "Bearer key-1", "Bearer key-2"]


async def test_a_second_401_is_rejected_not_a_registration_loop(autojump_clock: Any) -> None:
    async def master(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return registered_as("node-7", "key")
        return httpx.Response(401, json={"error": "nope"})

    seen = Seen()
    client = client_for(master, seen)
    with pytest.raises(MasterRejected) as info:
        await client.call(HEARTBEAT, json={}, retry=Retry())
    await client.aclose()
    assert info.value.status == 401
    assert seen.paths().count("/api/nodes/register") == 2
    assert len(seen.requests) == 4


# ---------------------------------------------------------------------------- registration refused


@pytest.mark.parametrize("status", [400, 403, 404, 422])
async def test_registration_4xx_is_refused_with_the_masters_reason(status: int, autojump_clock: Any) -> None:
    async def master(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": "node name n1 is banned"})

    seen = Seen()
    client = client_for(master, seen)
    with pytest.raises(RegistrationRefused) as info:
        await client.register()
    await client.aclose()
    message = str(info.value)
    assert "node name n1 is banned" in message and str(status) in message
    assert TOKEN not in message
    assert len(seen.requests) == 1  # refused for good: not retried
    assert not client.registered


async def test_registration_refusal_never_quotes_the_token_even_if_the_master_does(autojump_clock: Any) -> None:
    async def master(request: httpx.Request) -> httpx.Response:
        given = request.headers["X-Registration-Token"]
        return httpx.Response(403, json={"error": f"token {given} is disabled"})

    client = client_for(master, Seen())
    with pytest.raises(RegistrationRefused) as info:
        await client.register()
    await client.aclose()
    assert TOKEN not in str(info.value)
    assert "is disabled" in str(info.value)


async def test_registration_retries_401_429_5xx_and_transport_errors(autojump_clock: Any) -> None:
    answers: list[Any] = [401, 429, 503, httpx.ConnectError, 500]

    async def master(request: httpx.Request) -> httpx.Response:
        if answers:
            answer = answers.pop(0)
            if isinstance(answer, int):
                return httpx.Response(answer, json={"error": "later"})
            raise answer("connection refused", request=request)
        return registered_as("node-1", "key-1")

    seen = Seen()
    client = client_for(master, seen)
    answer = await client.register()
    await client.aclose()
    assert (answer.node_id, answer.api_key) == ("node-1", "key-1")
    assert client.registered and client.node_id == "node-1"
    assert len(seen.requests) == 6


# ---------------------------------------------------------------------------- retries and backoff


async def test_unavailable_is_retried_with_growing_backoff_and_logged_once_per_change(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    failures: list[Any] = [503, 429, httpx.ConnectError, 500, httpx.ReadTimeout, 502]
    path = "/api/nodes/node-1/heartbeat"

    async def master(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return registered_as("node-1", "key-1")
        if failures:
            failure = failures.pop(0)
            if isinstance(failure, int):
                return httpx.Response(failure, text="busy")
            raise failure("boom", request=request)
        return httpx.Response(200, json={"cancelTaskIds": ["t9"]})

    seen = Seen()
    client = client_for(master, seen)
    caplog.set_level(logging.INFO, logger="ckagent.master.client")
    answer = await client.call(HEARTBEAT, json={}, retry=Retry())
    await client.aclose()
    assert answer.cancel_task_ids == ["t9"]
    times = seen.times(path)
    assert len(times) == 7
    gaps = [b - a for a, b in pairwise(times)]
    # stamina: 0.5 s * 2**(n-1), capped at 30 s, plus up to 1 s of jitter.
    for n, gap in enumerate(gaps, start=1):
        floor = min(0.5 * 2 ** (n - 1), 30.0)
        assert floor <= gap <= floor + 1.0 + 1e-6, (n, gaps)
    assert gaps[-1] > gaps[0] and gaps[-1] > 8.0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("retrying with backoff" in m for m in messages) == 1, messages
    assert any(m.startswith("master unavailable (heartbeat: answered 503 text/plain, first bytes b'busy')")
               for m in messages), messages
    assert sum("reachable again" in m for m in messages) == 1, messages
    assert any("after 6 failed attempts" in m for m in messages), messages
    assert all(TOKEN not in m and "key-1" not in m for m in messages)


async def test_bounded_retries_give_up_with_master_unavailable(autojump_clock: Any) -> None:
    async def master(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return registered_as("node-1", "key-1")
        return httpx.Response(503)

    seen = Seen()
    client = client_for(master, seen)
    with pytest.raises(MasterUnavailable, match="503"):
        await client.call(POLL, retry=Retry(attempts=3))
    await client.aclose()
    assert len(seen.times("/api/nodes/node-1/tasks/pending")) == 3
    assert not client.connectivity.up


# ---------------------------------------------------------------------------- other 4xx


async def test_409_is_a_conflict_with_its_body_and_not_retried(autojump_clock: Any) -> None:
    async def master(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return registered_as("node-1", "key-1")
        assert json.loads(request.content) == {"seq": 7, "lines": ["x"]}
        return httpx.Response(409, json={"expectedSeq": 5, "error": "gap"})

    seen = Seen()
    client = client_for(master, seen)
    with pytest.raises(MasterConflict) as info:
        await client.call(LOGS, {"task": "t1"}, json={"seq": 7, "lines": ["x"]}, retry=Retry())
    await client.aclose()
    assert info.value.status == 409
    assert info.value.body == {"expectedSeq": 5, "error": "gap"}
    assert "gap" in str(info.value)
    assert len(seen.times("/api/tasks/t1/logs")) == 1


async def test_other_4xx_is_rejected_once(autojump_clock: Any) -> None:
    async def master(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return registered_as("node-1", "key-1")
        return httpx.Response(400, json={"error": "bad"})

    seen = Seen()
    client = client_for(master, seen)
    with pytest.raises(MasterRejected) as info:
        await client.call(ITEMS, {"task": "t1"}, json={}, retry=Retry())
    await client.aclose()
    assert not isinstance(info.value, MasterConflict)
    assert info.value.status == 400 and info.value.body == {"error": "bad"}
    assert len(seen.times("/api/tasks/t1/items")) == 1


async def test_a_rejection_never_quotes_the_api_key_even_if_the_master_does(autojump_clock: Any) -> None:
    async def master(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return registered_as("node-1", "api-key-SECRET-42")
        return httpx.Response(403, json={"error": f"key {request.headers['Authorization']} may not do this"})

    client = client_for(master, Seen())
    with pytest.raises(MasterRejected) as info:
        await client.call(ITEMS, {"task": "t1"}, json={})
    await client.aclose()
    assert "api-key-SECRET-42" not in str(info.value)
    assert "may not do this" in str(info.value) and "403" in str(info.value)


# ---------------------------------------------------------------------------- what a call leaves out


async def test_a_masters_cookie_is_neither_kept_nor_sent_back(autojump_clock: Any) -> None:
    async def master(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return httpx.Response(200, json={"nodeId": "node-1", "apiKey": "key-1"},
                                  headers={"Set-Cookie": "session=abc; Path=/"})
        return httpx.Response(200, json={"tasks": [], "cancelTaskIds": []}, headers={"Set-Cookie": "b=2; Path=/"})

    seen = Seen()
    client = client_for(master, seen)
    await client.call(POLL)
    await client.call(POLL)
    await client.aclose()
    assert [h.get("cookie") for _, _, _, h in seen.requests] == [None, None, None]
    assert [h["authorization"] for _, _, p, h in seen.requests if p != "/api/nodes/register"] == ["Bearer key-1"] * 2
    assert all(h["user-agent"] == "ckagent" for _, _, _, h in seen.requests)


async def test_calls_go_through_the_proxy_the_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """As with httpx's client: HTTP_PROXY is honoured for the master's calls (real sockets, 127.0.0.1)."""
    lines: list[bytes] = []

    async def proxy(stream: trio.SocketStream) -> None:  # answers in the master's place, keep-alive
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = await stream.receive_some(65536)
                if not data:
                    return
                buffer += data
            head, buffer = buffer.split(b"\r\n\r\n", 1)
            length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), b"0"))
            while len(buffer) < length:
                buffer += await stream.receive_some(65536)
            buffer = buffer[length:]
            lines.append(head.split(b"\r\n")[0])
            body = (b'{"nodeId": "node-1", "apiKey": "key-1"}' if b"/register" in lines[-1]
                    else b'{"tasks": [], "cancelTaskIds": []}')
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                  % (len(body), body))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            [listener] = await nursery.start(partial(trio.serve_tcp, proxy, 0, host="127.0.0.1"))
            port = listener.socket.getsockname()[1]
            for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy", "http_proxy"):
                monkeypatch.delenv(name, raising=False)
            monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
            client = MasterClient("http://master.invalid:8080", TOKEN, register_body)
            answer = await client.call(POLL, params={"limit": 2})
            await client.aclose()
            nursery.cancel_scope.cancel()
    assert answer.tasks == []
    assert lines == [b"POST http://master.invalid:8080/api/nodes/register HTTP/1.1",
                     b"GET http://master.invalid:8080/api/nodes/node-1/tasks/pending?limit=2 HTTP/1.1"]
