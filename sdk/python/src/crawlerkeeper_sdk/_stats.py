"""The stats side channel: :func:`report_stats` and :func:`progress` write snapshots to ``CK_STATS_FILE``.

Each line of the file is one complete snapshot (a JSON object); the newest line wins. The agent
reads the last line, ships it to the master (coalesced, rate-limited) and sends the final one with
the task's result. A line::

    {"time": 1764576000.5, "stats": {"items": 120, "requests": 14}, "progress": {"done": 3, "total": 10}}

Writes are coalesced: at most one line per :data:`MIN_INTERVAL` seconds; a snapshot reported
sooner is written when the interval is over (by a timer thread) or when the process exits. Outside
an agent (no ``CK_STATS_FILE``) both functions do nothing.

Well-known keys of ``stats`` (the agent, the status page and the metrics understand these; any other
key is kept as is): ``items``, ``itemsDropped``, ``requests``, ``responses``, ``responsesByStatus``
(``{"200": n, "404": m}``), ``bytes``, ``retries``, ``errors``, ``finishReason``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any, Dict, Optional

ENV_STATS_FILE = "CK_STATS_FILE"

MIN_INTERVAL = 1.0
"""Seconds between two lines written by one process (later snapshots replace a pending one)."""

_lock = threading.Lock()
_stats: Dict[str, Any] = {}
_progress: Optional[Dict[str, Any]] = None
_pending = False
_last_write = 0.0
_timer: Optional[threading.Timer] = None


def _after_fork_in_child() -> None:
    global _lock, _timer
    _lock = threading.Lock()
    _timer = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _line() -> bytes:
    snapshot: Dict[str, Any] = {"time": round(time.time(), 3), "stats": _stats}
    if _progress is not None:
        snapshot["progress"] = _progress
    text = json.dumps(snapshot, ensure_ascii=False, default=str, separators=(",", ":"))
    return (text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029") + "\n").encode("utf-8")


def _write_locked() -> None:
    """Append the current snapshot (caller holds ``_lock``)."""
    global _pending, _last_write
    path = os.environ.get(ENV_STATS_FILE)
    _pending = False
    if not path:
        return
    data = _line()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    _last_write = time.monotonic()


def _flush_timer() -> None:
    global _timer
    with _lock:
        _timer = None
        if _pending:
            _write_locked()


def _publish(force: bool) -> None:
    """Write now, or schedule the write when the last one was less than MIN_INTERVAL ago."""
    global _pending, _timer
    if not os.environ.get(ENV_STATS_FILE):
        return
    with _lock:
        _pending = True
        wait = MIN_INTERVAL - (time.monotonic() - _last_write)
        if force or wait <= 0:
            _write_locked()
            return
        if _timer is None:
            _timer = threading.Timer(wait, _flush_timer)
            _timer.daemon = True
            _timer.start()


def flush_stats() -> None:
    """Write a pending snapshot now (also done at interpreter exit). Raises ``OSError`` if it cannot."""
    with _lock:
        if _pending:
            _write_locked()


atexit.register(lambda: _safe_flush())


def _safe_flush() -> None:
    with contextlib.suppress(OSError):
        flush_stats()


def report_stats(stats: Mapping[str, Any], *, final: bool = False) -> None:
    """Report the crawl's statistics: ``stats`` is the complete current picture (it replaces the
    previous one), a mapping of JSON-able values (others are written as ``str(value)``).

    Use the well-known keys (see module docstring) where they fit: ``items``, ``requests``,
    ``responsesByStatus``, ``errors``, ``finishReason``... ``final=True`` writes at once (the
    spider is about to end). Raises ``TypeError`` when ``stats`` is not a mapping, ``OSError`` when
    the stats file cannot be written. Outside an agent it does nothing.
    """
    global _stats
    if not isinstance(stats, Mapping):
        raise TypeError(f"report_stats() takes a mapping of name -> value, got {type(stats).__name__}")
    _stats = dict(stats)
    _publish(final)


def progress(done: float, total: Optional[float] = None) -> None:
    """Report progress: ``done`` units of work of ``total`` (None = unknown), e.g. pages or ids.

    Kept with the last :func:`report_stats` snapshot in the same line. Raises ``TypeError`` for
    values that are not numbers, ``ValueError`` for negative ones.
    """
    global _progress
    for name, value in (("done", done), ("total", total)):
        if value is None and name == "total":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"progress(): {name} must be a number, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"progress(): {name} must be >= 0, got {value}")
    _progress = {"done": done, "total": total}
    _publish(False)
