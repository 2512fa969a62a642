# Settings of the bookscraper project, as `scrapy startproject` writes them plus its own feed and
# a SQLite pipeline (the shape of many public tutorials' projects).
BOT_NAME = "bookscraper"
SPIDER_MODULES = ["bookscraper.spiders"]
NEWSPIDER_MODULE = "bookscraper.spiders"
ROBOTSTXT_OBEY = False
LOG_LEVEL = "INFO"
REQUEST_FINGERPRINTER_IMPLEMENTATION = "2.7"
TWISTED_REACTOR = "twisted.internet.asyncioreactor.AsyncioSelectorReactor"
FEED_EXPORT_ENCODING = "utf-8"

# The project's own export: it keeps working under the agent, beside the agent's items.
FEEDS = {
    "output/books.jsonl": {"format": "jsonlines", "overwrite": True},
}

ITEM_PIPELINES = {
    "bookscraper.pipelines.PricePipeline": 100,
    "bookscraper.pipelines.SQLitePipeline": 300,
}
