"""Scrapy integration: an item pipeline that saves every item with :func:`crawlerkeeper_sdk.save_item`,
and an extension that reports Scrapy's stats with :func:`crawlerkeeper_sdk.report_stats`.

Enable the pipeline in the Scrapy project's ``settings.py``::

    ITEM_PIPELINES = {"crawlerkeeper_sdk.scrapy.CrawlerKeeperPipeline": 300}

The item extension (:class:`CrawlerKeeperItems`) and the stats extension (:class:`CrawlerKeeperStats`)
need no change to the project: in the agent's environments ``crawlerkeeper_sdk._scrapy_hook`` adds
them to Scrapy's ``EXTENSIONS_BASE``, however Scrapy is started. It snapshots the stats every ``CRAWLERKEEPER_STATS_INTERVAL`` seconds (default 5)
and once at close, with the finish reason.

**Scrapy's own serialization.** The extension and the pipeline encode each item with Scrapy's own
exporter for ``-o items.jsonl`` (``FEED_EXPORTERS["jsonl"]``, by default ``JsonLinesItemExporter``
and its ``ScrapyJSONEncoder``: datetimes as ``"1907-02-01T00:00:00"``, dates, times, ``Decimal`` as
a string, sets as lists, nested items as objects), built from the crawl's settings as Scrapy's feed
exporter builds it (``FEED_EXPORT_ENCODING``, ``FEED_EXPORT_FIELDS``, ``FEED_EXPORT_INDENT``, the
fields' ``serializer``): each line is byte for byte the line the project's own
``scrapy crawl -o items.jsonl`` writes for that item (:func:`scrapy_item_encoder`). Only when that
exporter cannot be built or cannot encode an item is the item written the way
:func:`crawlerkeeper_sdk.save_item` writes a dict (``str()`` for what JSON cannot hold): never lost.

Outside a crawl this module does not import Scrapy; it uses ``itemadapter`` (installed with Scrapy)
to turn any Scrapy-supported item (``scrapy.Item``, dict, dataclass, attrs class) into a plain dict.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from typing import Any, Callable, Dict, Optional
from urllib.parse import unquote, urlparse

from crawlerkeeper_sdk import _emit, _encode

try:  # itemadapter always comes with Scrapy; without it, plain dicts and dataclasses still work.
    from itemadapter import ItemAdapter
except ImportError:  # pragma: no cover - depends on the environment
    ItemAdapter = None

__all__ = ["CrawlerKeeperItems", "CrawlerKeeperPipeline", "CrawlerKeeperStats", "item_to_dict", "scrapy_item_encoder",
           "scrapy_summary"]

_log = logging.getLogger(__name__)


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


def scrapy_item_encoder(crawler: Any) -> Callable[[Any], bytes]:
    """The bytes Scrapy's own ``-o items.jsonl`` feed of this crawl writes for an item: a function
    ``item -> bytes`` (one JSON line ending in ``\\n``).

    The exporter is the crawl's ``FEED_EXPORTERS["jsonl"]`` (else ``["jsonlines"]``), built as Scrapy's
    ``FeedExporter`` builds it — through the crawler when the class has ``from_crawler`` — with the
    feed options a ``-o`` feed gets from the settings: ``encoding`` (``FEED_EXPORT_ENCODING``: unset
    means ASCII with ``\\u`` escapes, as Scrapy), ``fields_to_export`` (``FEED_EXPORT_FIELDS``),
    ``indent`` (``FEED_EXPORT_INDENT``). Raises whatever Scrapy raises building it (ImportError,
    TypeError...); the function raises what the exporter raises for an item it cannot encode.
    """
    from scrapy.utils.misc import load_object

    settings = crawler.settings
    exporters = settings.getwithbase("FEED_EXPORTERS")
    exporter_cls = load_object(exporters.get("jsonl") or exporters.get("jsonlines")
                               or "scrapy.exporters.JsonLinesItemExporter")
    getdictorlist = getattr(settings, "getdictorlist", None)
    fields = getdictorlist("FEED_EXPORT_FIELDS") if getdictorlist is not None else settings.getlist("FEED_EXPORT_FIELDS")
    options = {"fields_to_export": fields or None, "encoding": settings.get("FEED_EXPORT_ENCODING"),
               "indent": settings.getint("FEED_EXPORT_INDENT")}
    buffer = io.BytesIO()
    exporter = _build_exporter(exporter_cls, crawler, buffer, options)
    exporter.start_exporting()

    def encode(item: Any) -> bytes:
        buffer.seek(0)
        buffer.truncate()
        exporter.export_item(item)
        return buffer.getvalue()

    return encode


def _build_exporter(exporter_cls: Any, crawler: Any, buffer: Any, options: Dict[str, Any]) -> Any:
    """``exporter_cls(buffer, **options)`` the way the installed Scrapy's FeedExporter makes it."""
    try:
        from scrapy.utils.misc import build_from_crawler  # Scrapy >= 2.12
    except ImportError:
        build_from_crawler = None
    if build_from_crawler is not None:
        return build_from_crawler(exporter_cls, crawler, buffer, **options)
    try:
        from scrapy.utils.misc import create_instance  # Scrapy 2.0 - 2.11
    except ImportError:  # pragma: no cover - a Scrapy older than 2.0
        return exporter_cls(buffer, **options)
    return create_instance(exporter_cls, crawler.settings, crawler, buffer, **options)


