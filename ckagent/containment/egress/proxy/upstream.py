"""The proxy's side towards the destinations: name resolution checked against the task's policy,
connections (direct, through the task's HTTP proxy, or through its SOCKS5 proxy), and a pool of
kept-alive connections per task and destination.

Every address a connection is opened to is judged first (:meth:`Dialer.judge`): the name is resolved
once, each address is checked, and only an address that was checked is connected to — no second
lookup, so DNS rebinding gains nothing. Through a task's own proxy the proxy's address is judged the
same way, and so is the destination: an IP literal as it is, a name by what it resolves to here (a
name that does not resolve here is left to the task's proxy, which resolves it in its own network).

Errors: :class:`~.errors.Refused` (every address denied; ``refused`` lists them),
:class:`~.errors.UpstreamError` / :class:`~.errors.UpstreamTimeout` (cannot resolve, cannot connect, a
proxy that says no). Cancellation: any await may be cancelled; a connection half made is closed.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import h11
import trio

from ckagent.containment.egress.proxy.errors import ChainRefused, Refused, UpstreamError, UpstreamTimeout
from ckagent.containment.egress.proxy.routes import Route
from ckagent.containment.egress.proxy.target import Target

Resolve = Callable[[str, int], Awaitable[list[str]]]
"""(host, port) → its addresses in the resolver's order. Raises OSError (or UnicodeError)."""

Judge = Callable[[str, int], bool]
"""(address, port) → True when the task's policy denies it."""

MAX_RESPONSE_HEAD_BYTES = 65536
"""Largest head a destination or an upstream proxy may answer with (h11's limit on incomplete events)."""

NAME_CACHE_SECONDS = 30.0
"""How long a chained request's local check of a name is reused (seconds)."""


async def system_resolve(host: str, port: int) -> list[str]:
    """``getaddrinfo`` in a worker thread (Trio's), addresses deduplicated in order. Raises OSError."""
    infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def new_connection() -> h11.Connection:
    """h11's state of a connection towards a destination (client role), at its first request."""
    return h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_RESPONSE_HEAD_BYTES)


