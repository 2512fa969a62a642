# Scrapy settings for pwshop: pages rendered by a real browser through scrapy-playwright
# (https://github.com/scrapy-plugins/scrapy-playwright#activation).
import os

BOT_NAME = "pwshop"
SPIDER_MODULES = ["pwshop.spiders"]
NEWSPIDER_MODULE = "pwshop.spiders"
ROBOTSTXT_OBEY = False
TELNETCONSOLE_ENABLED = False
CONCURRENT_REQUESTS = 2

DOWNLOAD_HANDLERS = {
    "http": "scrapy_playwright.handler.ScrapyPlaywrightDownloadHandler",
    "https": "scrapy_playwright.handler.ScrapyPlaywrightDownloadHandler",
}
TWISTED_REACTOR = "twisted.internet.asyncioreactor.AsyncioSelectorReactor"

PLAYWRIGHT_BROWSER_TYPE = "chromium"
# `playwright install` needs the internet; on a CrawlerKeeper node the system Chromium is handed to
# every spider as CK_CHROMIUM_PATH (Debian: apt-get install chromium). Chromium's own sandbox is on where
# the agent says it works (CK_CHROMIUM_SANDBOX=1: the spider is not root and may make user namespaces;
# otherwise Playwright passes --no-sandbox), and the task has a /dev/shm of its own.
PLAYWRIGHT_LAUNCH_OPTIONS = {
    "headless": True,
    "executable_path": os.environ.get("CK_CHROMIUM_PATH"),
    "chromium_sandbox": os.environ.get("CK_CHROMIUM_SANDBOX") == "1",
    "args": ["--disable-gpu"],
}
PLAYWRIGHT_DEFAULT_NAVIGATION_TIMEOUT = 30 * 1000
FEED_EXPORT_ENCODING = "utf-8"
