"""A spider's hostile files, for the tests of what the agent reads back from the trees spiders own
(ckagent.node.beneath and its users): :func:`bounded` runs a call that must not block (a FIFO) in a
thread of its own and fails the test when it does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["bounded"]

T = TypeVar("T")


def bounded(fn: Callable[..., T], *args: Any, timeout: float = 10.0, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a daemon thread, its result or its exception; AssertionError when it
    has not returned within ``timeout`` seconds (it blocked: the thread is left behind)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except Exception as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name=f"bounded {getattr(fn, '__name__', fn)}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"{getattr(fn, '__name__', fn)} blocked for {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]
