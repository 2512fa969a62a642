"""A client connection of a task at the proxy, as the exchange sees it: reading request heads
with their limits, the I/O of one exchange (one deadline pushed as bytes move, an answer's burst in
one write), and the answers of the proxy's own (403, 407, 400…: :mod:`.errors`) with the drop of a
refused request's body.

:class:`ClientConnection` is the base of the exchange's ``_Client`` (:mod:`.exchange`), which holds
what is done with each request. The exceptions here are the package's own signals between the two
(never raised past :func:`.exchange.serve_client`): :class:`ClientGone`, :class:`Abort`, :class:`Stale`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NoReturn

import h11
import trio

from ckagent.containment.egress.proxy.errors import (
    BadRequest,
    ChainRefused,
    HeadTimeout,
    HeadTooLarge,
    ProxyError,
    UpstreamError,
    reason,
)
from ckagent.containment.egress.proxy.limits import Limits
from ckagent.containment.egress.proxy.relay import BUFFER_BYTES
from ckagent.containment.egress.proxy.taskproxy import TaskProxy
from ckagent.containment.egress.proxy.upstream import Upstream


class ClientGone(Exception):
    """The client's connection broke or closed: nothing more can be sent to it."""


class Abort(Exception):
    """The exchange broke after the answer began: the client's connection must be closed."""


class Stale(Exception):
    """A reused upstream connection closed before answering: the request may be sent again."""