@dataclass(eq=False)
class Upstream:
    """One open connection towards a destination: ``stream``, its h11 state ``conn`` (client
    role), the pool ``key`` it belongs to, and ``absolute`` (True: it talks to an HTTP proxy, so
    requests go in absolute form)."""

    stream: trio.SocketStream
    key: tuple[object, ...]
    absolute: bool = False
    conn: h11.Connection = field(default_factory=lambda: new_connection())
    idle_since: float = 0.0
    reused: bool = False
    via: str = ""
    """The task's HTTP proxy it goes through (its URL without password), "" when direct."""
    passed: bool = False
    """The last answer's body went by h11 (socket to socket) and the connection may be kept: its
    next request starts a fresh h11 state."""

    async def aclose(self) -> None:
        """Close the connection (never raises; cancellation: closes at once)."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await trio.aclose_forcefully(self.stream)


class Pool:
    """Idle kept-alive connections of one task, by key (destination and route). Not thread-safe
    (the Trio thread only). ``max_idle`` per key and ``max_total`` in all (a crawl across many hosts
    must not hold a descriptor per host it ever met: the least recently used go first);
    ``idle_timeout`` seconds before an idle one is dropped (looked at whenever the pool is used); one
    whose destination closed it (readable while idle) is never handed out."""

    def __init__(self, max_idle: int = 16, idle_timeout: float = 60.0, max_total: int = 64) -> None:
        self.max_idle, self.idle_timeout, self.max_total = max_idle, idle_timeout, max_total
        self._idle: dict[tuple[object, ...], list[Upstream]] = {}
        self._order: collections.OrderedDict[int, Upstream] = collections.OrderedDict()
        """Every idle connection, least recently idle first (by ``id``)."""

    def __len__(self) -> int:
        return len(self._order)

    def take(self, key: tuple[object, ...]) -> tuple[Upstream | None, list[Upstream]]:
        """The freshest usable idle connection of ``key`` (or None), and the stale and expired ones
        found (to close)."""
        stale = self._expired(time.monotonic())
        found = self._idle.get(key)
        while found:
            up = self._remove(found.pop())
            if _readable(up.stream):
                stale.append(up)
                continue
            up.reused = True
            return up, stale
        return None, stale

    def give(self, up: Upstream) -> list[Upstream]:
        """Keep ``up`` for the next request of its key; returns what must be closed instead (``up``
        itself when its key holds ``max_idle`` already; expired ones; the least recently used past
        ``max_total``)."""
        now = up.idle_since = time.monotonic()
        closing = self._expired(now)
        kept = self._idle.setdefault(up.key, [])
        if len(kept) >= self.max_idle:
            closing.append(up)
            return closing
        kept.append(up)
        self._order[id(up)] = up
        while len(self._order) > self.max_total:
            oldest = next(iter(self._order.values()))
            self._idle[oldest.key].remove(oldest)
            closing.append(self._remove(oldest))
        return closing

    def drain(self) -> list[Upstream]:
        """Every idle connection (the task ends: close them)."""
        out = list(self._order.values())
        self._idle.clear()
        self._order.clear()
        return out

    def _expired(self, now: float) -> list[Upstream]:
        out = []
        while self._order:
            oldest = next(iter(self._order.values()))
            if now - oldest.idle_since <= self.idle_timeout:
                break
            self._idle[oldest.key].remove(oldest)
            out.append(self._remove(oldest))
        return out

    def _remove(self, up: Upstream) -> Upstream:
        """Forget ``up`` (already out of its key's list), and its key when that list is empty."""
        self._order.pop(id(up), None)
        if not self._idle.get(up.key):
            self._idle.pop(up.key, None)
        return up


def _readable(stream: trio.SocketStream) -> bool:
    """True when an idle connection has something to read: its peer closed it (or sent junk)."""
    try:
        return bool(stream.socket.is_readable())
    except OSError:
        return True


@dataclass
class Dialer:
    """Opens connections for one task: ``judge`` its policy, ``resolve`` names, ``connect_timeout``
    seconds per connection attempt (a SOCKS or CONNECT handshake included)."""

    judge: Judge
    resolve: Resolve = system_resolve
    connect_timeout: float = 30.0
    _names: dict[tuple[str, int], tuple[float, Refused | None]] = field(default_factory=dict)

    async def checked_addresses(self, target: Target) -> list[str]:
        """The addresses of ``target`` its policy allows, in the resolver's order. Raises Refused (none
        allowed), UpstreamError (cannot resolve)."""
        if target.ip:
            addresses = [target.host]
        else:
            try:
                addresses = await self.resolve(target.host, target.port)
            except (OSError, UnicodeError, ValueError) as exc:
                raise UpstreamError(f"cannot resolve {target.host}: {_why(exc)}") from None
            if not addresses:
                raise UpstreamError(f"cannot resolve {target.host}: no address")
        allowed = [a for a in addresses if not self.judge(a, target.port)]
        if not allowed:
            raise Refused(f"egress policy: {target.authority} is denied",
                          tuple((_plain(a), target.port) for a in addresses))
        return allowed

    async def check_destination(self, target: Target) -> None:
        """For a request through the task's own proxy: the destination as this node sees it. An IP
        literal is judged as it is; a name by what it resolves to here, when it resolves (cached
        :data:`NAME_CACHE_SECONDS`). Raises Refused."""
        if target.ip:
            if self.judge(target.host, target.port):
                raise Refused(f"egress policy: {target.authority} is denied", ((_plain(target.host), target.port),))
            return
        key = (target.host, target.port)
        now = time.monotonic()
        cached = self._names.get(key)
        if cached is None or now - cached[0] > NAME_CACHE_SECONDS:
            verdict: Refused | None = None
            try:
                await self.checked_addresses(target)
            except Refused as exc:
                verdict = exc
            except UpstreamError:
                verdict = None  # not known here: the task's proxy resolves it
            if len(self._names) > 4096:
                self._names.clear()
            self._names[key] = cached = (now, verdict)
        if cached[1] is not None:
            raise cached[1]

    async def connect(self, target: Target) -> trio.SocketStream:
        """A TCP connection to an allowed address of ``target`` (tried in order). Raises Refused,
        UpstreamError, UpstreamTimeout."""
        errors: list[str] = []
        for address in await self.checked_addresses(target):
            try:
                with trio.fail_after(self.connect_timeout):
                    stream = await trio.open_tcp_stream(address, target.port)
            except trio.TooSlowError:
                errors.append(f"{_shown(address, target.port)}: timed out after {self.connect_timeout:g} s")
                continue
            except OSError as exc:
                errors.append(f"{_shown(address, target.port)}: {_why(exc)}")
                continue
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
            return stream
        if errors and all("timed out" in e for e in errors):
            raise UpstreamTimeout(f"cannot connect to {target.authority}: {'; '.join(errors)}")
        raise UpstreamError(f"cannot connect to {target.authority}: {'; '.join(errors)}")

    async def open(self, route: Route, target: Target) -> Upstream:
        """A connection for plain HTTP requests to ``target`` along ``route`` (pool key included).
        Raises Refused, UpstreamError, UpstreamTimeout."""
        if route.kind == "direct":
            return Upstream(await self.connect(target), ("direct", target.host, target.port))
        assert route.proxy is not None
        if route.kind == "http":
            return Upstream(await self.connect(route.proxy), ("http", route.proxy, route.auth), absolute=True,
                            via=route.shown)
        stream, leftover = await self.socks_tunnel(route, target)
        if leftover:  # (a SOCKS server says nothing more before the destination does)
            await trio.aclose_forcefully(stream)
            raise UpstreamError(f"the task's proxy {route.shown} sent data before the destination did")
        return Upstream(stream, ("socks", route.proxy, route.auth, target.host, target.port))

    async def tunnel(self, route: Route, target: Target) -> tuple[trio.SocketStream, bytes]:
        """A byte stream to ``target`` for a CONNECT tunnel, and what the upstream sent past its own
        answer. Raises Refused, UpstreamError, UpstreamTimeout."""
        if route.kind == "direct":
            return await self.connect(target), b""
        if route.kind == "http":
            return await self.http_tunnel(route, target)
        return await self.socks_tunnel(route, target)

    async def http_tunnel(self, route: Route, target: Target) -> tuple[trio.SocketStream, bytes]:
        """``CONNECT target`` through the task's HTTP proxy (destination checked here first)."""
        assert route.proxy is not None
        await self.check_destination(target)
        stream = await self.connect(route.proxy)
        try:
            conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_RESPONSE_HEAD_BYTES)
            authority = target.authority.encode("ascii")
            head = conn.send(h11.Request(method=b"CONNECT", target=authority,
                                         headers=[(b"host", authority), *route.proxy_authorization()]))
            with trio.fail_after(self.connect_timeout):
                await stream.send_all(head)
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await stream.receive_some(65536))
                        continue
                    break
            if not isinstance(event, h11.Response):
                raise UpstreamError(f"the task's proxy {route.shown} closed the connection instead of answering "
                                    f"CONNECT {target.authority}")
            if not 200 <= event.status_code < 300:
                what = " (it asks for credentials: check the user and password in its URL)" \
                    if event.status_code == 407 else ""
                raise ChainRefused(f"the task's proxy {route.shown} refused CONNECT {target.authority} "
                                   f"({event.status_code}){what}", event.status_code)
            return stream, conn.trailing_data[0]
        except trio.TooSlowError:
            await trio.aclose_forcefully(stream)
            raise UpstreamTimeout(f"the task's proxy {route.shown} did not answer CONNECT in time") from None
        except (h11.RemoteProtocolError, trio.BrokenResourceError, OSError) as exc:
            await trio.aclose_forcefully(stream)
            raise UpstreamError(f"the task's proxy {route.shown}: {_why(exc)}") from None
        except BaseException:  # (ChainRefused, Refused, a cancellation)
            await trio.aclose_forcefully(stream)
            raise

    async def socks_tunnel(self, route: Route, target: Target) -> tuple[trio.SocketStream, bytes]:
        """A SOCKS5 CONNECT to ``target`` through the task's proxy (RFC 1928; user/password RFC 1929).
        ``socks5h``: the proxy resolves a name; ``socks5``: it is resolved and checked here."""
        assert route.proxy is not None
        if route.remote_dns or target.ip:
            await self.check_destination(target)
            address = target.host
        else:
            address = (await self.checked_addresses(target))[0]
        stream = await self.connect(route.proxy)
        try:
            with trio.fail_after(self.connect_timeout):
                leftover = await _socks5(stream, route, address, target.port)
            return stream, leftover
        except trio.TooSlowError:
            await trio.aclose_forcefully(stream)
            raise UpstreamTimeout(f"the task's proxy {route.shown} did not answer in time") from None
        except (trio.BrokenResourceError, OSError) as exc:
            await trio.aclose_forcefully(stream)
            raise UpstreamError(f"the task's proxy {route.shown}: {_why(exc)}") from None
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise


