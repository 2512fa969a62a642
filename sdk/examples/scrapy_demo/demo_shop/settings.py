"""Scrapy settings of the demo_shop project (run by a CrawlerKeeper agent as `scrapy crawl products`)."""

import scrapy

BOT_NAME = "demo_shop"

SPIDER_MODULES = ["demo_shop.spiders"]
NEWSPIDER_MODULE = "demo_shop.spiders"

# The demo site is local and has no robots.txt.
ROBOTSTXT_OBEY = False

# Pagination is chained (page n+1 is requested after page n's items), so one request in flight is
# all this spider ever uses; saying so keeps the item order deterministic.
CONCURRENT_REQUESTS = 1
CONCURRENT_REQUESTS_PER_DOMAIN = 1
DOWNLOAD_DELAY = 0
DOWNLOAD_TIMEOUT = 30

# Every item goes to the task's items file (CK_ITEMS_FILE) and from there to the master.
ITEM_PIPELINES = {"crawlerkeeper_sdk.scrapy.CrawlerKeeperPipeline": 300}

LOG_LEVEL = "INFO"
# No control ports: neither the telnet console nor (Scrapy 2.19+) the remote-control HTTP server,
# which would listen on localhost and write a job file with its token to the user's state dir.
TELNETCONSOLE_ENABLED = False
REMOTE_CONTROL_ENABLED = False
FEED_EXPORT_ENCODING = "utf-8"
TWISTED_REACTOR = "twisted.internet.asyncioreactor.AsyncioSelectorReactor"

# Scrapy 2.7-2.11 warn unless the fingerprinter implementation is chosen; 2.12+ dropped the setting.
if tuple(int(part) for part in scrapy.__version__.split(".")[:2]) < (2, 12):
    REQUEST_FINGERPRINTER_IMPLEMENTATION = "2.7"
