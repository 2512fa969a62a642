"""The `products` spider: every product of the demo shop, page 1 first, in page order.

Start URL, first found wins: the spider argument `-a start_url=...`, the task parameter
`start_url` (CK_PARAMS), the environment variable DEMO_SITE_URL, http://127.0.0.1:8080/demo-site/.
"""

import os

import scrapy
from crawlerkeeper_sdk import task_context

DEFAULT_START_URL = "http://127.0.0.1:8080/demo-site/"


def demo_start_url():
    """The demo site's first page from the task parameters or the environment."""
    params = task_context().params
    return params.get("start_url") or os.environ.get("DEMO_SITE_URL") or DEFAULT_START_URL


class ProductsSpider(scrapy.Spider):
    name = "products"

    def __init__(self, start_url=None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start_urls = [start_url or demo_start_url()]
        self.pages_seen = 0
        self.items_seen = 0

    def parse(self, response, page=1):
        products = response.css("ul.products li.product")
        self.pages_seen += 1
        self.logger.info("page %d: %d products", page, len(products))
        for product in products:
            self.items_seen += 1
            yield {
                "title": product.css("a.title::text").get("").strip(),
                "price": float(product.css("span.price::text").get("0")),
                "sku": product.css("span.sku::text").get("").strip(),
                "url": response.urljoin(product.css("a.title::attr(href)").get("")),
                "page": page,
            }
        # Only after this page's items: the next page, so items arrive in page order.
        next_href = response.css("a.next::attr(href)").get()
        if next_href:
            yield response.follow(next_href, callback=self.parse, cb_kwargs={"page": page + 1})

    def closed(self, reason):
        self.logger.info(
            "summary: %d items from %d pages (finished: %s)", self.items_seen, self.pages_seen, reason
        )
