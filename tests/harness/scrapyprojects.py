"""Small real Scrapy projects for the tests of a spider's data between tasks and of polite stops.

:func:`write_cache_and_polite_project` writes one project (``scrapy.cfg``, a settings module, two
spiders) to a directory:

- ``cached`` (HTTPCACHE_ENABLED, Scrapy's defaults otherwise: the cache in the project's ``.scrapy``)
  fetches ``$START_URL/c/1`` .. ``/c/<CACHE_PAGES>`` once each;
- ``polite`` (``DOWNLOAD_DELAY``, AutoThrottle, a few requests in flight) follows ten new pages from
  every page it gets, forever; its pipeline writes ``polite pipeline: close_spider ran after N item(s)``
  in ``close_spider`` and its ``closed()`` says ``polite spider closed: <reason>``.

Both take the site from ``START_URL`` (a loopback origin of the test, e.g. harness.upstreams.IdentityOrigin).

:func:`write_site_project` writes another (``siteproj``) whose spider ``site`` crawls a
harness.crawlsite.CrawlSite from ``START_URL`` (its first listing): one item per page
(``{"url", "kind": "listing" | "item"}``), following the listing's item links and its next listing
(the item pages' links back are dropped by Scrapy's dupefilter), :data:`SITE_IN_FLIGHT` requests at a
time; with ``-a hold=1`` it fetches only the site's ``/hold`` page (a task that keeps its node busy
with this spider, its environment built, until the test releases it).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CACHE_PAGES", "PIPELINE_LINE", "POLITE_DELAY", "SITE_IN_FLIGHT", "write_cache_and_polite_project",
           "write_site_project"]

CACHE_PAGES = 3
"""Pages the ``cached`` spider fetches."""
POLITE_DELAY = 2.0
"""The ``polite`` spider's DOWNLOAD_DELAY (seconds; AutoThrottle's floor)."""
PIPELINE_LINE = "polite pipeline: close_spider ran after"
"""The start of the line the ``polite`` spider's pipeline prints in close_spider."""
SITE_IN_FLIGHT = 8
"""Requests the ``site`` spider keeps in flight (CONCURRENT_REQUESTS_PER_DOMAIN, Scrapy's default)."""

_SETTINGS = '''\
BOT_NAME = "politeproj"
SPIDER_MODULES = ["politeproj.spiders"]
ROBOTSTXT_OBEY = False
LOG_LEVEL = "INFO"
TELNETCONSOLE_ENABLED = False
REMOTE_CONTROL_ENABLED = False
'''

_SPIDERS = f'''\
import os

import scrapy


class Cached(scrapy.Spider):
    name = "cached"
    custom_settings = {{"HTTPCACHE_ENABLED": True, "CONCURRENT_REQUESTS": 1}}

    async def start(self):  # (Scrapy 2.13+; start_requests before)
        for request in self.start_requests():
            yield request

    def start_requests(self):
        base = os.environ["START_URL"].rstrip("/")
        for n in range(1, {CACHE_PAGES} + 1):
            yield scrapy.Request(f"{{base}}/c/{{n}}")

    def parse(self, response):
        yield {{"url": response.url, "cached": "cached" in response.flags}}


class PolitePipeline:
    def open_spider(self, spider):
        self.items = 0

    def process_item(self, item, spider):
        self.items += 1
        return item

    def close_spider(self, spider):
        print(f"{PIPELINE_LINE} {{self.items}} item(s)", flush=True)


class Polite(scrapy.Spider):
    name = "polite"
    custom_settings = {{
        "DOWNLOAD_DELAY": {POLITE_DELAY!r},
        "AUTOTHROTTLE_ENABLED": True,
        "CONCURRENT_REQUESTS": 4,
        "ITEM_PIPELINES": {{"politeproj.spiders.all.PolitePipeline": 100}},
    }}

    async def start(self):  # (Scrapy 2.13+; start_requests before)
        for request in self.start_requests():
            yield request

    def start_requests(self):
        yield scrapy.Request(os.environ["START_URL"].rstrip("/") + "/p/0")

    def parse(self, response):
        n = int(response.url.rsplit("/", 1)[-1])
        yield {{"url": response.url}}
        for i in range(1, 11):
            yield response.follow(f"/p/{{n * 10 + i}}")

    def closed(self, reason):
        print(f"polite spider closed: {{reason}}", flush=True)
'''


def write_cache_and_polite_project(directory: Path) -> Path:
    """Write the project (module docstring) into ``directory`` (made if missing); returns it. Blocking."""
    package = directory / "politeproj"
    (package / "spiders").mkdir(parents=True, exist_ok=True)
    (directory / "scrapy.cfg").write_text("[settings]\ndefault = politeproj.settings\n")
    (directory / "requirements.txt").write_text("scrapy>=2.11\n")
    (package / "__init__.py").write_text("")
    (package / "settings.py").write_text(_SETTINGS)
    (package / "spiders" / "__init__.py").write_text("")
    (package / "spiders" / "all.py").write_text(_SPIDERS)
    return directory


_SITE_SPIDER = f'''\
import os

import scrapy


class Site(scrapy.Spider):
    name = "site"
    custom_settings = {{"CONCURRENT_REQUESTS": {SITE_IN_FLIGHT}, "CONCURRENT_REQUESTS_PER_DOMAIN": {SITE_IN_FLIGHT}}}

    async def start(self):  # (Scrapy 2.13+; start_requests before)
        for request in self.start_requests():
            yield request

    def start_requests(self):
        start = os.environ["START_URL"]
        if getattr(self, "hold", None):
            yield scrapy.Request(start.split("/list/", 1)[0] + "/hold", callback=self.held, dont_filter=True)
            return
        yield scrapy.Request(start, callback=self.parse)

    def held(self, response):
        print("site spider: released", flush=True)

    def parse(self, response):
        yield {{"url": response.url, "kind": "listing"}}
        for href in response.css("a.item::attr(href)").getall():
            yield response.follow(href, callback=self.parse_item)
        more = response.css("a.next::attr(href)").get()
        if more:
            yield response.follow(more, callback=self.parse)

    def parse_item(self, response):
        yield {{"url": response.url, "kind": "item"}}
        yield response.follow(response.css("a.up::attr(href)").get(), callback=self.parse)
'''


def write_site_project(directory: Path) -> Path:
    """Write the ``siteproj`` project (module docstring) into ``directory`` (made if missing); returns
    it. Blocking."""
    package = directory / "siteproj"
    (package / "spiders").mkdir(parents=True, exist_ok=True)
    (directory / "scrapy.cfg").write_text("[settings]\ndefault = siteproj.settings\n")
    (directory / "requirements.txt").write_text("scrapy>=2.11\n")
    (package / "__init__.py").write_text("")
    (package / "settings.py").write_text(_SETTINGS.replace("politeproj", "siteproj"))
    (package / "spiders" / "__init__.py").write_text("")
    (package / "spiders" / "site.py").write_text(_SITE_SPIDER)
    return directory
