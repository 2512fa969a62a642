"""Where a request goes, read strictly: its target, its host, and the headers that go on with it.

A forward proxy gets absolute-form targets (``GET http://host:port/path?q``) and, for tunnels,
authority-form ones (``CONNECT host:port``). Everything here is pure and raises
:class:`~ckagent.containment.egress.proxy.errors.BadRequest` with what was wrong and what is expected:
a malformed host must become a 400 for that one request, never an exception further up (an IDNA
error from ``getaddrinfo`` once stopped the whole agent).

Hosts: an IPv4 or bracketed IPv6 literal (no zone id), or a DNS name of labels of 1–63 letters,
digits, ``-`` or ``_`` (at most 253 characters, one trailing dot allowed); a non-ASCII name is
encoded with IDNA (UTS 46, the ``idna`` package httpx depends on). Userinfo (``user@host``) and
percent-encoded hosts are refused: a browser never sends them, and they hide where a request goes.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

import h11

from ckagent.containment.egress.proxy.errors import BadRequest

MAX_HOST_CHARS = 253
_LABEL = re.compile(rb"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authorization", b"proxy-authenticate", b"proxy-connection",
    b"te", b"trailer", b"transfer-encoding", b"upgrade",
})
"""Headers that describe one connection, not the message (RFC 9110 7.6.1), and never pass the proxy.
``Transfer-Encoding`` is re-made by h11 from the body it sends; ``Content-Length`` passes."""


@dataclass(frozen=True)
class Target:
    """A destination: ``host`` (a lower-case ASCII DNS name, or an IP literal without brackets),
    ``port`` (1–65535), ``ip`` (True when ``host`` is an IP literal)."""

    host: str
    port: int
    ip: bool = False

    @property
    def authority(self) -> str:
        """``host:port`` (IPv6 in brackets), as a CONNECT line and a Host header name it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def host_header(self, default_port: int = 80) -> bytes:
        """The Host header for this target (the port left out when it is ``default_port``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port == default_port else f"{host}:{self.port}").encode("ascii")


def parse_host(raw: bytes, default_port: int | None) -> Target:
    """``host[:port]`` (authority without userinfo) → Target. ``default_port`` None: the port is
    required (CONNECT). Raises BadRequest."""
    text = _text(raw, "the host")
    if "@" in text:
        raise BadRequest("a user name in the URL (user@host) is not accepted; send credentials in headers")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise BadRequest(f"unbalanced '[' in the host {text!r}")
        host, rest = text[1:end], text[end + 1:]
        if rest and not rest.startswith(":"):
            raise BadRequest(f"unexpected {rest!r} after the IPv6 address")
        try:
            address = ipaddress.IPv6Address(host)
        except ValueError:
            raise BadRequest(f"{host!r} is not an IPv6 address (zone ids are not accepted)") from None
        return Target(str(address), _port(rest[1:] if rest else "", default_port, text), ip=True)
    host, sep, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if sep and ":" in host:
        raise BadRequest(f"an IPv6 address in a URL goes in brackets: [{text}]")
    port = _port(port_text if sep else "", default_port, text)
    return Target(*_hostname(host), port) if not _is_ipv4(host) else Target(host, port, ip=True)


def parse_absolute(target: bytes) -> tuple[Target, bytes]:
    """An absolute-form request target → (Target, the origin-form target to send on). Only
    ``http://`` is routed this way (HTTPS goes through CONNECT). Raises BadRequest."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() != b"http":
        if target.startswith(b"/"):
            raise BadRequest("this is a forward proxy: send the whole URL (GET http://host/path), not a path")
        if scheme.lower() in (b"https", b"wss", b"ws"):
            raise BadRequest(f"{scheme.decode('ascii', 'replace')}:// goes through a CONNECT tunnel, not a proxied GET")
        raise BadRequest("expected an http:// URL as the request target")
    end = len(rest)
    for stop in (b"/", b"?", b"#"):
        found = rest.find(stop)
        if 0 <= found < end:
            end = found
    authority, tail = rest[:end], rest[end:]
    if not authority:
        raise BadRequest("the URL has no host")
    path = tail.split(b"#", 1)[0]
    if not path.startswith(b"/"):
        path = b"/" + path
    return parse_host(authority, 80), path


