"""Identity web servers on loopback aliases, for testing what goes through the egress proxy.

Each host is an address of its own (127.0.0.2, 127.0.0.3, … — loopback only) with a plain HTTP and an
HTTPS port; every answer says which server gave it, so a test can prove that a request reached the
host it asked for, with the headers meant for it and nothing else (no ``Proxy-Authorization``, no
other host's ``Authorization``).

The servers are the standard library's :class:`http.server.ThreadingHTTPServer` speaking HTTP/1.1
(persistent connections: a connection serves requests until the client closes it or it is idle for
:data:`IDLE_TIMEOUT` seconds), each in a thread of its own, not hypercorn in the test's Trio loop: so
one set of servers can serve a whole test module (pytest-trio's async fixtures are per test), the
proxy under test is the only thing the test's event loop runs, and a handler sees the request exactly
as it arrived (the raw request target, header names as spelt, repeated headers, chunked framing).
HTTPS uses a test CA made with ``trustme`` (one certificate per host, for its IP address); clients
are pointed at :attr:`WebHosts.ca_file`.

Endpoints (any host, either scheme; every answer has ``X-Identity: <scheme>://<address>:<port>`` and
permissive CORS headers, for a browser's ``fetch`` from another host's page):

``/echo/<anything>``, ``/upload``   any method: JSON ``{"identity": {"address", "port", "scheme",
                                    "origin"}, "method", "target" (the request line's target as
                                    received), "path", "version", "headers": [[name, value], …] (as
                                    received, in order), "body": {"length", "sha256", "chunked"},
                                    "connection": {"serial", "request"}}`` (the connection's number on
                                    this server and the request's number on that connection, from 1).
                                    ``?close=1``: answered with ``Connection: close``, then closed;
                                    ``?linger=S``: the connection is closed (no word said) once it
                                    has been idle S seconds, as a server's keep-alive timeout does
``/status/204``, ``/status/304``    that status, no body (the 304 with ``Content-Length: 1234``)
``/bytes/<N>``                      N bytes of :func:`page_bytes` (``Content-Length``)
``/chunked/<N>``                    the same N bytes, sent ``Transfer-Encoding: chunked`` (16 KiB chunks)
``/redirect?to=<url>``              302 to ``url`` (another host, typically)
``/page``                           a small HTML page (a browser's starting point)
``OPTIONS`` anything                204 with the CORS answer to a preflight

Use::

    with web_hosts(tmp_dir) as hosts:                   # 127.0.0.2, 127.0.0.3, 127.0.0.4
        url = hosts["a"].url("https", "/echo/1")         # https://127.0.0.2:<port>/echo/1

Cancellation and teardown: leaving :func:`web_hosts` stops the servers and closes every connection
they still hold (kept-alive ones included), then joins their threads (bounded, see :data:`STOP_TIMEOUT`).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import json
import socket
import ssl
import string
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from harness.loopback import hold_port

__all__ = ["HOST_ADDRESSES", "WebHost", "WebHosts", "body_bytes", "page_bytes", "sha256_hex", "web_hosts"]

HOST_ADDRESSES = {"a": "127.0.0.2", "b": "127.0.0.3", "d": "127.0.0.4"}
"""The default hosts: name → loopback alias (``d`` is the one a test's policy denies)."""

IDLE_TIMEOUT = 30.0
"""Seconds a kept-alive connection may stay idle before the server closes it."""

STOP_TIMEOUT = 5.0
"""Seconds :func:`web_hosts` waits for each server's threads when it stops."""

CHUNK_BYTES = 16384
"""Size of each chunk of ``/chunked/<N>``."""

MAX_BODY_BYTES = 64 * 1024 * 1024
"""The largest request body a server reads (a test asking more is a mistake: 413)."""


def sha256_hex(data: bytes) -> str:
    """The sha256 of ``data`` as lowercase hex."""
    return hashlib.sha256(data).hexdigest()


def page_bytes(origin: str, size: int) -> bytes:
    """The body of ``/bytes/<size>`` (and ``/chunked/<size>``) at ``origin`` (``http://127.0.0.2:8080``):
    the hex sha256 of the origin, repeated and cut to ``size`` bytes — each server's pages differ, so a
    page's digest says which server sent it."""
    block = sha256_hex(origin.encode()).encode()
    return (block * (size // len(block) + 1))[:size]


def body_bytes(tag: str, size: int) -> bytes:
    """The request body a client sends for a request tagged ``tag``: ``"<tag>-"`` repeated, cut to
    ``size`` bytes (every client script makes it the same way). ``tag`` is ASCII letters, digits, ``-``."""
    if not tag or set(tag) - set(string.ascii_letters + string.digits + "-"):
        raise ValueError(f"a body tag is ASCII letters, digits and '-': {tag!r}")
    unit = (tag + "-").encode()
    return (unit * (size // len(unit) + 1))[:size]


@dataclass(frozen=True)
class WebHost:
    """One identity host: ``name`` (``a``), its loopback ``address`` and its two ports."""

    name: str
    address: str
    http_port: int
    https_port: int

    def port(self, scheme: str) -> int:
        """The port serving ``scheme`` (``http`` or ``https``)."""
        return {"http": self.http_port, "https": self.https_port}[scheme]

    def origin(self, scheme: str) -> str:
        """``<scheme>://<address>:<port>`` — also what its answers carry in ``X-Identity``."""
        return f"{scheme}://{self.address}:{self.port(scheme)}"

    def authority(self, scheme: str) -> str:
        """``<address>:<port>``: the ``Host`` header a request for ``scheme`` must carry."""
        return f"{self.address}:{self.port(scheme)}"

    def url(self, scheme: str, path: str) -> str:
        """The URL of ``path`` (starting with ``/``) on this host."""
        return self.origin(scheme) + path


@dataclass(frozen=True)
class WebHosts:
    """The running hosts by name, the CA file their HTTPS certificates chain to (PEM), the base64
    sha256 of each certificate's public key (Chromium's ``--ignore-certificate-errors-spki-list``, as
    Chromium has no CA file option), and ``closed_port``: a port of the first host's address that is
    bound but not listening (a connection to it is refused) while the hosts run."""

    hosts: dict[str, WebHost]
    ca_file: Path
    spki_hashes: tuple[str, ...]
    closed_port: int

    def __getitem__(self, name: str) -> WebHost:
        return self.hosts[name]

    def by_origin(self, origin: str) -> WebHost | None:
        """The host whose :meth:`WebHost.origin` (either scheme) is ``origin``, else None."""
        for host in self.hosts.values():
            if origin in (host.origin("http"), host.origin("https")):
                return host
        return None


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # (the handlers' sockets are shut down by stop(); their threads are joined there)

    def __init__(self, address: str, scheme: str, context: ssl.SSLContext | None) -> None:
        self.scheme, self.context = scheme, context
        self.connections: set[socket.socket] = set()
        self.threads: set[threading.Thread] = set()
        self.serial = 0
        self.lock = threading.Lock()
        self.port_hold: socket.socket | None = None
        """Its port held on 127.0.0.1 (harness.loopback): no agent's or proxy's listener has it."""
        super().__init__((address, 0), _Handler)

    @classmethod
    def unshared(cls, address: str, scheme: str, context: ssl.SSLContext | None) -> _Server:
        """A server on ``address`` whose port number no listener of 127.0.0.1 has while it runs
        (:func:`harness.loopback.hold_port`: the ``agent`` egress group refuses agents' ports on every
        local address)."""
        for _ in range(100):
            server = cls(address, scheme, context)
            try:
                server.port_hold = hold_port(address, server.server_address[1])
            except OSError:  # taken on 127.0.0.1: another port
                server.server_close()
                continue
            return server
        raise RuntimeError(f"no port on {address} that is free on 127.0.0.1 too, in 100 tries")

    @property
    def origin(self) -> str:
        host, port = self.server_address[:2]
        return f"{self.scheme}://{host!s}:{port}"

    def process_request(self, request: Any, client_address: Any) -> None:
        # The stdlib's, keeping the thread so stop() can join it.
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address),
                                  daemon=True, name=f"webhost {self.origin}")
        with self.lock:
            self.threads.add(thread)
        thread.start()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.context is not None:
            request.settimeout(IDLE_TIMEOUT)
            try:  # (wrapping detaches the plain socket: the wrapped one is closed below)
                request = self.context.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                return  # a client that gave up or distrusts the CA: its own business
        with self.lock:
            self.serial += 1
            serial = self.serial
            self.connections.add(request)
        try:
            _Handler(request, client_address, self, serial)
        finally:
            with self.lock:
                self.connections.discard(request)
            if self.context is not None:
                with contextlib.suppress(OSError):
                    request.close()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self.port_hold is not None:
            self.port_hold.close()
        with self.lock:
            connections, threads = list(self.connections), list(self.threads)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(STOP_TIMEOUT)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # persistent connections
    timeout = IDLE_TIMEOUT
    server: _Server

    def __init__(self, request: Any, client_address: Any, server: _Server, serial: int = 0) -> None:
        self.serial, self.requests = serial, 0
        super().__init__(request, client_address, server)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: the tests read the answers

    # Every method goes through one handler.
    def do_GET(self) -> None:
        self._handle()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_GET

    def do_OPTIONS(self) -> None:
        self._read_body()
        self._answer(204, b"", "text/plain")

    def _read_body(self) -> tuple[bytes, bool]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            total = 0
            while True:
                line = self.rfile.readline(1024)
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts), True
                total += size
                if total > MAX_BODY_BYTES:
                    raise ValueError("body too large")
                parts.append(self.rfile.read(size))
                self.rfile.readline(16)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise ValueError("body too large")
        return self.rfile.read(length), False

    def _handle(self) -> None:
        self.requests += 1
        try:
            body, chunked = self._read_body()
        except ValueError:
            self.close_connection = True
            self._answer(413, b"body too large or malformed\n", "text/plain")
            return
        url = urlsplit(self.path)
        route = url.path
        if route.startswith(("/bytes/", "/chunked/")):
            try:
                size = int(route.rsplit("/", 1)[1])
            except ValueError:
                self._answer(400, b"bad size\n", "text/plain")
                return
            data = page_bytes(self.server.origin, min(size, MAX_BODY_BYTES))
            if route.startswith("/bytes/"):
                self._answer(200, data, "application/octet-stream")
            else:
                self._answer_chunked(data)
            return
        if route == "/redirect":
            target = parse_qs(url.query).get("to", [""])[0]
            self._answer(302, b"", "text/plain", extra={"Location": target})
            return
        if route.startswith("/status/"):
            self._answer_status(route.rsplit("/", 1)[1])
            return
        if route == "/page":
            self._answer(200, b"<!doctype html><title>identity</title><p>" + self.server.origin.encode(),
                         "text/html")
            return
        host, port = self.server.server_address[:2]
        echo = {
            "identity": {"address": host, "port": port, "scheme": self.server.scheme, "origin": self.server.origin},
            "method": self.command, "target": self.path, "path": url.path, "version": self.request_version,
            "headers": [[name, value] for name, value in self.headers.items()],
            "body": {"length": len(body), "sha256": sha256_hex(body), "chunked": chunked},
            "connection": {"serial": self.serial, "request": self.requests},
        }
        query = parse_qs(url.query)
        extra = {"Connection": "close"} if query.get("close") else None  # (the stdlib then closes it)
        self._answer(200, json.dumps(echo).encode(), "application/json", extra=extra)
        if query.get("linger"):  # close the connection, silently, once idle that long (seconds)
            self.connection.settimeout(float(query["linger"][0]))

    def _answer_status(self, code: str) -> None:
        if code not in ("204", "304"):
            self._answer(400, b"only /status/204 and /status/304\n", "text/plain")
            return
        self.send_response(int(code))
        self._common_headers("text/plain")
        if code == "304":  # (a 304 may name the length of the page it stands for: it has no body)
            self.send_header("Content-Length", "1234")
            self.send_header("ETag", '"identity"')
        self.end_headers()

    def _common_headers(self, content_type: str) -> None:
        self.send_header("Content-Type", content_type)
        self.send_header("X-Identity", self.server.origin)
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Access-Control-Allow-Methods", "GET, POST, PUT, DELETE, PATCH, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "authorization, content-type, x-ck-id")
        self.send_header("Access-Control-Expose-Headers", "*")
        self.send_header("Access-Control-Max-Age", "0")

    def _answer(self, status: int, body: bytes, content_type: str, *, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self._common_headers(content_type)
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _answer_chunked(self, body: bytes) -> None:
        self.send_response(200)
        self._common_headers("application/octet-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for start in range(0, len(body), CHUNK_BYTES):
            piece = body[start:start + CHUNK_BYTES]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")


def _spki_hash(cert_pem: bytes) -> str:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    key = x509.load_pem_x509_certificate(cert_pem).public_key()
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


@contextlib.contextmanager
def web_hosts(directory: Path, addresses: dict[str, str] | None = None) -> Iterator[WebHosts]:
    """Start an identity host (HTTP and HTTPS, ports the OS picks) on each loopback address of
    ``addresses`` (name → 127.0.0.x; default :data:`HOST_ADDRESSES`), the test CA written to
    ``directory/ca.pem``; stop them all on leaving (see the module docstring). Blocking, ~50 ms.
    Raises ValueError for an address outside 127.0.0.0/8 (tests target loopback only), OSError when
    an address cannot be bound."""
    import ipaddress

    import trustme

    addresses = dict(HOST_ADDRESSES if addresses is None else addresses)
    for address in addresses.values():
        if ipaddress.ip_address(address) not in ipaddress.ip_network("127.0.0.0/8"):
            raise ValueError(f"identity hosts live on loopback addresses only, not {address}")
    ca = trustme.CA()
    directory.mkdir(parents=True, exist_ok=True)
    ca_file = directory / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    servers: list[_Server] = []
    hosts: dict[str, WebHost] = {}
    spki: list[str] = []
    closed = socket.socket()
    try:
        closed.bind((next(iter(addresses.values())), 0))  # (never listens: connections are refused)
        for name, address in addresses.items():
            cert = ca.issue_cert(address)
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            cert.configure_cert(context)
            spki.append(_spki_hash(cert.cert_chain_pems[0].bytes()))
            plain, tls = _Server.unshared(address, "http", None), _Server.unshared(address, "https", context)
            servers += [plain, tls]
            for server in (plain, tls):
                threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True,
                                 name=f"webhost {server.origin} accept").start()
            hosts[name] = WebHost(name, address, plain.server_address[1], tls.server_address[1])
        yield WebHosts(hosts, ca_file, tuple(spki), closed.getsockname()[1])
    finally:
        closed.close()
        for server in servers:
            server.stop()
