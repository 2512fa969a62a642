"""Hostile and unlucky peers of the agent's listeners, at the socket level (tests/test_egress_hostile.py).

- :class:`Upstream` is a loopback HTTP/1.1 server (h11) that answers with its own identity — or, by
  path, misbehaves as an upstream can (:data:`UPSTREAM_FAULTS`). It records every request it parsed
  and every byte it received, so a test can prove what did *not* arrive (a smuggled request, a folded
  header line, a connection to a denied host).
- :class:`Raw` is one client connection that sends bytes as given and reads answers with h11
  (:class:`Answer`, or None for a connection closed without one).
- :func:`status_port_under_test` serves the agent's status port (hypercorn) in-process with routes
  that need no agent, keeping what escapes it the same way.
- :func:`kept_busy` keeps a bystander connection making requests while a case runs on another.
- :func:`proxy_under_test` runs the agent's egress proxy in-process (the ``proxy`` level of
  :func:`ckagent.containment.egress.open_egress`) for one task, with upstreams on 127.0.0.3 and
  127.0.0.4, a denied host on 127.0.0.2 and a stand-in for the agent's port on 127.0.0.1; anything
  that escapes the proxy's own nursery is caught and kept (:attr:`ProxyUnderTest.escaped`).

Loopback only: every address here is 127.0.0.x (this host routes all of 127/8 to ``lo``).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

from harness.loopback import loopback_listeners

__all__ = [
    "AGENT_HOST",
    "DENIED_HOST",
    "UPSTREAM_FAULTS",
    "UPSTREAM_HOSTS",
    "Answer",
    "ProxyUnderTest",
    "Raw",
    "Upstream",
    "kept_busy",
    "proxy_under_test",
    "serve_upstream",
    "status_port_under_test",
    "task_final_while_alive",
]

UPSTREAM_HOSTS = ("127.0.0.3", "127.0.0.4")
"""Where the allowed upstreams listen."""
DENIED_HOST = "127.0.0.2"
"""An upstream the test's policy denies: it must never see a connection."""
AGENT_HOST = "127.0.0.1"
"""Where the stand-in for the agent's own port listens (the ``agent`` group denies it)."""

UPSTREAM_FAULTS = ("garbage", "reset", "short", "huge-head", "never", "flood", "flood-then-ok", "bad-chunks")
"""Paths (``/fault/<name>``) on which :class:`Upstream` misbehaves instead of answering:

garbage        a line that is not a status line, then close
reset          a 200 head announcing 100 000 bytes, 1 000 of them, then a TCP reset
short          a 200 head announcing 1 000 bytes, 10 of them, then a clean close (FIN)
huge-head      a 200 status line followed by 1 MiB of headers
never          reads the request and never answers (until the connection or the test ends)
flood          1xx answers without end (a burst of 1 000, then one each 10 ms)
flood-then-ok  1 000 1xx answers, then a proper 200 ``ok`` (kept alive), then close
bad-chunks     a chunked 200 whose chunk size is not hex, then close
"""


