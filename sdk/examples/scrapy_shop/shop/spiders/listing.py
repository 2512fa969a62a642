import json
import os

import scrapy


def param_start_url():
    """The task parameter `start_url` (CK_PARAMS, a JSON object the agent sets), or None."""
    try:
        return json.loads(os.environ.get("CK_PARAMS") or "{}").get("start_url")
    except (ValueError, AttributeError):
        return None


class ListingSpider(scrapy.Spider):
    """The listing pages only: one dict per product row (no detail pages)."""

    name = "listing"
    start_urls = ["http://127.0.0.1:8080/demo-site/"]

    def __init__(self, start_url=None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        start_url = start_url or param_start_url()  # `-a start_url=...`, else the task's params
        if start_url:
            self.start_urls = [start_url]

    def parse(self, response):
        for product in response.css("ul.products li.product"):
            yield {
                "title": product.css("a.title::text").get(),
                "price": product.css("span.price::text").get(),
                "sku": product.css("span.sku::text").get(),
                "url": response.urljoin(product.css("a.title::attr(href)").get()),
            }
        yield from response.follow_all(css="a.next", callback=self.parse)
