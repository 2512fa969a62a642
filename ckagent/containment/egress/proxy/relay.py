"""Bytes from one socket to another without looking at them: a CONNECT tunnel both ways (every HTTPS
and WebSocket request at the proxy), and the body of a large answer whose length is known.

A direction starts with ``recv``/``send`` through Trio; once it has carried :data:`SPLICE_AFTER_BYTES`
it moves to ``splice(2)`` through a kernel pipe of its own, so a large transfer is never copied into
the agent's memory (where Linux cannot splice these sockets, it stays on ``recv``/``send``). Small
tunnels — most pages — never open a pipe.

:func:`relay` never raises for what the two peers do (a reset, a close, silence): the tunnel ends.
:func:`move_exactly` raises :class:`Cut` when the source ends or breaks early. Cancellation stops
either at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable

import trio

BUFFER_BYTES = 262144
"""Bytes read at once from a socket (bodies and tunnels) while a direction is not spliced."""

SPLICE_AFTER_BYTES = 1048576
"""A direction that carried this many bytes moves to splice(2) (a pipe costs two descriptors)."""

SPLICE_BYTES = 1048576
"""Bytes asked of one splice(2) (the pipe is made this large where the kernel allows)."""

_SPLICE = getattr(os, "splice", None)
_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class Cut(Exception):
    """The source ended or broke before the bytes :func:`move_exactly` was to move."""


class _Pipe:
    """A non-blocking kernel pipe for one direction's splices (both ends closed by :meth:`close`)."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # (the default 64 KiB works, with more calls)
            fcntl.fcntl(self.w, _F_SETPIPE_SZ, SPLICE_BYTES)

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class _Direction:
    """One direction of bytes: ``source`` → ``sink``, on recv/send until it carried enough to splice."""

    def __init__(self, source: trio.SocketStream, sink: trio.SocketStream) -> None:
        self.source, self.sink = source, sink
        self.moved = 0
        self.pipe: _Pipe | None = None
        self.splicing = _SPLICE is not None
        self.moved_by_splice = False

    async def step(self, limit: int) -> int:
        """Move at most ``limit`` bytes; returns how many (0: the source ended). Raises OSError and
        trio's BrokenResourceError/ClosedResourceError when a side breaks."""
        if self.pipe is None and self.splicing and self.moved >= SPLICE_AFTER_BYTES:
            try:
                self.pipe = _Pipe()
            except OSError:  # (out of descriptors: stay on recv/send)
                self.splicing = False
        if self.pipe is not None:
            try:
                count = await self._splice(min(limit, SPLICE_BYTES))
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or self.moved_by_splice:
                    raise
                self.close()
                self.splicing = False  # (this kernel cannot splice these sockets: recv/send from now on)
                return await self.step(limit)
        else:
            data = await self.source.receive_some(min(limit, BUFFER_BYTES))
            if data:
                await self.sink.send_all(data)
            count = len(data)
        self.moved += count
        return count

    async def _splice(self, limit: int) -> int:
        assert self.pipe is not None and _SPLICE is not None
        source, sink = self.source.socket, self.sink.socket
        while True:
            try:
                count = _SPLICE(source.fileno(), self.pipe.w, limit, None, None, _FLAGS)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(source)
                continue
            break
        left = count
        while left:
            try:
                left -= _SPLICE(self.pipe.r, sink.fileno(), left, None, None, _FLAGS)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sink)
        if count:
            self.moved_by_splice = True
            await trio.lowlevel.checkpoint()  # (a fast peer must not keep the others waiting)
        return count

    def close(self) -> None:
        if self.pipe is not None:
            self.pipe.close()
            self.pipe = None


async def relay(a: trio.SocketStream, b: trio.SocketStream, idle_timeout: float,
                first: tuple[bytes, bytes] = (b"", b"")) -> None:
    """Bytes both ways between ``a`` and ``b`` until both sides ended (a half-close passes on as a
    half-close) or a side broke, or nothing moved for ``idle_timeout`` seconds; ``first``: what
    was read already from ``a`` and from ``b`` (sent on before anything else). Never raises for
    what the peers do; cancellation stops it."""
    ended = [False, False]
    with trio.CancelScope(deadline=trio.current_time() + idle_timeout) as scope:

        async def pump(direction: _Direction, index: int) -> None:
            try:
                if first[index]:
                    await direction.sink.send_all(first[index])
                while await direction.step(SPLICE_BYTES):
                    scope.deadline = trio.current_time() + idle_timeout
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    await direction.sink.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                scope.cancel()
                return
            finally:
                direction.close()
            ended[index] = True
            if all(ended):
                scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, _Direction(a, b), 0)
            nursery.start_soon(pump, _Direction(b, a), 1)


async def move_exactly(source: trio.SocketStream, sink: trio.SocketStream, count: int,
                       progress: Callable[[], None]) -> None:
    """Move ``count`` bytes from ``source`` to ``sink`` (spliced past :data:`SPLICE_AFTER_BYTES`);
    ``progress()`` after each step. Raises Cut when the source ends or breaks first, and trio's
    BrokenResourceError/ClosedResourceError or OSError when the sink does."""
    direction = _Direction(source, sink)
    direction.moved = SPLICE_AFTER_BYTES if count >= SPLICE_AFTER_BYTES else 0  # (a big body: splice at once)
    try:
        left = count
        while left:
            try:
                moved = await direction.step(left)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError) as exc:
                raise Cut(str(exc)) from None
            if not moved:
                raise Cut(f"the source ended {left} bytes early")
            left -= moved
            progress()
    finally:
        direction.close()
