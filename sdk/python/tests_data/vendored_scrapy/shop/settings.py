BOT_NAME = "shop"
SPIDER_MODULES = ["shop.spiders"]
ITEM_PIPELINES = {
    "shop.vendor.crawlerkeeper_sdk.scrapy.CrawlerKeeperPipeline": 300,
}
