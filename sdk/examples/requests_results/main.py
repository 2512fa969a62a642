#!/usr/bin/env python3
"""Scrape a shop's listing pages with requests + BeautifulSoup and write them to results.json.

    python main.py [--start-url URL] [--max-pages N]

The shape of many public scripts: no platform SDK, the results go to a file next to the script
(``results.json``, a JSON array), and each fetched page is kept for debugging (``pages/*.html``).
Under ckagent, ``outputs: {"items": ["results.json"]}`` makes the file's objects the task's items
and the pages become artifacts; without ``outputs`` both are artifacts. The start URL also comes
from the task's ``params.start_url`` (``CK_PARAMS``) when it is set.
"""

import argparse
import json
import os
import pathlib
import sys
from urllib.parse import urljoin

import requests
from bs4 import BeautifulSoup


def parse_args(argv=None):
    params = json.loads(os.environ.get("CK_PARAMS") or "{}")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start-url", default=params.get("start_url", "http://127.0.0.1:8080/demo-site/"))
    parser.add_argument("--max-pages", type=int, default=100)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    session = requests.Session()
    session.headers["User-Agent"] = "results-scraper/1.0 (+requests)"
    url, results = args.start_url, []
    pages_dir = pathlib.Path("pages")
    pages_dir.mkdir(exist_ok=True)
    pages = 0
    while url and pages < args.max_pages:
        response = session.get(url, timeout=30)
        response.raise_for_status()
        pages += 1
        (pages_dir / f"page-{pages}.html").write_text(response.text, encoding="utf-8")
        soup = BeautifulSoup(response.text, "html.parser")
        for li in soup.select("ul.products li.product"):
            link = li.select_one("a.title")
            results.append({
                "title": link.get_text(strip=True),
                "price": float(li.select_one("span.price").get_text(strip=True)),
                "sku": li.select_one("span.sku").get_text(strip=True),
                "url": urljoin(url, link["href"]),
            })
        nxt = soup.select_one("a.next")
        url = urljoin(url, nxt["href"]) if nxt else None
    with open("results.json", "w", encoding="utf-8") as out:
        json.dump(results, out, ensure_ascii=False, indent=2)
    print(f"wrote {len(results)} products from {pages} pages to results.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
