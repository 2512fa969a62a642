"""How one call of the master goes on the wire: its request built from parts kept ready, sent on the
transport httpx's client would use for it.

:class:`Wire` is the sending half of :class:`ckagent.master.client.MasterClient` for its calls (not
its downloads, which follow redirects through the client). Per request it does only what a call
needs, which is most of the agent's CPU per request saved (bench: ~1.6 → ~1.1 ms for a poll):

- the URL: ``server.url`` joined with a path, parsed once per path and kept (a task's few paths are
  reused: the long poll, each stream's batches; httpx would parse a string twice per request); a
  URL with query parameters (the poll's) is parsed once with them (``urlencode``: ``int``, ``float``
  and ``str`` values as httpx writes them);
- the headers: the client's defaults (``User-Agent: ckagent``, ``Accept``, ``Accept-Encoding``,
  ``Connection``) and the ``Authorization`` header, encoded once per key;
- the body: JSON encoded here (as httpx encodes it: UTF-8, compact, no NaN), or bytes given;
- the transport: the one the client picks for the URL (proxy variables and mounts honoured, as with
  ``client.request``), called directly. What the client would add per request and a call never uses
  is left out: cookies (the protocol has none; a ``Set-Cookie`` of the master is neither kept nor
  sent back), the auth and redirect flows (a call never follows a redirect: a 3xx is returned and
  classified as not the protocol, as before), event hooks, its default merging and its log line.

The body is read in full before :meth:`Wire.send` returns (as ``client.request`` does); on any error
or cancellation the response is closed first. Raises what httpx's transport raises (``httpx.TransportError``
and its kinds, with the request attached as the client attaches it), ``httpx.InvalidURL`` and
``UnicodeEncodeError`` for a URL or header httpx cannot send.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

import httpx

URL_CACHE_SIZE = 256
"""Request URLs kept parsed (see :meth:`Wire.url`); the cache starts over when full."""
SENT_ONCE_BYTES = 64 * 1024
"""Request bodies from this size on are handed to httpx as :class:`SentOnce` (see there)."""
_JSON = (b"Content-Type", b"application/json")


class SentOnce:
    """A request body httpx sends as it is (one piece, ``Content-Length`` given, not chunked) and that
    lets go of its bytes once they are sent.

    httpx keeps every answered request in a reference cycle (the response and the stream bound to it;
    the request hangs off the response) that only the cyclic GC frees, often a full collection later.
    With a bytes body that cycle held each batch's body (a stream batch is up to 1 MiB): a dozen
    of them at a time while a 100 MB item file was shipped, and the heap grew with the holes they
    left (bench/outputs.py: agent peak RSS 77 MB). The cycle now holds this empty shell."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def __aiter__(self) -> SentOnce:
        return self

    async def __anext__(self) -> bytes:
        data, self._data = self._data, b""
        if not data:
            raise StopAsyncIteration
        return data


class Wire:
    """Builds and sends the calls of one master (``base_url`` without a trailing slash) over ``client``'s
    transports (see module docstring). :attr:`client` may be replaced (a jammed pool's rebuild)."""

    def __init__(self, base_url: str, client: httpx.AsyncClient) -> None:
        self._base_url = base_url
        self._urls: dict[str, httpx.URL] = {}
        self._auth: tuple[str, tuple[bytes, bytes]] | None = None
        self.client = client

    @property
    def client(self) -> httpx.AsyncClient:
        """The client whose transports and default headers the calls use."""
        return self._client

    @client.setter
    def client(self, client: httpx.AsyncClient) -> None:
        self._client = client
        self._defaults = list(client.headers.raw)

    def url(self, path: str) -> httpx.URL:
        """``path`` (relative to server.url, or an absolute URL) as the URL the request goes to, parsed
        once. Raises httpx.InvalidURL as httpx does."""
        url = self._urls.get(path)
        if url is None:
            if len(self._urls) >= URL_CACHE_SIZE:
                self._urls.clear()
            url = httpx.URL(path if "://" in path else f"{self._base_url}/{path.lstrip('/')}")
            self._urls[path] = url
        return url

    def bearer(self, api_key: str) -> tuple[bytes, bytes]:
        """The ``Authorization`` header of ``api_key``, encoded once per key (UnicodeEncodeError for a
        key that is not ASCII, as httpx would raise)."""
        if self._auth is None or self._auth[0] != api_key:
            self._auth = (api_key, (b"Authorization", f"Bearer {api_key}".encode("ascii")))
        return self._auth[1]

    async def send(
        self, method: str, path: str, *, io_timeout: float, auth: tuple[bytes, bytes] | None = None,
        json: Any = None, content: bytes | None = None, content_type: str | None = None,
        params: Mapping[str, str | int | float] | None = None, headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """One request, its answer read in full. ``json`` (encoded here) or ``content`` (sent as it is,
        with ``content_type``; a large one as :class:`SentOnce`) is the body; ``auth`` is a header of
        :meth:`bearer`; ``io_timeout`` (seconds) bounds each connect, read, write and the wait for a
        connection of the pool. Raises: see module docstring; cancellation closes the response."""
        # A query is parsed once with its URL (merging params into a parsed URL parses it twice).
        url = httpx.URL(f"{self.url(path)}?{urlencode(params)}") if params else self.url(path)
        sent = self._defaults.copy()
        if auth is not None:
            sent.append(auth)
        if headers:
            sent.extend((name.encode("ascii"), value.encode("ascii")) for name, value in headers.items())
        body: bytes | SentOnce | None = content
        if json is not None:
            body = jsonlib.dumps(json, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            sent.append(_JSON)
        elif content is not None:
            sent.append((b"Content-Type", (content_type or "application/json").encode("ascii")))
            if len(content) >= SENT_ONCE_BYTES:
                body = SentOnce(content)
                sent.append((b"Content-Length", str(len(content)).encode()))
        request = httpx.Request(method, url, headers=sent, content=body, extensions={
            "timeout": {"connect": io_timeout, "read": io_timeout, "write": io_timeout, "pool": io_timeout}})
        transport = self._client._transport_for_url(url)  # what client.request would use (proxies, mounts)
        try:
            response = await transport.handle_async_request(request)
        except httpx.TransportError as exc:
            exc.request = request  # as the client does: the error says which request it was
            raise
        response.request = request
        try:
            await response.aread()
        except BaseException as exc:
            await response.aclose()
            if isinstance(exc, httpx.TransportError):
                exc.request = request
            raise
        return response
