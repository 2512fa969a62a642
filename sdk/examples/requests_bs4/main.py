#!/usr/bin/env python3
"""Scrape a shop's products with requests + BeautifulSoup (the classic script layout).

    python main.py --start-url http://127.0.0.1:8080/demo-site/ [--max-pages N] [--delay S]

Run by the agent, the task parameter `start_url` (CK_PARAMS) is the default of --start-url.

Items go through `crawlerkeeper_sdk.save_item` (requirements.txt asks for crawlerkeeper-sdk, as
`migrate_spiders.py` writes it; the agent serves that requirement with its own copy). Without the
SDK installed the script still runs and prints each item as a JSON line.
"""

import argparse
import json
import os
import sys
import time
from urllib.parse import urljoin

import requests
from bs4 import BeautifulSoup

try:
    from crawlerkeeper_sdk import save_item
except ImportError:  # run by hand, outside an agent
    def save_item(item):
        print(json.dumps(item, ensure_ascii=False))


def param_start_url():
    """The task parameter `start_url` (CK_PARAMS, a JSON object the agent sets), or None."""
    try:
        return json.loads(os.environ.get("CK_PARAMS") or "{}").get("start_url")
    except (ValueError, AttributeError):
        return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start-url", default=param_start_url() or "http://127.0.0.1:8080/demo-site/")
    parser.add_argument("--max-pages", type=int, default=100)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between requests")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    session = requests.Session()
    session.headers["User-Agent"] = "shop-scraper/1.0 (+requests)"
    url, pages, count = args.start_url, 0, 0
    while url and pages < args.max_pages:
        response = session.get(url, timeout=30)
        response.raise_for_status()
        soup = BeautifulSoup(response.text, "html.parser")
        pages += 1
        for li in soup.select("ul.products li.product"):
            link = li.select_one("a.title")
            save_item({
                "title": link.get_text(strip=True),
                "price": float(li.select_one("span.price").get_text(strip=True)),
                "sku": li.select_one("span.sku").get_text(strip=True),
                "url": urljoin(url, link["href"]),
            })
            count += 1
        nxt = soup.select_one("a.next")
        url = urljoin(url, nxt["href"]) if nxt else None
        if url and args.delay:
            time.sleep(args.delay)
    print(f"scraped {count} products from {pages} pages with requests {requests.__version__}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
