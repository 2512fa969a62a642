"""Scrapy settings of the scrapyd_shop project (found through the egg's [scrapy] entry point)."""

import scrapy

BOT_NAME = "scrapyd_shop"

SPIDER_MODULES = ["scrapyd_shop.spiders"]
NEWSPIDER_MODULE = "scrapyd_shop.spiders"

ROBOTSTXT_OBEY = False  # the demo site has no robots.txt
CONCURRENT_REQUESTS = 1  # pages are chained: one request in flight keeps the item order
DOWNLOAD_TIMEOUT = 30
LOG_LEVEL = "INFO"
TELNETCONSOLE_ENABLED = False
REMOTE_CONTROL_ENABLED = False
FEED_EXPORT_ENCODING = "utf-8"
TWISTED_REACTOR = "twisted.internet.asyncioreactor.AsyncioSelectorReactor"
SHOP_LABEL = ""
"""Put into every item when set (`-s SHOP_LABEL=...`, Scrapyd's `setting=SHOP_LABEL=...`)."""

if tuple(int(part) for part in scrapy.__version__.split(".")[:2]) < (2, 12):
    REQUEST_FINGERPRINTER_IMPLEMENTATION = "2.7"
