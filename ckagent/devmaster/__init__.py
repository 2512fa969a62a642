"""The reference master: the node protocol and an admin API over one SQLite file, for demos and tests.

    store/       the state and the protocol's stateful rules (claims, final results, seq numbers,
                 attempts, checkpoints), one module per concern (schema, database, nodes, spiders, tasks,
                 claims, streams, supersede, attempts, checkpoints, queue)
    retrypolicy.py  the retry decision after an attempt's final result (pure)
    sweeper.py   the periodic work: nodes lost after ``--node-lost-after``, retries that come due
    app.py       the Starlette app: composition, pages, ``route_table`` (the (method, path) pairs by side)
    node_api.py  the node protocol's routes (long poll, claims, streams, artifact uploads, code)
    checkpoint_api.py  the node protocol's checkpoint routes (chunks, manifests)
    admin_api.py the admin API's routes and the checks of its payloads
    queuemetrics.py  ``GET /metrics``: the queue for an autoscaler (pending, running, nodes, slots)
    taskpage.py  the page of one task (``/tasks/{id}``): its attempts and newest checkpoint
    web.py       what the routes share: request bodies, authentication, the long-poll notifier
    artifacts.py where a task's artifacts live (small ones in SQLite, large ones as synced files)
    demosite.py  the deterministic demo shop the example spiders crawl (/demo-site/)
    server.py    hypercorn (Trio worker): ``serve`` (startable) and ``serve_forever`` (the CLI's)
    client.py    ``AdminClient`` and ``zip_directory`` for demos and end-to-end tests

Backend teams can read store/ and node_api.py as the executable contract of docs/protocol.md.
"""

from __future__ import annotations

from ckagent.node.lazycli import defer_httpx_cli

# Before the admin client imports httpx (``python -m ckagent.devmaster`` imports this package
# first): httpx's own command-line client would pull in rich, click and pygments, about a sixth of
# the dev master process's start-up, for a command it never runs (a no-op when httpx is imported).
defer_httpx_cli()

from ckagent.devmaster.client import AdminApiError, AdminClient, zip_directory  # noqa: E402
from ckagent.devmaster.server import DevMasterConfig, serve, serve_forever  # noqa: E402

__all__ = ["AdminApiError", "AdminClient", "DevMasterConfig", "serve", "serve_forever", "zip_directory"]