class _ItemSaver:
    """Saves Scrapy items as Scrapy's own feed encodes them (:func:`scrapy_item_encoder`), or, when
    that cannot be, as :func:`crawlerkeeper_sdk.save_item` does (said once in the crawl's log)."""

    def __init__(self, crawler: Optional[Any]) -> None:
        self._encode: Optional[Callable[[Any], bytes]] = None
        if crawler is not None:
            try:
                self._encode = scrapy_item_encoder(crawler)
            except Exception as exc:  # a missing or odd exporter: the SDK's own encoding, never no items
                _log.warning("crawlerkeeper: cannot build Scrapy's JSON Lines exporter (%s: %s); items are "
                             "encoded as crawlerkeeper_sdk.save_item does", type(exc).__name__, exc)
        self._said = False

    def encode(self, item: Any) -> bytes:
        """The item's line(s) as :meth:`save` writes them (raises TypeError for what is not an item)."""
        if self._encode is not None:
            try:
                data = self._encode(item)
            except Exception as exc:
                if not self._said:
                    self._said = True
                    _log.warning("crawlerkeeper: Scrapy's exporter cannot encode an item (%s: %s); such items are "
                                 "encoded as crawlerkeeper_sdk.save_item does", type(exc).__name__, exc)
            else:
                return data if not data or data.endswith(b"\n") else data + b"\n"
        return _encode(item_to_dict(item))

    def save(self, item: Any) -> None:
        """Append one item to the task's items file (raises OSError if it cannot be written)."""
        data = self.encode(item)
        if data:
            _emit(data)


class CrawlerKeeperPipeline:
    """Scrapy item pipeline: saves each item as one JSON line of the task's items file.

    Put it last (a high order number) if other pipelines clean or drop items first. Items pass
    through unchanged, so later pipelines and feed exports still see them.

    When the crawl already has a feed to the task's items file (``FEEDS``, as an agent hands a
    Scrapy project that does not use this pipeline), the pipeline steps aside, so no item is
    written twice.
    """

    def __init__(self, crawler: Optional[Any] = None) -> None:
        self._saver = _ItemSaver(crawler)

    @classmethod
    def from_crawler(cls, crawler: Any) -> CrawlerKeeperPipeline:
        """Scrapy's factory: raises ``NotConfigured`` when a feed already writes the items file."""
        if _feeds_items_file(crawler.settings):
            from scrapy.exceptions import NotConfigured

            raise NotConfigured("a feed already writes the task's items file (CK_ITEMS_FILE)")
        return cls(crawler)

    def process_item(self, item: Any, spider: Any = None) -> Any:
        """Save ``item`` as Scrapy's own JSON Lines feed encodes it (module docstring) and return it
        unchanged.

        Raises ``TypeError`` for an object Scrapy would not accept as an item, ``OSError`` if
        the items file cannot be written.
        """
        self._saver.save(item)
        return item


class CrawlerKeeperItems:
    """Scrapy extension: every scraped item also becomes one JSON line of the task's items file.

    The agent enables it for any Scrapy run in its environments (``crawlerkeeper_sdk._scrapy_hook``),
    beside the project's own ``FEEDS``, which keep exporting as written. It listens to
    ``item_scraped`` (what feeds export: items that passed every pipeline) and appends each as
    Scrapy's own ``-o items.jsonl`` feed encodes it (module docstring), so items stream to the agent
    as they are scraped, byte for byte the project's own export.

    It steps aside (``NotConfigured``), so no item is written twice, when ``CK_SCRAPY_HOOK`` does not
    name ``items`` (the agent found the project ships items through the SDK itself), when
    ``CK_ITEMS_FILE`` is unset (not run by an agent), when a feed already writes the items file
    (``-o "$CK_ITEMS_FILE"``) or when :class:`CrawlerKeeperPipeline` is enabled.
    """

    @classmethod
    def from_crawler(cls, crawler: Any) -> CrawlerKeeperItems:
        """Scrapy's factory: connects to ``item_scraped``; raises ``NotConfigured`` as above."""
        from scrapy import signals
        from scrapy.exceptions import NotConfigured

        if "items" not in os.environ.get("CK_SCRAPY_HOOK", "").split(","):
            raise NotConfigured("the agent did not ask for items (the project uses the SDK)")
        if not os.environ.get("CK_ITEMS_FILE"):
            raise NotConfigured("not run by an agent (CK_ITEMS_FILE is unset)")
        if _feeds_items_file(crawler.settings):
            raise NotConfigured("a feed already writes the task's items file (CK_ITEMS_FILE)")
        if _pipeline_enabled(crawler.settings):
            raise NotConfigured("CrawlerKeeperPipeline already saves the items")
        ext = cls(crawler)
        crawler.signals.connect(ext.item_scraped, signal=signals.item_scraped)
        import logging

        logging.getLogger(__name__).info("crawlerkeeper: scraped items also go to the task's items file "
                                         "(CK_ITEMS_FILE), beside the project's own feeds")
        return ext

    def __init__(self, crawler: Optional[Any] = None) -> None:
        self._saver = _ItemSaver(crawler)
        self._crawler = crawler

    def item_scraped(self, item: Any, response: Any = None, spider: Any = None) -> None:
        """Append ``item`` to the task's items file as Scrapy's own feed encodes it — once its response is
        fully processed when the crawl checkpoints (``crawlerkeeper_sdk._scrapy_state``: exactly once)."""
        data = self._saver.encode(item)
        state = getattr(self._crawler, "_ck_state", None)
        if data and (state is None or not state.hold(data, response)):
            _emit(data)


