"""Elements read from a spool but not yet acknowledged by the master, encoded once, cut into batches.

The readers (:mod:`ckagent.delivery.readers`) add to a :class:`Pending`; the stream shipper
(:mod:`ckagent.delivery.shipper`) cuts batch bodies from it and takes what the master acknowledged.
Pure logic on bytes and lists (no I/O); ``trio.current_time()`` stamps when elements were read.
"""

from __future__ import annotations

import bisect
from collections import deque
from itertools import accumulate
from operator import add
from typing import Any

import trio

__all__ = ["Pending"]


class Pending:
    """Elements read but not yet acknowledged, in order, each already encoded as JSON (bytes).

    Parallel lists, one entry per element or *block*: the entry's bytes, its mark (where its last
    element ends in its source: an int), its size in the batch body (bytes, without its ``,``
    separator), its element count and, for a block, how to cut it. ``runs`` groups consecutive
    elements by the reader's tag (for the journal: which record and source they came from). A batch
    body is the entries joined with ``,`` — nothing is encoded twice.

    A block (:meth:`add_block`) is many printable-ASCII log lines read together, already joined as
    they travel in a body (``"a","b"``): a flood of plain lines costs one bytes object per read
    instead of several per line. A block is cut into its elements only where a batch ends inside it
    (or an answer needs its first element). ``len()`` counts elements, never entries. ``since`` is
    when the oldest pending element was read (``trio.current_time()``): a batch's age is its oldest
    element's, also for elements read while the batch before them was on its way.
    """

    __slots__ = ("_added", "_blocks", "_gone", "_reads", "count", "counts", "cuts", "elements", "marks", "runs", "since", "size", "sizes")

    def __init__(self) -> None:
        self.elements: list[bytes] = []
        self.marks: list[int] = []
        self.sizes: list[int] = []
        self.counts: list[int] = []  # elements in each entry (1, or a block's count)
        self.cuts: list[tuple[int, int] | None] = []  # a block's (mark before it, prefix bytes per line)
        self.runs: list[list[Any]] = []  # [count, tag]
        self.size = 0
        self.count = 0
        self.since = 0.0
        self._blocks = 0  # entries that are blocks: 0 keeps every operation on the one-entry-per-element path
        self._reads: deque[tuple[int, float]] = deque()  # (elements added up to this read's end, its time)
        self._added = 0  # elements ever added
        self._gone = 0  # elements ever taken or cleared

    def __len__(self) -> int:
        return self.count

    def _run(self, count: int, tag: Any) -> None:
        now = trio.current_time()
        if not self.count:
            self.since = now
        self._added += count
        self._reads.append((self._added, now))
        self.count += count
        if self.runs and self.runs[-1][1] == tag:
            self.runs[-1][0] += count
        else:
            self.runs.append([count, tag])

    def add(self, elements: list[bytes], marks: list[int], tag: Any = None) -> None:
        """Append encoded ``elements`` ending at ``marks`` (same length), all from one run ``tag``."""
        if not elements:
            return
        self._run(len(elements), tag)
        self.elements += elements
        self.marks += marks
        sizes = list(map(len, elements))
        self.sizes += sizes
        self.counts += [1] * len(sizes)
        self.cuts += [None] * len(sizes)
        self.size += sum(sizes) + len(sizes)

    def add_block(self, block: bytes, count: int, start: int, end: int, prefix_bytes: int, tag: Any = None) -> None:
        """Append ``count`` log lines encoded as one block (see :func:`ckagent.delivery.lines.encode_block`):
        ``"<prefix><line>","<prefix><line>"``, the lines ending at ``start`` + (each line's length + 1),
        the last at ``end``; ``prefix_bytes`` is the length of the (quote-free) prefix of every line."""
        self._run(count, tag)
        self.elements.append(block)
        self.marks.append(end)
        self.sizes.append(len(block))
        self.counts.append(count)
        self.cuts.append((start, prefix_bytes) if count > 1 else None)
        self.size += len(block) + 1
        if count > 1:
            self._blocks += 1

    def _explode(self, i: int) -> None:
        """Replace block entry ``i`` by one entry per element (marks from the lines' lengths)."""
        cut = self.cuts[i]
        assert cut is not None
        start, prefix_bytes = cut
        parts = self.elements[i][1:-1].split(b'","')
        elements = [b'"%s"' % part for part in parts]
        marks = list(accumulate([len(part) - prefix_bytes + 1 for part in parts], initial=start))[1:]
        k = len(elements)
        self.elements[i : i + 1] = elements
        self.marks[i : i + 1] = marks
        self.sizes[i : i + 1] = map(len, elements)
        self.counts[i : i + 1] = [1] * k
        self.cuts[i : i + 1] = [None] * k
        self._blocks -= 1

    def _split(self, i: int, k: int) -> None:
        """Cut block entry ``i`` into two entries: its first ``k`` elements and the rest (0 < k < count)."""
        block, c, mark, cut = self.elements[i], self.counts[i], self.marks[i], self.cuts[i]
        assert cut is not None and 0 < k < c
        start, prefix_bytes = cut
        inner = block[1:-1]
        if k <= c - k:  # split off the shorter side only: a bytes object per element of it
            head_len = sum(map(len, inner.split(b'","', k)[:k])) + 3 * (k - 1)
        else:
            head_len = len(inner.rsplit(b'","', c - k)[0])
        head, tail = b'"%s"' % inner[:head_len], b'"%s"' % inner[head_len + 3 :]
        middle = start + head_len - 3 * (k - 1) - k * prefix_bytes + k  # where the k-th line ends
        self.elements[i : i + 1] = head, tail
        self.marks[i : i + 1] = middle, mark
        self.sizes[i : i + 1] = len(head), len(tail)
        self.counts[i : i + 1] = k, c - k
        self.cuts[i : i + 1] = (start, prefix_bytes) if k > 1 else None, (middle, prefix_bytes) if c - k > 1 else None
        self._blocks += (k > 1) + (c - k > 1) - 1

    def _entries(self, n: int) -> int:
        """How many leading entries hold exactly the first ``n`` elements (a block across the boundary is cut)."""
        if not self._blocks or n <= 0:
            return max(n, 0)
        seen = 0
        for i, c in enumerate(self.counts):
            if seen + c >= n:
                if seen + c > n:
                    self._split(i, n - seen)
                return i + 1
            seen += c
        return len(self.counts)

    def first(self) -> bytes:
        """The first element (encoded)."""
        self._entries(1)
        return self.elements[0]

    def encoded(self) -> list[bytes]:
        """Every element, one by one (blocks cut)."""
        self._entries(self.count)
        while self._blocks:
            self._explode(next(i for i, c in enumerate(self.counts) if c > 1))
        return list(self.elements)

    def take(self, n: int) -> list[tuple[Any, int]]:
        """Drop the first ``n`` elements; returns ``(tag, last mark)`` of each run they touched, in order."""
        m = self._entries(n)
        touched: list[tuple[Any, int]] = []
        left = n
        counts = self.counts
        line = entry = 0  # elements and entries passed
        while left:
            run = self.runs[0]
            used = min(left, run[0])
            if self._blocks:  # runs end on entry boundaries (one add per run piece), and so does n
                target = line + used
                while line < target:
                    line += counts[entry]
                    entry += 1
                touched.append((run[1], self.marks[entry - 1]))
            else:
                touched.append((run[1], self.marks[n - left + used - 1]))
            left -= used
            if used == run[0]:
                del self.runs[0]
            else:
                run[0] -= used
        self.size -= sum(self.sizes[:m]) + m
        self.count -= n
        if self._blocks:
            self._blocks -= sum(1 for c in counts[:m] if c > 1)
        del self.elements[:m], self.marks[:m], self.sizes[:m], self.counts[:m], self.cuts[:m]
        self._gone += n
        reads = self._reads
        while reads and reads[0][0] <= self._gone:
            reads.popleft()
        if reads:
            self.since = reads[0][1]  # when the oldest element left was read
        return touched

    def size_of(self, n: int) -> int:
        """Bytes the first ``n`` elements take in a batch body (each with a separator)."""
        m = self._entries(n)
        return sum(self.sizes[:m]) + m

    def replace_first(self, element: bytes) -> None:
        """Put ``element`` (encoded) in place of the first element (same mark and run)."""
        self._entries(1)
        self.size += len(element) - self.sizes[0]
        self.elements[0] = element
        self.sizes[0] = len(element)

    def clear(self) -> None:
        self.elements, self.marks, self.sizes, self.counts, self.cuts, self.runs = [], [], [], [], [], []
        self.size = self.count = self._blocks = 0
        self._gone = self._added
        self._reads.clear()

    def batch_len(self, max_count: int, max_bytes: int) -> int:
        """How many leading elements make a batch of at most ``max_count`` and ``max_bytes`` (at least 1)."""
        if self._blocks:
            taken = size = i = 0
            while i < len(self.counts):
                c, s = self.counts[i], self.sizes[i] + 1
                if taken + c <= max_count and size + s <= max_bytes:
                    taken, size, i = taken + c, size + s, i + 1
                elif taken >= max_count or c == 1:
                    break
                elif taken + c > max_count and size + s <= max_bytes:
                    self._split(i, max_count - taken)  # the count ends the batch inside this block
                else:
                    self._explode(i)  # the size ends the batch inside this block: look at its elements
            return max(1, taken)
        n = min(len(self.elements), max_count)
        if (self.size if n == len(self.elements) else self.size_of(n)) <= max_bytes:
            return n
        # total of the first i+1 elements with their separators: sizes[0..i] + (i + 1)
        totals = list(map(add, accumulate(self.sizes[:n]), range(1, n + 1)))
        return max(1, min(n, bisect.bisect_right(totals, max_bytes)))

    def body(self, n: int, seq: int, key: str, attempt: int | None = None) -> bytes:
        """The JSON request body ``{"seq": seq, key: [first n elements]}`` (UTF-8 bytes), with
        ``"attempt": attempt`` after ``seq`` when given (None: left out, which a master reads as 1)."""
        m = self._entries(n)
        head = b'{"seq":%d,' % seq if attempt is None else b'{"seq":%d,"attempt":%d,' % (seq, attempt)
        return head + b'"%s":[%s]}' % (key.encode(), b",".join(self.elements[:m]))
