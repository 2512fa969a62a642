"""What this node can run, kept fresh: the cached scan at start, then a new scan in the background.

Registration uses the last scan, cached on disk (a fresh scan runs ~0.5–1 s of subprocesses); the
agent's root nursery runs :meth:`RuntimeScan.run`, which scans once the start is over and every
:data:`RUNTIME_SCAN_INTERVAL` seconds, keeps the scan on disk, refreshes the tools the node misses
(ckagent.code.capabilities) and the browser paths spiders get (updated in place), and says once at start
whether spiders' Chromium can use its own sandbox (``CK_CHROMIUM_SANDBOX``: ckagent.code.browsers).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from ckagent.code.browsers import for_identities
from ckagent.code.capabilities import Capabilities
from ckagent.code.runtimes import (
    BROWSER_VARS,
    RUNTIMES_CACHE,
    browser_env,
    detect_runtimes,
    load_cached_runtimes,
    save_runtimes_cache,
)
from ckagent.node.identity import Identities

log = logging.getLogger(__name__)

RUNTIME_SCAN_INTERVAL = 300.0
"""Seconds between two scans of the node's runtimes."""


class RuntimeScan:
    """The node's runtimes (``runtimes``: the scan of :func:`ckagent.code.runtimes.detect_runtimes`)
    and the browser variables spiders get (``browser_env``: one dict, updated in place after each scan).
    """

    def __init__(self, work_dir: Path, uv_path: Path | None, capabilities: Capabilities) -> None:
        self._cache = work_dir / RUNTIMES_CACHE
        self._uv_path = uv_path
        self.capabilities = capabilities
        self.runtimes: dict[str, Any] = {}
        self.browser_env: dict[str, str] = {}

    async def load_cached(self, identities: Identities | None = None) -> None:
        """Take the last scan kept on disk (none: empty) and its browser paths; with ``identities`` (whom
        spiders run as), also whether their Chromium can use its own sandbox (one probe, one log line:
        :func:`ckagent.code.browsers.for_identities`)."""
        self.runtimes = await trio.to_thread.run_sync(load_cached_runtimes, self._cache)
        self.browser_env.update(browser_env(self.runtimes))
        if identities is not None:
            self.browser_env.update((await trio.to_thread.run_sync(for_identities, identities)).env())

    def report(self) -> dict[str, Any]:
        """The scan, plus ``missing``: tool → what its absence costs (ckagent.code.capabilities)."""
        missing = self.capabilities.missing
        return {**self.runtimes, "missing": dict(missing)} if missing else self.runtimes

    async def run(self, start_after: Callable[[], Awaitable[None]],
                  on_found_again: Callable[[], None] = lambda: None) -> None:
        """Scan after ``start_after()`` returns, then every RUNTIME_SCAN_INTERVAL seconds, until
        cancelled; ``on_found_again()`` when a tool that was missing is back (the poller takes the
        spiders that need it again). Cancellation: stops between or during scans (a scan's
        subprocesses run in a worker thread and finish there)."""
        await start_after()
        while True:
            self.runtimes = await trio.to_thread.run_sync(detect_runtimes, self._uv_path)
            was_missing = set(self.capabilities.missing)
            if was_missing - set(self.capabilities.refresh()):
                log.info("found %s again: taking the spiders that need it",
                         ", ".join(sorted(was_missing - set(self.capabilities.missing))))
                on_found_again()
            await trio.to_thread.run_sync(save_runtimes_cache, self._cache, self.runtimes)
            browsers = await trio.to_thread.run_sync(browser_env, self.runtimes)
            for variable in BROWSER_VARS.values():
                self.browser_env.pop(variable, None)
            self.browser_env.update(browsers)
            await trio.sleep(RUNTIME_SCAN_INTERVAL)
