"""Ports for the tests' servers on loopback aliases (127.0.0.x) that no listener of 127.0.0.1 shares.

The egress policy's ``agent`` group refuses the ports of every agent on this host — an agent's status
port, the proxy's task listeners, all on 127.0.0.1 — on *every* local address: a server of a test on
127.0.0.3 whose port number an agent or proxy listener on 127.0.0.1 also has is refused (403 from the
proxy, a drop at nftables). And bind(0) readily hands the same number to two addresses on a busy
machine (measured: with 3,000 listeners on 127.0.0.1, 129 of 300 ports picked on 127.0.0.4 were among
theirs). So a server off 127.0.0.1 also holds its port number on 127.0.0.1 (:func:`hold_port`), bound
without SO_REUSEADDR and not listening: while it is held, no listener there can take that number.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import trio

__all__ = ["LOOPBACK_AGENT_HOST", "hold_port", "loopback_listeners"]

LOOPBACK_AGENT_HOST = "127.0.0.1"
"""Where agents and their proxies listen."""

TRIES = 100
"""Ports tried before giving up (each taken one was taken on 127.0.0.1 meanwhile: rare)."""


def hold_port(host: str, port: int) -> socket.socket | None:
    """For a server on ``host``:``port``: a socket bound to 127.0.0.1:``port`` that keeps every
    listener of 127.0.0.1 off that port number until it is closed; None when ``host`` is 127.0.0.1
    (the server's own listener does that). Raises OSError when 127.0.0.1:``port`` is taken (bind the
    server to another port)."""
    if host == LOOPBACK_AGENT_HOST:
        return None
    held = socket.socket()
    try:
        held.bind((LOOPBACK_AGENT_HOST, port))
    except OSError:
        held.close()
        raise
    return held


@contextlib.asynccontextmanager
async def loopback_listeners(host: str) -> AsyncIterator[list[trio.SocketListener]]:
    """``trio.open_tcp_listeners(0, host=host)`` on a port held on 127.0.0.1 too (:func:`hold_port`)
    until the block ends (the listeners are the caller's to close, as usual). Raises RuntimeError when
    :data:`TRIES` ports were all taken on 127.0.0.1."""
    for _ in range(TRIES):
        listeners = await trio.open_tcp_listeners(0, host=host)
        try:
            held = hold_port(host, listeners[0].socket.getsockname()[1])
        except OSError:
            for listener in listeners:
                await listener.aclose()
            continue
        try:
            yield listeners
        finally:
            if held is not None:
                held.close()
        return
    raise RuntimeError(f"no port on {host} that is free on {LOOPBACK_AGENT_HOST} too, in {TRIES} tries")
