"""The reference master: the node protocol and an admin API over one SQLite file, for demos and tests.

    store.py     the state and the protocol's stateful rules (claims, final results, seq numbers)
    app.py       the Starlette app: node endpoints, admin endpoints, long poll
    demosite.py  the deterministic demo shop the example spiders crawl (/demo-site/)
    server.py    hypercorn (Trio worker): ``serve`` (startable) and ``serve_forever`` (the CLI's)
    client.py    ``AdminClient`` and ``zip_directory`` for demos and end-to-end tests

Backend teams can read store.py and app.py as the executable contract of docs/protocol.md.
"""

from __future__ import annotations

from ckagent.devmaster.client import AdminApiError, AdminClient, zip_directory
from ckagent.devmaster.server import DevMasterConfig, serve, serve_forever

__all__ = ["AdminApiError", "AdminClient", "DevMasterConfig", "serve", "serve_forever", "zip_directory"]
