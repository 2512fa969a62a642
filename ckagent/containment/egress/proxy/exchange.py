"""One client connection of a task, served request by request with h11 on both sides.

Every request on a connection is parsed (h11), authorised, routed to the host *its own* target names,
checked against the task's policy and answered in order (pipelining: h11 holds the next request until
this one is answered). Plain ``http://`` requests are forwarded over a kept-alive connection from the
task's pool (:mod:`.upstream`) with hop-by-hop headers removed and ``Host`` set to the target's;
bodies stream both ways in either framing (h11 re-frames them for each side), ``Expect:
100-continue`` is passed on with the destination's ``100``; a body of known length of 1 MiB or more
passes from socket to socket (:mod:`.relay`). ``CONNECT host:port`` opens a tunnel (HTTPS, and
WebSockets over it) and relays bytes both ways, half-closes included. Reading heads, the I/O and the
proxy's own answers are :mod:`.connection`'s.

An answer of the proxy's own (:mod:`.errors`: 400/403/407/408/431/502/504) goes to this connection
only; after 403, 407 and 502 the connection carries the client's next request (the refused request's
body is read and dropped first, up to :attr:`Limits.drain_bytes`).

Timeouts (:class:`Limits`, seconds): a new connection that sends nothing for ``idle_timeout`` is
closed; a kept-alive one after ``keepalive_timeout``; a head that starts but is not complete within
``head_timeout`` gets 408; a destination or client that moves no byte for ``io_timeout`` ends the
exchange (504 before the answer began); a tunnel idle for ``tunnel_idle_timeout`` is closed.

:func:`serve_client` raises nothing a client or a destination can cause (its caller, the server,
still guards against bugs). Cancellation: the connection and its upstream are closed at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from functools import partial

import h11
import trio

from ckagent.containment.egress.proxy.connection import OUTCOME, Abort, ClientConnection, ClientGone, Stale
from ckagent.containment.egress.proxy.errors import (
    BadRequest,
    ProxyError,
    UpstreamError,
    UpstreamTimeout,
)
from ckagent.containment.egress.proxy.limits import MAX_INTERIM, Limits
from ckagent.containment.egress.proxy.relay import Cut, move_exactly, relay
from ckagent.containment.egress.proxy.routes import Route, Unusable
from ckagent.containment.egress.proxy.target import (
    Target,
    forwarded_headers,
    parse_absolute,
    parse_connect,
    request_headers,
    returned_headers,
)
from ckagent.containment.egress.proxy.taskproxy import TaskProxy
from ckagent.containment.egress.proxy.upstream import Upstream, new_connection


async def serve_client(stream: trio.SocketStream, task: TaskProxy, limits: Limits) -> None:
    """Serve ``stream`` (a client of ``task``) until it closes, idles out or breaks. Never raises
    for what the client or a destination does; cancellation closes everything at once."""
    await _Client(stream, task, limits).serve()


class _Client(ClientConnection):
    """What is done with each request of a connection (the loop, forwarding, tunnels)."""

    # ------------------------------------------------------------------------------------ the loop

    async def serve(self) -> None:
        first = True
        while True:
            try:
                request = await self._next_request(first)
            except ProxyError as exc:
                self.task.note(OUTCOME.get(exc.status, "error"), f"{exc.status} to a client: {exc}")
                await self._answer_and_close(exc)
                return
            except ClientGone:
                return
            if request is None:
                return
            first = False
            try:
                if request.method == b"CONNECT":
                    await self._tunnel(request)
                    return
                keep = await self._forward(request)
            except ProxyError as exc:
                keep = await self._refuse(exc)
            except (ClientGone, Abort):
                return
            if not keep or self.eof:
                return
            try:
                self.conn.start_next_cycle()
            except h11.LocalProtocolError:
                return
            await trio.lowlevel.checkpoint()  # (pipelined requests may all be buffered: let others run)

    # ----------------------------------------------------------------------------- plain requests

    async def _forward(self, request: h11.Request) -> bool:
        """Forward one http:// request and its answer. Returns True when the connection may carry
        the next request. Raises ProxyError (before the answer began), ClientGone, Abort."""
        headers = request_headers(request)
        self.task.authorize(headers)
        target, path = parse_absolute(request.target)
        route = self._route(target, tunnel=False)
        body_done = await self._body_is_empty()
        for attempt in (0, 1):
            up = await self._upstream(route, target)
            extra = route.proxy_authorization() if up.absolute else ()
            line_target = b"http://" + target.host_header() + path if up.absolute else path
            out = h11.Request(method=request.method, target=line_target,
                              headers=forwarded_headers(headers, target.host_header(), extra))
            try:
                with self._io_deadline() as io:
                    await self._send_up(up, up.conn.send(out) + (up.conn.send(h11.EndOfMessage()) if body_done else b""))
                    if body_done:
                        await self._answer(up, request.method)
                    else:
                        await self._answer_with_body(up, request.method)
                if io.cancelled_caught:  # nothing moved either way for io_timeout
                    if self._started:
                        raise Abort()
                    raise UpstreamTimeout(f"the destination sent nothing for {self.limits.io_timeout:g} s")
            except Stale:
                await up.aclose()
                if attempt == 0 and body_done:
                    continue  # the pooled connection had been closed by the destination: a new one
                raise UpstreamError(f"{target.authority} closed the connection without answering") from None
            except BaseException:
                await up.aclose()
                raise
            break
        self._release(up)
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE

    def _route(self, target: Target, tunnel: bool) -> Route:
        route = self.task.routes.route(target, tunnel)
        if isinstance(route, Unusable):
            raise UpstreamError(f"the task's {route.variable} cannot be used: {route.reason}")
        return route

    async def _upstream(self, route: Route, target: Target) -> Upstream:
        """A pooled connection for ``target`` along ``route``, or a new one (judged, connected)."""
        dialer = self.task.dialer
        if route.kind == "http":
            await dialer.check_destination(target)  # (every request through the task's proxy)
        key: tuple[object, ...] = (("direct", target.host, target.port) if route.kind == "direct" else
                                   ("http", route.proxy, route.auth) if route.kind == "http" else
                                   ("socks", route.proxy, route.auth, target.host, target.port))
        up, stale = self.task.pool.take(key)
        for old in stale:
            await old.aclose()
        if up is not None:
            return up
        return await dialer.open(route, target)

    async def _body_is_empty(self) -> bool:
        """True when the request has no body (its end is already here): it goes up in one piece."""
        if self.conn.their_state is not h11.SEND_BODY:
            return True
        try:
            event = self.conn.next_event()  # (only what is buffered: NEED_DATA when the body must be read)
        except h11.RemoteProtocolError as exc:
            raise BadRequest(f"malformed request body: {exc}") from None
        if isinstance(event, h11.EndOfMessage):
            return True
        if event is not h11.NEED_DATA:
            self._pending = event
        return False

    async def _answer(self, up: Upstream, method: bytes) -> None:
        """Relay the destination's answer (1xx, head, body) to the client (``method``: the request's);
        what the destination sent at once goes to the client in one write."""
        self._started = False
        interim = 0
        out: list[bytes] = []
        while True:
            event = await self._up_event(up, out)
            if isinstance(event, h11.InformationalResponse):
                interim += 1
                if event.status_code == 101:
                    raise Abort() if self._started else UpstreamError("the destination switched protocols unasked")
                if interim > MAX_INTERIM:
                    raise UpstreamError(f"the destination sent more than {MAX_INTERIM} 1xx answers")
                out.append(self._frame(h11.InformationalResponse(
                    status_code=event.status_code, headers=returned_headers(event.headers.raw_items()),
                    reason=event.reason)))
            elif isinstance(event, h11.Response):
                if event.status_code == 407 and up.via:  # (the client's credentials are the agent's, not for it)
                    raise UpstreamError(f"the task's proxy {up.via} asks for credentials (407): check the user "
                                        "and password in its URL")
                self._started = True
                self.task.count("forwarded")  # (counted before the client has the answer's end)
                headers = returned_headers(event.headers.raw_items())
                out.append(self._frame(h11.Response(status_code=event.status_code, reason=event.reason,
                                                    headers=headers)))
                length = _length(event, method)
                if length is not None and length >= PASS_BODY_BYTES:
                    await self._write(out)
                    await self._pass_body(up, event, length)
                    return
            elif isinstance(event, h11.Data):
                out.append(self._frame(h11.Data(data=event.data)))
            elif isinstance(event, h11.EndOfMessage):
                out.append(self._frame(h11.EndOfMessage()))
                await self._write(out)
                return
            elif self._started:
                await self._cut(out)
            else:
                raise UpstreamError("the destination closed the connection without answering")

    async def _answer_with_body(self, up: Upstream, method: bytes) -> None:
        """Stream the request's body up while relaying the answer down (a destination may answer
        before the body ends: the body is then cut and the client's connection closed). Raises what
        either side met (the answer's trouble first), never a group."""
        failures: list[Exception] = []

        async def side(work: Callable[[Upstream], Awaitable[None]], scope: trio.CancelScope, last: bool) -> None:
            try:
                await work(up)
            except (ProxyError, ClientGone, Abort, Stale) as exc:
                failures.insert(0, exc) if last else failures.append(exc)
                scope.cancel()
            else:
                if last:  # (the answer is complete: a body still coming is not needed)
                    scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(side, self._request_body, nursery.cancel_scope, False)
            nursery.start_soon(side, partial(self._answer, method=method), nursery.cancel_scope, True)
        if failures:
            if isinstance(failures[0], Stale):
                raise UpstreamError("the destination closed the connection without answering") from None
            raise failures[0]

    async def _request_body(self, up: Upstream) -> None:
        """The client's body, event by event, to the destination."""
        while True:
            if self._pending is not None:
                event, self._pending = self._pending, None
            else:
                event = await self._client_event()
            if isinstance(event, h11.Data):
                await self._send_up(up, up.conn.send(h11.Data(data=event.data)))
            elif isinstance(event, h11.EndOfMessage):
                await self._send_up(up, up.conn.send(h11.EndOfMessage()))
                return
            else:  # the client went away in the middle of its body
                raise ClientGone()

    async def _pass_body(self, up: Upstream, response: h11.Response, length: int) -> None:
        """A large body of known ``length``: what h11 holds goes through it, the rest from socket to
        socket without being read (:func:`.relay.move_exactly`); h11's counts are then brought level
        (the client's writer told of the bytes, the destination's connection a fresh h11 cycle when it
        may be kept). Raises Abort when a side breaks."""
        sent = 0
        while (event := self._buffered_up_event(up)) is not h11.NEED_DATA:
            if isinstance(event, h11.Data):
                await self._send(h11.Data(data=event.data))
                sent += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                await self._send(h11.EndOfMessage())
                return
            else:
                raise Abort()
        left = length - sent
        try:
            await move_exactly(up.stream, self.stream, left, self._moved)
        except (Cut, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise Abort() from None
        while left:  # (h11's writer counts what went by it: nothing is copied)
            step = min(left, len(_ZEROS))
            self.conn.send_with_data_passthrough(h11.Data(data=_ZEROS if step == len(_ZEROS) else _ZEROS[:step]))
            left -= step
        await self._send(h11.EndOfMessage())
        up.passed = _keeps_alive(response)

    def _buffered_up_event(self, up: Upstream) -> object:
        try:
            return up.conn.next_event()
        except h11.RemoteProtocolError:
            raise Abort() from None

    def _release(self, up: Upstream) -> None:
        """Back into the pool when both sides of the upstream exchange ended cleanly (or its body
        passed by h11 and it may be kept: a fresh h11 cycle), else closed."""
        if up.passed:
            up.passed = False
            up.conn = new_connection()
            for old in self.task.pool.give(up):
                _close_soon(old)
            return
        if up.conn.our_state is h11.DONE and up.conn.their_state is h11.DONE:
            try:
                up.conn.start_next_cycle()
            except h11.LocalProtocolError:
                pass
            else:
                for old in self.task.pool.give(up):
                    _close_soon(old)
                return
        _close_soon(up)

    # ------------------------------------------------------------------------------------ tunnels

    async def _tunnel(self, request: h11.Request) -> None:
        """``CONNECT host:port``: judged, connected, answered 200, then bytes both ways."""
        self.task.authorize(request_headers(request))
        target = parse_connect(request.target)
        route = self._route(target, tunnel=True)
        upstream, leftover = await self.task.dialer.tunnel(route, target)
        self.task.count("tunnel")
        try:
            await self._send(h11.Response(status_code=200, reason=b"Connection established", headers=[]))
            early = self.conn.trailing_data[0]  # (a client may send its TLS hello before our answer)
            await relay(self.stream, upstream, self.limits.tunnel_idle_timeout, (early, leftover))
        finally:
            await trio.aclose_forcefully(upstream)

PASS_BODY_BYTES = 1048576
"""An answer's body of a known length at least this large passes from socket to socket (:meth:`_Client._pass_body`)."""

_ZEROS = bytes(1048576)
"""What h11's writer is shown for the bytes that passed it (never sent: it only counts them)."""


def _length(response: h11.Response, method: bytes) -> int | None:
    """The answer's body length from its Content-Length (None: chunked, read to the close, or none)."""
    if method == b"HEAD" or response.status_code in (204, 304):
        return None
    lengths = [v for n, v in response.headers if n == b"content-length"]
    if len(lengths) != 1 or any(n == b"transfer-encoding" for n, _ in response.headers):
        return None
    return int(lengths[0])


def _keeps_alive(response: h11.Response) -> bool:
    """The destination keeps the connection after this answer (HTTP/1.1 without ``Connection: close``)."""
    if response.http_version < b"1.1":
        return False
    return not any(n == b"connection" and b"close" in v.lower() for n, v in response.headers)


def _close_soon(up: Upstream) -> None:
    """Close an upstream connection without awaiting (a socket close does not block)."""
    with contextlib.suppress(OSError):
        up.stream.socket.close()
