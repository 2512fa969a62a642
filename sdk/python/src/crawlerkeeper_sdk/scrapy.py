"""Scrapy integration: an item pipeline that saves every item with :func:`crawlerkeeper_sdk.save_item`.

Enable it in the Scrapy project's ``settings.py``::

    ITEM_PIPELINES = {"crawlerkeeper_sdk.scrapy.CrawlerKeeperPipeline": 300}

This module does not import Scrapy itself; it uses ``itemadapter`` (installed with Scrapy) to turn
any Scrapy-supported item (``scrapy.Item``, dict, dataclass, attrs class) into a plain dict.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict
from urllib.parse import unquote, urlparse

from crawlerkeeper_sdk import save_item

try:  # itemadapter always comes with Scrapy; without it, plain dicts and dataclasses still work.
    from itemadapter import ItemAdapter
except ImportError:  # pragma: no cover - depends on the environment
    ItemAdapter = None

__all__ = ["CrawlerKeeperPipeline", "item_to_dict"]


def item_to_dict(item: Any) -> Dict[str, Any]:
    """Convert a Scrapy item (``scrapy.Item``, dict, dataclass, attrs instance) to a plain dict.

    Nested items are converted too when ``itemadapter`` is installed. Raises ``TypeError`` for an
    object that is none of these.
    """
    if ItemAdapter is not None:
        try:
            return ItemAdapter(item).asdict()
        except TypeError:
            raise TypeError(
                f"CrawlerKeeperPipeline cannot save a {type(item).__name__}: Scrapy items must be "
                "dicts, scrapy.Item, dataclass or attrs instances"
            ) from None
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return dataclasses.asdict(item)
    try:
        return dict(item)
    except (TypeError, ValueError):
        raise TypeError(
            f"CrawlerKeeperPipeline cannot save a {type(item).__name__}: items must be dicts, "
            "scrapy.Item or dataclass instances"
        ) from None


class CrawlerKeeperPipeline:
    """Scrapy item pipeline: saves each item as one JSON line of the task's items file.

    Put it last (a high order number) if other pipelines clean or drop items first. Items pass
    through unchanged, so later pipelines and feed exports still see them.

    When the crawl already has a feed to the task's items file (``FEEDS``, as an agent hands a
    Scrapy project that does not use this pipeline), the pipeline steps aside, so no item is
    written twice.
    """

    @classmethod
    def from_crawler(cls, crawler: Any) -> CrawlerKeeperPipeline:
        """Scrapy's factory: raises ``NotConfigured`` when a feed already writes the items file."""
        if _feeds_items_file(crawler.settings):
            from scrapy.exceptions import NotConfigured

            raise NotConfigured("a feed already writes the task's items file (CK_ITEMS_FILE)")
        return cls()

    def process_item(self, item: Any, spider: Any = None) -> Any:
        """Save ``item`` (see :func:`crawlerkeeper_sdk.save_item`) and return it unchanged.

        Raises ``TypeError`` for an object Scrapy would not accept as an item, ``OSError`` if
        the items file cannot be written.
        """
        save_item(item_to_dict(item))
        return item


def _feeds_items_file(settings: Any) -> bool:
    """Whether Scrapy's ``FEEDS`` setting has a feed to the file named by ``CK_ITEMS_FILE``."""
    items_file = os.environ.get("CK_ITEMS_FILE")
    if not items_file:
        return False
    try:
        feeds = settings.getdict("FEEDS")
    except (TypeError, ValueError):
        return False
    target = os.path.abspath(items_file)
    for uri in feeds:
        path = str(uri)
        if path.startswith("file://"):
            path = unquote(urlparse(path).path)
        if os.path.isabs(path) and os.path.abspath(path) == target:
            return True
    return False