def parse_connect(target: bytes) -> Target:
    """A CONNECT target (``host:port``) → Target. Raises BadRequest."""
    return parse_host(target, None)


def forwarded_headers(headers: list[tuple[bytes, bytes]], host: bytes,
                      extra: tuple[tuple[bytes, bytes], ...] = ()) -> list[tuple[bytes, bytes]]:
    """A request's headers as they go on, names as the client wrote them and in its order (crawlers
    choose both): hop-by-hop ones (and those ``Connection`` names) out, ``Host`` the target's
    (whatever the client sent), ``extra`` added (an upstream proxy's credentials),
    ``Transfer-Encoding: chunked`` where the body was chunked."""
    named = _connection_names(headers)
    out: list[tuple[bytes, bytes]] = []
    chunked = False
    host_at = -1
    for name, value in headers:
        lower = name.lower()
        if lower == b"transfer-encoding":
            chunked = True
        if lower == b"host" and host_at < 0:
            host_at = len(out)
            out.append((name, host))
            continue
        if lower in HOP_BY_HOP or lower in named or lower == b"host" or \
                (lower == b"expect" and value.lower() != b"100-continue"):
            continue
        out.append((name, value))
    if host_at < 0:
        out.insert(0, (b"Host", host))
    if chunked:
        out.append((b"Transfer-Encoding", b"chunked"))
    out.extend(extra)
    return out


def returned_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A response's headers as they go back (names as the destination wrote them): hop-by-hop ones
    (and those ``Connection`` names) out. (h11 adds the framing the client's connection needs.)"""
    named = _connection_names(headers)
    kept = [(n, v) for n, v in headers if n.lower() not in HOP_BY_HOP and n.lower() not in named]
    if any(n.lower() == b"transfer-encoding" for n, _ in headers):  # chunked upstream: the length is unknown
        kept = [(n, v) for n, v in kept if n.lower() != b"content-length"]
    return kept


def request_headers(event: h11.Request) -> list[tuple[bytes, bytes]]:
    """The request's headers as (name as sent, value) pairs. Raises BadRequest for a request that
    could be read two ways (both Content-Length and Transfer-Encoding: a smuggling attempt)."""
    headers = event.headers.raw_items()
    names = {n.lower() for n, _ in headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        raise BadRequest("both Content-Length and Transfer-Encoding: the body's length is ambiguous")
    return headers


def _connection_names(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    return {token.strip().lower() for n, v in headers if n.lower() == b"connection" for token in v.split(b",")}


def _text(raw: bytes, what: str) -> str:
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"{what} is not ASCII or UTF-8") from None
    if not text or any(c.isspace() or c in "%\\/\x7f" or ord(c) < 32 for c in text):
        raise BadRequest(f"{what} {text!r} is malformed (empty, spaces, control characters or %-escapes)")
    return text


def _port(text: str, default: int | None, whole: str) -> int:
    if not text:
        if default is None:
            raise BadRequest(f"{whole!r}: a port is required (host:port)")
        return default
    if not text.isdigit() or len(text) > 5 or not 1 <= int(text) <= 65535:
        raise BadRequest(f"{whole!r}: the port must be 1..65535")
    return int(text)


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def _hostname(host: str) -> tuple[str]:
    """A DNS name, validated and IDNA-encoded (lower-case ASCII). Raises BadRequest."""
    if not host.isascii():
        import idna  # (a dependency of httpx; imported only for the rare non-ASCII host)

        try:
            host = idna.encode(host, uts46=True).decode("ascii")
        except (idna.IDNAError, UnicodeError, ValueError) as exc:
            raise BadRequest(f"the host {host!r} is not a valid internationalised name ({exc})") from None
    name = host.lower()
    bare = name[:-1] if name.endswith(".") else name
    if not bare or len(bare) > MAX_HOST_CHARS:
        raise BadRequest(f"the host name must have 1..{MAX_HOST_CHARS} characters")
    for label in bare.encode("ascii").split(b"."):
        if not _LABEL.fullmatch(label):
            raise BadRequest(f"the host {host!r} has a malformed label (1-63 letters, digits, '-' or '_' each, "
                             "no empty label)")
    return (bare,)
