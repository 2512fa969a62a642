"""Selenium demo spider: headless Chromium through chromedriver, both from the node's system packages.

The agent exposes the browser and driver it found as CK_CHROMIUM_PATH and CK_CHROMEDRIVER_PATH
(Debian: `apt-get install chromium chromium-driver`); giving Selenium both paths keeps Selenium
Manager from trying to download anything. Crawls the demo shop page by page (following the "next"
link) and saves one item per product.

Start URL, first found wins: the task parameter `start_url` (CK_PARAMS), DEMO_SITE_URL,
http://127.0.0.1:8080/demo-site/. Task parameter `leave_browser: true` exits without closing the
browser (to show that the agent's sweep removes it).
"""

import os
import shutil
import sys
import tempfile

from crawlerkeeper_sdk import chromium_args, save_item, task_context
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

DEFAULT_START_URL = "http://127.0.0.1:8080/demo-site/"
# Headless, with nothing phoning home (a closed network answers every background request with a
# refused connection). chromium_args() adds --no-sandbox only where Chromium's own sandbox cannot work
# (the spider runs as root, or may not make user namespaces); the task has a /dev/shm of its own.
CHROMIUM_FLAGS = (
    "--headless=new", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-extensions",
)


def browser_paths():
    chromium = os.environ.get("CK_CHROMIUM_PATH") or shutil.which("chromium") or shutil.which("google-chrome")
    driver = os.environ.get("CK_CHROMEDRIVER_PATH") or shutil.which("chromedriver")
    if not chromium or not driver:
        sys.exit("this spider needs Chromium and chromedriver on the node (apt-get install chromium chromium-driver)")
    return chromium, driver


def main():
    params = task_context().params
    url = params.get("start_url") or os.environ.get("DEMO_SITE_URL") or DEFAULT_START_URL
    chromium, driver_path = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, *chromium_args()):
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="ck-selenium-")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    print(f"crawling {url} with {driver.capabilities.get('browserVersion')}", flush=True)
    total = 0
    try:
        page = 0
        while url:
            page += 1
            driver.get(url)
            for li in driver.find_elements(By.CSS_SELECTOR, "li.product"):
                link = li.find_element(By.CSS_SELECTOR, "a.title")
                save_item({
                    "title": link.text.strip(),
                    "price": float(li.find_element(By.CSS_SELECTOR, "span.price").text),
                    "sku": li.find_element(By.CSS_SELECTOR, "span.sku").text.strip(),
                    "url": link.get_attribute("href"),
                    "page": page,
                })
                total += 1
            nxt = driver.find_elements(By.CSS_SELECTOR, "a.next")
            url = nxt[0].get_attribute("href") if nxt else None
        print(f"done: {total} items from {page} pages", flush=True)
    finally:
        if params.get("leave_browser"):
            print("leaving the browser running (leave_browser)", flush=True)
            os._exit(0)
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
