# Define your item pipelines here
#
# Don't forget to add your pipeline to the ITEM_PIPELINES setting
# See: https://docs.scrapy.org/en/latest/topics/item-pipeline.html

import os
import sqlite3

from itemadapter import ItemAdapter
from scrapy.exceptions import DropItem


class PricePipeline:
    """Turns the price text into a number; drops items without one."""

    def process_item(self, item, spider):
        adapter = ItemAdapter(item)
        try:
            adapter["price"] = round(float(adapter.get("price")), 2)
        except (TypeError, ValueError):
            raise DropItem(f"no price in {item!r}")
        return item


class DuplicatesPipeline:
    """Drops items whose SKU was seen before, remembered in a small SQLite database."""

    def open_spider(self, spider):
        folder = os.environ.get("CK_DATA_DIR") if getattr(spider, "persist_seen", None) else None
        self.db = sqlite3.connect(os.path.join(folder or ".", "seen.sqlite3"))
        self.db.execute("CREATE TABLE IF NOT EXISTS seen (sku TEXT PRIMARY KEY)")

    def close_spider(self, spider):
        self.db.commit()
        self.db.close()

    def process_item(self, item, spider):
        sku = ItemAdapter(item)["sku"]
        if self.db.execute("SELECT 1 FROM seen WHERE sku = ?", (sku,)).fetchone():
            raise DropItem(f"duplicate item found: {sku}")
        self.db.execute("INSERT INTO seen VALUES (?)", (sku,))
        return item
