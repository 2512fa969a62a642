"""A task's own proxies, kept in force behind the agent's: which way each request leaves the node.

A task (or its spider, or the node's environment passed on to spiders) may set ``HTTP_PROXY``,
``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY`` (lower-case names win, as curl and requests read
them): a team's rotating proxy, a company's outbound proxy. At the ``proxy`` egress level the task's
variables name the agent's proxy instead, so the agent's proxy keeps their meaning: it checks the
destination, then forwards through the task's proxy — ``http://`` proxies (absolute-form requests,
CONNECT for tunnels, their credentials sent as ``Proxy-Authorization``) and ``socks5://`` /
``socks5h://`` ones (RFC 1928, user name and password of RFC 1929; ``socks5h`` lets the proxy resolve
names). Hosts matching ``NO_PROXY`` go direct (still checked), as they would without the agent.

:func:`routes_from_env` reads the variables; :class:`Routes` picks the :class:`Route` of a request.
Raises nothing: a variable the proxy cannot follow (another scheme, a malformed URL) is reported in
:attr:`Routes.problems` (said once in the task log) and its requests fail with 502 naming it — never
sent direct, which would bypass the task's own proxy silently.
"""

from __future__ import annotations

import base64
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from ckagent.containment.egress.proxy.errors import BadRequest
from ckagent.containment.egress.proxy.target import Target, parse_host

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
"""The variables a task's own proxies are read from (also in lower case, which wins)."""


@dataclass(frozen=True)
class Route:
    """How a request leaves the node: ``kind`` ``direct``, ``http`` (an HTTP proxy) or ``socks5``;
    ``proxy`` the proxy's address (None: direct); ``auth`` the ``user:password`` for it (b"" = none);
    ``remote_dns`` (socks5h) the proxy resolves names; ``shown`` the proxy's URL without its
    password (for logs)."""

    kind: str = "direct"
    proxy: Target | None = None
    auth: bytes = b""
    remote_dns: bool = False
    shown: str = "direct"

    def proxy_authorization(self) -> tuple[tuple[bytes, bytes], ...]:
        """The ``Proxy-Authorization`` header an HTTP proxy gets (none without credentials)."""
        if self.kind != "http" or not self.auth:
            return ()
        return ((b"proxy-authorization", b"Basic " + base64.b64encode(self.auth)),)


DIRECT = Route()


@dataclass(frozen=True)
class Unusable:
    """A proxy variable that cannot be followed (``reason``): its requests fail with 502."""

    variable: str
    reason: str


@dataclass
class Routes:
    """The task's proxies: ``http`` for ``http://`` requests, ``https`` for CONNECT tunnels
    (each a Route, or an Unusable variable), ``no_proxy`` the bypass entries."""

    http: Route | Unusable = DIRECT
    https: Route | Unusable = DIRECT
    no_proxy: tuple[str, ...] = ()
    problems: list[str] = field(default_factory=list)
    """What the task log should say once (a variable that cannot be followed)."""

    @property
    def chained(self) -> list[str]:
        """The proxies in use (URLs without passwords), for the task log's one line."""
        shown = [r.shown for r in (self.http, self.https) if isinstance(r, Route) and r.kind != "direct"]
        return list(dict.fromkeys(shown))

    def describe(self) -> str:
        """``http:// through http://u:***@proxy:3128, https:// direct; NO_PROXY: .internal`` (no password)."""
        def way(route: Route | Unusable) -> str:
            if isinstance(route, Unusable):
                return f"refused ({route.variable} cannot be followed)"
            return "direct" if route.kind == "direct" else f"through {route.shown}"

        text = f"http:// {way(self.http)}, https:// {way(self.https)}"
        return text + (f"; NO_PROXY: {', '.join(self.no_proxy)}" if self.no_proxy else "")

    def route(self, target: Target, tunnel: bool) -> Route | Unusable:
        """The way a request to ``target`` leaves (``tunnel``: CONNECT, else a plain http:// request)."""
        if self.no_proxy and bypassed(target, self.no_proxy):
            return DIRECT
        return self.https if tunnel else self.http


def routes_from_env(env: Mapping[str, str]) -> Routes:
    """The task's proxies from its environment (the variables of :data:`PROXY_VARIABLES`). Never raises."""
    def get(name: str) -> str:
        return (env.get(name.lower()) or env.get(name) or "").strip()

    routes = Routes()
    everything = get("ALL_PROXY")
    for attr, name in (("http", "HTTP_PROXY"), ("https", "HTTPS_PROXY")):
        value, source = get(name), name
        if not value and everything:
            value, source = everything, "ALL_PROXY"
        if value:
            route = parse_route(value, source)
            if isinstance(route, Unusable):
                routes.problems.append(f"{source}: {route.reason}")
            setattr(routes, attr, route)
    routes.no_proxy = tuple(e.strip().lower() for e in get("NO_PROXY").split(",") if e.strip())
    routes.problems = list(dict.fromkeys(routes.problems))
    return routes


def parse_route(url: str, variable: str) -> Route | Unusable:
    """One proxy URL (``http://user:pass@host:port``, ``socks5h://host:1080``; a bare ``host:port``
    means http) → Route, or Unusable saying why."""
    text = url if "://" in url else "http://" + url
    try:
        parts = urlsplit(text)
        scheme = parts.scheme.lower()
        user, password = unquote(parts.username or ""), unquote(parts.password or "")
        netloc = parts.netloc.rpartition("@")[2]
    except ValueError as exc:
        return Unusable(variable, f"not a proxy URL ({exc})")
    if scheme not in ("http", "socks5", "socks5h"):
        why = "HTTPS to the proxy itself is not supported" if scheme == "https" else f"the scheme {scheme}:// is not supported"
        return Unusable(variable, f"{why}; use an http:// or socks5:// proxy")
    try:
        proxy = parse_host(netloc.encode("utf-8"), 80 if scheme == "http" else 1080)
    except BadRequest as exc:
        return Unusable(variable, f"its host: {exc}")
    auth = f"{user}:{password}".encode() if user or password else b""
    shown = f"{scheme}://{user + ':***@' if auth else ''}{proxy.authority}"
    kind = "http" if scheme == "http" else "socks5"
    return Route(kind, proxy, auth, remote_dns=scheme == "socks5h", shown=shown)


def bypassed(target: Target, entries: tuple[str, ...]) -> bool:
    """True when ``target`` matches a NO_PROXY entry: ``*``; a name and its subdomains (``example.com``,
    ``.example.com``); an IP address or network (``10.0.0.0/8``); each optionally with ``:port``."""
    host = target.host
    for entry in entries:
        if entry == "*":
            return True
        name, port = entry, ""
        if entry.startswith("["):
            name, _, rest = entry[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
        elif entry.count(":") == 1:
            name, _, port = entry.partition(":")
        if port and (not port.isdigit() or int(port) != target.port):
            continue
        if target.ip:
            try:
                if ipaddress.ip_address(host) in ipaddress.ip_network(name, strict=False):
                    return True
            except ValueError:
                pass
            continue
        name = name.lstrip("*").lstrip(".").rstrip(".")
        if name and (host == name or host.endswith("." + name)):
            return True
    return False
