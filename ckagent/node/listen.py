"""The agent's listening socket: bound before anything else starts, so a busy port is a clear start-up error.

Used by the status port (ckagent.port.status) and by the configuration check (ckagent.node.preflight).
"""

from __future__ import annotations

import errno
import socket


class StatusPortError(OSError):
    """The status/metrics port cannot be bound; ``str()`` says which address and what to change."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0 = any free port), not yet listening.

    Raises StatusPortError naming the address and the settings to change.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        shown = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        hint = "is another ckagent (or another program) using it? " if exc.errno == errno.EADDRINUSE else ""
        raise StatusPortError(
            f"cannot listen on {shown} for the status/metrics server: {exc.strerror or exc}; "
            f"{hint}set agent.port (AGENT_PORT) or agent.bind (AGENT_BIND)",
        ) from exc
    return sock