@dataclass
class Upstream:
    """A loopback HTTP/1.1 server. ``requests``: (method, target, headers as {lower name: value},
    body) of every request it parsed; ``raw``: every byte it received; ``connections``: how many it
    accepted. Its answer to a normal request is JSON: ``{"host", "port", "method", "target",
    "headers", "body_bytes"}`` (``host``/``port`` its own: who answered)."""

    host: str
    port: int = 0
    requests: list[tuple[str, str, dict[str, str], bytes]] = field(default_factory=list)
    raw: bytearray = field(default_factory=bytearray)
    connections: int = 0
    release: trio.Event = field(default_factory=trio.Event)
    """Requests for ``/hold`` are answered once this is set."""

    @property
    def authority(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    def targets(self) -> list[str]:
        """The request targets it parsed, in order."""
        return [target for _, target, _, _ in self.requests]

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve one connection (keep-alive, pipelining) until the client closes it or a fault ends it."""
        self.connections += 1
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=1 << 20)
        async with stream:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError,
                                     h11.ProtocolError):
                while True:
                    request, body = await self._read_request(stream, conn)
                    if request is None:
                        return
                    target = request.target.decode("latin-1")
                    headers = {n.decode("latin-1"): v.decode("latin-1") for n, v in request.headers}
                    self.requests.append((request.method.decode("latin-1"), target, headers, body))
                    if target == "/hold":
                        await self.release.wait()
                    if target.startswith("/fault/"):
                        await self._fault(stream, target.split("/")[2].split("?")[0])
                        return
                    answer = json.dumps({"host": self.host, "port": self.port,
                                         "method": request.method.decode("latin-1"), "target": target,
                                         "headers": headers, "body_bytes": len(body)}).encode()
                    data = conn.send(h11.Response(status_code=200, headers=[
                        ("Content-Type", "application/json"), ("Content-Length", str(len(answer)))]))
                    await stream.send_all((data or b"") + (conn.send(h11.Data(data=answer)) or b"")
                                          + (conn.send(h11.EndOfMessage()) or b""))
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()

    async def _read_request(self, stream: trio.SocketStream,
                            conn: h11.Connection) -> tuple[h11.Request | None, bytes]:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            await trio.lowlevel.checkpoint()
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                self.raw += data
                conn.receive_data(bytes(data))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            else:  # ConnectionClosed, PAUSED
                return None, b""

    async def _fault(self, stream: trio.SocketStream, name: str) -> None:
        if name == "garbage":
            await stream.send_all(b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff\xfe garbage\r\n\r\n")
        elif name in ("reset", "short"):
            announced, sent = (100_000, 1_000) if name == "reset" else (1_000, 10)
            await stream.send_all(f"HTTP/1.1 200 OK\r\nContent-Length: {announced}\r\n\r\n".encode()
                                  + b"x" * sent)
            if name == "reset":  # SO_LINGER 0: close() sends RST, not FIN
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif name == "huge-head":
            line = b"X-Filler: " + b"f" * 1000 + b"\r\n"
            await stream.send_all(b"HTTP/1.1 200 OK\r\n")
            for _ in range(1024):
                await stream.send_all(line)
            await stream.send_all(b"Content-Length: 2\r\n\r\nok")
        elif name == "never":
            await trio.sleep_forever()
        elif name in ("flood", "flood-then-ok"):
            await stream.send_all(b"HTTP/1.1 102 Processing\r\n\r\n" * 1000)
            if name == "flood-then-ok":  # a kept-alive answer, and then a close: a pool must not reuse it
                await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                return
            while True:
                await stream.send_all(b"HTTP/1.1 102 Processing\r\n\r\n")
                await trio.sleep(0.01)
        elif name == "bad-chunks":
            await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\nzz\r\n")


async def serve_upstream(nursery: trio.Nursery, host: str) -> Upstream:
    """An :class:`Upstream` listening on ``host`` (a 127.0.0.x address) port 0, served in ``nursery``;
    off 127.0.0.1 its port number is held there too (:mod:`harness.loopback`: the ``agent`` group
    refuses agents' ports on every local address)."""
    upstream = Upstream(host)
    await nursery.start(_serve_upstream, upstream)
    return upstream


async def _serve_upstream(upstream: Upstream, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with loopback_listeners(upstream.host) as listeners:
        upstream.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(upstream.handle, listeners)


@dataclass
class Answer:
    """One HTTP answer as a client read it: ``status``, ``headers`` ({lower name: value}), ``body``;
    ``complete`` False when the connection ended before the body did; ``informational`` the 1xx
    answers read before it."""

    status: int
    headers: dict[str, str]
    body: bytes
    complete: bool = True
    informational: int = 0

    def json(self) -> Any:
        """The body as JSON (an :class:`Upstream`'s answer)."""
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"Answer({self.status}, {self.body[:200]!r}{'' if self.complete else ', incomplete'})"


class Raw:
    """One client connection to ``127.0.0.x:port``: :meth:`send` sends bytes exactly as given,
    :meth:`answer` reads the next answer with h11. Use as ``async with Raw.open(port) as raw``."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)
        self.closed = False
        """True once the peer closed (or reset) the connection."""

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, port: int, host: str = AGENT_HOST) -> AsyncIterator[Raw]:
        """Connect (a :func:`trio.fail_after` at the call site bounds it)."""
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            yield cls(stream)

    async def send(self, data: bytes) -> bool:
        """Send ``data``; False when the peer had closed the connection already."""
        try:
            await self.stream.send_all(data)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.closed = True
            return False

    async def trickle(self, data: bytes, interval: float) -> bool:
        """Send ``data`` a byte at a time, ``interval`` seconds apart (a slow-loris); False when the
        peer closed or answered meanwhile (what it answered is left for :meth:`answer`)."""
        for i in range(len(data)):
            if not await self.send(data[i:i + 1]):
                return False
            with trio.move_on_after(interval):
                await trio.lowlevel.wait_readable(self.stream.socket)
                return False
        return True

    async def half_close(self) -> None:
        """Send FIN: nothing more comes from this side; answers may still arrive."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self.stream.send_eof()

    async def answer(self, method: bytes = b"GET") -> Answer | None:
        """The next answer (the one to a request made with ``method``: HEAD and CONNECT change the
        framing), or None when the connection closed (or reset) before its head came. An answer
        whose body the connection cut short is returned with ``complete`` False."""
        conn = self._conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        if conn.our_state is h11.IDLE:  # h11 reads an answer only to a request it saw go out
            conn.send(h11.Request(method=method, target=b"/" if method != b"CONNECT" else b"x:1",
                                  headers=[(b"host", b"x"), (b"content-length", b"0")]))
            conn.send(h11.EndOfMessage())
        head: h11.Response | None = None
        informational = 0
        body = bytearray()
        while True:
            await trio.lowlevel.checkpoint()
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                self.closed = True
                if head is None:
                    return None
                return Answer(head.status_code, _headers(head), bytes(body), False, informational)
            if event is h11.NEED_DATA:
                data = b""
                if not self.closed:
                    try:
                        data = await self.stream.receive_some(65536)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        data = b""
                if not data:
                    self.closed = True
                conn.receive_data(bytes(data))
                continue
            if isinstance(event, h11.InformationalResponse):
                informational += 1
            elif isinstance(event, h11.Response):
                head = event
                if method == b"CONNECT" and 200 <= event.status_code < 300:
                    return Answer(event.status_code, _headers(event), b"", True, informational)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return Answer(head.status_code, _headers(head), bytes(body), True, informational)
            else:  # ConnectionClosed
                self.closed = True
                if head is None:
                    return None
                return Answer(head.status_code, _headers(head), bytes(body), False, informational)

    async def until_closed(self) -> bytes:
        """Read until the peer closes; what came (bytes h11 did not parse are not included)."""
        data = bytearray()
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            while chunk := await self.stream.receive_some(65536):
                data += chunk
        self.closed = True
        return bytes(data)


def _headers(event: h11.Response | h11.InformationalResponse) -> dict[str, str]:
    return {n.decode("latin-1"): v.decode("latin-1") for n, v in event.headers}


@dataclass
class ProxyUnderTest:
    """The proxy of one task (``port``, ``user``, ``secret`` from the task's ``HTTP_PROXY``), its
    egress, the upstreams (``hosts[0]`` on 127.0.0.3, ``hosts[1]`` on 127.0.0.4), the ``denied`` host
    and the ``agent`` stand-in, and ``escaped``: what came out of the proxy's nursery (must stay [])."""

    egress: Any
    rules: Any
    port: int
    user: str
    secret: str
    hosts: tuple[Upstream, Upstream]
    denied: Upstream
    agent: Upstream
    escaped: list[BaseException] = field(default_factory=list)
    errors_seen: collections.Counter[str] = field(default_factory=collections.Counter)
    """The server's ``errors`` at the last check (each check reports what is new since)."""

    def auth(self) -> bytes:
        """The task's ``Proxy-Authorization`` header line (CRLF-terminated)."""
        token = base64.b64encode(f"{self.user}:{self.secret}".encode()).decode()
        return f"Proxy-Authorization: Basic {token}\r\n".encode()

    def get(self, url: str, *extra: str, method: str = "GET", body: bytes = b"", version: str = "1.1") -> bytes:
        """A well-formed absolute-form request for ``url`` with the task's credentials."""
        host = urlsplit(url).netloc
        lines = "".join(f"{line}\r\n" for line in extra)
        length = f"Content-Length: {len(body)}\r\n" if body or method in ("POST", "PUT") else ""
        return (f"{method} {url} HTTP/{version}\r\nHost: {host}\r\n{lines}{length}".encode()
                + self.auth() + b"\r\n" + body)

    def url(self, index: int = 0, path: str = "/") -> str:
        """``http://127.0.0.3:<port><path>`` (index 1: 127.0.0.4)."""
        return f"http://{self.hosts[index].authority}{path}"

    async def good(self, raw: Raw | None = None, index: int = 0, path: str = "/good") -> None:
        """A good request, on ``raw`` or a new connection, is answered by the host it names; raises
        AssertionError otherwise (a :func:`trio.fail_after` at the call site bounds it)."""
        if raw is None:
            async with Raw.open(self.port) as fresh:
                await self.good(fresh, index, path)
            return
        assert await raw.send(self.get(self.url(index, path))), "the proxy closed a good connection"
        answer = await raw.answer()
        assert answer is not None and answer.status == 200 and answer.complete, answer
        seen = answer.json()
        assert (seen["host"], seen["port"], seen["target"]) == (self.hosts[index].host, self.hosts[index].port,
                                                              path), seen

    def assert_nothing_escaped(self) -> None:
        """Nothing a connection did reached the proxy's nursery, and the denied host and the agent
        stand-in never saw a connection."""
        assert not self.escaped, f"escaped the proxy's connection handlers: {self.escaped!r}"
        errors = collections.Counter(self.egress.server.errors)
        new, self.errors_seen = errors - self.errors_seen, errors
        assert not new, f"connections ended on an error of the proxy's own (a bug): {dict(new)}"
        assert self.denied.connections == 0, f"the denied host was reached: {self.denied.requests}"
        assert self.agent.connections == 0, f"the agent's port was reached: {self.agent.requests}"


@contextlib.asynccontextmanager
async def proxy_under_test(deny: str = "metadata,link-local,agent," + DENIED_HOST, allow: str = "",
                           limits: Any = None) -> AsyncIterator[ProxyUnderTest]:
    """The egress proxy (``proxy`` level) for one task attached with no jail, its upstreams, served
    until the block ends. ``deny``/``allow``: the node policy (``task.egress_deny``/``_allow``);
    ``limits``: the proxy's :class:`ckagent.containment.egress.proxy.Limits` (None: its defaults)."""
    from ckagent.containment.egress import open_egress, parse_text

    async with trio.open_nursery() as nursery:
        hosts = (await serve_upstream(nursery, UPSTREAM_HOSTS[0]), await serve_upstream(nursery, UPSTREAM_HOSTS[1]))
        denied = await serve_upstream(nursery, DENIED_HOST)
        agent = await serve_upstream(nursery, AGENT_HOST)
        egress = open_egress("proxy", None, "ckagent_hostile", parse_text(deny, allow), agent_port=agent.port)
        if limits is not None:
            assert egress.server is not None
            egress.server.limits = limits
        escaped: list[BaseException] = []
        await nursery.start(_serve_recording, egress, escaped)
        rules = await trio.to_thread.run_sync(egress.attach, None, "hostile-task", None)
        url = urlsplit(egress.task_env(rules)["HTTP_PROXY"])
        assert url.hostname == AGENT_HOST and url.port and url.username and url.password, url
        proxy = ProxyUnderTest(egress, rules, url.port, url.username, url.password, hosts, denied, agent, escaped)
        try:
            yield proxy
        finally:
            with contextlib.suppress(Exception):
                egress.detach(rules)
            nursery.cancel_scope.cancel()


async def _serve_recording(egress: Any, escaped: list[BaseException], *,  # noqa: ASYNC128
                           task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    """``egress.serve``, keeping what escapes it (a connection's error that would end the agent)."""
    try:
        await egress.serve(task_status=task_status)
    except Exception as exc:  # the proxy's nursery ended with an error: the test reports it
        escaped.append(exc)



@contextlib.asynccontextmanager
async def status_port_under_test() -> AsyncIterator[tuple[int, list[BaseException]]]:
    """The agent's status port (:func:`ckagent.port.status.serve_status`) on 127.0.0.1 with routes
    that need no agent (/healthz answers ``ok``); yields (port, what escaped its nursery)."""
    from ckagent.port.status import Readiness, StatusRoutes, serve_status

    async def metrics(accept: str) -> tuple[bytes, str]:
        return b"# nothing\n", "text/plain"

    async def status() -> dict[str, Any]:
        return {}

    routes = StatusRoutes(metrics=metrics, readiness=lambda: Readiness(True), status=status)
    escaped: list[BaseException] = []

    async def serve(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:  # noqa: ASYNC128
        try:
            await serve_status(routes, AGENT_HOST, 0, task_status=task_status)
        except Exception as exc:  # the status server's nursery ended with an error: the test reports it
            escaped.append(exc)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve)
        try:
            yield port, escaped
        finally:
            nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def kept_busy(request: Callable[[int], Awaitable[None]], interval: float) -> AsyncIterator[None]:
    """``request(n)`` now and then every ``interval`` seconds while the block runs (a bystander
    connection, kept from its idle timeout), and once more after it."""
    done = trio.Event()

    async def keep() -> None:
        n = 0
        while not done.is_set():
            await request(n)
            n += 1
            with trio.move_on_after(interval):
                await done.wait()
        await request(n)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep)
        try:
            yield
        finally:
            done.set()


async def task_final_while_alive(admin: Any, agent: Any, task_id: str, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
    """The task once final (as the master holds it); fails the test at once, with the end of the
    agent's log, when the agent process exits first (a crash would otherwise look like a slow task)."""
    found: dict[str, Any] = {}
    with trio.fail_after(timeout):
        async with trio.open_nursery() as nursery:

            async def final() -> None:
                found.update(await admin.wait_task_final(task_id, timeout + 1))
                nursery.cancel_scope.cancel()

            nursery.start_soon(final)
            code = await agent.wait()
            raise AssertionError(f"the agent exited ({code}) before task {task_id} ended:\n{agent.log_text()[-4000:]}")
    return found
