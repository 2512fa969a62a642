"""The last lines of a stream, for failure messages a person can act on (pure; no I/O).

:class:`TailBuffer` keeps the last ``max_bytes`` of what a process wrote (an installer's output, a
spider's stderr) while it runs; :func:`last_lines` turns text into its last whole lines within a
character budget, so a message is never cut in the middle of a line (only a single line longer
than the whole budget is shortened, from its start, marked with ``…``).
"""

from __future__ import annotations

from collections import deque

ELLIPSIS = "…"


class TailBuffer:
    """The last ``max_bytes`` bytes written (whole chunks are kept; the oldest dropped first)."""

    def __init__(self, max_bytes: int = 16384) -> None:
        self.max_bytes = max_bytes
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._dropped = False

    def write(self, chunk: bytes) -> None:
        """Add ``chunk`` (drops the oldest chunks beyond ``max_bytes``)."""
        if not chunk:
            return
        self._chunks.append(chunk)
        self._size += len(chunk)
        while self._size - len(self._chunks[0]) >= self.max_bytes:
            self._size -= len(self._chunks.popleft())
            self._dropped = True

    def text(self) -> str:
        """What is kept, decoded (UTF-8, bad bytes replaced), without a torn first line when bytes were dropped."""
        data = b"".join(self._chunks)
        torn = self._dropped or len(data) > self.max_bytes
        text = data[-self.max_bytes:].decode("utf-8", errors="replace")
        if torn:
            _, _, text = text.partition("\n")
        return text


def last_lines(text: str, max_chars: int = 2000, max_lines: int = 30) -> str:
    """The last whole non-empty-ended lines of ``text``: at most ``max_lines`` lines and ``max_chars`` characters.

    Trailing blank lines are dropped. A last line longer than ``max_chars`` keeps its end, prefixed
    with ``…``. Returns "" for blank text.
    """
    lines = text.rstrip().splitlines()
    picked: list[str] = []
    used = 0
    for line in reversed(lines):
        line = line.rstrip()
        cost = len(line) + (1 if picked else 0)
        if len(picked) >= max_lines or used + cost > max_chars:
            if not picked:
                picked.append(ELLIPSIS + line[-(max_chars - 1):])
            break
        picked.append(line)
        used += cost
    return "\n".join(reversed(picked))
