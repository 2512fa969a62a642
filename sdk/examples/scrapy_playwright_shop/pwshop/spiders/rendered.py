import json
import os

import scrapy


def param_start_url():
    """The task parameter `start_url` (CK_PARAMS, a JSON object the agent sets), or None."""
    try:
        return json.loads(os.environ.get("CK_PARAMS") or "{}").get("start_url")
    except (ValueError, AttributeError):
        return None


class RenderedSpider(scrapy.Spider):
    """The listing pages, each rendered by Chromium (meta playwright=True), with the page title."""

    name = "rendered"
    start_urls = ["http://127.0.0.1:8080/demo-site/"]

    def __init__(self, start_url=None, *args, **kwargs):
        super().__init__(*args, **kwargs)
        start_url = start_url or param_start_url()  # `-a start_url=...`, else the task's params
        if start_url:
            self.start_urls = [start_url]

    async def start(self):
        for url in self.start_urls:
            yield scrapy.Request(url, meta={"playwright": True, "playwright_include_page": True})

    def start_requests(self):  # Scrapy < 2.13
        for url in self.start_urls:
            yield scrapy.Request(url, meta={"playwright": True, "playwright_include_page": True})

    async def parse(self, response):
        page = response.meta["playwright_page"]
        title = await page.title()
        await page.close()
        for product in response.css("ul.products li.product"):
            yield {
                "title": product.css("a.title::text").get(),
                "price": float(product.css("span.price::text").get()),
                "sku": product.css("span.sku::text").get(),
                "url": response.urljoin(product.css("a.title::attr(href)").get()),
                "page_title": title,
            }
        next_page = response.css("a.next::attr(href)").get()
        if next_page:
            yield response.follow(next_page, self.parse, meta={"playwright": True, "playwright_include_page": True})
