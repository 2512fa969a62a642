"""Attach the CrawlerKeeper Scrapy extensions to every crawl of this interpreter, however it started.

The agent's environments carry a ``.pth`` file that imports this module at interpreter start-up.
It does nothing unless ``CK_SCRAPY_HOOK`` is set (the agent sets it for its Python tasks): then,
when Scrapy loads its defaults (``scrapy.settings.default_settings``), two extensions are added to
``EXTENSIONS_BASE``:

- ``crawlerkeeper_sdk.scrapy.CrawlerKeeperItems`` (``CK_SCRAPY_HOOK`` names ``items``): every
  scraped item also goes to the task's items file, beside the project's own ``FEEDS``;
- ``crawlerkeeper_sdk.scrapy.CrawlerKeeperStats`` (always): live crawl statistics;
- ``crawlerkeeper_sdk._scrapy_state.CrawlerKeeperState`` (``CK_SCRAPY_HOOK`` names ``state``): the
  crawl checkpoints at the agent's requests and resumes; Scrapy's default ``JOBDIR`` becomes
  ``$CK_STATE_DIR/jobdir`` (a project's own JOBDIR wins, as any setting over a default), and the
  downloader middleware ``crawlerkeeper_sdk._scrapy_proxy.CrawlerKeeperProxyReset`` keeps a request
  from carrying an earlier node's proxy into a resumed attempt.

Because it changes Scrapy's defaults, not the command line or the settings module, it works for
``scrapy crawl`` under any shell, ``python -m scrapy``, and scripts that build a ``CrawlerProcess``
from their own settings; a project's ``EXTENSIONS`` (merged with ``EXTENSIONS_BASE`` by Scrapy)
does not remove it. The hook never raises: a failure leaves Scrapy as it is.
"""

import contextlib
import os
import sys

TARGET = "scrapy.settings.default_settings"
EXTENSIONS = {"crawlerkeeper_sdk.scrapy.CrawlerKeeperItems": 0, "crawlerkeeper_sdk.scrapy.CrawlerKeeperStats": 900}
STATE_EXTENSION = "crawlerkeeper_sdk._scrapy_state.CrawlerKeeperState"
PROXY_RESET = "crawlerkeeper_sdk._scrapy_proxy.CrawlerKeeperProxyReset"


def _patch(module):
    base = dict(getattr(module, "EXTENSIONS_BASE", None) or {})
    for name, order in EXTENSIONS.items():
        base.setdefault(name, order)
    if "state" in os.environ.get("CK_SCRAPY_HOOK", "").split(",") and os.environ.get("CK_STATE_DIR"):
        base.setdefault(STATE_EXTENSION, 950)
        if not getattr(module, "JOBDIR", None):
            module.JOBDIR = os.path.join(os.environ["CK_STATE_DIR"], "jobdir")
        middlewares = dict(getattr(module, "DOWNLOADER_MIDDLEWARES_BASE", None) or {})
        middlewares.setdefault(PROXY_RESET, 740)  # (crawlerkeeper_sdk._scrapy_proxy: before HttpProxyMiddleware)
        module.DOWNLOADER_MIDDLEWARES_BASE = middlewares
    module.EXTENSIONS_BASE = base


class _Loader:
    """Runs the real loader, then adds the extensions to the module it loaded."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with contextlib.suppress(Exception):  # never break Scrapy's import
            _patch(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    """A meta path finder that wraps the loader of Scrapy's default settings, once."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        import importlib.util

        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install():
    """Install the hook when ``CK_SCRAPY_HOOK`` is set (idempotent; never raises)."""
    if not os.environ.get("CK_SCRAPY_HOOK"):
        return
    try:
        module = sys.modules.get(TARGET)
        if module is not None:
            _patch(module)
        elif not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())
    except Exception:  # an interpreter start-up hook must never fail
        pass


install()
