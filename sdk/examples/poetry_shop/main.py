"""A requests + BeautifulSoup scraper managed by Poetry: its poetry.lock pins every version.

Writes its results to results.json (as many public scrapers do) and prints one line per page;
it also reports which versions it runs with, so the lock can be seen to be honoured.
"""
import json
import os
import sys
from urllib.parse import urljoin

import bs4
import requests

params = json.loads(os.environ.get("CK_PARAMS") or "{}")  # the task's params: start_url first
start = (sys.argv[1] if len(sys.argv) > 1 else params.get("start_url")
         or os.environ.get("START_URL", "http://127.0.0.1:8080/demo-site/"))
print(f"running with requests {requests.__version__}, beautifulsoup4 {bs4.__version__}", flush=True)
rows, url, page = [], start, 1
while url:
    soup = bs4.BeautifulSoup(requests.get(url, timeout=30).text, "html.parser")
    for li in soup.select("ul.products li.product"):
        rows.append({"title": li.select_one("a.title").get_text(strip=True),
                     "sku": li.select_one("span.sku").get_text(strip=True), "page": page})
    print(f"page {page}: {len(rows)} products", flush=True)
    link = soup.select_one("a.next")
    url = urljoin(url, link["href"]) if link else None
    page += 1
with open("results.json", "w", encoding="utf-8") as fh:
    json.dump(rows, fh, ensure_ascii=False, indent=2)
