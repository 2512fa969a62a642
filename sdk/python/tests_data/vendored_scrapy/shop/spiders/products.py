# ruff: noqa  (sample legacy project for migrate_spiders.py, kept as spider teams wrote it)
import scrapy

from ..vendor.crawlerkeeper_sdk import save_item
from shop.vendor import crawlerkeeper_sdk as ck


class ProductsSpider(scrapy.Spider):
    name = "products"
    start_urls = ["http://127.0.0.1:8000/"]

    def parse(self, response):
        save_item({"url": response.url, "params": ck.get_params()})
