"""A crawl's statistics as the spider reports them: the stats file, its newest snapshot, the Scrapy stats (ckagent.code.scrapyhook).

The spider (the SDK's ``report_stats``/``progress``, or the Scrapy extension the agent's hook enables)
appends snapshots to ``<task dir>/stats.jsonl`` (``CK_STATS_FILE``): each line one complete JSON
object ``{"time": epoch seconds, "stats": {...}, "progress": {"done": n, "total": m}}``; the newest
line wins. The file is the spool: whatever the agent or the master went through, the final snapshot
is its last line, read again when the result is (re)built.

A snapshot's *seq* is the byte offset where its line ends: it grows with every new line, is the same
after a restart, and lets the master drop an older snapshot that arrives late.

Well-known keys of ``stats`` (read by the status page, the metrics and ``ckagent exec``): ``items``,
``itemsDropped``, ``requests``, ``responses``, ``responsesByStatus`` (status → count), ``bytes``,
``retries``, ``errors``, ``finishReason``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATS_FILE = "stats.jsonl"
"""The stats file's name in the task directory (``CK_STATS_FILE``)."""

MAX_SNAPSHOT_BYTES = 64 * 1024
"""A snapshot line longer than this is ignored (the previous one stays the newest)."""



@dataclass(frozen=True)
class Snapshot:
    """One stats line: ``seq`` (byte offset of its end), ``data`` (the whole JSON object)."""

    seq: int
    data: dict[str, Any]

    @property
    def stats(self) -> dict[str, Any]:
        """The ``stats`` object ({} when missing)."""
        stats = self.data.get("stats")
        return stats if isinstance(stats, dict) else {}

    @property
    def finish_reason(self) -> str | None:
        """``stats.finishReason`` when it is a string (Scrapy's close reason)."""
        reason = self.stats.get("finishReason")
        return reason if isinstance(reason, str) and reason else None


def read_last_snapshot(path: Path, after: int = -1) -> Snapshot | None:
    """The newest complete snapshot line of ``path`` ending after byte ``after`` (blocking; one small read).

    Returns None when there is none (no file, no complete line, nothing new, or only lines that are
    not JSON objects / longer than MAX_SNAPSHOT_BYTES among the last bytes). The file is the spider's:
    it is opened like every spool file (never following a symlink, never blocking on a FIFO). Never
    raises for the file's content; OSError other than a missing file propagates (SpoolFileError for
    a file that is not a regular one).
    """
    from ckagent.delivery.spool import open_spool  # here: ckagent.delivery imports this module

    try:
        fd = open_spool(path)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size <= max(after, 0):
            return None
        start = max(0, size - MAX_SNAPSHOT_BYTES - 1)
        data = os.pread(fd, size - start, start)
    finally:
        os.close(fd)
    end = data.rfind(b"\n")
    while end >= 0:
        begin = data.rfind(b"\n", 0, end) + 1
        seq = start + end + 1
        if seq <= after:
            return None
        if begin == 0 and start > 0:  # the line may start before what was read: too long
            return None
        try:
            obj = json.loads(data[begin:end])
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return Snapshot(seq, obj)
        end = begin - 1
    return None


def summary(stats: dict[str, Any] | None) -> dict[str, int]:
    """The counters shown everywhere: items, requests, responses, errors (0 when not reported)."""
    out: dict[str, int] = {}
    for key in ("items", "requests", "responses", "errors"):
        value = (stats or {}).get(key)
        out[key] = int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0
    return out
