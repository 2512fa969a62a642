"""Plain-Python demo spider for CrawlerKeeper (standard library only).

Crawls the demo shop page by page, following the "next" link, saves every product with
crawlerkeeper_sdk.save_item and reports its figures with report_stats. Run: `python main.py` (the
agent does; so can you).

Start URL, first found wins: the task parameter `start_url` (CK_PARAMS), the environment variable
DEMO_SITE_URL, http://127.0.0.1:8080/demo-site/.
"""

import os
import sys
import urllib.request
from html.parser import HTMLParser
from urllib.parse import urljoin

from crawlerkeeper_sdk import report_stats, save_item, task_context

DEFAULT_START_URL = "http://127.0.0.1:8080/demo-site/"
MAX_PAGES = 1000
TIMEOUT_SECONDS = 30


class ShopPageParser(HTMLParser):
    """Collects the products (title, href, price, sku) and the next-page link of one page."""

    def __init__(self):
        super().__init__()
        self.products = []
        self.next_href = None
        self._field = None  # which product field the text being read belongs to

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "li" and "product" in classes:
            self.products.append({"title": "", "href": "", "price": "", "sku": ""})
        elif tag == "a" and "next" in classes:
            self.next_href = dict(attrs).get("href")
        elif self.products and tag == "a" and "title" in classes:
            self.products[-1]["href"] = dict(attrs).get("href") or ""
            self._field = "title"
        elif self.products and tag == "span" and "price" in classes:
            self._field = "price"
        elif self.products and tag == "span" and "sku" in classes:
            self._field = "sku"

    def handle_endtag(self, tag):
        self._field = None

    def handle_data(self, data):
        if self._field is not None:
            self.products[-1][self._field] += data


def fetch(url):
    request = urllib.request.Request(url, headers={"User-Agent": "crawlerkeeper-python-demo/1.0"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
        charset = response.headers.get_content_charset() or "utf-8"
        return response.read().decode(charset, errors="replace")


def main():
    params = task_context().params
    url = params.get("start_url") or os.environ.get("DEMO_SITE_URL") or DEFAULT_START_URL
    print("crawling " + url, flush=True)
    seen = set()
    page = 0
    total = 0
    while url and url not in seen and page < MAX_PAGES:
        seen.add(url)
        page += 1
        parser = ShopPageParser()
        parser.feed(fetch(url))
        parser.close()
        for product in parser.products:
            save_item(
                {
                    "title": product["title"].strip(),
                    "price": float(product["price"]),
                    "sku": product["sku"].strip(),
                    "url": urljoin(url, product["href"]),
                    "page": page,
                }
            )
        total += len(parser.products)
        # The crawl's figures for the master, the node's status page and its metrics (CK_STATS_FILE).
        report_stats({"requests": page, "responses": page, "responsesByStatus": {"200": page}, "items": total})
        print(f"page {page}: {len(parser.products)} products", flush=True)
        url = urljoin(url, parser.next_href) if parser.next_href else None
    print(f"done: {total} items from {page} pages", flush=True)
    report_stats({"requests": page, "responses": page, "responsesByStatus": {"200": page}, "items": total,
                  "finishReason": "finished"}, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
