"""Scans of an items file by the items reader's own rules (ckagent.delivery.readers), apart from the
stream: the items over the size limit a task's end says (:func:`scan_oversize`), and how many items a
stretch of the file makes (:func:`count_items`: a checkpoint's position in the items stream)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ckagent.delivery.lines import LineSplitter
from ckagent.delivery.readers import _ItemLines
from ckagent.delivery.spool import READ_CHUNK, open_spool

__all__ = ["OVERSIZE_SCAN_BYTES", "count_items", "scan_oversize"]

OVERSIZE_SCAN_BYTES = 256 * 1024 * 1024
"""At most this much of an items file's unread tail is scanned at a task's end (:func:`scan_oversize`)."""


def scan_oversize(path: Path, start: int, max_line_bytes: int) -> tuple[list[tuple[int, int]], int]:
    """The items over ``max_line_bytes`` in ``path`` from offset ``start`` (where a line starts) to its
    end, as the items reader will find them: ``([(size, end offset), ...], scanned up to)``. Reads at
    most :data:`OVERSIZE_SCAN_BYTES`; a file that is not a plain file of the spool (a link the spider
    planted) or cannot be read gives ``([], start)``. Blocking."""
    found: list[tuple[int, int]] = []

    def notes(_source: str, size: int, _limit: int, end: int) -> None:
        found.append((size, end))

    try:
        fd = open_spool(path)
    except OSError:
        return [], start
    try:
        splitter = LineSplitter(start, max_line_bytes, False)
        lines = _ItemLines(start, lambda _raw: None, max_line_bytes, notes, path.name)
        at = start
        while at - start < OVERSIZE_SCAN_BYTES:
            data = os.pread(fd, READ_CHUNK, at)
            if not data:
                lines.elements(*splitter.flush(), True)
                break
            at += len(data)
            lines.elements(*splitter.feed(data), False)
        else:
            at = lines.line_start
    except OSError:
        return found, start
    finally:
        os.close(fd)
    return found, at


def count_items(path: Path, start: int, end: int, encode: Callable[[bytes], bytes | None],
                max_line_bytes: int) -> tuple[int, int]:
    """How many items the items stream makes of ``path``'s complete lines from ``start`` (where a line
    starts) up to offset ``end``, by the reader's own rules (``encode`` None: skipped; a line over
    ``max_line_bytes``: one placeholder): ``(count, where the last counted line ends)`` — a line that
    ends after ``end`` (torn at it) is not counted. A file that is not a plain file of the spool gives
    ``(0, start)``. Blocking (reads ``end - start`` bytes)."""
    try:
        fd = open_spool(path)
    except OSError:
        return 0, start
    count, last = 0, start
    try:
        splitter = LineSplitter(start, max_line_bytes, False)
        lines = _ItemLines(start, encode, max_line_bytes)
        at = start
        while at < end and (data := os.pread(fd, min(READ_CHUNK, end - at), at)):
            at += len(data)
            elements, marks = lines.elements(*splitter.feed(data), False)
            count += len(elements)
            last = marks[-1] if marks else last
    except OSError:
        return 0, start
    finally:
        os.close(fd)
    return count, last
