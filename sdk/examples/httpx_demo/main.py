"""Python demo spider using httpx (installed by the agent from requirements.txt) and crawlerkeeper_sdk.

Crawls the demo shop page by page, then visits each product's detail page for its description, and
saves one item per product. Start URL, first found wins: the task parameter `start_url`
(CK_PARAMS), DEMO_SITE_URL, http://127.0.0.1:8080/demo-site/. Run: `python main.py`.
"""

import os
import re
import sys
from urllib.parse import urljoin

import httpx
from crawlerkeeper_sdk import save_item, task_context

DEFAULT_START_URL = "http://127.0.0.1:8080/demo-site/"
PRODUCT = re.compile(
    r'<li class="product"><a class="title" href="([^"]*)">([^<]*)</a>\s*'
    r'<span class="price">([^<]*)</span>\s*<span class="sku">([^<]*)</span></li>'
)
NEXT = re.compile(r'<a class="next" href="([^"]*)">')
DESCRIPTION = re.compile(r'<p class="description">([^<]*)</p>')


def main():
    url = task_context().params.get("start_url") or os.environ.get("DEMO_SITE_URL") or DEFAULT_START_URL
    print(f"crawling {url} with httpx {httpx.__version__}", flush=True)
    total = 0
    with httpx.Client(headers={"User-Agent": "crawlerkeeper-httpx-demo/1.0"}, timeout=30) as client:
        page = 0
        while url:
            page += 1
            html = client.get(url).raise_for_status().text
            for href, title, price, sku in PRODUCT.findall(html):
                detail_url = urljoin(url, href)
                detail = client.get(detail_url).raise_for_status().text
                found = DESCRIPTION.search(detail)
                save_item({
                    "title": title.strip(), "price": float(price), "sku": sku.strip(), "url": detail_url,
                    "description": found.group(1) if found else None, "page": page,
                })
                total += 1
            print(f"page {page}: {total} items so far", flush=True)
            nxt = NEXT.search(html)
            url = urljoin(url, nxt.group(1)) if nxt else None
    print(f"done: {total} items", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
