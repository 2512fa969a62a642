"""Durable delivery: a task's files are the spool; the outbox ships them to the master exactly once.

Files of a task (``work_dir/tasks/<task-id>/``)::

    output.log       stdout + stderr bytes as received (LogSink), plus the agent's notices
    items.jsonl      one JSON object per line, written by the spider (the SDK)
    *.log ...        the spider's own log files (globs: ``task.log_files`` + the task's ``params.logFiles``)
    output.journal   the order in which the log sources' bytes enter the task's ONE log stream

**One log stream, several sources.** The master numbers a task's log lines with one ``seq`` space,
so lines of the spider's log files must be merged with stdout/stderr in an order that is the same
every time it is computed — after a crash too — or a resend could drop or repeat lines. The agent
therefore writes that order down: the *journal* is an append-only text file of small records::

    S <idx> <path>    source <idx> is the file <path> (relative to the task dir; 0 = output.log)
    D <idx> <size>    the stream continues with source <idx>'s bytes up to offset <size>
    F <idx>           source <idx> is complete: its unterminated last line becomes a line
    E                 the stream is complete

Every source is cut into lines by its own :class:`LineSplitter`; the log stream is the lines in the
order the journal feeds the bytes. Lines of a spider log file are marked with their source:
``[scrapy.log] <line>``; stdout/stderr lines are not marked. The journal is the only writer's
decision; readers replay it, so the stream is a pure function of the files. Positions stored in the
state store are ``{"j": <journal offset of the record being replayed>, "p": {<idx>: <end offset of
the source's last acknowledged line>}}``; the items stream is one file (``{"offset": n}``).

**Lines.** Splitting works on bytes, so offsets stay exact: a line ends at ``\\n``, ``\\r\\n`` or a
lone ``\\r`` (progress bars become lines instead of one endless line); a line longer than
``max_line_bytes`` (64 KiB) is cut into pieces at a UTF-8 character boundary. Bytes are decoded only
once a line is complete (a character split across reads stays whole), as UTF-8 with replacement
(invalid bytes become U+FFFD, never an exception). Values of secrets are masked (``***``) per line
or piece (a secret cut by a 64 KiB piece boundary is not recognised).

**Shipping** (:class:`StreamShipper`): read from the acknowledged position, cut batches (≤ 5000
elements, ≤ 1 MiB of JSON, or ~1 s old), POST ``{seq, lines|items}``, store the new position only
after a 2xx, one request at a time per stream. The master answers with the count it holds; a 409
``{expectedSeq}`` rewinds (to an in-memory checkpoint, or the start) or skips what it already has.
413/422 halve the batch; a single element the master refuses is replaced by a short placeholder (a
gap would block the stream forever). 404 or a 409 without ``expectedSeq`` ends the stream.

**The outbox** (:class:`Outbox`, one per agent, in the agent's root nursery) owns every task's
delivery: the journal writer, the two shippers and, once both streams are complete, the final result
(stored first, sent last, retried with exponential backoff and jitter until acknowledged). A task's
worker slot is free as soon as its process has ended; delivery goes on without it. On start the
agent hands unfinished deliveries from the state store to the outbox (:meth:`Outbox.resume`).
Requests are sent by at most ``SEND_CONCURRENCY`` tasks at a time; a shipper waiting in backoff
retries early (after ≥ 1 s) when another request has found the master reachable again.

**Disk budget** (:class:`LogSink`): output.log stops growing at ``task.max_log_bytes`` or when the
filesystem's free space would fall below ``task.min_free_disk_bytes``; the pipes are still drained
(the spider never blocks) and one marker line at the end says how many bytes were dropped. The
spider's own files (items, log files) are not the agent's to cut.

**Retention** (:func:`cleanup_task_dirs`): a task's directory is deleted only after its result was
acknowledged (which happens only after both streams were), and ``task.retention`` seconds later.

Errors: shipping never raises for master trouble (MasterUnavailable is retried until cancelled;
the stored position lets the next start resume). Nothing here raises into the agent for a
task's data: an unexpected bug in one task's delivery is logged and that task is left in the
state store for the next start. ``OSError`` writing output.log truncates it (marker) instead of
failing the task.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from itertools import accumulate
from pathlib import Path, PurePosixPath
from typing import Any

import trio

from ckagent.master import MasterClient, MasterConflict, MasterRejected, MasterUnavailable
from ckagent.protocol import Task, TaskResult
from ckagent.state import AsyncStateStore, TaskRecord

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 64 * 1024
"""Longest log line (bytes); longer ones are cut into pieces."""
MAX_ITEM_BYTES = 16 * 1024 * 1024
"""Longest items.jsonl line (bytes) read as one item."""
MAX_BATCH_BYTES = 1024 * 1024
"""Most JSON bytes of elements in one batch (one larger element travels alone)."""
MAX_BATCH_COUNT = 5000
"""Most elements in one batch."""
BATCH_AGE = 1.0
"""Seconds a non-full batch may wait for more elements before it is sent."""
TAIL_INTERVAL = 0.25
"""Seconds between looks at a file written by another process (items, spider log files)."""
SCAN_INTERVAL = 1.0
"""Seconds between looks for new or grown spider log files."""
READ_CHUNK = 256 * 1024
"""Bytes read from a spool file at a time."""
SEND_CONCURRENCY = 8
"""Tasks of the outbox that may have a request in flight at the same time."""
BACKOFF_INITIAL = 0.5
BACKOFF_MAX = 30.0
EARLY_RETRY_AFTER = 1.0
"""Seconds in backoff after which a shipper retries at once if the master was seen reachable again."""
MAX_LOG_SOURCES = 64
"""Most spider log files tailed for one task (more are ignored, with a notice in the agent log)."""
CHECKPOINTS_KEPT = 64

OUTPUT_LOG = "output.log"
ITEMS_FILE = "items.jsonl"
JOURNAL_FILE = "output.journal"
AGENT_FILES = frozenset({OUTPUT_LOG, ITEMS_FILE, JOURNAL_FILE})
DEFAULT_LOG_GLOBS: tuple[str, ...] = ("*.log",)

_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|KEY)$", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------- secrets


def secret_values(env: dict[str, str], extra: Iterable[str] = ()) -> list[str]:
    """Values to mask: env variables named like *TOKEN, *SECRET, *PASSWORD, *KEY, plus ``extra``.

    Values shorter than 4 characters are not masked (they would mangle ordinary text). Longest first.
    """
    values = [v for k, v in env.items() if _SECRET_NAME.search(k)]
    values.extend(extra)
    return sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)


class Masker:
    """Replaces every occurrence of the given secret values with ``***`` (``bool(masker)``: any secret)."""

    def __init__(self, secrets: Iterable[str]) -> None:
        # A value with a line break can never be inside one line: leaving it out lets callers mask
        # many lines joined with "\n" at once without changing the line count.
        values = sorted({s for s in secrets if s and "\n" not in s and "\r" not in s}, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(v) for v in values)) if values else None

    def __bool__(self) -> bool:
        return self._pattern is not None

    def __call__(self, text: str) -> str:
        """Return ``text`` with secrets masked."""
        if self._pattern is None or self._pattern.search(text) is None:
            return text
        return self._pattern.sub("***", text)


# ---------------------------------------------------------------------------------------------- lines

_TERM_CR = re.compile(rb"\r\n|\r|\n")
_TERM_LF = re.compile(rb"\n")


class LineSplitter:
    """Incremental bytes → complete lines with the byte offset where each ends (see module docstring).

    ``feed(data)`` returns ``(lines, ends)`` for the lines completed so far (terminators stripped;
    ``ends[i]`` is the offset just after line i's terminator). ``flush()`` ends the stream: an
    unterminated last line is returned too. ``offset`` is where the unfinished line starts (the
    first byte not yet returned). The result does not depend on how the bytes were chunked, so a
    splitter restarted at any returned end offset continues exactly as the first one did.
    """

    def __init__(self, start_offset: int = 0, max_line_bytes: int = MAX_LINE_BYTES, cr_breaks: bool = True) -> None:
        if max_line_bytes < 4:
            raise ValueError("max_line_bytes must be at least 4")
        self._buf = b""
        self._start = start_offset
        self._max = max_line_bytes
        self._cr = cr_breaks

    @property
    def offset(self) -> int:
        """Offset of the first byte not yet returned as part of a line."""
        return self._start

    @property
    def buffered(self) -> int:
        """Bytes held back (an unfinished line)."""
        return len(self._buf)

    def feed(self, data: bytes) -> tuple[list[bytes], list[int]]:
        """Add bytes; return the lines they completed and their end offsets."""
        buf = self._buf + data if self._buf else bytes(data)
        return self._split(buf, final=False)

    def flush(self) -> tuple[list[bytes], list[int]]:
        """End of stream: return what is left (including an unterminated last line)."""
        return self._split(self._buf, final=True)

    def _split(self, buf: bytes, final: bool) -> tuple[list[bytes], list[int]]:
        mx = self._max
        if not (self._cr and b"\r" in buf):
            # Fast path (no \r): C-level split, then check no line is too long.
            parts = buf.split(b"\n")
            rest = parts.pop()
            if len(rest) <= mx and (not parts or max(map(len, parts)) <= mx):
                start = self._start
                ends = list(accumulate([len(p) + 1 for p in parts], initial=start))
                del ends[0]
                if final and rest:
                    parts.append(rest)
                    ends.append(start + len(buf))
                    rest = b""
                self._buf = rest
                self._start = start + len(buf) - len(rest)
                return parts, ends
        return self._split_slow(buf, final)

    def _split_slow(self, buf: bytes, final: bool) -> tuple[list[bytes], list[int]]:
        mx = self._max
        base = self._start
        n = len(buf)
        lines: list[bytes] = []
        ends: list[int] = []
        pos = 0
        content_end = n  # where the content of the unfinished line ends (before a trailing lone \r)
        for match in (_TERM_CR if self._cr else _TERM_LF).finditer(buf):
            s, e = match.start(), match.end()
            if e == n and not final and buf[s] == 0x0D:
                content_end = s  # "\r" at the end of what we have: could be the start of "\r\n"
                break
            while s - pos > mx:
                cut = _utf8_boundary(buf, pos + mx, pos)
                lines.append(buf[pos:cut])
                ends.append(base + cut)
                pos = cut
            lines.append(buf[pos:s])
            ends.append(base + e)
            pos = e
        while content_end - pos > mx:
            cut = _utf8_boundary(buf, pos + mx, pos)
            lines.append(buf[pos:cut])
            ends.append(base + cut)
            pos = cut
        if final and n > pos:
            lines.append(buf[pos:])
            ends.append(base + n)
            pos = n
        self._buf = buf[pos:]
        self._start = base + pos
        return lines, ends


def _utf8_boundary(buf: bytes, cut: int, lo: int) -> int:
    """Move ``cut`` back (at most 3 bytes, never to ``lo``) so it does not split a UTF-8 character."""
    for back in range(4):
        i = cut - back
        if i <= lo:
            break
        if (buf[i] & 0xC0) != 0x80:  # not a continuation byte: a character starts here
            return i
    return cut


# ---------------------------------------------------------------------------------------------- converters


def decode_lines(lines: Sequence[bytes], masker: Masker | None = None, prefix: str = "") -> list[str]:
    """Log lines as shipped: UTF-8 with replacement, secrets masked, ``prefix`` (the source mark) added.

    The lines hold no ``\\n``, so they are decoded (and searched for secrets) in one piece: a newline
    ends any invalid UTF-8 sequence, which makes this the same as decoding line by line.
    """
    if not lines:
        return []
    text = b"\n".join(lines).decode("utf-8", "replace")
    if masker:
        text = masker(text)
    texts = text.split("\n")
    if prefix:
        texts = [prefix + t for t in texts]
    return texts


_PLAIN = bytes(b for b in range(0x20, 0x7F) if b not in b'"\\')
_MILD = b'"\\\t' + bytes(range(0x80, 0x100))


def json_sizes(lines: list[bytes], extra: int = 0) -> list[int]:
    """Upper bounds of the JSON-encoded sizes (bytes, without quotes) of the decoded ``lines``.

    Printable ASCII stays as it is (×1); a quote, backslash or tab becomes two bytes (×2); an invalid
    UTF-8 byte becomes U+FFFD, three bytes (×3); a control character ``\\u00XX``, six bytes (×6).
    One factor for the whole group, found with C-speed byte translations. ``extra`` (a source
    prefix) is added to each.
    """
    rest = b"".join(lines).translate(None, _PLAIN)
    if not rest:
        factor = 1
    elif rest.translate(None, _MILD):
        factor = 6
    else:
        factor = 2 if rest.isascii() else 3
    if factor == 1 and not extra:
        return list(map(len, lines))
    return [len(raw) * factor + extra for raw in lines]


def _finite_float(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else text  # 1e999 would be Infinity: JSON cannot carry it


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def item_object(raw: bytes) -> Any:
    """One items.jsonl line → the item; a blank line → None (skipped); anything else is wrapped, not lost."""
    text = raw.decode("utf-8", "replace")
    if not text.strip():
        return None
    try:
        value = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except ValueError as exc:
        return {"_invalidItem": text[:10000], "_error": f"not JSON: {exc}"}
    return value if isinstance(value, dict) else {"_invalidItem": text[:10000], "_error": "not a JSON object"}


# ---------------------------------------------------------------------------------------------- readers


class _Pending:
    """Elements read but not yet acknowledged, in order.

    Parallel lists: the element, its mark (where it ends in its source: an int) and its estimated
    JSON size in bytes (with 3 bytes of separators); ``runs`` groups consecutive elements by the
    reader's tag (for the journal: which record and source they came from).
    """

    __slots__ = ("elements", "marks", "runs", "since", "size", "sizes")

    def __init__(self) -> None:
        self.elements: list[Any] = []
        self.marks: list[int] = []
        self.sizes: list[int] = []
        self.runs: list[list[Any]] = []  # [count, tag]
        self.size = 0
        self.since = 0.0

    def __len__(self) -> int:
        return len(self.elements)

    def add(self, elements: list[Any], marks: list[int], sizes: list[int], tag: Any = None) -> None:
        if not elements:
            return
        if not self.elements:
            self.since = trio.current_time()
        self.elements += elements
        self.marks += marks
        sizes = [size + 3 for size in sizes]
        self.sizes += sizes
        self.size += sum(sizes)
        if self.runs and self.runs[-1][1] == tag:
            self.runs[-1][0] += len(elements)
        else:
            self.runs.append([len(elements), tag])

    def take(self, n: int) -> list[tuple[Any, int]]:
        """Drop the first ``n`` elements; returns ``(tag, last mark)`` of each run they touched, in order."""
        touched: list[tuple[Any, int]] = []
        left = n
        while left:
            run = self.runs[0]
            used = min(left, run[0])
            touched.append((run[1], self.marks[n - left + used - 1]))
            left -= used
            if used == run[0]:
                del self.runs[0]
            else:
                run[0] -= used
        self.size -= sum(self.sizes[:n])
        del self.elements[:n], self.marks[:n], self.sizes[:n]
        if self.elements:
            self.since = trio.current_time()
        return touched

    def size_of(self, n: int) -> int:
        """Estimated bytes of the first ``n`` elements."""
        return sum(self.sizes[:n])

    def clear(self) -> None:
        self.elements, self.marks, self.sizes, self.runs, self.size = [], [], [], [], 0

    def batch_len(self, max_count: int, max_bytes: int) -> int:
        """How many leading elements make a batch of at most ``max_count`` and ``max_bytes`` (at least 1)."""
        n = min(len(self.elements), max_count)
        if self.size <= max_bytes and n == len(self.elements):
            return n
        totals = list(accumulate(self.sizes[:n]))
        return max(1, min(n, bisect.bisect_right(totals, max_bytes)))


async def _pread(fd: int, size: int, offset: int) -> bytes:
    return await trio.to_thread.run_sync(os.pread, fd, size, offset)


class _FileReader:
    """Elements of one file (the items stream). Position: ``{"offset": <end of the last element>}``."""

    def __init__(self, path: Path, convert: Callable[[bytes], Any], max_line_bytes: int, cr_breaks: bool) -> None:
        self.path = path
        self._convert = convert
        self._max = max_line_bytes
        self._cr = cr_breaks
        self._fd = -1
        self._read_at = 0
        self._splitter = LineSplitter(0, max_line_bytes, cr_breaks)
        self.finished = False  # set by the owner: the file will not grow any more
        self.done = False
        self.polls = True  # written by another process: look again every TAIL_INTERVAL

    async def restore(self, position: Any) -> None:
        offset = int(position.get("offset", 0)) if isinstance(position, dict) else 0
        self._read_at = offset
        self._splitter = LineSplitter(offset, self._max, self._cr)
        self.done = False

    async def read(self, pending: _Pending) -> bool:
        if self.done:
            return False
        if self._fd < 0:
            try:
                self._fd = await trio.to_thread.run_sync(os.open, self.path, os.O_RDONLY)
            except FileNotFoundError:
                if self.finished:
                    self.done = True
                return False
        finished = self.finished  # read before reading: a finish after an empty read still gets a last read
        data = await _pread(self._fd, READ_CHUNK, self._read_at)
        if data:
            self._read_at += len(data)
            lines, ends = self._splitter.feed(data)
        elif finished:
            lines, ends = self._splitter.flush()
            self.done = True
        else:
            return False
        elements, marks, sizes = [], [], []
        for raw, end in zip(lines, ends, strict=True):
            element = self._convert(raw)
            if element is not None:
                elements.append(element)
                marks.append(end)
                sizes.append(len(raw))
        pending.add(elements, marks, sizes)
        return True

    def commit(self, runs: list[tuple[Any, int]]) -> Any:
        """The position after the elements of ``runs`` (from :meth:`_Pending.take`)."""
        return {"offset": runs[-1][1]}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _Source:
    """One log source while the journal is replayed."""

    __slots__ = ("fd", "fed", "finalized", "path", "prefix", "splitter")

    def __init__(self, path: str, start: int, max_line_bytes: int) -> None:
        self.path = path
        self.prefix = "" if path == OUTPUT_LOG else f"[{path}] "
        self.splitter = LineSplitter(start, max_line_bytes, True)
        self.fed = start
        self.fd = -1
        self.finalized = False


def parse_journal(data: bytes) -> tuple[list[tuple[int, str, int, str]], int]:
    """Journal bytes → ``([(record offset, kind, idx, arg)], end of the last complete record)``.

    ``arg`` is the path for S, the size (as text) for D, "" otherwise. A torn last record (no
    newline) is not returned. Unknown record kinds raise ValueError.
    """
    records: list[tuple[int, str, int, str]] = []
    pos = 0
    while True:
        nl = data.find(b"\n", pos)
        if nl < 0:
            return records, pos
        text = data[pos:nl].decode("utf-8", "surrogateescape")
        kind = text[:1]
        if kind == "E":
            records.append((pos, "E", -1, ""))
        elif kind in ("S", "D", "F"):
            _, _, rest = text.partition(" ")
            idx_text, _, arg = rest.partition(" ")
            records.append((pos, kind, int(idx_text), arg))
        else:
            raise ValueError(f"bad journal record at offset {pos}: {text[:80]!r}")
        pos = nl + 1


class _JournalReader:
    """The log stream of a task: replays ``output.journal`` over its sources (see module docstring)."""

    def __init__(self, task_dir: Path, masker: Masker, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.task_dir = task_dir
        self._masker = masker
        self._max = max_line_bytes
        self._sources: dict[int, _Source] = {}
        self._jfd = -1
        self._jbuf = b""
        self._jat = 0  # next unread byte of _jbuf
        self._jpos = 0  # journal offset of _jbuf[_jat]
        self._record: tuple[int, int, int] | None = None  # (record offset, idx, target size) being fed
        self._acked: dict[int, int] = {}
        self.done = False
        self.polls = False  # the journal writer notifies

    async def restore(self, position: Any) -> None:
        self.close()
        start = 0
        acked: dict[int, int] = {}
        if isinstance(position, dict) and "j" in position:
            start = int(position["j"])
            acked = {int(k): int(v) for k, v in dict(position.get("p", {})).items()}
        elif isinstance(position, dict) and "offset" in position:  # stored before the journal existed
            acked = {0: int(position["offset"])}
        self._acked = dict(acked)
        self._sources = {}
        self._record = None
        self.done = False
        head = b""
        if start:
            head = await trio.to_thread.run_sync(_read_prefix, self.task_dir / JOURNAL_FILE, start)
        records, _ = parse_journal(head)
        fed_to: dict[int, int] = {}
        for _, kind, idx, arg in records:
            if kind == "S":
                self._sources[idx] = _Source(arg, acked.get(idx, 0), self._max)
            elif kind == "D":
                fed_to[idx] = int(arg)
            elif kind == "F" and idx in self._sources:
                self._sources[idx].finalized = True
        # Bytes of an unfinished line fed before the resume record: feed them again (they complete
        # no line — every line they complete was acknowledged before the checkpoint).
        for idx, source in self._sources.items():
            target = fed_to.get(idx, 0)
            if not source.finalized and target > source.fed:
                data = await self._read_source(source, target - source.fed)
                source.fed += len(data)
                source.splitter.feed(data)
        self._jpos = start
        self._jbuf, self._jat = b"", 0

    async def _read_source(self, source: _Source, size: int) -> bytes:
        if source.fd < 0:
            try:
                source.fd = await trio.to_thread.run_sync(os.open, self.task_dir / source.path, os.O_RDONLY)
            except OSError as exc:
                log.warning("log source %s of %s cannot be read (%s); skipping it", source.path, self.task_dir, exc)
                return b""
        return await _pread(source.fd, size, source.fed)

    async def _next_record(self) -> tuple[int, str, int, str] | None:
        """The next complete journal record ``(offset, kind, idx, arg)``, or None for now."""
        nl = self._jbuf.find(b"\n", self._jat)
        if nl < 0:
            if self._jfd < 0:
                try:
                    self._jfd = await trio.to_thread.run_sync(os.open, self.task_dir / JOURNAL_FILE, os.O_RDONLY)
                except FileNotFoundError:
                    return None
            rest = self._jbuf[self._jat :]
            more = await _pread(self._jfd, 65536, self._jpos + len(rest))
            if not more:
                return None
            self._jbuf, self._jat = rest + more, 0
            nl = self._jbuf.find(b"\n")
            if nl < 0:
                return None
        records, _ = parse_journal(self._jbuf[self._jat : nl + 1])
        _, kind, idx, arg = records[0]
        at = self._jpos
        self._jpos += nl + 1 - self._jat
        self._jat = nl + 1
        return at, kind, idx, arg

    def _peek_d(self, idx: int) -> int | None:
        """If the next record is already buffered and is ``D idx <size>``: consume it, return the size."""
        at = self._jat
        nl = self._jbuf.find(b"\n", at)
        if nl < 0 or self._jbuf[at : at + 2] != b"D ":
            return None
        _, idx_text, size_text = self._jbuf[at:nl].split(b" ", 2)
        if int(idx_text) != idx:
            return None
        self._jpos += nl + 1 - at
        self._jat = nl + 1
        return int(size_text)

    async def read(self, pending: _Pending) -> bool:
        progress = False
        budget = READ_CHUNK
        while budget > 0 and not self.done:
            if self._record is not None:
                at, idx, target = self._record
                source = self._sources[idx]
                want = min(READ_CHUNK, target - source.fed)
                data = await self._read_source(source, want) if want > 0 else b""
                if len(data) < want:
                    log.warning("log source %s of %s is shorter than recorded; skipping to its end",
                                source.path, self.task_dir)
                source.fed = target if len(data) < want else source.fed + len(data)
                if source.fed >= target:
                    self._record = None
                if data:
                    self._emit(pending, at, idx, *source.splitter.feed(data))
                    budget -= len(data)
                progress = True
                continue
            record = await self._next_record()
            if record is None:
                break
            progress = True
            at, kind, idx, arg = record
            if kind == "S":
                self._sources[idx] = _Source(arg, self._acked.get(idx, 0), self._max)
            elif kind == "D":
                target = int(arg)
                # Following D records of the same source continue the same bytes: read them in one go
                # (the elements keep this record's offset: a replay from it skips what was fed).
                while (ahead := self._peek_d(idx)) is not None:
                    target = max(target, ahead)
                known = self._sources.get(idx)
                if known is not None and target > known.fed:
                    self._record = (at, idx, target)
            elif kind == "F":
                ending = self._sources.get(idx)
                if ending is not None and not ending.finalized:
                    ending.finalized = True
                    self._emit(pending, at, idx, *ending.splitter.flush())
                    if ending.fd >= 0:
                        os.close(ending.fd)
                        ending.fd = -1
            elif kind == "E":
                self.done = True
        return progress

    def _emit(self, pending: _Pending, at: int, idx: int, lines: list[bytes], ends: list[int]) -> None:
        if lines:
            source = self._sources[idx]
            pending.add(decode_lines(lines, self._masker, source.prefix), ends,
                        json_sizes(lines, len(source.prefix)), (at, idx))

    def commit(self, runs: list[tuple[Any, int]]) -> Any:
        """The position after the elements of ``runs`` (from :meth:`_Pending.take`)."""
        acked = self._acked
        for (_, idx), end in runs:
            acked[idx] = end
        return {"j": runs[-1][0][0], "p": {str(k): v for k, v in acked.items()}}

    def close(self) -> None:
        for source in self._sources.values():
            if source.fd >= 0:
                os.close(source.fd)
                source.fd = -1
        if self._jfd >= 0:
            os.close(self._jfd)
            self._jfd = -1


def _read_prefix(path: Path, size: int) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(size)


class LogJournal:
    """Writes a task's ``output.journal`` (the merge order of its log sources; see module docstring).

    Blocking but tiny: :meth:`open` reads an existing journal (use ``trio.to_thread``); the record
    writes are small ``os.write`` calls on an O_APPEND descriptor (like :class:`LogSink`). Only the
    outbox's journal task writes. Raises OSError when the file cannot be created.
    """

    def __init__(self, task_dir: Path) -> None:
        self.task_dir = task_dir
        self.path = task_dir / JOURNAL_FILE
        self._fd = -1
        self.paths: dict[int, str] = {}  # idx → path (the current idx of each path is in `current`)
        self.current: dict[str, int] = {}
        self.recorded: dict[int, int] = {}
        self.finalized: set[int] = set()
        self.ended = False
        self.on_record: Callable[[], None] | None = None
        self._warned_full = False

    def open(self) -> None:
        """Read what an earlier run wrote (cutting a torn last record), then open for appending."""
        data = b""
        with contextlib.suppress(FileNotFoundError):
            data = self.path.read_bytes()
        records, good = parse_journal(data)
        if good < len(data):
            log.warning("%s: dropping a torn last record (%d bytes)", self.path, len(data) - good)
            os.truncate(self.path, good)
        for _, kind, idx, arg in records:
            if kind == "S":
                self.paths[idx] = arg
                self.current[arg] = idx
                self.recorded[idx] = 0
            elif kind == "D":
                self.recorded[idx] = int(arg)
            elif kind == "F":
                self.finalized.add(idx)
            elif kind == "E":
                self.ended = True
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        if 0 not in self.paths:
            self._write([self._declare(OUTPUT_LOG)])

    def _declare(self, path: str) -> str:
        idx = max(self.paths, default=-1) + 1
        self.paths[idx] = path
        self.current[path] = idx
        self.recorded[idx] = 0
        return f"S {idx} {path}\n"

    def _write(self, records: list[str]) -> None:
        if records and self._fd >= 0:
            data = "".join(records).encode("utf-8", "surrogateescape")
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            if self.on_record is not None:
                self.on_record()

    def note(self, sizes: dict[str, int]) -> None:
        """Record growth: ``sizes`` maps source path → current size. New paths are declared; a file
        that shrank (rotated or truncated) continues as a new source. Does nothing once ended."""
        if self.ended:
            return
        records: list[str] = []
        for path, size in sizes.items():
            idx = self.current.get(path)
            if idx is None:
                if len(self.paths) >= MAX_LOG_SOURCES + 1:
                    if not self._warned_full:
                        log.warning("%s: more than %d log files; ignoring the others", self.task_dir, MAX_LOG_SOURCES)
                        self._warned_full = True
                    continue
                records.append(self._declare(path))
                idx = self.current[path]
            elif idx in self.finalized:
                continue
            elif size < self.recorded[idx]:
                log.info("%s: log file %s shrank (rotated?); reading it again from its start", self.task_dir, path)
                records.append(f"F {idx}\n")
                self.finalized.add(idx)
                records.append(self._declare(path))
                idx = self.current[path]
            if size > self.recorded[idx]:
                records.append(f"D {idx} {size}\n")
                self.recorded[idx] = size
        self._write(records)

    def end(self, sizes: dict[str, int]) -> None:
        """The task is over: record the last growth, complete every source, end the stream (idempotent)."""
        if self.ended:
            return
        self.note(sizes)
        records = [f"F {idx}\n" for idx in sorted(self.paths) if idx not in self.finalized]
        self.finalized.update(self.paths)
        records.append("E\n")
        self.ended = True
        self._write(records)

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _safe_glob(pattern: str) -> bool:
    p = PurePosixPath(pattern)
    return bool(pattern) and not p.is_absolute() and ".." not in p.parts and "\n" not in pattern


def scan_log_files(task_dir: Path, globs: Sequence[str]) -> dict[str, int]:
    """Spider log files under ``task_dir`` matching ``globs``: relative path → size (blocking).

    Only regular files inside the task dir (no symlinks, nothing of the agent's own files, no path
    with a newline); absolute or ``..`` patterns are ignored.
    """
    found: dict[str, int] = {}
    root = task_dir.resolve()
    for pattern in globs:
        if not _safe_glob(pattern):
            continue
        for path in sorted(task_dir.glob(pattern)):
            rel = path.relative_to(task_dir).as_posix()
            if rel in AGENT_FILES or rel in found or "\n" in rel:
                continue
            try:
                st = path.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or not path.resolve().is_relative_to(root):
                continue
            found[rel] = st.st_size
    return found


def task_log_globs(task: Task, defaults: Sequence[str]) -> list[str]:
    """The globs of a task's spider log files: ``defaults`` plus ``params.logFiles`` (a str or list of str)."""
    extra = task.params.get("logFiles") if isinstance(task.params, dict) else None
    if isinstance(extra, str):
        extra = [extra]
    globs = list(defaults)
    if isinstance(extra, list):
        globs += [g for g in extra if isinstance(g, str) and _safe_glob(g)]
    return globs


# ---------------------------------------------------------------------------------------------- shipping


_RETRY_STATUSES = frozenset({401, 408})
"""4xx answers retried with backoff like 5xx: 401 after re-registering did not help (yet), 408 timeout."""


class _Flight:
    """A batch on its way: ``count`` leading elements of the pending ones, ``size`` their estimated bytes."""

    __slots__ = ("answer", "count", "size")

    def __init__(self, count: int, size: int) -> None:
        self.count = count
        self.size = size
        self.answer: _Answer | None = None


class _Answer:
    __slots__ = ("expected", "kind")

    def __init__(self, kind: str, expected: int | None = None) -> None:
        self.kind = kind  # ok | expected | shrink | refused
        self.expected = expected


async def _backoff_sleep(master: MasterClient, attempt: int) -> None:
    """Sleep the backoff for ``attempt`` (1, 2, ...): exponential with jitter, capped at BACKOFF_MAX.

    Ends early (but not before EARLY_RETRY_AFTER seconds) when the master becomes reachable again.
    """
    base = min(BACKOFF_MAX, BACKOFF_INITIAL * 2 ** (attempt - 1))
    delay = random.uniform(base / 2, base)
    was_up = master.connectivity.up
    start = trio.current_time()
    with trio.move_on_after(delay):
        while True:
            await trio.sleep(0.25)
            if not was_up and master.connectivity.up and trio.current_time() - start >= EARLY_RETRY_AFTER:
                return


class StreamShipper:
    """Ships one stream of one task (see module docstring): ``kind`` "logs" or "items".

    Build it with :meth:`logs` or :meth:`items`. :meth:`notify` says the spool grew; :meth:`finish`
    says the items file is complete (the log stream knows it from the journal's E record). ``stats``:
    ``acked`` elements the master holds, ``read`` elements read. ``refused`` is True when the master
    refused the stream for good.
    """

    def __init__(
        self,
        master: MasterClient,
        store: AsyncStateStore,
        task_id: str,
        kind: str,
        reader: _FileReader | _JournalReader,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        if kind not in ("logs", "items"):
            raise ValueError(f"unknown stream kind {kind!r}")
        self._master = master
        self._store = store
        self.task_id = task_id
        self.kind = kind
        self.stream = "log" if kind == "logs" else "items"
        self._key = "lines" if kind == "logs" else "items"
        self._reader = reader
        self._limiter = limiter or trio.CapacityLimiter(1)
        self._wake = trio.Event()
        self._count_limit = self._count_ceiling = MAX_BATCH_COUNT
        self.acked = 0
        self.refused = False
        self.requests = 0

    @classmethod
    def logs(cls, master: MasterClient, store: AsyncStateStore, task_id: str, task_dir: Path, masker: Masker,
             limiter: trio.CapacityLimiter | None = None, max_line_bytes: int = MAX_LINE_BYTES) -> StreamShipper:
        """The log stream of the task in ``task_dir`` (its journal and sources)."""
        return cls(master, store, task_id, "logs", _JournalReader(task_dir, masker, max_line_bytes), limiter)

    @classmethod
    def items(cls, master: MasterClient, store: AsyncStateStore, task_id: str, task_dir: Path,
              limiter: trio.CapacityLimiter | None = None) -> StreamShipper:
        """The items stream of the task in ``task_dir`` (``items.jsonl``)."""
        reader = _FileReader(task_dir / ITEMS_FILE, item_object, MAX_ITEM_BYTES, cr_breaks=False)
        return cls(master, store, task_id, "items", reader, limiter)

    def notify(self) -> None:
        """The spool grew: wake the shipper."""
        self._wake.set()

    def finish(self) -> None:
        """The items file is complete (no-op for logs): ship the rest, then :meth:`run` returns."""
        if isinstance(self._reader, _FileReader):
            self._reader.finished = True
        self._wake.set()

    async def run(self) -> None:
        """Ship until the stream is complete and acknowledged (or refused by the master).

        Resumes from the position in the state store. Cancellation stops shipping at once; the
        acknowledged position is already on disk.
        """
        reader = self._reader
        seq, position = await self._store.stream_position(self.task_id, self.stream)
        self.acked = seq
        await reader.restore(position)
        checkpoints: dict[int, Any] = {0: None, seq: position}
        pending = _Pending()
        skip = 0  # elements the master already holds beyond `seq`: read them, do not send them
        flight: _Flight | None = None  # the one request in flight (its elements lead `pending`)
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    if flight is not None and flight.answer is not None:
                        answer, n, flight = flight.answer, flight.count, None
                        if answer.kind == "refused":
                            self.refused = True
                            return
                        if answer.kind == "shrink":
                            if n > 1:  # smaller batches from now on (up to the size that failed)
                                self._count_limit = self._count_ceiling = max(1, n // 2)
                            else:  # this element is the problem, not the batch size
                                pending.elements[0] = self._placeholder(pending.elements[0])
                                self._count_ceiling = MAX_BATCH_COUNT
                            continue
                        expected = seq + n if answer.expected is None else answer.expected
                        if expected >= seq:
                            done = min(expected - seq, len(pending))
                            if done:
                                position = reader.commit(pending.take(done))
                                seq += done
                                checkpoints[seq] = position
                                while len(checkpoints) > CHECKPOINTS_KEPT:
                                    del checkpoints[next(k for k in checkpoints if k)]
                                await self._store.save_stream_position(self.task_id, self.stream, seq, position)
                            skip = expected - seq
                            self.acked = seq
                            self._count_limit = min(self._count_ceiling, self._count_limit * 2)
                        else:
                            start = max(k for k in checkpoints if k <= expected)
                            log.warning("task %s %s: the master holds %d elements, fewer than acknowledged "
                                        "(%d); resending from element %d", self.task_id, self.stream, expected,
                                        seq, start)
                            seq, skip = start, expected - start
                            self.acked = seq
                            pending.clear()
                            await reader.restore(checkpoints[start])
                        continue
                    if skip and pending and flight is None:
                        n = min(skip, len(pending))
                        seq += n
                        skip -= n
                        position = reader.commit(pending.take(n))
                        if not skip:
                            checkpoints[seq] = position
                            await self._store.save_stream_position(self.task_id, self.stream, seq, position)
                        self.acked = seq
                        continue
                    # Read ahead (up to one batch beyond the one in flight) while the master works.
                    progress = False
                    sending_count = flight.count if flight is not None else 0
                    sending_size = flight.size if flight is not None else 0
                    if (not reader.done and len(pending) - sending_count < self._count_limit
                            and pending.size - sending_size < MAX_BATCH_BYTES):
                        progress = await reader.read(pending)
                    if flight is None and pending and not skip and (
                        reader.done
                        or len(pending) >= self._count_limit
                        or pending.size >= MAX_BATCH_BYTES
                        or trio.current_time() - pending.since >= BATCH_AGE
                    ):
                        n = pending.batch_len(self._count_limit, MAX_BATCH_BYTES)
                        flight = _Flight(n, pending.size_of(n))
                        nursery.start_soon(self._fly, flight, seq, pending.elements[:n])
                        continue
                    if reader.done and not pending and flight is None:
                        if skip:
                            log.warning("task %s %s: the master holds %d more elements than this node has",
                                        self.task_id, self.stream, skip)
                        return
                    if not progress:
                        wait = TAIL_INTERVAL
                        if pending and flight is None:
                            wait = min(wait, max(0.0, BATCH_AGE - (trio.current_time() - pending.since)))
                        with trio.move_on_after(wait):
                            await self._wake.wait()
                        self._wake = trio.Event()
        finally:
            reader.close()

    async def _fly(self, flight: _Flight, seq: int, elements: list[Any]) -> None:
        flight.answer = await self._post(seq, elements)
        self._wake.set()

    def _placeholder(self, element: Any) -> Any:
        size = len(json.dumps(element, ensure_ascii=False))
        if self.kind == "logs":
            return f"[ckagent] a log line of {size} bytes was refused by the master and dropped"
        return {"_invalidItem": None, "_error": f"an item of {size} bytes was refused by the master and dropped"}

    async def _post(self, seq: int, elements: list[Any]) -> _Answer:
        """POST one batch until the master answers (backoff on MasterUnavailable). See module docstring."""
        if self.kind == "items" and len(elements) > 1:
            # An item's size is estimated from its line; re-encoding may differ: measure it.
            size = len(json.dumps(elements, ensure_ascii=False, separators=(",", ":")).encode())
            if size > MAX_BATCH_BYTES:
                return _Answer("shrink")
        path = f"/api/tasks/{self.task_id}/{self.kind}"
        body = {"seq": seq, self._key: elements}
        attempt = 0
        while True:
            try:
                async with self._limiter:
                    self.requests += 1
                    answer = await self._master.call(self.kind, "POST", path, json=body)
                accepted = answer.get("acceptedSeq") if isinstance(answer, dict) else None
                return _Answer("ok", accepted if isinstance(accepted, int) and accepted >= 0 else None)
            except MasterUnavailable:
                attempt += 1
                await _backoff_sleep(self._master, attempt)
            except MasterConflict as exc:
                expected = exc.body.get("expectedSeq") if isinstance(exc.body, dict) else None
                if isinstance(expected, int) and expected >= 0:
                    log.info("task %s %s: master expects element %d (sent %d)", self.task_id, self.stream,
                             expected, seq)
                    return _Answer("expected", expected)
                log.error("task %s %s: the master refuses the stream (%s); not sending it any more",
                          self.task_id, self.stream, exc)
                return _Answer("refused")
            except MasterRejected as exc:
                if exc.status in _RETRY_STATUSES:
                    attempt += 1
                    await _backoff_sleep(self._master, attempt)
                    continue
                if exc.status == 404:
                    log.error("task %s %s: the master does not know the task (404); not sending the stream",
                              self.task_id, self.stream)
                    return _Answer("refused")
                log.error("task %s %s: the master rejected a batch of %d element(s) (%s); sending it smaller",
                          self.task_id, self.stream, len(elements), exc)
                if len(elements) == 1 and self._is_placeholder(elements[0]):
                    return _Answer("refused")
                return _Answer("shrink")

    def _is_placeholder(self, element: Any) -> bool:
        if isinstance(element, str):
            return element.startswith("[ckagent] a log line of ")
        return isinstance(element, dict) and "_invalidItem" in element and element.get("_invalidItem") is None


async def send_result(
    master: MasterClient, store: AsyncStateStore, task_id: str, result: TaskResult,
    limiter: trio.CapacityLimiter | None = None,
) -> None:
    """Send a final result until the master acknowledges it (forever, with backoff), then mark it acked.

    A 409 or other 4xx means the master will never take it (cancelled there, claimed by another
    node): logged, and marked done so it is not retried across restarts. Cancellation stops the
    retries; the result stays in the state store for the next start.
    """
    attempt = 0
    while True:
        try:
            async with limiter if limiter is not None else contextlib.nullcontext():
                await master.call("result", "POST", f"/api/tasks/{task_id}/result", json=result.to_json())
            break
        except MasterUnavailable:
            attempt += 1
            await _backoff_sleep(master, attempt)
        except MasterConflict as exc:
            log.warning("task %s: master refused the final result %s (%s)", task_id, result.status, exc)
            break
        except MasterRejected as exc:
            if exc.status in _RETRY_STATUSES:
                attempt += 1
                await _backoff_sleep(master, attempt)
                continue
            log.error("task %s: master rejected the final result (%s)", task_id, exc)
            break
    await store.mark_result_acked(task_id)


# ---------------------------------------------------------------------------------------------- capture


class DiskGuard:
    """Free space of the filesystem holding ``path`` (bytes), refreshed by :meth:`refresh`.

    Writers call :meth:`allows` before and :meth:`consumed` after writing, so the estimate follows
    fast writers between refreshes. ``min_free_bytes`` 0 disables the floor.
    """

    def __init__(self, path: Path, min_free_bytes: int) -> None:
        self.path = path
        self.min_free_bytes = min_free_bytes
        self.free_bytes: int | None = None

    def allows(self, size: int) -> bool:
        """True if writing ``size`` more bytes keeps the free space at or above the floor."""
        if not self.min_free_bytes or self.free_bytes is None:
            return True
        return self.free_bytes - size >= self.min_free_bytes

    def consumed(self, size: int) -> None:
        """``size`` bytes were written."""
        if self.free_bytes is not None:
            self.free_bytes -= size

    async def refresh(self) -> None:
        """Measure the free space again (in a worker thread). OSError leaves the last figure."""
        try:
            usage = await trio.to_thread.run_sync(shutil.disk_usage, self.path)
        except OSError as exc:
            log.debug("cannot measure free space of %s: %s", self.path, exc)
            return
        self.free_bytes = usage.free


class LogSink:
    """Appends the spider's stdout/stderr bytes to ``output.log`` as they arrive (never blocks on the network).

    Writes are plain ``os.write`` calls on an O_APPEND descriptor: page-cache writes of pipe-sized
    chunks take microseconds, so the pipe readers never wait on a thread hop. ``on_write`` is called
    after every write. Disk budget: once the file would exceed ``max_bytes`` (0 = no limit), or the
    ``guard`` says the free-space floor is reached, or a write fails (ENOSPC, EIO...), later bytes
    are counted and dropped; :meth:`close` then appends one marker line with the count.
    ``size`` is the file's size (bytes), ``dropped_bytes`` what was not written.

    Raises OSError only from the constructor (the file cannot be created).
    """

    def __init__(
        self,
        path: Path,
        on_write: Callable[[], None] | None = None,
        *,
        max_bytes: int = 0,
        guard: DiskGuard | None = None,
    ) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        self.size = os.fstat(self._fd).st_size
        self._on_write = on_write
        self._max = max_bytes
        self._guard = guard
        self.bytes_written = 0
        self.dropped_bytes = 0
        self.truncated: str | None = None  # why output is being dropped
        self._ends_line = True

    def write(self, data: bytes | bytearray) -> None:
        """Append ``data`` (as much as the budget allows; the rest is counted as dropped)."""
        if self._fd < 0:
            return
        n = len(data)
        if self.truncated is not None:
            self.dropped_bytes += n
            return
        allowed = n
        reason = None
        if self._max and self.size + n > self._max:
            allowed = max(0, self._max - self.size)
            reason = f"the task's log budget of {self._max} bytes (task.max_log_bytes) was reached"
        if allowed and self._guard is not None and not self._guard.allows(allowed):
            allowed = 0
            reason = (f"free disk space fell below {self._guard.min_free_bytes} bytes "
                      "(task.min_free_disk_bytes)")
        written = 0
        if allowed:
            view = memoryview(data)[:allowed]
            try:
                while view:
                    k = os.write(self._fd, view)
                    view = view[k:]
                    written += k
            except OSError as exc:
                reason = f"writing output.log failed: {exc.strerror or exc}"
        if written:
            self.size += written
            self.bytes_written += written
            self._ends_line = data[written - 1] == 0x0A
            if self._guard is not None:
                self._guard.consumed(written)
        if written < n:
            self.dropped_bytes += n - written
            self.truncated = reason or "output dropped"
            log.warning("%s: output truncated: %s", self.path, self.truncated)
        if self._on_write is not None:
            self._on_write()

    def write_line(self, data: bytes) -> None:
        """Append one line of the agent's own (a notice): on a line of its own even when the spider's
        output so far ends without a newline. Counts against the budget like the spider's output."""
        self.write(data if self._ends_line else b"\n" + data)

    def close(self) -> None:
        """Write the truncation marker (if output was dropped), close the file (idempotent)."""
        if self._fd < 0:
            return
        if self.dropped_bytes:
            stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            marker = (f"{'' if self._ends_line else chr(10)}[ckagent {stamp}] output truncated: "
                      f"{self.dropped_bytes} bytes dropped because {self.truncated}\n").encode()
            try:
                os.write(self._fd, marker)
                self.size += len(marker)
            except OSError as exc:
                log.error("%s: cannot write the truncation marker: %s", self.path, exc)
        os.close(self._fd)
        self._fd = -1
        if self._on_write is not None:
            self._on_write()


# ---------------------------------------------------------------------------------------------- outbox

Delivered = Callable[[TaskResult], None]


@dataclasses.dataclass(frozen=True)
class OutboxConfig:
    """Settings of the outbox: globs of spider log files, the disk budget (bytes; 0 = none) and
    retention (seconds; 0 = keep forever)."""

    log_globs: tuple[str, ...] = DEFAULT_LOG_GLOBS
    max_log_bytes: int = 0
    min_free_disk_bytes: int = 0
    retention: float = 0.0
    agent_secrets: tuple[str, ...] = ()


class TaskDelivery:
    """One task's delivery, owned by the :class:`Outbox`. The supervisor writes to :attr:`sink`
    while the process runs and calls :meth:`finish` once with the final result."""

    def __init__(self, outbox: Outbox, task_id: str, task_dir: Path, masker: Masker, globs: list[str],
                 sink: LogSink | None, journal: LogJournal, on_delivered: Delivered | None) -> None:
        self.outbox = outbox
        self.task_id = task_id
        self.task_dir = task_dir
        self.globs = globs
        self.sink = sink
        self.journal = journal
        self.on_delivered = on_delivered
        self.logs = StreamShipper.logs(outbox.master, outbox.store, task_id, task_dir, masker, outbox.limiter)
        self.items = StreamShipper.items(outbox.master, outbox.store, task_id, task_dir, outbox.limiter)
        journal.on_record = self.logs.notify
        self._wake = trio.Event()
        self.ended = trio.Event()
        self.delivered = trio.Event()
        self.result: TaskResult | None = None
        self.ship_logs = True  # False when the journal cannot be opened (the result still goes)

    def output_written(self) -> None:
        """The sink wrote to output.log."""
        self._wake.set()

    async def finish(self, result: TaskResult) -> None:
        """The process is over: close output.log, store ``result``, let the streams complete and the
        result follow them. Returns at once (after the state store write); cancellation before that
        write leaves the task to the next start (reported AGENT_LOST)."""
        if self.sink is not None:
            self.sink.close()
        await self.outbox.store.set_result(self.task_id, result.to_json())
        self.result = result
        self.items.finish()
        self.ended.set()
        self._wake.set()

    async def _journal_loop(self) -> None:
        """Record the growth of output.log (when notified) and of spider log files (every SCAN_INTERVAL)."""
        next_scan = trio.current_time()
        while not self.ended.is_set():
            with trio.move_on_at(next_scan):
                await self._wake.wait()
            self._wake = trio.Event()
            sizes: dict[str, int] = {}
            if self.sink is not None:
                sizes[OUTPUT_LOG] = self.sink.size
            if trio.current_time() >= next_scan:
                sizes.update(await trio.to_thread.run_sync(scan_log_files, self.task_dir, self.globs))
                next_scan = trio.current_time() + SCAN_INTERVAL
            self.journal.note(sizes)
        sizes = await trio.to_thread.run_sync(self._final_sizes)
        self.journal.end(sizes)
        self.journal.close()

    def _final_sizes(self) -> dict[str, int]:
        sizes = scan_log_files(self.task_dir, self.globs)
        try:
            sizes[OUTPUT_LOG] = (self.task_dir / OUTPUT_LOG).stat().st_size
        except FileNotFoundError:
            sizes[OUTPUT_LOG] = 0
        return sizes

    async def run(self) -> None:
        """Journal, ship both streams, then send the result. Cancellation leaves it all for the next start."""
        async with trio.open_nursery() as nursery:
            if self.ship_logs:
                nursery.start_soon(self._journal_loop)
                nursery.start_soon(self.logs.run)
            nursery.start_soon(self.items.run)
            await self.ended.wait()
        assert self.result is not None
        result = dataclasses.replace(self.result, item_count=self.items.acked, log_lines=self.logs.acked)
        await self.outbox.store.set_result(self.task_id, result.to_json())
        await send_result(self.outbox.master, self.outbox.store, self.task_id, result, self.outbox.limiter)
        self.delivered.set()
        if self.on_delivered is not None:
            self.on_delivered(result)


class Outbox:
    """Every task's delivery, in one nursery that outlives the tasks (see module docstring).

    ``await nursery.start(outbox.run)`` starts it; :meth:`open_task` / :meth:`resume` add tasks;
    :meth:`wait_idle` waits until nothing is left to send. Also keeps the free-space figure of the
    work dir fresh and deletes expired task directories (retention).
    """

    def __init__(self, master: MasterClient, store: AsyncStateStore, work_dir: Path,
                 config: OutboxConfig | None = None) -> None:
        self.master = master
        self.store = store
        self.work_dir = work_dir
        self.tasks_dir = work_dir / "tasks"
        self.config = config or OutboxConfig()
        self.limiter = trio.CapacityLimiter(SEND_CONCURRENCY)
        self.guard = DiskGuard(work_dir, self.config.min_free_disk_bytes)
        self.deliveries: dict[str, TaskDelivery] = {}
        self._nursery: trio.Nursery | None = None
        self._idle = trio.Event()
        self._idle.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run until cancelled (the agent's stop). Unsent data stays on disk for the next start."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await self.guard.refresh()
            nursery.start_soon(self._disk_loop)
            if self.config.retention > 0:
                nursery.start_soon(self._retention_loop)
            task_status.started()
            await trio.sleep_forever()

    @property
    def pending(self) -> int:
        """Tasks whose delivery is not complete."""
        return len(self.deliveries)

    async def wait_idle(self) -> None:
        """Return when every delivery is complete (at once if none is pending)."""
        await self._idle.wait()

    async def open_task(self, task: Task, task_dir: Path, on_delivered: Delivered | None = None) -> TaskDelivery:
        """Start delivering a task that is about to run; write its output to ``.sink``.

        Raises OSError when output.log or the journal cannot be created.
        """
        masker = Masker(secret_values(task.env, self.config.agent_secrets))
        journal = LogJournal(task_dir)
        await trio.to_thread.run_sync(journal.open)
        delivery = TaskDelivery(self, task.id, task_dir, masker, task_log_globs(task, self.config.log_globs),
                                None, journal, on_delivered)
        delivery.sink = LogSink(task_dir / OUTPUT_LOG, delivery.output_written,
                                max_bytes=self.config.max_log_bytes, guard=self.guard)
        self._start(delivery)
        return delivery

    async def resume(self, record: TaskRecord) -> None:
        """Deliver what an earlier run left: the streams from their stored positions, then the result."""
        assert record.result is not None, "recover the task (AGENT_LOST) before resuming its delivery"
        try:
            task = Task.from_json(record.task_json)
            env, globs = task.env, task_log_globs(task, self.config.log_globs)
        except ValueError:
            env, globs = {}, list(self.config.log_globs)
        masker = Masker(secret_values(env, self.config.agent_secrets))
        journal = LogJournal(record.task_dir)
        ship_logs = True
        try:
            await trio.to_thread.run_sync(journal.open)
        except (OSError, ValueError) as exc:
            log.error("task %s: cannot open its log journal (%s); not sending its log", record.task_id, exc)
            ship_logs = False
        delivery = TaskDelivery(self, record.task_id, record.task_dir, masker, globs, None, journal, None)
        delivery.ship_logs = ship_logs
        delivery.result = TaskResult.from_json(record.result)
        delivery.items.finish()
        delivery.ended.set()
        self._start(delivery)

    def _start(self, delivery: TaskDelivery) -> None:
        if self._nursery is None:
            raise RuntimeError("the outbox is not running")
        self.deliveries[delivery.task_id] = delivery
        self._idle = trio.Event()
        self._nursery.start_soon(self._guarded, delivery, name=f"deliver {delivery.task_id}")

    async def _guarded(self, delivery: TaskDelivery) -> None:
        try:
            await delivery.run()
        except Exception:
            log.exception("task %s: delivery failed; it stays in the state store for the next start",
                          delivery.task_id)
        finally:
            if delivery.sink is not None:
                delivery.sink.close()
            delivery.journal.close()
            self.deliveries.pop(delivery.task_id, None)
            if not self.deliveries:
                self._idle.set()

    async def _disk_loop(self) -> None:
        while True:
            await trio.sleep(1.0)
            await self.guard.refresh()

    async def _retention_loop(self) -> None:
        interval = min(3600.0, max(1.0, self.config.retention / 4))
        while True:
            await cleanup_task_dirs(self.store, self.tasks_dir, self.config.retention)
            await trio.sleep(interval)


async def cleanup_task_dirs(store: AsyncStateStore, tasks_dir: Path, older_than: float) -> int:
    """Delete the directories of tasks fully acknowledged more than ``older_than`` seconds ago.

    ``older_than`` 0 deletes every acknowledged task's directory (``--cleanup-temp-files`` at start).
    Never touches a task whose result the master has not acknowledged, nor anything outside
    ``tasks_dir``. Returns how many were deleted; errors are logged, not raised.
    """
    cutoff = time.time() - older_than
    deleted = 0
    root = await trio.to_thread.run_sync(tasks_dir.resolve)
    for record in await store.delivered_before(cutoff if older_than > 0 else time.time() + 1):
        target = record.task_dir
        if target.resolve().parent != root:
            log.warning("task %s: not deleting %s (outside %s)", record.task_id, target, tasks_dir)
            await store.forget(record.task_id)
            continue
        try:
            await trio.to_thread.run_sync(_rmtree, target)
        except OSError as exc:
            log.warning("task %s: cannot delete %s: %s", record.task_id, target, exc)
            continue
        await store.forget(record.task_id)
        deleted += 1
    if deleted:
        log.info("deleted %d delivered task director%s", deleted, "y" if deleted == 1 else "ies")
    return deleted


def _rmtree(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
