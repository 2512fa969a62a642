# Scrapy settings for shop project
#
# For simplicity, this file contains only settings considered important or
# commonly used. You can find more settings consulting the documentation:
#
#     https://docs.scrapy.org/en/latest/topics/settings.html

BOT_NAME = "shop"

SPIDER_MODULES = ["shop.spiders"]
NEWSPIDER_MODULE = "shop.spiders"

USER_AGENT = "shop (+https://example.com/bot)"

# The demo site has no robots.txt
ROBOTSTXT_OBEY = False

CONCURRENT_REQUESTS = 4
DOWNLOAD_DELAY = 0
TELNETCONSOLE_ENABLED = False

SPIDER_MIDDLEWARES = {
    "shop.middlewares.ShopSpiderMiddleware": 543,
}

DOWNLOADER_MIDDLEWARES = {
    "shop.middlewares.ShopDownloaderMiddleware": 543,
}

ITEM_PIPELINES = {
    "shop.pipelines.PricePipeline": 300,
    "shop.pipelines.DuplicatesPipeline": 400,
}

FEED_EXPORT_ENCODING = "utf-8"
TWISTED_REACTOR = "twisted.internet.asyncioreactor.AsyncioSelectorReactor"
