"""The egress proxy's limits: its timeouts (seconds) and sizes (bytes), one record for the whole proxy.

What each limit answers when it is crossed is said in :mod:`.exchange` and docs/operations.md
("The proxy level").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """The proxy's limits.

    ``idle_timeout``: seconds a new client connection may send nothing before it is closed;
    ``keepalive_timeout``: seconds a kept-alive one may wait for its next request; ``head_timeout``:
    seconds from a head's first byte to its end (then 408); ``io_timeout``: seconds a destination
    or a client may move no byte in the middle of an exchange (504 before the answer began);
    ``tunnel_idle_timeout``: seconds a CONNECT tunnel may carry nothing; ``max_head_bytes`` and
    ``max_headers``: a head's size and field count (over: 431); ``drain_bytes``: how much of a
    refused request's body is read and dropped to keep its connection (more: closed);
    ``max_connections``: see below.
    """

    idle_timeout: float = 30.0
    keepalive_timeout: float = 120.0
    head_timeout: float = 30.0
    io_timeout: float = 300.0
    tunnel_idle_timeout: float = 900.0
    max_head_bytes: int = 65536
    max_headers: int = 256
    drain_bytes: int = 1048576
    max_connections: int = 512
    """Client connections one task may hold open at once; one more is answered 503 and closed (a
    spider that floods its proxy with connections must not take the agent's file descriptors)."""


MAX_INTERIM = 32
"""1xx answers a destination may send before its final one (more: 502)."""
