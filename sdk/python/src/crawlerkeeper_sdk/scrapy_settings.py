"""A Scrapy settings module that is the project's own settings plus the CrawlerKeeper stats extension.

The agent itself no longer needs it (its environments add the extensions through
``crawlerkeeper_sdk._scrapy_hook``); it stays for running the stats extension by hand: set
``SCRAPY_SETTINGS_MODULE`` to this module (your own goes to ``CK_SCRAPY_SETTINGS_MODULE``). Importing it:

1. finds the project's settings module: ``CK_SCRAPY_SETTINGS_MODULE``, else ``[settings]`` of the
   closest ``scrapy.cfg`` (project ``SCRAPY_PROJECT``, default ``default``), as Scrapy itself would;
2. puts the project directory on ``sys.path`` (as Scrapy's ``init_env`` does) and copies every
   upper-case name of that module here;
3. adds ``crawlerkeeper_sdk.scrapy.CrawlerKeeperStats`` to ``EXTENSIONS`` (order 900).

A spider's ``custom_settings`` that replace ``EXTENSIONS`` as a whole also drop the extension (then
no stats are reported; nothing else changes). Raises ImportError when the project's module cannot
be imported, as Scrapy would.
"""

import os
import sys
from importlib import import_module
from pathlib import Path

_project = os.environ.get("CK_SCRAPY_SETTINGS_MODULE") or None
try:
    from scrapy.utils.conf import closest_scrapy_cfg, get_config
except ImportError:  # pragma: no cover - only imported by Scrapy
    closest_scrapy_cfg = get_config = None  # type: ignore[assignment]
if get_config is not None:
    _closest = closest_scrapy_cfg()
    if _closest:
        _projdir = str(Path(_closest).parent)
        if _projdir not in sys.path:
            sys.path.append(_projdir)
    if _project is None:
        _cfg = get_config()
        _name = os.environ.get("SCRAPY_PROJECT", "default")
        if _cfg.has_option("settings", _name):
            _project = _cfg.get("settings", _name)
if _project:
    _module = import_module(_project)
    globals().update({k: v for k, v in vars(_module).items() if k.isupper()})

EXTENSIONS = dict(globals().get("EXTENSIONS") or {})
EXTENSIONS.setdefault("crawlerkeeper_sdk.scrapy.CrawlerKeeperStats", 900)
