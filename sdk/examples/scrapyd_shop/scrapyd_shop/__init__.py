"""The scrapyd_shop project: the demo shop's products, deployed as a Scrapyd egg."""
