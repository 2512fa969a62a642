# ruff: noqa  (sample legacy project for migrate_spiders.py, kept as spider teams wrote it)
BOT_NAME = "shop"
SPIDER_MODULES = ["shop.spiders"]
ITEM_PIPELINES = {
    "shop.vendor.crawlerkeeper_sdk.scrapy.CrawlerKeeperPipeline": 300,
}
