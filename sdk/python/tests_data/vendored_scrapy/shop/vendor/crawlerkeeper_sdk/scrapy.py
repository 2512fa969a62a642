# ruff: noqa  (sample legacy project for migrate_spiders.py, kept as spider teams wrote it)
from shop.vendor.crawlerkeeper_sdk import save_item


class CrawlerKeeperPipeline:
    def process_item(self, item, spider):
        save_item(item)
        return item
