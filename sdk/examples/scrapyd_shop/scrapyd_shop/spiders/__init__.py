"""Spiders of the scrapyd_shop project."""
