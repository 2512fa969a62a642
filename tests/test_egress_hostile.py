"""Nothing a client or an upstream sends to the agent's listeners ends more than its own connection.

The egress proxy (the ``proxy`` level: a listener per task on 127.0.0.1) and the status port
(hypercorn: /metrics /healthz /readyz /status) are edges: every byte a spider or a scraper sends
them is hostile or unlucky until parsed. For each case of a matrix — what a client sends (idle,
half-close, garbage, huge and slow heads, bad chunking, pipelining with a refusal in the middle,
smuggling, malformed and IDNA hosts, unspecified and mapped addresses, CONNECT) and what an upstream
answers (garbage, a reset, a short body, a huge head, silence, a 1xx flood) — the bad connection gets
a clear 4xx/5xx or a close, another connection of the same task that was open meanwhile goes on, a
new one is served, and nothing reaches the proxy's nursery (it would be the agent's). A hypothesis
fuzz of the request boundary holds the same over arbitrary bytes and mutated requests. A real agent
process runs a spider that sends the worst of it to its ``HTTP_PROXY``: the agent stays up, the task
ends SUCCESS. Loopback only: every target is a 127.0.0.x address (tests/harness/hostile.py).
"""

from __future__ import annotations

import base64
import logging
import signal
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    AGENT_HOST,
    DENIED_HOST,
    Answer,
    ProxyUnderTest,
    Raw,
    RecordingMaster,
    agent_process,
    free_port,
    kept_busy,
    no_strays,
    proxy_under_test,
    serve_upstream,
    status_port_under_test,
    submit,
    task_final_while_alive,
    wait_exit,
    wait_registered,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ckagent.containment.egress.proxy import Limits

IDLE = 0.4
"""The proxy's idle, keep-alive, head and tunnel timeouts in these tests (seconds)."""
UPSTREAM = 0.6
"""The proxy's I/O timeout in these tests (seconds): an upstream that moves no byte for this long."""
BOUND = 10.0
"""Every case ends within this (seconds): a hung case fails, it does not stall the suite."""


LIMITS = Limits(idle_timeout=IDLE, keepalive_timeout=IDLE, head_timeout=IDLE, io_timeout=UPSTREAM,
                tunnel_idle_timeout=IDLE)
"""The proxy's limits in the cases about time (TIMED): idle and slow peers are cases of a fast test."""
RELAXED = Limits(idle_timeout=10, keepalive_timeout=10, head_timeout=10, io_timeout=10, tunnel_idle_timeout=10)
"""The proxy's limits in the other cases: no timeout of the proxy's may fire when a loaded machine
stalls this process for a moment (a 0.6 s stall would be a false 504)."""
FUZZ_LIMITS = Limits(idle_timeout=2, keepalive_timeout=2, head_timeout=2, io_timeout=2, tunnel_idle_timeout=2)
"""The fuzz's: each example ends with the client's FIN; these bound the rare one that does not."""
TIMED = {"idle", "idle after a request", "slow-loris", "slow-loris on a kept-alive connection",
         "Expect: 100-continue, no body", "never", "never, with a body", "flood", "flood, with a body"}
"""The cases that wait for one of the proxy's timeouts."""


@pytest.fixture
async def proxy() -> AsyncIterator[ProxyUnderTest]:
    """The proxy of one task, served in-process with its upstreams (tests/harness/hostile.py), with
    RELAXED limits (a case in TIMED sets LIMITS before its connections open)."""
    async with proxy_under_test(limits=RELAXED) as under_test:
        yield under_test


@pytest.fixture
async def fuzz_proxy() -> AsyncIterator[ProxyUnderTest]:
    """The proxy under a policy that denies everything but the two upstreams: a fuzzed request can
    name no address off loopback (its authority is never mutated), and this holds it twice."""
    async with proxy_under_test(deny="metadata,link-local,agent,0.0.0.0/0,::/0",
                                allow="127.0.0.3/32,127.0.0.4/32", limits=FUZZ_LIMITS) as under_test:
        yield under_test


