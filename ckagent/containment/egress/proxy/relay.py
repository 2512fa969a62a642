"""A CONNECT tunnel's bytes, both ways: the relay behind every HTTPS (and WebSocket) request at the proxy.

:func:`relay` never raises for what the two peers do (a reset, a close, silence): the tunnel ends.
Cancellation stops it at once.
"""

from __future__ import annotations

import contextlib

import trio

BUFFER_BYTES = 262144
"""Bytes read at once from a socket (bodies and tunnels)."""


async def relay(a: trio.SocketStream, b: trio.SocketStream, idle_timeout: float,
                first: tuple[bytes, bytes] = (b"", b"")) -> None:
    """Bytes both ways between ``a`` and ``b`` until both sides ended (a half-close passes on as a
    half-close) or a side broke, or nothing moved for ``idle_timeout`` seconds; ``first``: what
    was read already from ``a`` and from ``b`` (sent on before anything else). Never raises for
    what the peers do; cancellation stops it."""
    ended = [False, False]
    with trio.CancelScope(deadline=trio.current_time() + idle_timeout) as scope:

        async def pump(source: trio.SocketStream, sink: trio.SocketStream, index: int) -> None:
            try:
                if first[index]:
                    await sink.send_all(first[index])
                while data := await source.receive_some(BUFFER_BYTES):
                    scope.deadline = trio.current_time() + idle_timeout
                    await sink.send_all(data)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    await sink.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                scope.cancel()
                return
            ended[index] = True
            if all(ended):
                scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, a, b, 0)
            nursery.start_soon(pump, b, a, 1)
