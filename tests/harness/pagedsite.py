"""Sites for the resumable example spiders and the state tests, served on 127.0.0.1 from a thread.

- :func:`serve_site` serves a :class:`PagedSite`: ``pages`` detail pages under ``/site/``, each with an
  ``<h1>`` (so sdk/examples/python_resume and node_resume save one item per page), a sku, and links to
  the next page and to a page further on (the crawl's seen set matters), at an optional steady delay per
  request; it counts the fetches of each path (pages fetched twice are visible).
- The demo shop (ckagent/devmaster/demosite.py's HTML) is served by the same server under ``/demo-site/``.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ckagent.devmaster import demosite

__all__ = ["PagedSite", "page_sku", "serve_site"]


def page_sku(n: int) -> str:
    """The sku shown on page ``n`` of a :class:`PagedSite`."""
    return f"P-{n:05d}"


@dataclass
class PagedSite:
    """What :func:`serve_site` serves and counts. ``base`` is the start URL (``.../site/``)."""

    pages: int
    delay_seconds: float = 0.0
    base: str = ""
    fetches: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def html(self, n: int) -> str:
        links = [f'<a class="next" href="/site/page/{n + 1}/">next</a>'] if n < self.pages else []
        if n * 2 <= self.pages:
            links.append(f'<a href="/site/page/{n * 2}/">double</a>')
        return (f"<html><head><title>Page {n}</title></head><body><h1>Page {n}</h1>"
                f'<span class="price">{n}.00</span> <span class="sku">{page_sku(n)}</span>'
                f"{' '.join(links)}</body></html>\n")

    def page_fetches(self) -> dict[int, int]:
        """How many times each page was fetched (the start URL is page 1)."""
        with self.lock:
            counts = dict(self.fetches)
        result: dict[int, int] = collections.Counter()
        for path, count in counts.items():
            match = re.fullmatch(r"/site/(?:page/(\d+)/)?", path)
            if match:
                result[int(match.group(1) or 1)] += count
        return dict(result)


def _handler(site: PagedSite) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with site.lock:
                site.fetches[self.path] += 1
            if site.delay_seconds:
                time.sleep(site.delay_seconds)  # a steady rate: the server's thread, never the test's
            body = self._body()
            if body is None:
                self.send_error(404)
                return
            data = body.encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> str | None:
            match = re.fullmatch(r"/site/(?:page/(\d+)/)?", self.path)
            if match:
                n = int(match.group(1) or 1)
                return site.html(n) if 1 <= n <= site.pages else None
            match = re.fullmatch(r"/demo-site/(?:page/(\d+)/)?", self.path)
            if match and 1 <= int(match.group(1) or 1) <= demosite.PAGES:
                return demosite.page_html(int(match.group(1) or 1))
            match = re.fullmatch(r"/demo-site/product/(\d+)/", self.path)
            if match and 1 <= int(match.group(1)) <= demosite.PRODUCTS:
                return demosite.product_html(int(match.group(1)))
            return None

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def serve_site(pages: int, *, delay_seconds: float = 0.0) -> Iterator[PagedSite]:
    """Serve a :class:`PagedSite` of ``pages`` pages (and the demo shop) on 127.0.0.1, a port of the OS's
    choosing, until the block ends. ``delay_seconds`` is added to every request (its server thread)."""
    site = PagedSite(pages, delay_seconds)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(site))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    site.base = f"http://127.0.0.1:{server.server_address[1]}/site/"
    try:
        yield site
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
