"""A fault-injecting HTTP/1.1 proxy between an agent and the reference master (real sockets, 127.0.0.1 port 0).

The agent is pointed at the proxy (``server.url = http://127.0.0.1:<proxy port>``); every request is
classified as the node call it is (:func:`call_of`: a name of the agent's endpoint table,
ckagent.master.endpoints — register, heartbeat, poll, claim, result, release, logs, items, batches,
stats, artifact, spider_files, spider_file, download — or other) and either forwarded to the master or
answered by a fault.
One request per connection: the proxy asks the master to close after answering.

Two ways to choose a fault:

- :meth:`FaultProxy.set` — from now on, every request of the named calls gets ``mode`` (until
  :meth:`FaultProxy.heal`); what the tests of each answer class use;
- a ``chooser(request) -> mode`` given to the constructor (e.g. seeded random faults), used while no
  mode is set.

:class:`MockFaults` applies the same modes inside an ``httpx.MockTransport`` (logic tests on the
autojump clock, a master in memory).

Modes (:data:`MODES`), one per answer class of the master boundary (ckagent/master/client.py)::

    pass         forward
    html         200 text/html, a captive portal's page (not forwarded)
    truncated    forwarded; the master's JSON answer cut in half (Content-Length of the cut body)
    wrong_shape  200 application/json of the wrong shape (not forwarded)
    empty_object 200 ``{}``: a misrouted gateway's answer (not forwarded)
    429, 503     the proxy's own 429 (text/plain, Retry-After) / 503 (text/html); not forwarded
    500, 502     the proxy's own empty 500 / 502
    401          401 {"error": …} (not forwarded): the agent registers again
    403          403 {"error": …}: another 4xx in the protocol's words (that request fails)
    404_html     404 text/html: a misrouted ingress (a 4xx that is not the protocol's)
    reset        the connection is reset (RST) without an answer
    timeout      no answer: the request is held until the client gives up
    drop         the connection is closed without an answer, before forwarding
    drop_answer  forwarded (the master acts on it), then closed without the answer
    delay        forwarded after a random pause of 0.05-0.8 s
    404_json     404 {"error": "task not found"}: the protocol's "unknown task" (a master restarting)
    404_spring   404 in Spring Boot's shape {"timestamp", "status": 404, "error": "Not Found", "path"}
    413          413 {"error": "request entity too large"}
    slow         forwarded after ``slow_seconds`` (a master that takes its time to answer)
    hang_body    forwarded; the answer's head and the first half of its body are sent, then nothing
                 until the client gives up (at most HOLD_LIMIT)
    429_retry    429 {"error": …} with ``Retry-After: <retry_after>``

``batches`` in the calls of :meth:`FaultProxy.set` names node batches alone; ``logs`` names them too
(they carry the log batches), and ``spider_files`` names a spider file's download as well as the
listing (:data:`COUNTS_AS`; :meth:`FaultProxy.faulted` counts them the same way).
"""

from __future__ import annotations

import json
import random
import socket
import struct
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
import trio

from ckagent.master.endpoints import CLAIM, ENDPOINTS

MODES = ("pass", "html", "truncated", "wrong_shape", "empty_object", "429", "503", "500", "502", "401", "403", "404_html",
         "reset", "timeout", "drop", "drop_answer", "delay", "404_json", "404_spring", "413", "slow", "hang_body",
         "429_retry")
CALLS = frozenset(ENDPOINTS) | {"other"}
"""Every call :func:`call_of` can name: the agent's endpoints, and ``other``."""
COUNTS_AS = {"batches": "logs", "spider_file": "spider_files"}
"""A call that the calls of :meth:`FaultProxy.set` (and :meth:`FaultProxy.faulted`) also name by another."""

PORTAL_PAGE = (b"<!DOCTYPE html><html><head><title>Sign in to the network</title></head>"
               b"<body><form>Accept the terms to continue</form></body></html>")
