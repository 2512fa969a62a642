# Define here the models for your spider middleware
#
# See documentation in:
# https://docs.scrapy.org/en/latest/topics/spider-middleware.html

from scrapy import Item, signals


class ShopSpiderMiddleware:
    """Stamps every item with the spider that produced it."""

    @classmethod
    def from_crawler(cls, crawler):
        s = cls()
        crawler.signals.connect(s.spider_opened, signal=signals.spider_opened)
        return s

    def process_spider_output(self, response, result, spider):
        for i in result:
            if isinstance(i, Item) and "crawled_by" in i.fields:
                i["crawled_by"] = spider.name
            yield i

    async def process_spider_output_async(self, response, result, spider):
        async for i in result:
            if isinstance(i, Item) and "crawled_by" in i.fields:
                i["crawled_by"] = spider.name
            yield i

    def spider_opened(self, spider):
        spider.logger.info("Spider opened: %s" % spider.name)


class ShopDownloaderMiddleware:
    """Sends a header with every request (the kind of thing projects do for an API key or a proxy)."""

    def process_request(self, request, spider):
        request.headers.setdefault("X-Shop-Crawler", spider.name)
        return None
