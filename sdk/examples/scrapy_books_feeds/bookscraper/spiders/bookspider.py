import json
import os

import scrapy


class BookSpider(scrapy.Spider):
    """Every row of the listing, following its pagination."""

    name = "bookspider"

    def __init__(self, start_url=None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        params = json.loads(os.environ.get("CK_PARAMS") or "{}")  # the task's params (--param start_url=)
        self.start_urls = [start_url or params.get("start_url")
                           or os.environ.get("START_URL", "http://127.0.0.1:8080/demo-site/")]

    def parse(self, response):
        for product in response.css("ul.products li.product"):
            yield {
                "title": product.css("a.title::text").get(),
                "price": product.css("span.price::text").get(),
                "sku": product.css("span.sku::text").get(),
            }
        yield from response.follow_all(css="a.next", callback=self.parse)