HOLD_LIMIT = 120.0
"""Seconds a ``timeout`` request is held at most (the client normally gives up long before)."""


@dataclass(frozen=True)
class Request:
    """One request as the proxy saw it: ``call`` (see :func:`call_of`), ``payload`` the decoded JSON body."""

    method: str
    path: str
    call: str
    payload: Any


def call_of(method: str, path: str, payload: Any) -> str:
    """The node call a request (``path`` raw, without its query) is: the name of the endpoint whose route
    it is, or ``other``. A claim and a final result share their route: a claim's status is RUNNING."""
    names = [e.name for e in ENDPOINTS.values() if e.matches(method, path)]
    if CLAIM.name in names:
        return CLAIM.name if isinstance(payload, dict) and payload.get("status") == "RUNNING" else "result"
    return names[0] if names else "other"


class FaultProxy:
    """See module docstring. ``faults`` counts the modes applied; ``attempts`` records, per
    (path, seq of the body), when each request arrived; ``seen`` lists (time, call, mode)."""

    def __init__(self, upstream_port: int, *, chooser: Callable[[Request], str] | None = None) -> None:
        self.upstream_port = upstream_port
        self.chooser = chooser
        self.mode = "pass"
        self.calls: frozenset[str] = frozenset()
        self.faults: Counter[str] = Counter()
        self.attempts: dict[tuple[str, Any], list[float]] = defaultdict(list)
        self.seen: list[tuple[float, str, str]] = []
        self.slow_seconds = 10.0
        self.retry_after = 1

    def set(self, mode: str, calls: Iterable[str] = CALLS) -> None:
        """Answer every request of ``calls`` with ``mode`` from now on."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
        unknown = set(calls) - CALLS
        if unknown:
            raise ValueError(f"unknown calls {sorted(unknown)}; known: {sorted(CALLS)}")
        self.mode, self.calls = mode, frozenset(calls)

    def heal(self) -> None:
        """Forward everything again (the chooser, if any, decides again)."""
        self.mode, self.calls = "pass", frozenset()

    def faulted(self, call: str, since: float = float("-inf")) -> int:
        """How many requests of ``call`` got a fault (not ``pass``) since trio time ``since``."""
        return sum(1 for t, c, m in self.seen if call in (c, COUNTS_AS.get(c)) and m != "pass" and t >= since)

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on 127.0.0.1 (a free port, handed to ``task_status.started``) until cancelled."""
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    def _choose(self, request: Request) -> str:
        if request.call in self.calls or COUNTS_AS.get(request.call) in self.calls:
            return self.mode
        if self.chooser is not None:
            return self.chooser(request)
        return "pass"

    async def _handle(self, client: trio.SocketStream) -> None:
        async with client:
            try:
                head, body = await read_request(client)
            except (trio.BrokenResourceError, ValueError):
                return
            if not head:
                return
            method, target = head.split(b"\r\n", 1)[0].decode().split()[:2]
            path = target.split("?")[0]
            try:
                payload = json.loads(body) if body else None
            except ValueError:
                payload = None
            request = Request(method, path, call_of(method, path, payload), payload)
            now = trio.current_time()
            self.attempts[(path, payload.get("seq") if isinstance(payload, dict) else None)].append(now)
            mode = self._choose(request)
            self.seen.append((now, request.call, mode))
            self.faults[mode] += 1
            try:
                await self._answer(client, mode, head, body, path)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return  # the client gave up first

    async def _answer(self, client: trio.SocketStream, mode: str, head: bytes, body: bytes, path: str = "") -> None:
        if mode in ("drop",):
            return
        if mode == "reset":
            client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return
        if mode == "timeout":
            with trio.move_on_after(HOLD_LIMIT):
                while await client.receive_some(65536):  # until the client closes its side
                    pass
            return
        own = own_answer(mode, path, self.retry_after)
        if own is not None:
            status, reason, headers, content = own
            extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
            await client.send_all(f"HTTP/1.1 {status} {reason}\r\n{extra}Content-Length: {len(content)}\r\n"
                                  f"Connection: close\r\n\r\n".encode() + content)
            return
        if mode == "delay":
            await trio.sleep(random.uniform(0.05, 0.8))
        if mode == "slow":
            await trio.sleep(self.slow_seconds)
        answer = await self._forward(head, body)
        if mode == "drop_answer":
            return
        if mode == "hang_body":
            top, _, rest = answer.partition(b"\r\n\r\n")
            await client.send_all(top + b"\r\n\r\n" + rest[: max(1, len(rest) // 2)])
            with trio.move_on_after(HOLD_LIMIT):
                while await client.receive_some(65536):  # until the client closes its side
                    pass
            return
        if mode == "truncated":
            answer = _truncate(answer)
        await client.send_all(answer)

    async def _forward(self, head: bytes, body: bytes) -> bytes:
        lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"connection:")]
        upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream_port)
        async with upstream:
            await upstream.send_all(b"\r\n".join([*lines, b"Connection: close", b"", b""]) + body)
            answer = b""
            while chunk := await upstream.receive_some(65536):
                answer += chunk
        return answer


