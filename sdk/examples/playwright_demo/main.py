"""Playwright demo spider: Python Playwright driving the node's own Chromium (no browser download).

`playwright install` cannot work on a node without internet access, so the spider launches the
system browser the agent found, passed as CK_CHROMIUM_PATH (Debian: `apt-get install chromium`),
through `executable_path`. Crawls the demo shop page by page and saves one item per product.

Start URL, first found wins: the task parameter `start_url` (CK_PARAMS), DEMO_SITE_URL,
http://127.0.0.1:8080/demo-site/.
"""

import os
import shutil
import sys

from crawlerkeeper_sdk import chromium_sandbox, save_item, task_context
from playwright.sync_api import sync_playwright

DEFAULT_START_URL = "http://127.0.0.1:8080/demo-site/"
# Chromium's own sandbox is on where the agent says it works (chromium_sandbox(): the spider is not root
# and may make user namespaces), and the task has a /dev/shm of its own: no --no-sandbox, no
# --disable-dev-shm-usage needed.
CHROMIUM_ARGS = [
    "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run",
]


def main():
    url = task_context().params.get("start_url") or os.environ.get("DEMO_SITE_URL") or DEFAULT_START_URL
    chromium = os.environ.get("CK_CHROMIUM_PATH") or shutil.which("chromium")
    if not chromium:
        sys.exit("this spider needs Chromium on the node (apt-get install chromium); CK_CHROMIUM_PATH is unset")
    total = 0
    with sync_playwright() as p:
        # Playwright gives the browser a fresh temporary profile (user data dir) of its own.
        browser = p.chromium.launch(executable_path=chromium, headless=True, chromium_sandbox=chromium_sandbox(),
                                    args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            print(f"crawling {url} with Chromium {browser.version}", flush=True)
            n = 0
            while url:
                n += 1
                page.goto(url)
                for li in page.query_selector_all("li.product"):
                    link = li.query_selector("a.title")
                    save_item({
                        "title": link.inner_text().strip(),
                        "price": float(li.query_selector("span.price").inner_text()),
                        "sku": li.query_selector("span.sku").inner_text().strip(),
                        "url": page.evaluate("(a) => a.href", link),
                        "page": n,
                    })
                    total += 1
                nxt = page.query_selector("a.next")
                url = page.evaluate("(a) => a.href", nxt) if nxt else None
        finally:
            browser.close()
    print(f"done: {total} items", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