def _pipeline_enabled(settings: Any) -> bool:
    """Whether ``ITEM_PIPELINES`` enables :class:`CrawlerKeeperPipeline` (by its path or the class)."""
    try:
        pipelines = settings.getwithbase("ITEM_PIPELINES")
    except (AttributeError, TypeError, ValueError):
        return False
    for key, order in dict(pipelines).items():
        name = key if isinstance(key, str) else f"{getattr(key, '__module__', '')}.{getattr(key, '__name__', '')}"
        if order is not None and name.rsplit(".", 1)[-1] == "CrawlerKeeperPipeline":
            return True
    return False


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


def _count(stats: Dict[str, Any], key: str) -> int:
    value = stats.get(key, 0)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def scrapy_summary(stats: Dict[str, Any], finish_reason: Any = None) -> Dict[str, Any]:
    """Scrapy's stats (``crawler.stats.get_stats()``) → a snapshot with the well-known keys.

    ``requests``, ``responses``, ``responsesByStatus`` (``{"200": n}``), ``bytes`` (response bytes),
    ``items``, ``itemsDropped``, ``retries``, ``errors`` (ERROR log lines), ``finishReason`` (the
    close reason, e.g. ``finished`` or ``closespider_itemcount``), plus ``scrapy``: every stat with
    JSON-safe values (datetimes as ISO strings).
    """
    by_status = {}
    prefix = "downloader/response_status_count/"
    for key, value in stats.items():
        if key.startswith(prefix) and isinstance(value, int):
            by_status[key[len(prefix):]] = value
    raw = {}
    for key, value in stats.items():
        if isinstance(value, (int, float, str, bool)) or value is None:
            raw[key] = value
        elif hasattr(value, "isoformat"):
            raw[key] = value.isoformat()
        else:
            raw[key] = str(value)
    summary: Dict[str, Any] = {
        "requests": _count(stats, "downloader/request_count"),
        "responses": _count(stats, "downloader/response_count"),
        "responsesByStatus": by_status,
        "bytes": _count(stats, "downloader/response_bytes"),
        "items": _count(stats, "item_scraped_count"),
        "itemsDropped": _count(stats, "item_dropped_count"),
        "retries": _count(stats, "retry/count"),
        "errors": _count(stats, "log_count/ERROR"),
        "scrapy": raw,
    }
    reason = finish_reason if finish_reason is not None else stats.get("finish_reason")
    if reason is not None:
        summary["finishReason"] = str(reason)
    return summary


class CrawlerKeeperStats:
    """Scrapy extension: reports ``scrapy_summary(stats)`` every ``CRAWLERKEEPER_STATS_INTERVAL``
    seconds (default 5; 0 = only at close) and at close (with the finish reason, written at once).

    Does nothing outside an agent (no ``CK_STATS_FILE``). A failing write is logged, never raised
    into the crawl.
    """

    def __init__(self, crawler: Any, interval: float) -> None:
        self.crawler = crawler
        self.interval = interval
        self._loop: Any = None

    @classmethod
    def from_crawler(cls, crawler: Any) -> CrawlerKeeperStats:
        """Scrapy's constructor hook: connects to ``spider_opened`` and ``spider_closed``."""
        from scrapy import signals

        ext = cls(crawler, crawler.settings.getfloat("CRAWLERKEEPER_STATS_INTERVAL", 5.0))
        crawler.signals.connect(ext.spider_opened, signal=signals.spider_opened)
        crawler.signals.connect(ext.spider_closed, signal=signals.spider_closed)
        return ext

    def _report(self, reason: Any = None, final: bool = False) -> None:
        from crawlerkeeper_sdk import report_stats

        try:
            report_stats(scrapy_summary(dict(self.crawler.stats.get_stats()), reason), final=final)
        except (OSError, TypeError, ValueError) as exc:
            import logging

            logging.getLogger(__name__).warning("crawlerkeeper: cannot report stats: %s", exc)

    def spider_opened(self, spider: Any) -> None:
        """Start the periodic snapshots."""
        self._report()
        if self.interval > 0:
            from twisted.internet import task

            self._loop = task.LoopingCall(self._report)
            self._loop.start(self.interval, now=False)

    def spider_closed(self, spider: Any, reason: Any = None) -> None:
        """Stop the snapshots and write the final one (with ``reason``) at once."""
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._report(reason, final=True)