def own_answer(mode: str, path: str, retry_after: int = 1) -> tuple[int, str, dict[str, str], bytes] | None:
    """The answer the proxy gives itself in ``mode`` (status, reason, headers, body), or None for a mode
    that forwards, cuts or withholds the answer. Shared by the proxy and :class:`MockFaults`."""
    own = {
        "html": (200, "OK", "text/html; charset=utf-8", PORTAL_PAGE),
        "wrong_shape": (200, "OK", "application/json", b'{"hello": "from the proxy", "items": [1, 2]}'),
        "empty_object": (200, "OK", "application/json", b"{}"),
        "429": (429, "Too Many Requests", "text/plain", b"slow down\n"),
        "503": (503, "Service Unavailable", "text/html", b"<html><body>503 Service Unavailable</body></html>"),
        "500": (500, "Oops", "", b""),
        "502": (502, "Oops", "", b""),
        "401": (401, "Unauthorized", "application/json", b'{"error": "the proxy wants credentials"}'),
        "403": (403, "Forbidden", "application/json", b'{"error": "blocked by the proxy"}'),
        "404_html": (404, "Not Found", "text/html", b"<html><body><h1>404 Not Found</h1>nginx</body></html>"),
        "404_json": (404, "Not Found", "application/json", b'{"error": "task not found"}'),
        "404_spring": (404, "Not Found", "application/json", json.dumps(
            {"timestamp": "2026-12-01T21:00:00.000+00:00", "status": 404, "error": "Not Found",
             "path": path}).encode()),
        "413": (413, "Payload Too Large", "application/json", b'{"error": "request entity too large"}'),
        "429_retry": (429, "Too Many Requests", "application/json", b'{"error": "slow down"}'),
    }.get(mode)
    if own is None:
        return None
    status, reason, ctype, content = own
    headers = {"Content-Type": ctype} if ctype else {}
    if mode == "429":
        headers["Retry-After"] = "1"
    if mode == "429_retry":
        headers["Retry-After"] = str(retry_after)
    return status, reason, headers, content


def _truncate(answer: bytes) -> bytes:
    """The answer with its body cut in half and a Content-Length that says so (a cut, not a transport error)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = [line for line in head.split(b"\r\n")
             if not line.lower().startswith((b"content-length:", b"transfer-encoding:"))]
    cut = body[: len(body) // 2]
    return b"\r\n".join([*lines, f"Content-Length: {len(cut)}".encode(), b"", b""]) + cut


async def read_request(stream: trio.SocketStream) -> tuple[bytes, bytes]:
    """(head, body) of one HTTP/1.1 request with a Content-Length body; (b"", b"") if the peer closed.

    Raises ValueError for a body shorter than announced."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return b"", b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ValueError("short body")
        body += chunk
    return head, body


