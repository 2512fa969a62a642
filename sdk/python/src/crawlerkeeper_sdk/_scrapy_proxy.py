"""A request that crosses nodes must not keep the old node's proxy (issue 38; the hook's ``state`` mode).

Scrapy's HttpProxyMiddleware writes the proxy it takes from the environment (``HTTP_PROXY``…: on an
agent at the ``proxy`` egress level, the task's own listener on 127.0.0.1) into the request itself:
``meta["proxy"]``, ``meta["_scheme_proxy"]`` (the mark that it came from the environment),
``meta["_auth_proxy"]`` and the ``Proxy-Authorization`` header. A request that went through it once —
in flight at a checkpoint, or retried or redirected into the JOBDIR's queues — carries that proxy into
the next attempt, on another node, where that listener does not exist (every such request fails).

:class:`CrawlerKeeperProxyReset`, a downloader middleware placed just before HttpProxyMiddleware (740
< 750), removes what HttpProxyMiddleware took from the environment, so that it takes it again from
this process's environment: the same proxy on the same node, the new one on another. A proxy the
spider set itself (no ``_scheme_proxy``) is left alone.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ORDER", "CrawlerKeeperProxyReset"]

ORDER = 740
"""Its place in ``DOWNLOADER_MIDDLEWARES_BASE`` (HttpProxyMiddleware is 750)."""


class CrawlerKeeperProxyReset:
    """Downloader middleware (module docstring)."""

    def process_request(self, request: Any, spider: Any = None) -> None:
        """Forget the environment's proxy HttpProxyMiddleware wrote into ``request`` earlier (returns None)."""
        meta = request.meta
        if not meta.get("_scheme_proxy"):
            return
        meta.pop("_scheme_proxy", None)
        meta.pop("proxy", None)
        meta.pop("_auth_proxy", None)
        request.headers.pop(b"Proxy-Authorization", None)
