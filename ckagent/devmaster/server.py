"""Run the dev master: hypercorn's Trio worker serving :func:`ckagent.devmaster.app.create_app`.

``serve`` is the startable service (for tests and embedding: ``base_url = await nursery.start(serve,
config)``); ``serve_forever`` is the blocking entry point behind ``ckagent dev-master`` and
``python -m ckagent.devmaster``. Data lives in one SQLite file and survives restarts.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.typing import ASGIFramework

from ckagent.devmaster.app import Notifier, create_app
from ckagent.devmaster.store import NODE_LIVE_SECONDS, Store
from ckagent.devmaster.sweeper import NODE_LOST_AFTER_SECONDS, sweep

__all__ = ["DevMasterConfig", "main", "serve", "serve_forever"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DevMasterConfig:
    """Settings of one dev master. ``port`` 0 picks a free port; ``max_long_poll_seconds`` caps waitSeconds."""

    db_path: Path
    registration_token: str
    admin_token: str
    host: str = "127.0.0.1"
    port: int = 8080
    max_long_poll_seconds: float = 30.0
    claim_in_poll: bool = True
    """Offer the ``claim-in-poll`` feature (False: behave as a master from before it)."""
    artifacts: bool = True
    """Offer the ``artifacts`` feature and its endpoints (False: behave as a master from before it)."""
    poll_follows_results: bool = True
    """Offer the ``poll-follows-results`` feature (False: behave as a master from before it)."""
    graceful_timeout: float = 2.0
    """Seconds in-flight requests get to finish after a graceful shutdown starts."""
    public_url: str | None = None
    """The URL agents reach this master at, for the codePackage urls it hands out; None (the default)
    hands them out relative (``/api/packages/…``), resolved by each agent against its ``server.url``."""
    discard_logs: bool = False
    """Acknowledge log lines without storing them (count and SHA-256 only: ``GET /api/tasks/{id}/logs/digest``),
    so the master keeps up with any agent; for benchmarks."""

    node_lost_after: float = NODE_LOST_AFTER_SECONDS
    """Seconds without a heartbeat after which a node's RUNNING tasks end their attempt NODE_LOST and get a
    new one (default 600: the protocol's restart grace; ckagent.devmaster.sweeper)."""
    node_live_after: float = NODE_LIVE_SECONDS
    """Seconds after its last heartbeat a node that did not leave still holds its name against another
    ``nodeUid`` (default 90; registration answers 409 meanwhile, docs/protocol.md "Register"); tests shorten it."""

    def __repr__(self) -> str:  # tokens are secrets
        return (
            f"DevMasterConfig(db_path={str(self.db_path)!r}, host={self.host!r}, port={self.port}, "
            "registration_token='***', admin_token='***')"
        )


def _hypercorn_config(config: DevMasterConfig) -> HypercornConfig:
    hc = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hc.bind = [f"{host}:{config.port}"]
    hc.accesslog = None
    hc.loglevel = "WARNING"
    hc.graceful_timeout = config.graceful_timeout
    hc.include_server_header = False
    return hc


async def serve(
    config: DevMasterConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the dev master until cancelled (or until ``shutdown_trigger`` returns: graceful stop).

    Opens (creates) the SQLite file, binds ``config.host:config.port`` and calls
    ``task_status.started(base_url)`` with the real bound URL, e.g. ``"http://127.0.0.1:43127"``.
    Cancellation stops the server at once; either way the database is closed on the way out.
    A graceful stop answers waiting long polls at once and gives other requests
    ``config.graceful_timeout`` seconds. Raises OSError if the address cannot be bound and
    sqlite3.Error if the database cannot be opened.
    """
    store = await trio.to_thread.run_sync(Store, config.db_path)
    store.discard_logs = config.discard_logs
    store.node_live_seconds = config.node_live_after
    try:
        notifier = Notifier()
        app = create_app(
            store,
            notifier,
            registration_token=config.registration_token,
            admin_token=config.admin_token,
            max_long_poll_seconds=config.max_long_poll_seconds,
            public_url=config.public_url,
            claim_in_poll=config.claim_in_poll,
            artifacts=config.artifacts,
            poll_follows_results=config.poll_follows_results,
        )

        async def until_shutdown() -> None:
            try:
                if shutdown_trigger is None:
                    await trio.sleep_forever()
                else:
                    await shutdown_trigger()
            finally:
                notifier.close()

        sweeps = trio.CancelScope()

        async def run_sweeps() -> None:
            with sweeps:
                await sweep(store, notifier, config.node_lost_after)

        async def run_http(  # noqa: ASYNC128 - hypercorn_serve calls task_status.started()
            task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
        ) -> None:
            try:
                await hypercorn_serve(cast(ASGIFramework, app), _hypercorn_config(config),
                                      shutdown_trigger=until_shutdown, task_status=task_status)
            finally:
                sweeps.cancel()  # served to the end: the periodic work ends with it

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_sweeps)
            binds = await nursery.start(run_http)
            base_url = str(binds[0]).rstrip("/")
            _log.info("dev master listening on %s (db: %s)", base_url, config.db_path)
            task_status.started(base_url)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(store.close)


def serve_forever(
    *,
    db_path: Path | str,
    host: str = "127.0.0.1",
    port: int = 8080,
    registration_token: str,
    admin_token: str,
    public_url: str | None = None,
    discard_logs: bool = False,
    node_lost_after: float = NODE_LOST_AFTER_SECONDS,
    node_live_after: float = NODE_LIVE_SECONDS,
) -> None:
    """Run the dev master in the foreground until SIGINT or SIGTERM, then return normally (exit 0).

    Prints ``ckagent dev master listening on http://HOST:PORT (db: PATH)`` to stdout as soon as the
    socket is bound. Raises OSError if the address cannot be bound.
    """
    config = DevMasterConfig(
        db_path=Path(db_path),
        host=host,
        port=port,
        registration_token=registration_token,
        admin_token=admin_token,
        public_url=public_url,
        discard_logs=discard_logs,
        node_lost_after=node_lost_after,
        node_live_after=node_live_after,
    )

    async def main_task() -> None:
        stop = trio.Event()
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def run_server(  # noqa: ASYNC128 - serve() calls task_status.started()
                    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
                ) -> None:
                    await serve(config, shutdown_trigger=stop.wait, task_status=task_status)
                    nursery.cancel_scope.cancel()  # served to the end: stop watching signals

                base_url = await nursery.start(run_server)
                print(f"ckagent dev master listening on {base_url} (db: {config.db_path})", flush=True)
                async for _signum in signals:
                    if stop.is_set():  # a second signal: stop now
                        nursery.cancel_scope.cancel()
                        break
                    stop.set()  # graceful; a hard stop shortly after in case something hangs
                    nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout + 1.0

    trio.run(main_task)


def main(argv: list[str] | None = None) -> int:
    """``python -m ckagent.devmaster [--db F] [--host H] [--port P]``; tokens from flags or the environment.

    The tokens come from ``--registration-token``/``--admin-token`` or, better (flags show up in
    ``ps``), from DEVMASTER_REGISTRATION_TOKEN and DEVMASTER_ADMIN_TOKEN, like ``ckagent dev-master``.
    Returns 0 after SIGINT/SIGTERM; exits 2 on usage errors.
    """
    parser = argparse.ArgumentParser(prog="python -m ckagent.devmaster", description=__doc__)
    parser.add_argument(
        "--db", type=Path, default=Path("master.sqlite"), help="SQLite file (created if missing)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    parser.add_argument("--registration-token", default=os.environ.get("DEVMASTER_REGISTRATION_TOKEN"))
    parser.add_argument("--admin-token", default=os.environ.get("DEVMASTER_ADMIN_TOKEN"))
    parser.add_argument("--public-url", default=os.environ.get("DEVMASTER_PUBLIC_URL"),
                        help="URL agents reach this master at, for code package URLs (default: relative URLs)")
    parser.add_argument("--discard-logs", action="store_true",
                        help="acknowledge log lines without storing them (count and SHA-256 only; benchmarks)")
    parser.add_argument("--node-lost-after", type=float, default=NODE_LOST_AFTER_SECONDS, metavar="SECONDS",
                        help="a node silent this long loses its running tasks to new attempts (default 600:"
                             " the protocol's restart grace)")
    parser.add_argument("--node-live-after", type=float, default=NODE_LIVE_SECONDS, metavar="SECONDS",
                        help="a node that did not leave holds its name against another nodeUid this long after its"
                             " last heartbeat (default 90)")
    args = parser.parse_args(argv)
    for flag, value in (("--node-lost-after", args.node_lost_after), ("--node-live-after", args.node_live_after)):
        if not value > 0:
            parser.error(f"{flag}: expected a number of seconds > 0")
    if not args.registration_token or not args.admin_token:
        parser.error(
            "needs --registration-token/DEVMASTER_REGISTRATION_TOKEN and --admin-token/DEVMASTER_ADMIN_TOKEN"
        )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    serve_forever(
        db_path=args.db,
        host=args.host,
        port=args.port,
        registration_token=args.registration_token,
        admin_token=args.admin_token,
        public_url=args.public_url,
        discard_logs=args.discard_logs,
        node_lost_after=args.node_lost_after,
        node_live_after=args.node_live_after,
    )
    return 0
