"""A plain-Python spider whose crawl survives its node (CrawlerKeeper SDK, standard library only).

It crawls a site breadth-first from the task parameter ``start_url`` (CK_PARAMS; else the environment
variable START_URL; else http://127.0.0.1:8080/demo-site/), following every link to a URL that starts
with the task parameter ``scope`` (default: the start URL's scheme, host and port), and saves one item
per page that has an ``<h1>`` (the demo shop's listing pages have none: they only lead to products):
``{"url", "title": the h1, "page": how many items before it + 1}``, with ``"price"`` and ``"sku"``
(the first span.price/span.sku) when the page shows them — on the demo shop, its 30 products. Its frontier
and its seen set are the task's state: the agent asks for them every checkpoint interval (on_persist)
and before it moves the crawl to another node (on_migrating), and a later attempt, on any node, starts
from them (load_state) — so each page's item reaches the master once.

Task parameters: ``start_url``; ``scope``; ``max_pages`` (default 100000); ``delay_seconds`` between two pages
(default 0). Run: ``python main.py`` (the agent does; so can you: outside an agent the items are printed
and nothing is persisted).
"""

import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from html.parser import HTMLParser
from urllib.parse import urldefrag, urljoin, urlsplit

import crawlerkeeper_sdk as ck

TIMEOUT_SECONDS = 30
TRIES = 3


class PageParser(HTMLParser):
    """The links (href values) of one page, its h1 (None if it has none), its first price and sku."""

    def __init__(self):
        super().__init__()
        self.links = []
        self.fields = {}  # "h1", "price", "sku" -> text
        self._field = None  # which field the text being read belongs to

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        classes = (attributes.get("class") or "").split()
        if tag == "a" and attributes.get("href"):
            self.links.append(attributes["href"])
        elif tag == "h1" and "h1" not in self.fields:
            self._field = "h1"
        elif tag == "span" and "price" in classes and "price" not in self.fields:
            self._field = "price"
        elif tag == "span" and "sku" in classes and "sku" not in self.fields:
            self._field = "sku"
        if self._field is not None:
            self.fields.setdefault(self._field, "")

    def handle_endtag(self, tag):
        self._field = None

    def handle_data(self, data):
        if self._field is not None:
            self.fields[self._field] += data


class Crawl:
    """The crawl's state: what is left to fetch, what was ever queued, how many pages and items are done."""

    def __init__(self, start_url):
        state = ck.load_state({"frontier": [start_url], "seen": [start_url], "pages": 0, "items": 0})
        self.frontier = deque(state["frontier"])
        self.seen = set(state["seen"])
        self.pages = state["pages"]
        self.items = state["items"]
        self.leave_at = None  # monotonic time the agent will stop us (a migration), or None

    def snapshot(self):
        """The state to persist (called by the SDK's watcher thread, holding ck.state_lock())."""
        return {"frontier": list(self.frontier), "seen": sorted(self.seen), "pages": self.pages,
                "items": self.items}

    def migrating(self, seconds_left):
        print(f"migrating: the agent stops this spider in {seconds_left} s; no new pages", flush=True)
        self.leave_at = time.monotonic() + (seconds_left or 0.0)


def fetch(url):
    """(status, html) of one page; network errors are tried TRIES times."""
    request = urllib.request.Request(url, headers={"User-Agent": "crawlerkeeper-python-resume/1.0"})
    for attempt in range(TRIES):
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
                charset = response.headers.get_content_charset() or "utf-8"
                return response.status, response.read().decode(charset, errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except OSError:
            if attempt == TRIES - 1:
                raise
            time.sleep(1 + attempt)
    raise AssertionError("unreachable")


def main():
    context = ck.task_context()
    params = context.params
    start_url = params.get("start_url") or os.environ.get("START_URL") or "http://127.0.0.1:8080/demo-site/"
    max_pages = int(params.get("max_pages", 100000))
    delay = float(params.get("delay_seconds", 0))
    parts = urlsplit(start_url)
    scope = params.get("scope") or f"{parts.scheme}://{parts.netloc}/"

    crawl = Crawl(start_url)
    ck.on_persist(crawl.snapshot)
    ck.on_migrating(crawl.migrating)
    print(f"attempt {context.attempt}: {crawl.pages} pages done ({crawl.items} items), {len(crawl.frontier)} "
          f"to go from {start_url}", flush=True)
    stop = threading.Event()
    while crawl.frontier and crawl.pages < max_pages:
        if crawl.leave_at is not None:
            # The snapshot is taken: what we would fetch now is fetched again by the next attempt.
            if stop.wait(max(0.0, crawl.leave_at - time.monotonic()) + 10):
                break
            crawl.leave_at = None  # still running long after the notice: the agent changed its mind
        url = crawl.frontier[0]  # left in the frontier until its item is saved
        status, html = fetch(url)
        parser = PageParser()
        parser.feed(html)
        parser.close()
        with ck.state_lock():  # the item and the state that accounts for it, never one without the other
            crawl.frontier.popleft()
            crawl.pages += 1
            if status != 200:
                print(f"{url}: HTTP {status}, skipped", flush=True)
            elif "h1" in parser.fields:
                crawl.items += 1
                item = {"url": url, "title": parser.fields["h1"].strip(), "page": crawl.items}
                item.update((name, parser.fields[name].strip()) for name in ("price", "sku") if name in parser.fields)
                ck.save_item(item)
            for href in parser.links:
                link = urldefrag(urljoin(url, href))[0]
                if link.startswith(scope) and link not in crawl.seen:
                    crawl.seen.add(link)
                    crawl.frontier.append(link)
        ck.report_stats({"requests": crawl.pages, "items": crawl.items})
        ck.progress(crawl.pages, None)
        if delay:
            time.sleep(delay)
    print(f"done: {crawl.items} items from {crawl.pages} pages", flush=True)
    ck.report_stats({"requests": crawl.pages, "items": crawl.items, "finishReason": "finished"}, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