async def _socks5(stream: trio.SocketStream, route: Route, host: str, port: int) -> bytes:
    """The SOCKS5 handshake; returns bytes received past the answer. Raises UpstreamError."""
    buffer = bytearray()

    async def need(count: int) -> bytes:
        while len(buffer) < count:
            data = await stream.receive_some(4096)
            if not data:
                raise UpstreamError(f"the task's proxy {route.shown} closed the connection")
            buffer.extend(data)
        out = bytes(buffer[:count])
        del buffer[:count]
        return out

    methods = b"\x00\x02" if route.auth else b"\x00"
    await stream.send_all(b"\x05" + bytes([len(methods)]) + methods)
    version, method = await need(2)
    if version != 5 or method not in methods:
        raise UpstreamError(f"the task's proxy {route.shown} is not a SOCKS5 proxy or refused our methods")
    if method == 2:
        user, _, password = route.auth.partition(b":")
        if len(user) > 255 or len(password) > 255:
            raise UpstreamError("the SOCKS5 user name and password must have at most 255 bytes each")
        await stream.send_all(b"\x01" + bytes([len(user)]) + user + bytes([len(password)]) + password)
        if (await need(2))[1] != 0:
            raise UpstreamError(f"the task's proxy {route.shown} refused the user name and password")
    try:
        ip = ipaddress.ip_address(host)
        addr = (b"\x01" if ip.version == 4 else b"\x04") + ip.packed
    except ValueError:
        name = host.encode("ascii")
        addr = b"\x03" + bytes([len(name)]) + name
    await stream.send_all(b"\x05\x01\x00" + addr + struct.pack(">H", port))
    version, reply, _, kind = await need(4)
    if version != 5 or reply != 0:
        raise UpstreamError(f"the task's proxy {route.shown} refused the connection to {host}:{port} "
                            f"(SOCKS reply {reply})")
    skip = {1: 4, 4: 16}.get(kind)
    if skip is None:
        skip = (await need(1))[0] if kind == 3 else -1
    if skip < 0:
        raise UpstreamError(f"the task's proxy {route.shown} sent a malformed SOCKS answer")
    await need(skip + 2)
    return bytes(buffer)


def _plain(address: str) -> str:
    """An address as refusals count it (an IPv4-mapped IPv6 address as IPv4)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def _shown(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
