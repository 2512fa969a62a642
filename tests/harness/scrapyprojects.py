"""Small real Scrapy projects for the tests of a spider's data between tasks and of polite stops.

:func:`write_cache_and_polite_project` writes one project (``scrapy.cfg``, a settings module, two
spiders) to a directory:

- ``cached`` (HTTPCACHE_ENABLED, Scrapy's defaults otherwise: the cache in the project's ``.scrapy``)
  fetches ``$START_URL/c/1`` .. ``/c/<CACHE_PAGES>`` once each;
- ``polite`` (``DOWNLOAD_DELAY``, AutoThrottle, a few requests in flight) follows ten new pages from
  every page it gets, forever; its pipeline writes ``polite pipeline: close_spider ran after N item(s)``
  in ``close_spider`` and its ``closed()`` says ``polite spider closed: <reason>``.

Both take the site from ``START_URL`` (a loopback origin of the test, e.g. harness.upstreams.IdentityOrigin).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CACHE_PAGES", "PIPELINE_LINE", "POLITE_DELAY", "write_cache_and_polite_project"]

CACHE_PAGES = 3
"""Pages the ``cached`` spider fetches."""
POLITE_DELAY = 2.0
"""The ``polite`` spider's DOWNLOAD_DELAY (seconds; AutoThrottle's floor)."""
PIPELINE_LINE = "polite pipeline: close_spider ran after"
"""The start of the line the ``polite`` spider's pipeline prints in close_spider."""

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
