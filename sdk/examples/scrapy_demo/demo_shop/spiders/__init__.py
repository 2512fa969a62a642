"""Spiders of the demo_shop project."""
