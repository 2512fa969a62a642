# ruff: noqa  (sample legacy project for migrate_spiders.py, kept as spider teams wrote it)
"""Saves one item through the SDK (runs without Scrapy)."""
import shop.vendor.crawlerkeeper_sdk
from .vendor.crawlerkeeper_sdk import save_item

if __name__ == "__main__":
    save_item({"n": 1})
    shop.vendor.crawlerkeeper_sdk.save_item({"n": 2})