class ClientConnection:
    """One client connection of ``task`` on ``stream`` (see the module docstring)."""

    def __init__(self, stream: trio.SocketStream, task: TaskProxy, limits: Limits) -> None:
        self.stream, self.task, self.limits = stream, task, limits
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        self.eof = False
        self._started = False
        """The destination's answer began reaching the client (an error now can only cut it)."""
        self._io: trio.CancelScope | None = None
        """The current exchange's scope (:meth:`_io_deadline`)."""
        self._pending: object = None
        """A body event read while looking for the request's end (sent up first)."""

    async def _next_request(self, first: bool) -> h11.Request | None:
        """The next request's head; None when the client closed or stayed idle (no byte of a head).
        Raises BadRequest, HeadTooLarge, HeadTimeout, ClientGone."""
        idle_until = trio.current_time() + (self.limits.idle_timeout if first else self.limits.keepalive_timeout)
        head_until: float | None = None
        while (event := self._head_event()) is h11.NEED_DATA:
            if self.eof:
                return None
            if head_until is None and self.conn.trailing_data[0]:
                head_until = trio.current_time() + self.limits.head_timeout
            with trio.move_on_at(head_until if head_until is not None else idle_until) as waited:
                self._feed(await self._receive())
            if waited.cancelled_caught:
                if head_until is not None:
                    raise HeadTimeout(f"the request head was not complete within {self.limits.head_timeout:g} s")
                return None
        if isinstance(event, h11.Request):
            if len(event.headers) > self.limits.max_headers:
                raise HeadTooLarge(f"more than {self.limits.max_headers} header fields")
            size = len(event.method) + len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers.raw_items())
            if size > self.limits.max_head_bytes:  # (h11 checks only a head that is not complete yet)
                raise HeadTooLarge("the request head is over the size limit")
            return event
        return None  # ConnectionClosed (or PAUSED, which a new cycle never is)

    def _head_event(self) -> object:
        try:
            return self.conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise _head_error(exc) from None

    # ------------------------------------------------------------------------------- our answers

    async def _refuse(self, exc: ProxyError) -> bool:
        """Answer a request the proxy does not forward; True when the connection goes on. Never
        raises (it runs in an ``except`` clause of :meth:`serve`, whose siblings would not catch)."""
        if isinstance(exc, ChainRefused):
            self.task.note("upstream", f"{exc.status}: {exc}")
        elif exc.status == 403:
            self.task.count_refused(getattr(exc, "refused", ()))
        else:
            self.task.note(OUTCOME.get(exc.status, "error"), f"{exc.status}: {exc}")
        if self.conn.our_state is not h11.SEND_RESPONSE:
            return False  # (the answer had begun: nothing more can be said)
        waiting = self.conn.they_are_waiting_for_100_continue
        sent = False
        with trio.move_on_after(self.limits.io_timeout):  # (a client that reads nothing)
            sent = await self._try_send_error(exc, close=not exc.keep_alive or waiting)
        if not sent:
            return False
        if not exc.keep_alive or waiting:
            return False
        try:
            return await self._drain()
        except (ClientGone, Abort):  # (a body that breaks while it is dropped ends the connection)
            return False

    async def _answer_and_close(self, exc: ProxyError) -> None:
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            with trio.move_on_after(self.limits.io_timeout):
                await self._try_send_error(exc, close=True)

    async def _try_send_error(self, exc: ProxyError, close: bool) -> bool:
        """:meth:`_send_error`; False when the client is gone or the answer cannot be given now."""
        try:
            await self._send_error(exc, close)
        except (ClientGone, h11.LocalProtocolError):
            return False
        return True

    async def _send_error(self, exc: ProxyError, close: bool) -> None:
        body = (str(exc) + "\n").encode("utf-8", "replace")
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
        if exc.status == 407:
            headers.append((b"proxy-authenticate", b'Basic realm="ckagent task"'))
        if close:
            headers.append((b"connection", b"close"))
        await self._write([self._frame(h11.Response(status_code=exc.status, reason=reason(exc.status).encode(),
                                                    headers=headers)),
                           self._frame(h11.Data(data=body)), self._frame(h11.EndOfMessage())])

    async def _drain(self) -> bool:
        """Read and drop the rest of a refused request's body; True when it ended within the limit."""
        left = self.limits.drain_bytes
        event, self._pending = self._pending, None
        with trio.move_on_after(self.limits.head_timeout):
            while True:
                if isinstance(event, h11.Data):
                    left -= len(event.data)
                    if left < 0:
                        return False
                elif event is not None:
                    return isinstance(event, h11.EndOfMessage) and self.conn.their_state is h11.DONE
                if self.conn.their_state is not h11.SEND_BODY:
                    return self.conn.their_state is h11.DONE
                event = await self._client_event()
        return False

    # ------------------------------------------------------------------------------------- the I/O

    async def _receive(self) -> bytes:
        try:
            return await self.stream.receive_some(BUFFER_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise ClientGone() from None

    def _feed(self, data: bytes) -> None:
        if not data:
            self.eof = True
        self.conn.receive_data(data)

    async def _client_event(self) -> object:
        """The client's next event while its body is read (bad framing → Abort). Its time is the
        exchange's (:meth:`_io_deadline`), or the caller's."""
        while (event := self._body_event()) is h11.NEED_DATA:
            if self.eof:
                raise ClientGone()
            self._feed(await self._receive())
            self._moved()
        return event

    def _body_event(self) -> object:
        try:
            return self.conn.next_event()
        except h11.RemoteProtocolError:
            raise Abort() from None

    @contextlib.contextmanager
    def _io_deadline(self) -> Iterator[trio.CancelScope]:
        """The scope of one exchange: cancelled when nothing moved either way for ``io_timeout``
        (each move pushes its deadline: :meth:`_moved`). The caller tells what its cancellation means."""
        self._started = False
        with trio.CancelScope(deadline=trio.current_time() + self.limits.io_timeout) as scope:
            self._io = scope
            try:
                yield scope
            finally:
                self._io = None

    def _moved(self) -> None:
        """Bytes moved: the exchange's deadline is pushed (at most once a second: it is cheap, not free)."""
        io = self._io
        if io is not None:
            until = trio.current_time() + self.limits.io_timeout
            if until - io.deadline > 1.0:
                io.deadline = until

    def _frame(self, event: h11.Event) -> bytes:
        """The bytes of one event to the client (h11 frames it for the client's connection)."""
        return self.conn.send(event) or b""

    async def _write(self, out: list[bytes]) -> None:
        """Send what ``out`` holds to the client in one write, and empty it."""
        data = b"".join(out)
        out.clear()
        if data:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                raise ClientGone() from None
            self._moved()

    async def _send(self, event: h11.Event) -> None:
        await self._write([self._frame(event)])

    async def _send_up(self, up: Upstream, data: bytes | None) -> None:
        if not data:
            return
        try:
            await up.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            if up.reused and up.conn.their_state is h11.SEND_RESPONSE:
                raise Stale() from None
            raise UpstreamError("the destination closed the connection") from None
        self._moved()

    async def _up_event(self, up: Upstream, out: list[bytes] | None = None) -> object:
        """The destination's next event; what ``out`` holds for the client is sent before waiting for
        more. Raises Stale (a reused connection that closed before answering), UpstreamError
        (before the answer began), Abort (after)."""
        conn, started = up.conn, self._started
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                if not started:
                    raise UpstreamError(f"the destination's answer is not HTTP/1.1: {exc}") from None
                event = None
            if event is None:
                await self._cut(out)
            if event is not h11.NEED_DATA:
                if isinstance(event, h11.ConnectionClosed) and not started:  # (after: _answer cuts)
                    if up.reused:
                        raise Stale()
                    raise UpstreamError("the destination closed the connection without answering")
                return event
            if out:
                await self._write(out)
            try:
                data = await up.stream.receive_some(BUFFER_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                if started:  # (what was ready went before this read)
                    raise Abort() from None
                if up.reused:
                    raise Stale() from None
                raise UpstreamError("the destination reset the connection") from None
            if not data and not started and not conn.trailing_data[0]:  # closed before a byte of answer
                if up.reused:
                    raise Stale()
                raise UpstreamError("the destination closed the connection without answering")
            try:
                conn.receive_data(data)
            except RuntimeError:  # (data after the connection closed)
                raise Abort() from None
            self._moved()

    async def _cut(self, out: list[bytes] | None) -> NoReturn:
        """The answer broke after it began: what is ready still goes to the client (it sees the body
        end short), then Abort ends the connection."""
        if out:
            with contextlib.suppress(ClientGone):
                await self._write(out)
        raise Abort()



OUTCOME = {400: "bad-request", 403: "refused", 407: "auth", 408: "timeout", 431: "too-large", 502: "upstream",
            504: "upstream", 503: "upstream"}
"""The outcome (ckagent.containment.egress.proxy.taskproxy.OUTCOMES) of each answer of the proxy's own."""


def _head_error(exc: h11.RemoteProtocolError) -> ProxyError:
    """h11's verdict on a malformed head as the proxy's answer (431 for a head over the limit)."""
    if exc.error_status_hint == 431 or "too long" in str(exc).lower():
        return HeadTooLarge("the request head is over the size limit")
    return BadRequest(f"malformed request: {exc}")