def _crashes(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Log records with a traceback from the proxy: a case hit a last-resort handler, not a rule."""
    return [f"{r.getMessage()}\n{''.join(traceback.format_exception(*r.exc_info))}" for r in caplog.records
            if r.exc_info and r.name.startswith("ckagent.containment.egress")]


async def _survives(proxy: ProxyUnderTest, case: Callable[[ProxyUnderTest, Raw], Awaitable[None]],
                    caplog: pytest.LogCaptureFixture, name: str = "") -> None:
    """Run ``case`` on its own connection while a bystander connection of the same task goes on
    making good requests; then a new connection is served and nothing escaped. The proxy's limits
    are LIMITS when ``name`` is in TIMED, else RELAXED (the server reads them per connection)."""
    caplog.set_level(logging.INFO)
    assert proxy.egress.server is not None
    proxy.egress.server.limits = LIMITS if name in TIMED else RELAXED
    with trio.fail_after(BOUND):
        async with Raw.open(proxy.port) as bystander:

            async def request(n: int) -> None:
                await proxy.good(bystander, 1, f"/bystander/{n}")

            async with kept_busy(request, IDLE / 4), Raw.open(proxy.port) as raw:
                await case(proxy, raw)
        await proxy.good()
    proxy.assert_nothing_escaped()
    assert not _crashes(caplog), _crashes(caplog)


# ------------------------------------------------------------------------------ what a client sends


def _closes(answer: Answer | None, *statuses: int) -> None:
    """The connection answered one of ``statuses``, or closed without an answer (None)."""
    assert answer is None or answer.status in statuses, answer


async def _ends_within(raw: Raw, seconds: float, *statuses: int) -> None:
    """The proxy answers one of ``statuses`` or closes within ``seconds``; after an answer that
    keeps the connection, our FIN makes it close."""
    with trio.fail_after(seconds):
        answer = await raw.answer()
        _closes(answer, *statuses)
        if answer is not None:
            await raw.half_close()
        await raw.until_closed()


async def idle(proxy: ProxyUnderTest, raw: Raw) -> None:
    await _ends_within(raw, IDLE * 4, 408)


async def idle_after_a_request(proxy: ProxyUnderTest, raw: Raw) -> None:
    await proxy.good(raw)
    await _ends_within(raw, IDLE * 4, 408)


async def half_close_after_a_request(proxy: ProxyUnderTest, raw: Raw) -> None:
    await raw.send(proxy.get(proxy.url(0, "/one")) + proxy.get(proxy.url(1, "/two")))
    await raw.half_close()
    first, second = await raw.answer(), await raw.answer()
    assert first is not None and first.status == 200 and first.json()["target"] == "/one", first
    assert second is not None and second.status == 200 and second.json()["host"] == proxy.hosts[1].host, second


async def half_close_mid_head(proxy: ProxyUnderTest, raw: Raw) -> None:
    await raw.send(proxy.get(proxy.url())[:30])
    await raw.half_close()
    _closes(await raw.answer(), 400)


def _garbage(data: bytes, *statuses: int) -> Callable[[ProxyUnderTest, Raw], Awaitable[None]]:
    async def case(proxy: ProxyUnderTest, raw: Raw) -> None:
        await raw.send(data)
        await _ends_within(raw, IDLE * 4, *statuses)

    return case


TLS_HELLO = bytes.fromhex("16030100a5010000a10303") + bytes(range(32)) + b"\x00\x00\x02\x13\x01\x01\x00"


def _huge_head(size: int) -> Callable[[ProxyUnderTest, Raw], Awaitable[None]]:
    async def case(proxy: ProxyUnderTest, raw: Raw) -> None:
        await raw.send(proxy.get(proxy.url(0, "/huge"), "X-Big: " + "b" * size))
        _closes(await raw.answer(), 431)
        assert "/huge" not in proxy.hosts[0].targets()

    return case


async def huge_request_line(proxy: ProxyUnderTest, raw: Raw) -> None:
    await raw.send(proxy.get(proxy.url(0, "/" + "p" * 200_000)))
    _closes(await raw.answer(), 414, 431)


async def huge_head_read_at_once(proxy: ProxyUnderTest, raw: Raw) -> None:
    """A 70 KB head that is whole in the socket buffer when the proxy reads it (sent while the
    proxy waits for the answer to the request before it): over the 64 KiB limit all the same."""
    await raw.send(proxy.get(proxy.url(0, "/hold")))
    await raw.send(proxy.get(proxy.url(0, "/huge"), "X-Big: " + "b" * 70_000))
    proxy.hosts[0].release.set()
    first = await raw.answer()
    assert first is not None and first.status == 200, first
    _closes(await raw.answer(), 431)
    assert "/huge" not in proxy.hosts[0].targets()


async def too_many_headers(proxy: ProxyUnderTest, raw: Raw) -> None:
    await raw.send(proxy.get(proxy.url(), *(f"X-H{i}: v" for i in range(2000))))
    _closes(await raw.answer(), 431)


async def slow_loris(proxy: ProxyUnderTest, raw: Raw) -> None:
    """A head sent a byte at a time, each well within the idle timeout: the head timeout ends it."""
    with trio.fail_after(IDLE * 6):
        await raw.trickle(proxy.get(proxy.url()), IDLE / 8)
        answer = await raw.answer()
    assert answer is not None and answer.status == 408, answer


async def slow_loris_on_a_kept_alive_connection(proxy: ProxyUnderTest, raw: Raw) -> None:
    await proxy.good(raw)
    await slow_loris(proxy, raw)


async def expect_100_without_a_body(proxy: ProxyUnderTest, raw: Raw) -> None:
    await raw.send(proxy.get(proxy.url(0, "/expect"), "Expect: 100-continue", "Content-Length: 10", method="PATCH"))
    with trio.fail_after(IDLE * 4 + UPSTREAM * 2):
        answer = await raw.answer(b"PATCH")
    assert answer is None or answer.status in (400, 408, 502, 504) or not answer.complete, answer
    assert "/expect" not in proxy.hosts[0].targets()  # never a complete request upstream


def _chunked(body: bytes) -> Callable[[ProxyUnderTest, Raw], Awaitable[None]]:
    async def case(proxy: ProxyUnderTest, raw: Raw) -> None:
        head = proxy.get(proxy.url(0, "/chunked"), "Transfer-Encoding: chunked", method="PATCH")
        await raw.send(head + body)
        await raw.half_close()
        with trio.fail_after(IDLE * 4 + UPSTREAM * 2):
            answer = await raw.answer(b"PATCH")
        assert answer is None or answer.status in (400, 502) or not answer.complete, answer
        assert "/chunked" not in proxy.hosts[0].targets()  # the upstream never got a whole message

    return case


async def pipelined_with_a_refusal_in_the_middle(proxy: ProxyUnderTest, raw: Raw) -> None:
    await raw.send(proxy.get(proxy.url(0, "/one")) + proxy.get(f"http://{proxy.denied.authority}/two")
                   + proxy.get(proxy.url(1, "/three")) + proxy.get(proxy.url(0, "/four")))
    answers = [await raw.answer() for _ in range(4)]
    assert [a.status if a else None for a in answers] == [200, 403, 200, 200], answers
    seen = [(a.json()["host"], a.json()["target"]) for a in answers if a and a.status == 200]
    assert seen == [(proxy.hosts[0].host, "/one"), (proxy.hosts[1].host, "/three"), (proxy.hosts[0].host, "/four")]


async def refused_with_a_body_then_a_good_request(proxy: ProxyUnderTest, raw: Raw) -> None:
    """A refused request's body is read and dropped: the connection carries the next request."""
    await raw.send(proxy.get(f"http://{proxy.denied.authority}/x", method="POST", body=b"hello")
                   + proxy.get(f"http://{proxy.denied.authority}/y", "Transfer-Encoding: chunked", method="PATCH")
                   + b"5\r\nhello\r\n0\r\n\r\n")
    assert [(a.status if a else None) for a in (await raw.answer(b"POST"), await raw.answer(b"PATCH"))] == [403, 403]
    await proxy.good(raw)


def _refused_with_a_bad_body(wrong_secret: bool) -> Callable[[ProxyUnderTest, Raw], Awaitable[None]]:
    async def case(proxy: ProxyUnderTest, raw: Raw) -> None:
        request = proxy.get(f"http://{proxy.denied.authority}/x", "Transfer-Encoding: chunked", method="PATCH")
        if wrong_secret:
            request = request.replace(proxy.auth(), b"Proxy-Authorization: " + _wrong_secret(proxy) + b"\r\n")
        await raw.send(request + b"zz\r\n")
        _closes(await raw.answer(b"PATCH"), 407 if wrong_secret else 403, 400)

    return case


async def pipelined_with_a_malformed_host_in_the_middle(proxy: ProxyUnderTest, raw: Raw) -> None:
    await raw.send(proxy.get(proxy.url(0, "/one")) + proxy.get("http://a..b/two") + proxy.get(proxy.url(1, "/three")))
    first, second, third = await raw.answer(), await raw.answer(), await raw.answer()
    assert first is not None and first.json()["target"] == "/one", first
    assert second is not None and second.status == 400, second
    assert third is None or third.json()["host"] == proxy.hosts[1].host, third  # closed, or answered right


async def pipelined_hosts_interleaved(proxy: ProxyUnderTest, raw: Raw) -> None:
    order = [0, 1, 1, 0, 1, 0, 0]
    await raw.send(b"".join(proxy.get(proxy.url(i, f"/{n}"), f"Authorization: Bearer for-{i}")
                            for n, i in enumerate(order)))
    for n, i in enumerate(order):
        answer = await raw.answer()
        assert answer is not None and answer.status == 200, answer
        seen = answer.json()
        assert (seen["host"], seen["target"]) == (proxy.hosts[i].host, f"/{n}"), seen
        assert seen["headers"]["authorization"] == f"Bearer for-{i}", seen
        assert "proxy-authorization" not in seen["headers"], seen


SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: 127.0.0.3\r\n\r\n"


def _smuggle(*headers: str, body: bytes) -> Callable[[ProxyUnderTest, Raw], Awaitable[None]]:
    """A POST whose framing headers disagree (or are ambiguous), with a second request hidden in
    what one reading calls the body: refused with 400, and no upstream ever parses the hidden one."""

    async def case(proxy: ProxyUnderTest, raw: Raw) -> None:
        await raw.send(proxy.get(proxy.url(0, "/front"), *headers, method="PATCH") + body)
        answer = await raw.answer(b"PATCH")
        assert answer is not None and answer.status in (400, 501), answer
        for upstream in proxy.hosts:
            assert "/smuggled" not in upstream.targets() and b"/smuggled" not in upstream.raw, upstream.requests

    return case


async def obs_fold(proxy: ProxyUnderTest, raw: Raw) -> None:
    """RFC 9112 5.2: a proxy rejects obs-fold or replaces it with spaces; it never passes it on."""
    await raw.send(proxy.get(proxy.url(0, "/fold"), "X-Folded: a", " b"))
    answer = await raw.answer()
    assert answer is not None and answer.status in (200, 400), answer
    assert b"\r\n b" not in proxy.hosts[0].raw, proxy.hosts[0].raw


async def bare_lf(proxy: ProxyUnderTest, raw: Raw) -> None:
    await raw.send(proxy.get(proxy.url(0, "/lf")).replace(b"\r\n", b"\n"))
    answer = await raw.answer()
    assert answer is not None and answer.status in (200, 400), answer
    assert b"\n" not in proxy.hosts[0].raw.replace(b"\r\n", b""), proxy.hosts[0].raw  # CRLF only, upstream


def _bad_head(*headers: str, statuses: tuple[int, ...] = (400,)) -> Callable[[ProxyUnderTest, Raw], Awaitable[None]]:
    async def case(proxy: ProxyUnderTest, raw: Raw) -> None:
        await raw.send(proxy.get(proxy.url(0, "/bad-head"), *headers))
        answer = await raw.answer()
        assert answer is not None and answer.status in statuses, answer
        assert "/bad-head" not in proxy.hosts[0].targets()

    return case


async def host_header_names_another_host(proxy: ProxyUnderTest, raw: Raw) -> None:
    """Routed by the URL; the Host header made to agree with it."""
    request = proxy.get(proxy.url(0, "/host")).replace(f"Host: {proxy.hosts[0].authority}".encode(),
                                                       f"Host: {proxy.denied.authority}".encode())
    await raw.send(request)
    answer = await raw.answer()
    assert answer is not None and answer.status == 200, answer
    assert answer.json()["headers"]["host"] == proxy.hosts[0].authority, answer


async def origin_form(proxy: ProxyUnderTest, raw: Raw) -> None:
    await raw.send(b"GET / HTTP/1.1\r\nHost: " + proxy.denied.authority.encode() + b"\r\n" + proxy.auth() + b"\r\n")
    _closes(await raw.answer(), 400, 403)


async def no_credentials(proxy: ProxyUnderTest, raw: Raw) -> None:
    """The port says which task asks (Chromium cannot send proxy credentials)."""
    await raw.send(proxy.get(proxy.url(0, "/anonymous")).replace(proxy.auth(), b""))
    answer = await raw.answer()
    assert answer is not None and answer.status == 200 and answer.json()["target"] == "/anonymous", answer


def _credentials(token: bytes) -> Callable[[ProxyUnderTest, Raw], Awaitable[None]]:
    async def case(proxy: ProxyUnderTest, raw: Raw) -> None:
        await raw.send(proxy.get(proxy.url(0, "/creds")).replace(proxy.auth(), b"Proxy-Authorization: " + token
                                                                 + b"\r\n"))
        _closes(await raw.answer(), 400, 407)
        assert "/creds" not in proxy.hosts[0].targets()

    return case


def _wrong_secret(proxy: ProxyUnderTest) -> bytes:
    return b"Basic " + base64.b64encode(f"{proxy.user}:not-the-secret".encode())


async def wrong_secret(proxy: ProxyUnderTest, raw: Raw) -> None:
    await _credentials(_wrong_secret(proxy))(proxy, raw)


async def http10_without_host(proxy: ProxyUnderTest, raw: Raw) -> None:
    await raw.send(f"GET {proxy.url(0, '/old')} HTTP/1.0\r\n".encode() + proxy.auth() + b"\r\n")
    answer = await raw.answer()
    assert answer is not None and answer.status == 200 and answer.json()["target"] == "/old", answer


async def connect_then_http_through_the_tunnel(proxy: ProxyUnderTest, raw: Raw) -> None:
    authority = proxy.hosts[0].authority
    await raw.send(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n".encode() + proxy.auth() + b"\r\n")
    answer = await raw.answer(b"CONNECT")
    assert answer is not None and answer.status == 200, answer
    await raw.send(f"GET /tunnelled HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    inner = Raw(raw.stream)
    through = await inner.answer()
    assert through is not None and through.json()["target"] == "/tunnelled", through


async def connect_then_idle(proxy: ProxyUnderTest, raw: Raw) -> None:
    authority = proxy.hosts[0].authority
    await raw.send(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n".encode() + proxy.auth() + b"\r\n")
    answer = await raw.answer(b"CONNECT")
    assert answer is not None and answer.status == 200, answer


CLIENT_CASES: dict[str, Callable[[ProxyUnderTest, Raw], Awaitable[None]]] = {
    "idle": idle,
    "idle after a request": idle_after_a_request,
    "half-close after two requests": half_close_after_a_request,
    "half-close mid-head": half_close_mid_head,
    "garbage: TLS ClientHello": _garbage(TLS_HELLO, 400),
    "garbage: text": _garbage(b"hello proxy, how are you\r\n\r\n", 400),
    "garbage: NULs": _garbage(b"\x00" * 64 + b"\r\n\r\n", 400),
    "garbage: HTTP/2 preface": _garbage(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, 505),
    # (h11 reads any HTTP/d.d as 1.1; nothing listens on 127.0.0.3:80: 502 is fine too)
    "garbage: HTTP/9.9": _garbage(b"GET http://127.0.0.3/ HTTP/9.9\r\nHost: x\r\n\r\n", 400, 502, 505),
    "garbage: one long line": _garbage(b"G" * 300_000, 400, 414, 431),
    "huge head (100 KB)": _huge_head(100_000),
    "huge head (400 KB)": _huge_head(400_000),
    "huge head, read at once": huge_head_read_at_once,
    "huge request line": huge_request_line,
    "too many headers": too_many_headers,
    "slow-loris": slow_loris,
    "slow-loris on a kept-alive connection": slow_loris_on_a_kept_alive_connection,
    "Expect: 100-continue, no body": expect_100_without_a_body,
    "chunked: size not hex": _chunked(b"zz\r\nabc\r\n0\r\n\r\n"),
    "chunked: size overflows": _chunked(b"f" * 40 + b"\r\nabc\r\n0\r\n\r\n"),
    "chunked: data longer than its size": _chunked(b"3\r\nabcdef\r\n0\r\n\r\n"),
    "chunked: no end": _chunked(b"3\r\nabc\r\n"),
    "pipelined, a refusal in the middle": pipelined_with_a_refusal_in_the_middle,
    "pipelined, a malformed host in the middle": pipelined_with_a_malformed_host_in_the_middle,
    "refused, with a body, then a good request": refused_with_a_body_then_a_good_request,
    "refused, with a bad chunked body": _refused_with_a_bad_body(False),
    "wrong secret, with a bad chunked body": _refused_with_a_bad_body(True),
    "pipelined, two hosts interleaved": pipelined_hosts_interleaved,
    "smuggling: Content-Length then Transfer-Encoding": _smuggle(
        "Content-Length: 5", "Transfer-Encoding: chunked", body=b"0\r\n\r\n" + SMUGGLED),
    "smuggling: Transfer-Encoding then Content-Length": _smuggle(
        "Transfer-Encoding: chunked", f"Content-Length: {len(SMUGGLED) + 5}", body=b"0\r\n\r\n" + SMUGGLED),
    "smuggling: two Content-Lengths": _smuggle("Content-Length: 0", f"Content-Length: {len(SMUGGLED)}",
                                               body=SMUGGLED),
    "smuggling: Content-Length: 0, 40": _smuggle(f"Content-Length: 0, {len(SMUGGLED)}", body=SMUGGLED),
    "smuggling: Transfer-Encoding: xchunked": _smuggle("Transfer-Encoding: xchunked", body=b"0\r\n\r\n" + SMUGGLED),
    "smuggling: Transfer-Encoding: chunked, identity": _smuggle("Transfer-Encoding: chunked, identity",
                                                                body=b"0\r\n\r\n" + SMUGGLED),
    "smuggling: folded Transfer-Encoding": _smuggle("Content-Length: 5", "Transfer-Encoding:", " chunked",
                                                    body=b"0\r\n\r\n" + SMUGGLED),
    "obs-fold": obs_fold,
    "bare LF line ends": bare_lf,
    "bare CR in a value": _bad_head("X-A: a\rb"),
    "NUL in a value": _bad_head("X-A: a\x00b"),
    "space before the colon": _bad_head("Content-Length : 0"),
    "Content-Length: -1": _bad_head("Content-Length: -1"),
    "Content-Length: +1": _bad_head("Content-Length: +1"),
    "Content-Length: 1e3": _bad_head("Content-Length: 1e3"),
    "header name with a space": _bad_head("X A: b"),
    "Host header names another host": host_header_names_another_host,
    "origin-form request (not a proxy request)": origin_form,
    "no proxy credentials: the port names the task": no_credentials,
    "credentials: wrong secret": wrong_secret,
    "credentials: not base64": _credentials(b"Basic !!!not base64!!!"),
    "credentials: not Basic": _credentials(b"Bearer abc"),
    "credentials: no colon": _credentials(b"Basic " + base64.b64encode(b"someone")),
    "credentials: another task's": _credentials(b"Basic " + base64.b64encode(b"tsomeoneelse:secret")),
    "HTTP/1.0 without Host": http10_without_host,
    "https:// in a GET": _garbage(b"GET https://127.0.0.3/ HTTP/1.1\r\nHost: 127.0.0.3\r\n\r\n", 400),
    "ftp:// in a GET": _garbage(b"GET ftp://127.0.0.3/ HTTP/1.1\r\nHost: 127.0.0.3\r\n\r\n", 400),
    "CONNECT, then HTTP through the tunnel": connect_then_http_through_the_tunnel,
    "CONNECT, then idle": connect_then_idle,
}


KNOWN_DEFECTS: dict[str, str] = {}
"""Cases that fail on the proxy as merged, reported to its owner (strict: a fix turns them into errors
until this list is updated)."""


def _known(name: str) -> Any:
    if name not in KNOWN_DEFECTS:
        return name
    strict = "not strict" not in KNOWN_DEFECTS[name]
    return pytest.param(name, marks=pytest.mark.xfail(strict=strict, reason=KNOWN_DEFECTS[name]))


@pytest.mark.parametrize("name", [_known(name) for name in CLIENT_CASES])
async def test_a_hostile_client_ends_only_its_own_connection(
    proxy: ProxyUnderTest, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    await _survives(proxy, CLIENT_CASES[name], caplog, name)


# ------------------------------------------------------------------------------ hosts


AGENT_PORT = "{agent}"
"""Stands for the agent stand-in's port in the host table (filled in at run time)."""

HOSTS: list[tuple[str, tuple[int, ...]]] = [
    ("a..b", (400,)),
    ("." + "a" * 10, (400,)),
    ("a" * 64 + ".invalid", (400,)),
    (".".join(["a" * 63] * 4)[:254], (400,)),  # 254 characters: one over DNS's limit
    ("a%00b.invalid", (400,)),
    ("a b.invalid", (400,)),
    ("a\tb.invalid", (400,)),
    ("%31%32%37.0.0.3", (400,)),
    ("[::1", (400,)),
    ("::1", (400,)),
    ("[fe80::1%25lo]", (400,)),
    ("127.0.0.3:0", (400,)),
    ("127.0.0.3:70000", (400,)),
    ("127.0.0.3:-1", (400,)),
    ("127.0.0.3:8x", (400,)),
    ("127.0.0.3:", (400, 502)),  # an empty port may mean 80: nothing listens there
    ("user@127.0.0.3", (400,)),
    ("user:pw@127.0.0.3", (400,)),
    ("bücher.invalid", (400,)),  # a request line is ASCII: clients send a name in IDNA (below)
    ("xn--bcher-kva.invalid", (502,)),  # IDNA, valid: not found
    ("XN--BCHER-KVA.INVALID", (502,)),
    ("xn--a.invalid", (400, 502)),  # punycode that decodes to nothing valid
    ("xn--bcher-kva-.invalid", (400, 502)),
    ("xn--.invalid", (400, 502)),
    ("a\u200db.invalid", (400,)),  # ZERO WIDTH JOINER
    ("ä..b", (400,)),
    ("-a.invalid", (400, 502)),
    ("a_b.invalid", (400, 502)),
    ("\u00a0.invalid", (400,)),
    (DENIED_HOST + ":" + "{denied}", (403,)),
    ("0.0.0.0:" + AGENT_PORT, (403,)),
    ("[::]:" + AGENT_PORT, (403,)),
    ("[::ffff:127.0.0.1]:" + AGENT_PORT, (403,)),
    ("[::ffff:7f00:1]:" + AGENT_PORT, (403,)),
    ("[0:0:0:0:0:ffff:127.0.0.1]:" + AGENT_PORT, (403,)),
    ("2130706433:" + AGENT_PORT, (400, 403)),  # decimal IPv4 for 127.0.0.1
    ("0x7f.1:" + AGENT_PORT, (400, 403)),
    ("127.1:" + AGENT_PORT, (400, 403)),
    ("017700000001:" + AGENT_PORT, (400, 403)),  # octal
    ("localhost:" + AGENT_PORT, (403,)),
    ("LOCALHOST.:" + AGENT_PORT, (400, 403)),
    ("127.0.0.1.:" + AGENT_PORT, (400, 403)),
    ("[::1]:" + AGENT_PORT, (403, 502)),  # the stand-in listens on IPv4 only: refused, or nothing there
]


def _host(proxy: ProxyUnderTest, host: str) -> str:
    return host.replace("{agent}", str(proxy.agent.port)).replace("{denied}", str(proxy.denied.port))


@pytest.mark.parametrize(("host", "statuses"), HOSTS, ids=[h[:40] for h, _ in HOSTS])
async def test_a_malformed_or_local_host_gets_its_answer(
    proxy: ProxyUnderTest, caplog: pytest.LogCaptureFixture, host: str, statuses: tuple[int, ...]
) -> None:
    """The same host in an absolute-form URL and in a CONNECT: 400 when malformed, 502 when it does
    not resolve, 403 when it names (however spelled) what the policy denies; the keep-alive connection
    it came on serves its next request when the answer lets it."""

    async def absolute(proxy: ProxyUnderTest, raw: Raw) -> None:
        target = _host(proxy, host)
        await raw.send(f"GET http://{target}/x HTTP/1.1\r\nHost: {target}\r\n".encode() + proxy.auth() + b"\r\n")
        answer = await raw.answer()
        assert answer is not None and answer.status in statuses, (host, answer)
        if "connection" not in answer.headers or answer.headers["connection"].lower() != "close":
            await proxy.good(raw)

    async def connect(proxy: ProxyUnderTest, raw: Raw) -> None:
        target = _host(proxy, host)
        if ":" not in target.rsplit("]", 1)[-1]:
            target += ":80"
        await raw.send(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n".encode() + proxy.auth() + b"\r\n")
        answer = await raw.answer(b"CONNECT")
        assert answer is not None and answer.status in statuses, (host, answer)

    await _survives(proxy, absolute, caplog)
    await _survives(proxy, connect, caplog)


@pytest.mark.parametrize("target", ["127.0.0.3", "http://127.0.0.3:80/", "[::1", ":80", "127.0.0.3:80 extra",
                                    "a..b:443", "/", "*"])
async def test_a_malformed_connect_target_gets_400(
    proxy: ProxyUnderTest, caplog: pytest.LogCaptureFixture, target: str
) -> None:
    async def case(proxy: ProxyUnderTest, raw: Raw) -> None:
        await raw.send(f"CONNECT {target} HTTP/1.1\r\nHost: x\r\n".encode() + proxy.auth() + b"\r\n")
        _closes(await raw.answer(b"CONNECT"), 400)

    await _survives(proxy, case, caplog)


# ------------------------------------------------------------------------------ what an upstream sends


UPSTREAM_CASES: dict[str, tuple[int, ...]] = {
    "garbage": (502,),
    "reset": (200, 502),  # 200: the head came; then the connection ends short
    "short": (200, 502),
    "huge-head": (502,),
    "never": (504,),
    "flood": (502, 504),
    "flood-then-ok": (200, 502),
    "bad-chunks": (200, 502),
}


UPSTREAM_IDS = [f"{fault}{suffix}" for fault in UPSTREAM_CASES for suffix in ("", ", with a body")]


@pytest.mark.parametrize("case", [_known(name) for name in UPSTREAM_IDS])
async def test_a_hostile_upstream_ends_only_its_own_request(
    proxy: ProxyUnderTest, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    """A clear 502/504 (or, once the head was passed on, a connection ended short: the client sees
    the body is incomplete); never a wrong answer to a later request on the pool. With a body, the
    request's body streams up while the answer is awaited: the same answers."""
    fault, _, with_body = case.partition(", ")
    body = b"hello" if with_body else b""

    async def exchange(proxy: ProxyUnderTest, raw: Raw) -> None:
        await raw.send(proxy.get(proxy.url(0, f"/fault/{fault}"), f"Content-Length: {len(body)}", method="PATCH")
                       + body)
        with trio.fail_after(UPSTREAM * 4):
            answer = await raw.answer(b"PATCH")
        assert answer is not None and answer.status in UPSTREAM_CASES[fault], answer
        if answer.status == 200 and fault != "flood-then-ok":
            assert not answer.complete, answer  # the client must see it was cut short
        if fault == "flood-then-ok" and answer.status == 200:
            assert answer.body == b"ok", answer
        if answer.complete and answer.headers.get("connection", "").lower() != "close":
            await proxy.good(raw)  # the same client connection goes on

    await _survives(proxy, exchange, caplog, case)


async def test_an_upstream_that_resets_a_tunnel_ends_only_that_tunnel(
    proxy: ProxyUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    async def case(proxy: ProxyUnderTest, raw: Raw) -> None:
        authority = proxy.hosts[0].authority
        await raw.send(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n".encode() + proxy.auth() + b"\r\n")
        answer = await raw.answer(b"CONNECT")
        assert answer is not None and answer.status == 200, answer
        await raw.send(f"GET /fault/reset HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        with trio.fail_after(UPSTREAM * 4):
            await raw.until_closed()

    await _survives(proxy, case, caplog)


# ------------------------------------------------------------------------------ fuzz (hypothesis)


FUZZ = settings(max_examples=200, derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
"""Fuzz settings: a fixed sequence of examples (CI sees the same inputs each run), no example database,
no shrinking (a failure reports the example as found, in a second, not a minute later; add
``Phase.shrink`` to ``phases`` locally for the smallest one)."""

TOKENS = [b"\r\n", b"\n", b"\r", b" ", b"\t", b":", b"\x00", b"\xff", b"%00", b"@", b"[", b"]", b"..", b"xn--",
          "ü".encode(), b"chunked", b"Transfer-Encoding: chunked\r\n", b"Content-Length: 5\r\n",
          b"Content-Length: 99999999999999999999\r\n", b"0\r\n\r\n", b"HTTP/1.1", b"HTTP/1.0", b"CONNECT ",
          b"Expect: 100-continue\r\n", b"Connection: close\r\n", b"Connection: keep-alive, te\r\n",
          b"Upgrade: websocket\r\n", b"\r\n\r\n", b"X-Long: " + b"l" * 9000 + b"\r\n"]
"""Byte strings the mutations insert: framing, separators, hostile header lines."""

HEADER_LINES = [b"Transfer-Encoding: chunked\r\n", b"Content-Length: 5\r\n", b"Content-Length: 0\r\n",
                b"Content-Length: 5, 6\r\n", b"Transfer-Encoding: gzip, chunked\r\n", b"X-Folded: a\r\n b\r\n",
                b"Expect: 100-continue\r\n", b"Connection: close\r\n", b"Connection: x-hop\r\nX-Hop: 1\r\n",
                b"Proxy-Connection: keep-alive\r\n", b"Upgrade: websocket\r\nConnection: upgrade\r\n",
                b"Host: 127.0.0.2\r\n", b"Host:\r\n", b": empty-name\r\n", b"X-Bare-LF: 1\n",
                b"Proxy-Authorization: Basic Og==\r\n", b"Te: trailers\r\n", b"X-Long: " + b"l" * 9000 + b"\r\n"]
"""Whole header lines the mutations add after the request line."""

FUZZ_HOSTS = [h for h, _ in HOSTS] + ["127.0.0.3:{port}", "127.0.0.4:{port}"]


def _fuzz_requests(proxy: ProxyUnderTest) -> list[tuple[bytes, bytes, bytes]]:
    """Valid requests split as (before the authority, the authority, after it): mutations never
    touch the authority, so no mutation can name an address off loopback."""
    auth = proxy.auth().decode()
    out = []
    for index, (method, path, extra, body) in enumerate([
        ("GET", "/a", "", ""),
        ("POST", "/b", "Content-Length: 5\r\n", "hello"),
        ("PATCH", "/c", "Transfer-Encoding: chunked\r\n", "5\r\nhello\r\n0\r\n\r\n"),
        ("GET", "/d", "Connection: close\r\n", ""),
        ("HEAD", "/e", "Expect: 100-continue\r\n", ""),
    ]):
        authority = proxy.hosts[index % 2].authority
        out.append((f"{method} http://".encode(), authority.encode(),
                    f"{path} HTTP/1.1\r\nHost: {authority}\r\n{extra}{auth}\r\n{body}".encode()))
    authority = proxy.hosts[0].authority
    out.append((b"CONNECT ", authority.encode(), f" HTTP/1.1\r\nHost: {authority}\r\n{auth}\r\nGET / HTTP/1.1\r\n"
                f"Host: {authority}\r\n\r\n".encode()))
    return out


@st.composite
def _mutated(draw: st.DrawFn, bases: list[tuple[bytes, bytes, bytes]], ports: tuple[int, int]) -> bytes:
    """A valid request (or two, pipelined) after up to five mutations outside its authority, or with
    its authority swapped for one of the hostile hosts (all loopback, unresolvable or malformed)."""
    before, authority, after = draw(st.sampled_from(bases))
    if draw(st.booleans()):
        host = draw(st.sampled_from(FUZZ_HOSTS)).replace("{agent}", str(ports[0])).replace("{denied}", str(ports[0]))
        authority = host.replace("{port}", str(ports[1])).encode()
    for _ in range(draw(st.integers(0, 3))):
        part = draw(st.sampled_from(["before", "after", "after"]))
        data = bytearray(before if part == "before" else after)
        kind = draw(st.sampled_from(["header", "header", "insert", "delete", "replace", "duplicate", "lf",
                                     "truncate"]))
        at = draw(st.integers(0, len(data)))
        if kind == "header" and part == "after":  # a line of its own among the headers
            line = draw(st.sampled_from(HEADER_LINES))
            at = data.find(b"\r\n") + 2
            data[at:at] = line
        elif kind == "insert":
            data[at:at] = draw(st.one_of(st.sampled_from(TOKENS), st.binary(min_size=1, max_size=8)))
        elif kind == "delete":
            del data[at:at + draw(st.integers(1, 16))]
        elif kind == "replace" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == "duplicate":
            span = bytes(data[at:at + draw(st.integers(1, 64))])
            data[at:at] = span
        elif kind == "lf":
            data = bytearray(bytes(data).replace(b"\r\n", b"\n", draw(st.integers(1, 3))))
        elif kind == "truncate":
            del data[at:]
        if part == "before":
            before = bytes(data)
        else:
            after = bytes(data)
    request = before + authority + after
    return request + draw(st.sampled_from([b"", request, b"GET http://127.0.0.4:1/x HTTP/1.1\r\n\r\n"]))


async def _one(proxy: ProxyUnderTest, data: bytes) -> None:
    """Send ``data`` on a new connection, half-close, read until the proxy closes; then a good
    request on a new connection is answered right and nothing escaped."""
    with trio.fail_after(FUZZ_LIMITS.idle_timeout * 2 + 3):
        async with Raw.open(proxy.port) as raw:
            await raw.send(data)
            await raw.half_close()
            await raw.until_closed()
        await proxy.good()
    proxy.assert_nothing_escaped()


async def test_fuzz_the_request_boundary(fuzz_proxy: ProxyUnderTest, caplog: pytest.LogCaptureFixture) -> None:
    """Arbitrary bytes, and valid requests mutated (framing, separators, hostile headers and hosts):
    the proxy never raises out of a connection handler and keeps serving, example after example."""
    caplog.set_level(logging.INFO)
    proxy = fuzz_proxy
    bases = _fuzz_requests(proxy)
    ports = (proxy.agent.port, proxy.hosts[0].port)
    examples = st.one_of(st.binary(max_size=1024),
                         st.tuples(st.sampled_from([b for b, _, _ in bases]), st.binary(max_size=256)).map(b"".join),
                         _mutated(bases, ports))

    @FUZZ
    @given(examples)
    def fuzz(data: bytes) -> None:
        trio.from_thread.run(_one, proxy, data)

    with trio.fail_after(120):
        await trio.to_thread.run_sync(fuzz, abandon_on_cancel=True)
    async with Raw.open(proxy.port) as raw:
        await proxy.good(raw)
        await proxy.good(raw, 1)
    assert not _crashes(caplog), _crashes(caplog)


# ------------------------------------------------------------------------------ the status port


KEEP_ALIVE = 0.4
"""hypercorn's keep-alive (idle) timeout on the status port in the cases about time (seconds; 5 by default)."""


def _keep_alive(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """hypercorn's keep-alive (idle) timeout for the status ports this test serves."""
    from hypercorn.config import Config

    monkeypatch.setattr(Config, "keep_alive_timeout", seconds)


async def _healthz(port: int) -> None:
    async with Raw.open(port) as raw:
        await raw.send(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
        answer = await raw.answer()
    assert answer is not None and (answer.status, answer.body) == (200, b"ok\n"), answer


async def _status_idle(raw: Raw) -> None:
    await _ends_within(raw, KEEP_ALIVE * 4, 408)


async def _status_half_close(raw: Raw) -> None:
    await raw.send(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
    await raw.half_close()
    answer = await raw.answer()
    assert answer is not None and answer.status == 200, answer


async def _status_slow_loris(raw: Raw) -> None:
    with trio.fail_after(KEEP_ALIVE * 6):
        await raw.trickle(b"GET /healthz HTTP/1.1\r\nHost: agent\r\nX-Slow: " + b"s" * 1000, KEEP_ALIVE / 8)
        _closes(await raw.answer(), 408)


async def _status_pipelined(raw: Raw) -> None:
    await raw.send(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\nGET /nope HTTP/1.1\r\nHost: a\r\n\r\n"
                   b"POST /healthz HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabcGET /healthz HTTP/1.1\r\n"
                   b"Host: a\r\n\r\n")
    statuses = [(await raw.answer()) for _ in range(4)]
    assert [a.status if a else None for a in statuses] == [200, 404, 405, 200], statuses


def _status_garbage(data: bytes, *statuses: int) -> Callable[[Raw], Awaitable[None]]:
    async def case(raw: Raw) -> None:
        await raw.send(data)
        with trio.fail_after(5):
            _closes(await raw.answer(), *statuses)

    return case


STATUS_CASES: dict[str, Callable[[Raw], Awaitable[None]]] = {
    "idle": _status_idle,
    "half-close after a request": _status_half_close,
    "slow-loris": _status_slow_loris,
    "pipelined": _status_pipelined,
    "garbage: TLS ClientHello": _status_garbage(TLS_HELLO, 400),
    "garbage: text": _status_garbage(b"hello status port\r\n\r\n", 400),
    "garbage: HTTP/2 preface then junk": _status_garbage(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 64, 400),
    "huge head": _status_garbage(b"GET /healthz HTTP/1.1\r\nHost: a\r\nX-Big: " + b"b" * 100_000 + b"\r\n\r\n",
                                 400, 431),
    # 200 too: a head that arrives in one read is parsed whole (hypercorn reads at most 64 KiB at once)
    "too many headers": _status_garbage(b"GET /healthz HTTP/1.1\r\nHost: a\r\n" + b"X-H: v\r\n" * 5000 + b"\r\n",
                                        200, 400, 431),
    "smuggling: Content-Length and Transfer-Encoding": _status_garbage(
        b"POST /healthz HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        b"GET /status HTTP/1.1\r\nHost: a\r\n\r\n", 400, 405),
    "bad chunks": _status_garbage(b"POST /healthz HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                                  400, 405),
}


@pytest.mark.parametrize("name", list(STATUS_CASES))
async def test_a_hostile_client_of_the_status_port_ends_only_its_own_connection(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The agent's other listener follows the same rule: after each case /healthz still answers,
    on a connection that was open meanwhile and on a new one, and nothing escaped the server."""
    _keep_alive(monkeypatch, KEEP_ALIVE if name in ("idle", "slow-loris") else 5.0)
    with trio.fail_after(BOUND):
        async with status_port_under_test() as (port, escaped):
            await _healthz(port)
            async with Raw.open(port) as bystander:

                async def request(n: int) -> None:
                    await bystander.send(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
                    answer = await bystander.answer()
                    assert answer is not None and answer.status == 200, answer

                async with kept_busy(request, KEEP_ALIVE / 4), Raw.open(port) as raw:
                    await STATUS_CASES[name](raw)
            await _healthz(port)
            assert not escaped, escaped


async def test_fuzz_the_status_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arbitrary bytes, and requests with random bytes after them, to the status port."""
    _keep_alive(monkeypatch, 2.0)
    requests = [b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n", b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n",
                b"POST /status HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nab"]
    async with status_port_under_test() as (port, escaped):

        async def one(data: bytes) -> None:
            with trio.fail_after(2.0 * 2 + 3):
                async with Raw.open(port) as raw:
                    await raw.send(data)
                    await raw.half_close()
                    await raw.until_closed()
                await _healthz(port)
            assert not escaped, escaped

        @settings(FUZZ, max_examples=100)
        @given(st.one_of(st.binary(max_size=512),
                         st.tuples(st.sampled_from(requests), st.binary(max_size=128)).map(b"".join)))
        def fuzz(data: bytes) -> None:
            trio.from_thread.run(one, data)

        with trio.fail_after(60):
            await trio.to_thread.run_sync(fuzz, abandon_on_cancel=True)


# ------------------------------------------------------------------------------ the agent as a whole


HOSTILE_SPIDER = r'''
import base64, os, socket, sys, time, urllib.parse

proxy = urllib.parse.urlsplit(os.environ["HTTP_PROXY"])
token = base64.b64encode(f"{proxy.username}:{proxy.password}".encode()).decode()
auth = f"Proxy-Authorization: Basic {token}\r\n"
GOOD, DENIED = os.environ["GOOD"], os.environ["DENIED"]


def ask(data, timeout=20):
    """Send ``data``, half-close, read the status line (or 'closed')."""
    with socket.create_connection((proxy.hostname, proxy.port), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        try:
            while b"\r\n" not in reply and (chunk := s.recv(4096)):
                reply += chunk
        except ConnectionResetError:
            pass
        return reply.split(b"\r\n")[0].decode("latin-1") or "closed"


def get(url, *extra):
    host = urllib.parse.urlsplit(url).netloc
    return f"GET {url} HTTP/1.1\r\nHost: {host}\r\n{''.join(extra)}{auth}\r\n".encode()


idle = socket.create_connection((proxy.hostname, proxy.port), timeout=120)  # sends nothing, ever
opened = time.monotonic()
cases = {
    "garbage": b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03garbage\r\n\r\n",
    "empty-label": get("http://a..b/"),
    "long-label": get("http://" + "a" * 64 + ".invalid/"),
    "connect-empty-label": f"CONNECT a..b:443 HTTP/1.1\r\nHost: a..b:443\r\n{auth}\r\n".encode(),
    "bad-idna": get("http://a\u200db.invalid/"),
    "huge-head": get(GOOD, "X-Big: " + "b" * 100_000 + "\r\n"),
    "denied": get(DENIED),
    "good": get(GOOD),
}
for name, data in cases.items():
    for _ in range(3):
        print(name, ask(data), flush=True)
idle.settimeout(float(os.environ["IDLE_BOUND"]))
try:
    closed = idle.recv(4096)
    print("idle", "closed" if not closed else closed.split(b"\r\n")[0].decode("latin-1"), flush=True)
except ConnectionResetError:
    print("idle closed", flush=True)
except socket.timeout:
    print("idle still open after", round(time.monotonic() - opened), "s", flush=True)
print("waited", round(time.monotonic() - opened), "s", flush=True)
print("good", ask(get(GOOD)), flush=True)
'''


@pytest.mark.slow
async def test_an_agent_serves_on_while_its_spider_sends_the_worst_to_its_proxy(
    recording_master: RecordingMaster, tmp_path: Path, nursery: trio.Nursery
) -> None:
    """A real agent at ``task.egress: proxy``: its spider holds an idle proxy connection and sends
    garbage, malformed and IDNA-invalid hosts (main's proxy once died of ``a..b``: UnicodeError from
    getaddrinfo, and of an idle connection: UnboundLocalError), a huge head, a denied and a good
    request. The agent stays up and answers /healthz, the task ends SUCCESS, each case gets its
    answer, and the agent's log says what was refused once per task, not once per request."""
    admin = recording_master.admin
    good, denied = await serve_upstream(nursery, "127.0.0.3"), await serve_upstream(nursery, DENIED_HOST)
    status_port = free_port()
    agent = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token,
                          agent__port=status_port, task__egress="proxy", task__egress_deny="metadata,link-local,agent," + DENIED_HOST)
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "hostile-proxy", {"main.py": HOSTILE_SPIDER},
                               env={"GOOD": f"http://{good.authority}/good", "DENIED": f"http://{denied.authority}/",
                                    "IDLE_BOUND": "90"})
        task = await task_final_while_alive(admin, agent, task_id, 150)
        assert agent.process is not None and agent.process.returncode is None, agent.log_text()[-3000:]
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(f"http://127.0.0.1:{status_port}/healthz")).text == "ok\n"
        # The status port's hostile cases, against the agent's own.
        for name in ("garbage: TLS ClientHello", "half-close after a request", "huge head", "pipelined"):
            async with Raw.open(status_port) as raw:
                with trio.fail_after(10):
                    await STATUS_CASES[name](raw)
            await _healthz(status_port)
        # Hostile paths to the status page's task routes: answered (never a file outside the task's).
        for path, statuses in [(f"/tasks/{task_id}/artifacts/..%2f..%2f..%2f..%2fetc%2fpasswd", {404}),
                               (f"/tasks/{task_id}/artifacts/%2fetc%2fpasswd", {404}),
                               (f"/tasks/{task_id}/artifacts/../../agent.yaml", {404}),
                               ("/tasks/%00/log.txt", {404}), ("/tasks/..%2f..%2f/log.txt", {404}),
                               (f"/tasks/{task_id}/log.txt", {200}), ("/" + "x" * 8000, {404, 414, 431})]:
            async with Raw.open(status_port) as raw:
                await raw.send(f"GET {path} HTTP/1.1\r\nHost: agent\r\n\r\n".encode())
                with trio.fail_after(10):
                    answer = await raw.answer()
            assert answer is not None and answer.status in statuses, (path, answer)
            assert b"root:" not in answer.body, (path, answer)
        await _healthz(status_port)
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 30) == 0
    lines = await admin.get_logs(task_id)
    assert task["status"] == "SUCCESS", (task, lines[-30:])
    assert "Traceback" not in agent.log_text(), agent.log_text()[-4000:]
    answers = [line for line in lines if line.split(" ")[0] in ("garbage", "empty-label", "long-label", "idle",
                                                                "connect-empty-label", "bad-idna", "huge-head",
                                                                "denied", "good")]
    got: dict[str, set[str]] = {line.split(" ", 1)[0]: set() for line in answers}
    for line in answers:  # "name HTTP/1.1 400 Bad Request" → {"name": {"400"}}; "name closed" → {"closed"}
        name, _, reply = line.partition(" ")
        got[name].add(reply.split(" ")[1] if reply.startswith("HTTP/") else reply)
    assert got["garbage"] <= {"400", "closed"}, answers
    for name in ("empty-label", "long-label", "connect-empty-label", "bad-idna"):
        assert got[name] == {"400"}, answers
    assert got["huge-head"] <= {"431", "200"}, answers  # 200: KNOWN_DEFECTS["huge head, read at once"]
    assert got["denied"] == {"403"}, answers
    assert got["good"] == {"200"}, answers
    assert got["idle"] <= {"closed", "408"}, answers
    assert task["egressRefused"] == [{"address": DENIED_HOST, "port": denied.port, "count": 3}], task
    about = [line for line in agent.log_text().splitlines() if task_id in line and "egress" in line]
    assert 1 <= len(about) < 6, about  # once per task (and reason), not once for each of 24 requests
