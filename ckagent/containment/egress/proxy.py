"""The filtering proxy of the ``proxy`` egress level: advisory, for hosts where the kernel cannot help.

The tasks' ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` point at ``http://t<key>:task@127.0.0.1:<port>``;
the user name says which task asks (:meth:`ckagent.containment.egress.Egress.task_env`). For ``CONNECT
host:port`` (HTTPS) and absolute-form requests (``GET http://host/...``) the proxy resolves the host,
checks every address against the task's policy, connects to the first allowed address it checked
(no second lookup: DNS rebinding gains nothing) and relays bytes both ways. A refused destination
gets ``403`` and is counted for the task. A program that ignores the variables is not stopped: the
level is advisory (docs/operations.md, "Egress").

Cancellation: :func:`serve_proxy` runs until its nursery is cancelled; every connection is a task of
that nursery.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio

from ckagent.node.egress_policy import EgressPolicy

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 65536
HEAD_TIMEOUT = 30.0
CONNECT_TIMEOUT = 30.0

Lookup = Callable[[str], "tuple[EgressPolicy, Callable[[str, int], None]] | None"]
"""user name → (the task's policy, count a refusal(address, port)), None = unknown task."""


PROXY_PORT_FILE = "egress-proxy.port"
"""In the agent's work dir: the proxy's port, taken again by the next agent."""


async def serve_proxy(lookup: Lookup, agent_port: Callable[[], int | None], work_dir: Path | None = None, *,
                      task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Listen on 127.0.0.1 and serve until cancelled; ``task_status.started`` gets the URL
    ``http://127.0.0.1:<port>``. The port is the one ``work_dir/PROXY_PORT_FILE`` names (the previous agent's: its
    handed-over tasks' proxy variables name it), and is written there; when it cannot be had
    (another program took it), a port the OS picks, and a warning says those tasks' proxied
    connections fail until they end."""
    port_file = None if work_dir is None else work_dir / PROXY_PORT_FILE
    port = 0 if port_file is None else await trio.to_thread.run_sync(_read_port, port_file)
    try:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    except OSError as exc:
        if not port:
            raise
        log.warning("egress proxy: cannot listen on 127.0.0.1:%d again (%s): the proxy variables of tasks "
                    "left by the previous agent name it, so their proxied connections fail", port, exc)
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    if port_file is not None:
        await trio.to_thread.run_sync(_write_port, port_file, port)
    async with trio.open_nursery() as nursery:
        task_status.started(f"http://127.0.0.1:{port}")
        async def handler(stream: trio.SocketStream) -> None:
            await _serve(stream, lookup, agent_port)

        await trio.serve_listeners(handler, listeners, handler_nursery=nursery)


async def _serve(client: trio.SocketStream, lookup: Lookup, agent_port: Callable[[], int | None]) -> None:
    async with client:
        with trio.move_on_after(HEAD_TIMEOUT):
            head, rest = await _read_head(client)
        if not head:
            return
        try:
            method, target, version, headers = _parse(head)
        except ValueError:
            await _answer(client, 400, "bad request")
            return
        user = _user(headers)
        found = lookup(user) if user else None
        if found is None:
            await _answer(client, 407, "unknown task", extra="Proxy-Authenticate: Basic realm=\"ckagent\"\r\n")
            return
        policy, count = found
        try:
            host, port, forward = _destination(method, target, version, headers)
        except ValueError as exc:
            await _answer(client, 400, str(exc))
            return
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
        except OSError as exc:
            await _answer(client, 502, f"cannot resolve {host}: {exc}")
            return
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        allowed = [a for a in addresses if not policy.blocks(a, port, agent_port=agent_port(), local=_is_local(a))]
        if not allowed:
            for address in addresses:
                count(address, port)
            await _answer(client, 403, f"egress policy: {host}:{port} is denied")
            return
        try:
            with trio.fail_after(CONNECT_TIMEOUT):
                upstream = await trio.open_tcp_stream(allowed[0], port)
        except (OSError, trio.TooSlowError) as exc:
            await _answer(client, 502, f"cannot connect to {host}:{port}: {exc}")
            return
        async with upstream:
            if forward is None:
                await client.send_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                await upstream.send_all(forward)
            if rest:
                await upstream.send_all(rest)
            async with trio.open_nursery() as relay:
                relay.start_soon(_pump, client, upstream, relay.cancel_scope)
                relay.start_soon(_pump, upstream, client, relay.cancel_scope)


async def _pump(source: trio.SocketStream, sink: trio.SocketStream, scope: trio.CancelScope) -> None:
    try:
        while data := await source.receive_some(65536):
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        scope.cancel()


async def _read_head(stream: trio.SocketStream) -> tuple[bytes, bytes]:
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        if len(buffer) > MAX_HEAD_BYTES:
            return b"", b""
        try:
            data = await stream.receive_some(8192)
        except (trio.BrokenResourceError, OSError):
            return b"", b""
        if not data:
            return b"", b""
        buffer += data
    head, _, rest = buffer.partition(b"\r\n\r\n")
    return head, rest


def _parse(head: bytes) -> tuple[str, str, str, list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, version = lines[0].split(" ")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ValueError("bad header")
        headers.append((name.strip(), value.strip()))
    return method, target, version, headers


def _user(headers: list[tuple[str, str]]) -> str | None:
    for name, value in headers:
        if name.lower() == "proxy-authorization" and value.lower().startswith("basic "):
            with contextlib.suppress(ValueError):
                return base64.b64decode(value[6:]).decode("latin-1").partition(":")[0]
    return None


def _destination(method: str, target: str, version: str,
                 headers: list[tuple[str, str]]) -> tuple[str, int, bytes | None]:
    """(host, port, the request to send upstream; None for CONNECT)."""
    if method == "CONNECT":
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError("CONNECT needs host:port")
        return host.strip("[]"), int(port), None
    url = urlsplit(target)
    if url.scheme != "http" or not url.hostname:
        raise ValueError("expected an absolute http:// URL (https goes through CONNECT)")
    path = url.path or "/"
    if url.query:
        path += "?" + url.query
    kept = [(n, v) for n, v in headers if n.lower() not in ("proxy-authorization", "proxy-connection")]
    request = f"{method} {path} {version}\r\n" + "".join(f"{n}: {v}\r\n" for n, v in kept) + "\r\n"
    return url.hostname, url.port or 80, request.encode("latin-1")


async def _answer(stream: trio.SocketStream, code: int, text: str, *, extra: str = "") -> None:
    reason = {400: "Bad Request", 403: "Forbidden", 407: "Proxy Authentication Required",
              502: "Bad Gateway"}[code]
    body = (text + "\n").encode()
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        await stream.send_all(f"HTTP/1.1 {code} {reason}\r\n{extra}Content-Type: text/plain\r\nContent-Length: "
                              f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)


def _is_local(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or ip.is_unspecified


def _read_port(path: Path) -> int:
    """The port a previous agent's proxy listened on (0: none recorded, or unreadable)."""
    try:
        port = int(path.read_text().strip())
    except (OSError, ValueError):
        return 0
    return port if 0 < port < 65536 else 0


def _write_port(path: Path, port: int) -> None:
    try:
        path.write_text(f"{port}\n")
    except OSError as exc:  # the next agent picks another port: its handed-over tasks' proxying fails
        log.warning("egress proxy: cannot record its port in %s: %s", path, exc)
