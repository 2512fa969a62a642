"""A site to crawl for the tests of crawls that survive their node (issue 38): many pages, served at a
steady rate, every fetch counted per URL.

:class:`CrawlSite` serves, on 127.0.0.1 (HTTP/1.1 with h11, connections kept alive as Scrapy, urllib3
and undici keep them), a paginated listing with item pages::

    /list/<n>    n in 0 .. listings-1: <h1>listing n</h1>, links to its ``per_listing`` item pages
                 (<a class="item" href="/item/<i>">), then to the next listing (<a class="next">)
    /item/<i>    i in 0 .. listings * per_listing - 1: <h1>item i</h1> and a link back to its listing
    /hold        answered only once :meth:`CrawlSite.release` is called (a task that holds its node)
    anything else: 404

Every page is meant to give one item, so a crawl of the whole site gives :attr:`CrawlSite.pages`
items. The pages are answered at ``rate`` pages per second across all connections (each request takes
the next free slot of a clock shared by every connection; no burst): a crawl of the site takes
``pages / rate`` seconds however many requests the crawler keeps in flight, so "40 % of the crawl" is a
time and "one checkpoint interval's worth of pages" a count. :attr:`CrawlSite.fetches` counts the
requests per path, at arrival (a request that was in flight when its node died counts: the resumed
crawl fetches it again).
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

__all__ = ["CrawlSite", "Fetch"]

_PAGE = re.compile(r"^/(list|item)/(\d{1,9})$")


@dataclass(frozen=True)
class Fetch:
    """One request the site received: its ``path`` and when (``time.time()``-like wall seconds, from
    ``trio.current_time()`` offset to the wall clock: comparable with the agents' timestamps)."""

    path: str
    at: float


@dataclass
class CrawlSite:
    """The site (module docstring). ``listings`` × (1 + ``per_listing``) pages at ``rate`` pages/s.

    Start it in a nursery: ``port = await nursery.start(site.serve)``; :attr:`url` is its root.
    Not thread-safe: one Trio run."""

    listings: int = 50
    per_listing: int = 20
    rate: float = 100.0
    hold_timeout: float = 600.0
    """Seconds a /hold request waits for :meth:`release` at most (then it is answered anyway)."""
    fetches: Counter[str] = field(default_factory=Counter)
    log: list[Fetch] = field(default_factory=list)
    connections: int = 0
    port: int = 0
    _next_slot: float = 0.0
    _released: trio.Event = field(default_factory=trio.Event)
    _waiters: list[tuple[int, trio.Event]] = field(default_factory=list)
    _wall_offset: float = 0.0

    @property
    def pages(self) -> int:
        """Pages of the site (each gives one item)."""
        return self.listings * (1 + self.per_listing)

    @property
    def url(self) -> str:
        """The site's root URL (``http://127.0.0.1:<port>``), once serving."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def start_url(self) -> str:
        """Where a crawl of the whole site starts: the first listing page."""
        return f"{self.url}/list/0"

    def all_paths(self) -> list[str]:
        """Every page's path: the listings, then the items."""
        return ([f"/list/{n}" for n in range(self.listings)] +
                [f"/item/{i}" for i in range(self.listings * self.per_listing)])

    def fetched(self) -> int:
        """Page fetches so far (every page, every time; /hold and 404s not counted)."""
        return sum(self.fetches.values())

    def fetched_twice(self) -> int:
        """Fetches beyond the first of each page: the work a crawl did again."""
        return sum(count - 1 for count in self.fetches.values() if count > 1)

    def seconds(self, pages: int) -> float:
        """Seconds the site takes to serve ``pages`` pages at its rate."""
        return pages / self.rate

    async def reached(self, fetches: int) -> None:
        """Return once the site has served ``fetches`` page fetches (an event, no polling); bound the
        wait with ``trio.fail_after`` at the call site."""
        if self.fetched() >= fetches:
            return
        event = trio.Event()
        self._waiters.append((fetches, event))
        await event.wait()

    def release(self) -> None:
        """Answer every /hold request, now and later."""
        self._released.set()

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve on 127.0.0.1 (a free port) until cancelled (startable: ``started(port)``)."""
        self._wall_offset = time.time() - trio.current_time()
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._client, listeners)

    # ------------------------------------------------------------------------------ one connection

    async def _client(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                while True:
                    event = await self._next(conn, stream)
                    if not isinstance(event, h11.Request):
                        return  # the client closed, or sent what a GET crawler does not
                    while not isinstance(await self._next(conn, stream), h11.EndOfMessage):
                        pass  # (a body nobody reads)
                    status, body = await self._page(event.target.decode("ascii", "replace"))
                    out = conn.send(h11.Response(status_code=status, headers=[
                        (b"content-type", b"text/html; charset=utf-8"),
                        (b"content-length", str(len(body)).encode())]))
                    await stream.send_all(out + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()
            except (h11.RemoteProtocolError, h11.LocalProtocolError, trio.BrokenResourceError,
                    trio.ClosedResourceError):
                return  # (a crawler killed mid-request resets its connections)

    @staticmethod
    async def _next(conn: h11.Connection, stream: trio.SocketStream) -> Any:
        """The next h11 event of ``conn``, reading from ``stream`` as needed."""
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await stream.receive_some(65536))

    async def _page(self, target: str) -> tuple[int, bytes]:
        path = target.split("?", 1)[0]
        if path == "/hold":
            with trio.move_on_after(self.hold_timeout):
                await self._released.wait()
            return 200, b"<html><body><h1>released</h1></body></html>"
        match = _PAGE.match(path)
        if match is None:
            return 404, b"not here"
        kind, number = match.group(1), int(match.group(2))
        items = self.listings * self.per_listing
        if (kind == "list" and number >= self.listings) or (kind == "item" and number >= items):
            return 404, b"not here"
        self.fetches[path] += 1
        self.log.append(Fetch(path, trio.current_time() + self._wall_offset))
        total = self.fetched()
        for waiter in [w for w in self._waiters if total >= w[0]]:
            self._waiters.remove(waiter)
            waiter[1].set()
        now = trio.current_time()
        slot = max(now, self._next_slot)
        self._next_slot = slot + 1 / self.rate
        await trio.sleep_until(slot)
        if kind == "item":
            listing = number // self.per_listing
            body = f'<h1>item {number}</h1><a class="up" href="/list/{listing}">listing {listing}</a>'
        else:
            first = number * self.per_listing
            links = "".join(f'<li><a class="item" href="/item/{i}">item {i}</a></li>'
                            for i in range(first, first + self.per_listing))
            more = f'<a class="next" href="/list/{number + 1}">next</a>' if number + 1 < self.listings else ""
            body = f"<h1>listing {number}</h1><ul>{links}</ul>{more}"
        return 200, f"<html><head><title>{path}</title></head><body>{body}</body></html>".encode()

    def interval_worth(self, seconds: float, in_flight: int) -> int:
        """The pages a crawl at the site's rate fetches in ``seconds``, plus ``in_flight`` requests
        (what a crawler had asked for and not yet got at a checkpoint): the bound of the pages a resumed
        crawl may fetch twice when its checkpoint was ``seconds`` old."""
        return math.ceil(seconds * self.rate) + in_flight
