"""Runs the spider from a script with settings of its own (no scrapy.cfg lookup, no command line)."""
from scrapy.crawler import CrawlerProcess

from bookscraper.spiders.bookspider import BookSpider

process = CrawlerProcess(settings={
    "LOG_LEVEL": "INFO",
    "ROBOTSTXT_OBEY": False,
    "TWISTED_REACTOR": "twisted.internet.asyncioreactor.AsyncioSelectorReactor",
    "FEEDS": {"output/script.csv": {"format": "csv", "overwrite": True}},
})
process.crawl(BookSpider)
process.start()
