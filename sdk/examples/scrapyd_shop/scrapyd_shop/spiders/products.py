"""The `products` spider as a Scrapyd user writes it: every product of the demo shop, page order.

No CrawlerKeeper SDK: its arguments come as Scrapyd passes them, `-a start_url=...` (a task
parameter `start_url` on a ckagent node), `-a tag=...` (put into every item when given) and
Scrapyd's `-a _job=<job id>`; the setting SHOP_LABEL (`-s SHOP_LABEL=...`) is put into every item
when set. Default start URL: http://127.0.0.1:8080/demo-site/.
"""

import os

import scrapy


class ProductsSpider(scrapy.Spider):
    name = "products"

    def __init__(self, start_url=None, tag=None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start_urls = [start_url or "http://127.0.0.1:8080/demo-site/"]
        self.tag = tag
        self.items_seen = 0

    def parse(self, response, page=1):
        label = self.settings.get("SHOP_LABEL")
        for product in response.css("ul.products li.product"):
            self.items_seen += 1
            item = {
                "title": product.css("a.title::text").get("").strip(),
                "price": float(product.css("span.price::text").get("0")),
                "sku": product.css("span.sku::text").get("").strip(),
                "url": response.urljoin(product.css("a.title::attr(href)").get("")),
                "page": page,
            }
            if self.tag:
                item["tag"] = self.tag
            if label:
                item["label"] = label
            yield item
        next_href = response.css("a.next::attr(href)").get()
        if next_href:
            yield response.follow(next_href, callback=self.parse, cb_kwargs={"page": page + 1})

    def closed(self, reason):
        self.logger.info(
            "summary: %d items (finished: %s); job %s, project %s, settings %s", self.items_seen, reason,
            getattr(self, "_job", None), os.environ.get("SCRAPY_PROJECT"), os.environ.get("SCRAPY_SETTINGS_MODULE"),
        )
