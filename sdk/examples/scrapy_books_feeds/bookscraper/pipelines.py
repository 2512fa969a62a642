import sqlite3


class PricePipeline:
    """'£3.99' → 3.99"""

    def process_item(self, item, spider=None):
        price = item.get("price")
        if isinstance(price, str):
            item["price"] = float(price.strip().lstrip("£$€"))
        return item


class SQLitePipeline:
    """Stores every book in books.db (made by database_setup.py, which must run first)."""

    def open_spider(self, spider=None):
        self.db = sqlite3.connect("books.db")
        self.db.execute("SELECT 1 FROM books LIMIT 1")  # fails loudly when the setup step did not run

    def close_spider(self, spider=None):
        self.db.commit()
        self.db.close()

    def process_item(self, item, spider=None):
        self.db.execute("INSERT OR REPLACE INTO books (sku, title, price) VALUES (?, ?, ?)",
                        (item["sku"], item["title"], item["price"]))
        return item
