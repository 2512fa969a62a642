import json
import os

import scrapy

from shop.items import ProductItem


def param_start_url():
    """The task parameter `start_url` (CK_PARAMS, a JSON object the agent sets), or None."""
    try:
        return json.loads(os.environ.get("CK_PARAMS") or "{}").get("start_url")
    except (ValueError, AttributeError):
        return None


class ProductsSpider(scrapy.Spider):
    """Every product with its detail page, following the listing's pagination."""

    name = "products"
    allowed_domains = ["127.0.0.1", "localhost"]
    start_urls = ["http://127.0.0.1:8080/demo-site/"]

    def __init__(self, start_url=None, persist_seen=None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        start_url = start_url or param_start_url()  # `-a start_url=...`, else the task's params
        if start_url:
            self.start_urls = [start_url]
        self.persist_seen = persist_seen

    def parse(self, response, page=1):
        for href in response.css("li.product a.title::attr(href)").getall():
            yield response.follow(href, self.parse_product, cb_kwargs={"page": page})
        next_page = response.css("a.next::attr(href)").get()
        if next_page is not None:
            yield response.follow(next_page, self.parse, cb_kwargs={"page": page + 1})

    def parse_product(self, response, page):
        item = ProductItem()
        item["title"] = response.css("h1.title::text").get()
        item["price"] = response.css("span.price::text").get()
        item["sku"] = response.css("span.sku::text").get()
        item["url"] = response.url
        item["description"] = response.css("p.description::text").get()
        item["page"] = page
        yield item
