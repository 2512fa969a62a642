"""What stands behind the egress proxy in its tests, on loopback: an origin server that says who it
is, a team's HTTP forward proxy and a SOCKS5 proxy — each recording what it received, so a test can
prove where a request went and with which headers.

Each is a Trio server started in the test's nursery (``await nursery.start(server.serve)`` → its
port); they speak HTTP/1.1 with h11 and keep connections alive, as real ones do. Only 127.0.0.x.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import h11
import trio

from harness.loopback import loopback_listeners

__all__ = ["IdentityOrigin", "RecordingProxy", "Seen", "Socks5Server"]


@dataclass
class Seen:
    """One request a server received: ``method``, ``target``, ``headers`` (lower-case names)."""

    method: str
    target: str
    headers: dict[str, str]


async def _h11_requests(stream: trio.SocketStream, handle: Any) -> None:
    """Serve h11 requests on ``stream`` until it closes: ``handle(conn, request, body)`` answers."""
    conn = h11.Connection(h11.SERVER)
    while True:
        await trio.lowlevel.checkpoint()
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return
        if event is h11.NEED_DATA:
            try:
                data = await stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            conn.receive_data(data)
            continue
        if isinstance(event, h11.Request):
            body = b""
            while True:
                more = conn.next_event()
                if more is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(more, h11.Data):
                    body += more.data
                else:
                    break
            keep = await handle(conn, stream, event, body)
            if not keep or conn.our_state is not h11.DONE:
                return
            conn.start_next_cycle()
            continue
        return


async def _answer(conn: h11.Connection, stream: trio.SocketStream, status: int, body: bytes,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    out = conn.send(h11.Response(status_code=status, headers=[(b"content-length", str(len(body)).encode()),
                                                              *(headers or [])]))
    out += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
    await stream.send_all(out)


@dataclass
class IdentityOrigin:
    """An origin server on ``host``: every answer is JSON ``{"host", "port", "method", "path",
    "headers", "body_length"}``; ``seen`` lists what it received, ``connections`` how many it accepted."""

    host: str = "127.0.0.2"
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    port: int = 0
    close_after_answer: bool = False
    """Close every connection after its answer without saying so (as a server whose keep-alive
    timeout ran out while the connection sat in a client's pool)."""

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled (startable: ``started(port)``)."""
        async with loopback_listeners(self.host) as listeners:  # (a port no agent listener has)
            self.port = listeners[0].socket.getsockname()[1]
            task_status.started(self.port)
            await trio.serve_listeners(self._client, listeners)

    async def _client(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        async with stream:
            await _h11_requests(stream, self._handle)

    async def _handle(self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, body: bytes) -> bool:
        headers = {n.decode().lower(): v.decode() for n, v in request.headers.raw_items()}
        self.seen.append(Seen(request.method.decode(), request.target.decode(), headers))
        answer = {"host": self.host, "port": self.port, "method": request.method.decode(),
                  "path": request.target.decode(), "headers": headers, "body_length": len(body),
                  "connection": self.connections}
        await _answer(conn, stream, 200, json.dumps(answer).encode(), [(b"content-type", b"application/json")])
        return not self.close_after_answer


@dataclass
class RecordingProxy:
    """A team's HTTP forward proxy on ``host`` (absolute-form requests, CONNECT tunnels), kept-alive;
    ``seen`` lists every request it received with its headers (``Proxy-Authorization`` included);
    ``need_auth``: answer 407 to requests without exactly this ``Proxy-Authorization`` value."""

    host: str = "127.0.0.5"
    need_auth: str | None = None
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled (startable: ``started(port)``)."""
        async with loopback_listeners(self.host) as listeners:  # (a port no agent listener has)
            task_status.started(listeners[0].socket.getsockname()[1])
            await trio.serve_listeners(self._client, listeners)

    async def _client(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        async with stream:
            await _h11_requests(stream, self._handle)

    async def _handle(self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, body: bytes) -> bool:
        headers = {n.decode().lower(): v.decode() for n, v in request.headers.raw_items()}
        self.seen.append(Seen(request.method.decode(), request.target.decode(), headers))
        if self.need_auth is not None and headers.get("proxy-authorization") != self.need_auth:
            await _answer(conn, stream, 407, b"team proxy: who are you?", [(b"proxy-authenticate", b"Basic")])
            return True
        if request.method == b"CONNECT":
            host, _, port = request.target.decode().rpartition(":")
            host = "127.0.0.2" if host == "origin.test" else host.strip("[]")
            upstream = await trio.open_tcp_stream(host, int(port))
            await stream.send_all(conn.send(h11.Response(status_code=200, headers=[])))
            await _splice(stream, upstream)
            return False
        url = request.target.decode()
        assert url.startswith("http://"), url
        authority, _, path = url[len("http://"):].partition("/")
        host, _, port = authority.rpartition(":")
        host = "127.0.0.2" if host == "origin.test" else host.strip("[]")  # (names resolved as the tests say)
        async with await trio.open_tcp_stream(host, int(port or 80)) as upstream:
            client = h11.Connection(h11.CLIENT)
            kept = [(n, v) for n, v in request.headers.raw_items() if n.lower() != b"proxy-authorization"]
            await upstream.send_all(client.send(h11.Request(method=request.method, target=b"/" + path.encode(),
                                                            headers=kept)) +
                                    (client.send(h11.Data(data=body)) if body else b"") +
                                    client.send(h11.EndOfMessage()))
            answer = b""
            status = 502
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await upstream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    answer += event.data
                else:
                    break
        await _answer(conn, stream, status, answer, [(b"via", b"1.1 team-proxy")])
        return True


@dataclass
class Socks5Server:
    """A SOCKS5 proxy on ``host`` (RFC 1928; with ``auth`` (user, password) RFC 1929 is required);
    ``asked`` lists the (host, port) of each CONNECT (a name when the client let the proxy resolve)."""

    host: str = "127.0.0.6"
    auth: tuple[bytes, bytes] | None = None
    asked: list[tuple[str, int]] = field(default_factory=list)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled (startable: ``started(port)``)."""
        async with loopback_listeners(self.host) as listeners:  # (a port no agent listener has)
            task_status.started(listeners[0].socket.getsockname()[1])
            await trio.serve_listeners(self._client, listeners)

    async def _client(self, stream: trio.SocketStream) -> None:
        async with stream:
            buffer = bytearray()

            async def need(count: int) -> bytes:
                while len(buffer) < count:
                    data = await stream.receive_some(4096)
                    if not data:
                        raise trio.BrokenResourceError
                    buffer.extend(data)
                out = bytes(buffer[:count])
                del buffer[:count]
                return out

            try:
                _, count = await need(2)
                methods = await need(count)
                wanted = 2 if self.auth is not None else 0
                if wanted not in methods:
                    await stream.send_all(b"\x05\xff")
                    return
                await stream.send_all(bytes([5, wanted]))
                if self.auth is not None:
                    _, ulen = await need(2)
                    user = await need(ulen)
                    (plen,) = await need(1)
                    password = await need(plen)
                    ok = (user, password) == self.auth
                    await stream.send_all(b"\x01" + (b"\x00" if ok else b"\x01"))
                    if not ok:
                        return
                _, _, _, kind = await need(4)
                if kind == 1:
                    host = ".".join(str(b) for b in await need(4))
                elif kind == 3:
                    (length,) = await need(1)
                    host = (await need(length)).decode()
                else:
                    packed = await need(16)
                    import ipaddress

                    host = str(ipaddress.IPv6Address(packed))
                (port,) = struct.unpack(">H", await need(2))
                self.asked.append((host, port))
                target = "127.0.0.2" if host == "origin.test" else host  # (names resolved as the tests say)
                upstream = await trio.open_tcp_stream(target, port)
                await stream.send_all(b"\x05\x00\x00\x01" + bytes(4) + b"\x00\x00")
                await _splice(stream, upstream)
            except (trio.BrokenResourceError, OSError):
                return


async def _splice(a: trio.SocketStream, b: trio.SocketStream) -> None:
    async def pump(source: trio.SocketStream, sink: trio.SocketStream, scope: trio.CancelScope) -> None:
        try:
            while data := await source.receive_some(65536):
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        scope.cancel()

    async with b, trio.open_nursery() as nursery:
        nursery.start_soon(partial(pump, a, b, nursery.cancel_scope))
        nursery.start_soon(partial(pump, b, a, nursery.cancel_scope))
