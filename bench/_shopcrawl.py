"""The Scrapy crawl of :mod:`bench.proxy`: the demo shop, every listing and product page, LAPS times.

``scrapy runspider bench/_shopcrawl.py -a start_url=URL -a laps=N -a stats_file=FILE`` (Scrapy from
the bench venv). Each lap starts at the shop's first page, follows the ``next`` links and every
product's detail page and yields the product as an item (5 listing + 30 product pages a lap, like
sdk/examples/scrapy_demo's ``products`` spider but with the detail pages, so a lap is 35 requests);
laps run side by side (``dont_filter``), with Scrapy's default concurrency (16 requests, 8 per
domain) as an unconfigured spider crawls. The proxy comes from ``HTTP_PROXY`` as for any spider
(Scrapy's HttpProxyMiddleware: one kept-alive connection pool to the proxy, credentials as
``Proxy-Authorization``). At the end FILE gets the crawl's stats as JSON (``elapsed_time_seconds``
from the spider's open to its close, counts of responses, statuses and items).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from typing import Any

import scrapy


class ShopSpider(scrapy.Spider):
    """Every page of the demo shop, ``laps`` times (see the module docstring)."""

    name = "shop"
    custom_settings = {  # noqa: RUF012 - Scrapy's own class attribute
        "ROBOTSTXT_OBEY": False,
        "TELNETCONSOLE_ENABLED": False,
        "REMOTE_CONTROL_ENABLED": False,
        "LOG_LEVEL": "WARNING",
        "COOKIES_ENABLED": False,
    }

    def __init__(self, start_url: str, laps: str = "1", stats_file: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start_url, self.laps, self.stats_file = start_url, int(laps), stats_file

    async def start(self) -> AsyncIterator[scrapy.Request]:  # noqa: ASYNC900 - Scrapy 2.13+'s API
        for request in self.start_requests():
            yield request

    def start_requests(self) -> Iterator[scrapy.Request]:  # Scrapy < 2.13
        for lap in range(self.laps):
            yield scrapy.Request(self.start_url, callback=self.parse, dont_filter=True, cb_kwargs={"lap": lap})

    def parse(self, response: Any, lap: int = 0) -> Iterator[scrapy.Request]:
        for href in response.css("ul.products li.product a.title::attr(href)").getall():
            yield response.follow(href, callback=self.product, dont_filter=True)
        next_href = response.css("a.next::attr(href)").get()
        if next_href:
            yield response.follow(next_href, callback=self.parse, dont_filter=True, cb_kwargs={"lap": lap})

    def product(self, response: Any) -> Iterator[dict[str, Any]]:
        yield {"title": response.css("h1.title::text").get(), "sku": response.css("span.sku::text").get()}

    def closed(self, reason: str) -> None:
        stats = self.crawler.stats.get_stats()
        wanted = {key: value for key, value in stats.items()
                  if isinstance(value, int | float) and not isinstance(value, bool)}
        wanted["finish_reason"] = reason
        started = stats.get("start_time")  # (CoreStats sets elapsed_time_seconds after this callback)
        if isinstance(started, datetime):
            now = datetime.now(started.tzinfo) if started.tzinfo else datetime.now()
            wanted["elapsed_time_seconds"] = (now - started).total_seconds()
        if self.stats_file:
            with open(self.stats_file, "w") as fh:
                json.dump(wanted, fh)