class MockFaults:
    """The proxy's modes for ``httpx.MockTransport``: logic tests of the master boundary (autojump clock,
    a master in memory) meet the same faults as the end-to-end ones, classified by :func:`call_of` and
    answered with the proxy's own bytes (:func:`own_answer`). Where the proxy acts on the socket:

    reset        httpx.ReadError (the connection reset while the answer was awaited)
    drop         httpx.RemoteProtocolError (closed without an answer; not forwarded)
    drop_answer  forwarded, then httpx.RemoteProtocolError
    timeout      the request's read timeout passes (trio.sleep), then httpx.ReadTimeout; not forwarded
    hang_body    forwarded; the read timeout passes, then httpx.ReadTimeout
    truncated    forwarded; the answer's body cut in half
    delay, slow  a pause (0.05-0.8 s; ``slow_seconds``), then forwarded

    ``master(request) -> httpx.Response`` is the master behind it. ``set``/``heal``/``faulted``/``seen``
    work as on :class:`FaultProxy`.
    """

    def __init__(self, master: Callable[[httpx.Request], httpx.Response]) -> None:
        self.master = master
        self.mode = "pass"
        self.calls: frozenset[str] = frozenset()
        self.seen: list[tuple[float, str, str]] = []
        self.slow_seconds = 10.0
        self.retry_after = 1

    def set(self, mode: str, calls: Iterable[str] = CALLS) -> None:
        """Answer every request of ``calls`` with ``mode`` from now on (as :meth:`FaultProxy.set`)."""
        FaultProxy.set(self, mode, calls)  # type: ignore[arg-type]  # the same attributes

    def heal(self) -> None:
        """Forward everything again."""
        self.mode, self.calls = "pass", frozenset()

    def faulted(self, call: str, since: float = float("-inf")) -> int:
        """How many requests of ``call`` got a fault (not ``pass``) since trio time ``since``."""
        return FaultProxy.faulted(self, call, since)  # type: ignore[arg-type]  # the same attributes

    def transport(self) -> httpx.MockTransport:
        """A transport for ``MasterClient(..., transport=...)``."""
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        """Answer ``request`` as the proxy would in the mode that applies to its call."""
        try:
            payload = json.loads(request.content) if request.content else None
        except ValueError:
            payload = None
        call = call_of(request.method, request.url.path, payload)
        applies = call in self.calls or ("batches" in self.calls and request.url.path.endswith("/batches"))
        mode = self.mode if applies else "pass"
        self.seen.append((trio.current_time(), call, mode))
        own = own_answer(mode, request.url.path, self.retry_after)
        if own is not None:
            status, _reason, headers, content = own
            return httpx.Response(status, headers=headers, content=content)
        read_timeout = (request.extensions.get("timeout") or {}).get("read") or HOLD_LIMIT
        if mode == "reset":
            raise httpx.ReadError("[Errno 104] Connection reset by peer", request=request)
        if mode == "drop":
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if mode == "timeout":
            await trio.sleep(min(read_timeout, HOLD_LIMIT))
            raise httpx.ReadTimeout("timed out", request=request)
        if mode == "delay":
            await trio.sleep(random.uniform(0.05, 0.8))
        if mode == "slow":
            await trio.sleep(self.slow_seconds)
        answer = self.master(request)
        if mode == "drop_answer":
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if mode == "hang_body":
            await trio.sleep(min(read_timeout, HOLD_LIMIT))
            raise httpx.ReadTimeout("timed out", request=request)
        if mode == "truncated":
            content = answer.content[: len(answer.content) // 2]
            headers = {k: v for k, v in answer.headers.items() if k.lower() not in ("content-length", "transfer-encoding")}
            return httpx.Response(answer.status_code, headers=headers, content=content)
        return answer
