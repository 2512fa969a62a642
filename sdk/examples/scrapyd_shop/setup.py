# What scrapyd-deploy writes for a project that has no setup.py: the settings module as the
# [scrapy] entry point, which is how Scrapyd (and a ckagent node) finds the project's settings.
from setuptools import find_packages, setup

setup(
    name="scrapyd_shop",
    version="1.0",
    packages=find_packages(),
    entry_points={"scrapy": ["settings = scrapyd_shop.settings"]},
)
