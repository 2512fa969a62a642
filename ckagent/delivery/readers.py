"""Readers of the spool: the items file's tailer and the replay of a task's log journal (written by
:mod:`ckagent.delivery.journal`). Both add what they read to a :class:`ckagent.delivery.pending.Pending`.

See the package docstring (ckagent.delivery) for the whole design.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from ckagent.delivery.journal import parse_journal, split_start
from ckagent.delivery.lines import LineSplitter, Masker, encode_block, encode_json, encode_lines
from ckagent.delivery.pending import Pending
from ckagent.delivery.spool import (
    ITEMS_JOURNAL,
    JOURNAL_FILE,
    MAX_LINE_BYTES,
    OUTPUT_LOG,
    READ_CHUNK,
    open_in,
    open_spool,
    read_spool,
)

log = logging.getLogger(__name__)

def _pread(fd: int, size: int, offset: int) -> bytes:
    """Read on the event loop's thread: spool files were just written by the agent or its spider, so
    their bytes are in the page cache and a read is a copy of at most READ_CHUNK bytes (tens of µs),
    far cheaper than a hop to a worker thread and back (what restore's cold read of a journal prefix
    after a restart still takes)."""
    return os.pread(fd, size, offset)


def oversize_placeholder(size: int, limit: int) -> bytes:
    """The one item that stands for an items.jsonl line over the limit (dropped, not cut into pieces)."""
    return encode_json({"_invalidItem": None, "_error": (
        f"an item of {size} bytes (its line, with the line end) is over the limit of {limit} bytes "
        f"({limit / (1 << 20):g} MiB) for one item and was dropped; write smaller items (e.g. store large "
        "content as a file in CK_TASK_DIR and put its name in the item)")})


OversizeHook = Callable[[str, int, int, int], None]
"""``hook(source, size, limit, end)``: an item of ``size`` bytes in ``source`` (a path relative to the
task dir), ending at offset ``end``, is over ``limit`` and became a placeholder."""


class OversizeNotes:
    """Where a reader reports the items it replaced by a placeholder for their size: each is said once
    (the reader and the end's scan, :func:`scan_oversize`, may both meet it) through ``say(text)``,
    set by the reader's owner (None: not said). Shared by a reader's :class:`_ItemLines` across restores."""

    __slots__ = ("said", "say")

    def __init__(self) -> None:
        self.say: Callable[[str], None] | None = None
        self.said: set[tuple[str, int]] = set()  # (source, end offset) of the items said

    def __call__(self, source: str, size: int, limit: int, end: int) -> None:
        if self.say is None or (source, end) in self.said:
            return
        self.said.add((source, end))
        self.say(f"an item of {size} bytes in {source} (ending at byte {end}) is over the limit of {limit} bytes "
                 f"({limit / (1 << 20):g} MiB) for one item: the master gets a placeholder in its place "
                 "(_invalidItem), the spool on the node keeps the item; write smaller items (e.g. store large "
                 "content as a file in CK_TASK_DIR and put its name in the item)")


class _ItemLines:
    """Complete lines of an items file → their elements: each line encoded (None: skipped), a line
    longer than the limit (the splitter's pieces of it) replaced by one placeholder, reported to
    ``notes`` (as ``source``)."""

    __slots__ = ("_encode", "_max", "_notes", "_source", "line_start", "oversize")

    def __init__(self, start: int, encode: Callable[[bytes], bytes | None], max_line_bytes: int,
                 notes: OversizeHook | None = None, source: str = "") -> None:
        self.line_start = start  # where the next line (or piece of a cut one) starts
        self.oversize = 0  # bytes so far of a line longer than max_line_bytes (0: none being read)
        self._encode = encode
        self._max = max_line_bytes
        self._notes = notes
        self._source = source

    def elements(self, lines: list[bytes], ends: list[int], final: bool) -> tuple[list[bytes], list[int]]:
        """(elements, their marks) of ``lines`` ending at ``ends``; ``final``: the last is the file's
        unterminated last line (flushed), not a piece of a longer one."""
        if lines and not self.oversize and max(map(len, lines)) <= self._max - 4:
            # No piece of a cut line among them (each piece is longer than that): the common case.
            self.line_start = ends[-1]
            encoded = list(map(self._encode, lines))
            if None not in encoded:
                return encoded, ends  # type: ignore[return-value] # no None in it
            kept = [(element, end) for element, end in zip(encoded, ends, strict=True) if element is not None]
            return [element for element, _ in kept], [end for _, end in kept]
        elements, marks = [], []
        encode = self._encode
        last = len(lines) - 1
        for i, (raw, end) in enumerate(zip(lines, ends, strict=True)):
            start, self.line_start = self.line_start, end
            # A piece the splitter cut off a line longer than max_line_bytes consumed no terminator.
            element: bytes | None
            cut = end - start == len(raw) and len(raw) > self._max - 4 and not (final and i == last)
            if cut or self.oversize:
                self.oversize += end - start
                if cut:
                    continue
                element = oversize_placeholder(self.oversize, self._max)
                if self._notes is not None:
                    self._notes(self._source, self.oversize, self._max, end)
                self.oversize = 0
            else:
                element = encode(raw)
            if element is not None:
                elements.append(element)
                marks.append(end)
        return elements, marks


class _FileReader:
    """Elements of one file (the items stream). Position: ``{"offset": <end of the last element>}``."""

    def __init__(self, path: Path, encode: Callable[[bytes], bytes | None], max_line_bytes: int,
                 cr_breaks: bool) -> None:
        self.path = path
        self._encode = encode  # a line → its encoded element, or None to skip it
        self._max = max_line_bytes
        self._cr = cr_breaks
        self._fd = -1
        self._read_at = 0
        self._splitter = LineSplitter(0, max_line_bytes, cr_breaks)
        self.oversize_notes = OversizeNotes()
        """Where the items replaced by a placeholder for their size are said (its ``say``)."""
        self._lines = _ItemLines(0, encode, max_line_bytes, self.oversize_notes, path.name)
        self.finished = False  # set by the owner: the file will not grow any more
        self.done = False
        # Written by another process, so nothing notifies its growth directly: while it grows the shipper
        # looks again every TAIL_INTERVAL; once a read finds nothing new it waits for a notification
        # (the outbox's once-a-second scan sees the file's size change, or the task's end).
        self.polls = False

    async def restore(self, position: Any) -> None:
        offset = int(position.get("offset", 0)) if isinstance(position, dict) else 0
        self._read_at = offset
        self._splitter = LineSplitter(offset, self._max, self._cr)
        self._lines = _ItemLines(offset, self._encode, self._max, self.oversize_notes, self.path.name)
        self.done = False

    async def read(self, pending: Pending) -> bool:
        if self.done:
            return False
        if self._fd < 0:
            try:
                self._fd = open_spool(self.path)  # a missing file costs one failed open, on the loop
            except FileNotFoundError:
                if self.finished:
                    self.done = True
                return False
            except OSError as exc:  # a symlink or FIFO put there by the spider: never followed
                log.warning("%s: %s; this stream ends here", self.path.parent.name, exc)
                self.done = True
                return False
        finished = self.finished  # read before reading: a finish after an empty read still gets a last read
        data = _pread(self._fd, READ_CHUNK, self._read_at)
        self.polls = bool(data)
        if data:
            self._read_at += len(data)
            lines, ends = self._splitter.feed(data)
        elif finished:
            lines, ends = self._splitter.flush()
            self.done = True
        else:
            return False
        pending.add(*self._lines.elements(lines, ends, self.done))
        return True

    def commit(self, runs: list[tuple[Any, int]]) -> Any:
        """The position after the elements of ``runs`` (from :meth:`Pending.take`)."""
        return {"offset": runs[-1][1]}

    @property
    def line_start(self) -> int:
        """Offset where the line being read starts: every line before it was read (and reported)."""
        return self._lines.line_start

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _Source:
    """One log source while the journal is replayed."""

    __slots__ = ("fd", "fed", "finalized", "items", "path", "prefix", "splitter")

    def __init__(self, path: str, start: int, max_line_bytes: int, items: _ItemLines | None = None) -> None:
        self.path = path
        self.prefix = "" if path == OUTPUT_LOG else f"[{path}] "
        self.splitter = LineSplitter(start, max_line_bytes, items is None)
        self.items = items  # an items source (the items journal's): its lines become items
        self.fed = start
        self.fd = -1
        self.finalized = False


class _JournalReader:
    """The log stream of a task: replays ``output.journal`` over its sources (see module docstring)."""

    def __init__(self, task_dir: Path, masker: Masker, max_line_bytes: int = MAX_LINE_BYTES,
                 journal: str = JOURNAL_FILE) -> None:
        self.task_dir = task_dir
        self._journal = journal
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

    def _source(self, path: str, start: int) -> _Source:
        return _Source(path, start, self._max)

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
            head = await trio.to_thread.run_sync(_read_prefix, self.task_dir / self._journal, start)
        records, _ = parse_journal(head)
        fed_to: dict[int, int] = {}
        for _, kind, idx, arg in records:
            if kind == "S":
                self._sources[idx] = self._source(arg, acked.get(idx, 0))
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
                source.fd = open_in(self.task_dir, source.path)  # never a link out of the task dir
            except OSError as exc:
                log.warning("log source %s of %s cannot be read (%s); skipping it", source.path, self.task_dir, exc)
                return b""
        return _pread(source.fd, size, source.fed)

    async def _next_record(self) -> tuple[int, str, int, str] | None:
        """The next complete journal record ``(offset, kind, idx, arg)``, or None for now."""
        nl = self._jbuf.find(b"\n", self._jat)
        if nl < 0:
            if self._jfd < 0:
                try:
                    self._jfd = open_spool(self.task_dir / self._journal)
                except FileNotFoundError:
                    return None
            rest = self._jbuf[self._jat :]
            more = _pread(self._jfd, 65536, self._jpos + len(rest))
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

    async def read(self, pending: Pending) -> bool:
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
                    self._emit_fed(pending, at, idx, data)
                    budget -= len(data)
                progress = True
                continue
            record = await self._next_record()
            if record is None:
                break
            progress = True
            at, kind, idx, arg = record
            if kind == "S":
                self._sources[idx] = self._source(arg, self._acked.get(idx, 0))
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
                    self._emit_final(pending, at, idx)
                    if ending.fd >= 0:
                        os.close(ending.fd)
                        ending.fd = -1
            elif kind == "E":
                self.done = True
        return progress

    def _emit_fed(self, pending: Pending, at: int, idx: int, data: bytes) -> None:
        """Feed source ``idx``'s next bytes to its splitter and add the lines they complete (as one
        block when they are plain lines: see :meth:`Pending.add_block`)."""
        source = self._sources[idx]
        fed = source.splitter.feed_block(data)
        if fed is None:
            self._emit(pending, at, idx, *source.splitter.feed(data))
            return
        block, start, count = fed
        encoded = encode_block(block, self._masker, source.prefix)
        if encoded is None:
            self._emit(pending, at, idx, *LineSplitter.split_block(block, start))
        else:
            pending.add_block(encoded[0], count, start, start + len(block) + 1, encoded[1], (at, idx))

    def _emit_final(self, pending: Pending, at: int, idx: int) -> None:
        """Source ``idx`` is complete: its unterminated last line becomes a line."""
        self._emit(pending, at, idx, *self._sources[idx].splitter.flush())

    def _emit(self, pending: Pending, at: int, idx: int, lines: list[bytes], ends: list[int]) -> None:
        if lines:
            source = self._sources[idx]
            pending.add(encode_lines(lines, self._masker, source.prefix), ends, (at, idx))

    def commit(self, runs: list[tuple[Any, int]]) -> Any:
        """The position after the elements of ``runs`` (from :meth:`Pending.take`)."""
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


class _ItemJournalReader(_JournalReader):
    """The items stream of a task with declared item files: replays ``items.journal`` over
    items.jsonl and the links of its JSON Lines files (ckagent.delivery.outputs.live). Positions as
    the log stream's; each source's lines become items as :class:`_FileReader`'s do."""

    def __init__(self, task_dir: Path, encode: Callable[[bytes], bytes | None], max_line_bytes: int) -> None:
        super().__init__(task_dir, Masker([]), max_line_bytes, journal=ITEMS_JOURNAL)
        self._encode = encode
        self.oversize_notes = OversizeNotes()
        """Where the items replaced by a placeholder for their size are said (its ``say``)."""

    def _source(self, path: str, start: int) -> _Source:
        path, begins = split_start(path)  # a file appended to a sample of the package: from its end
        start = max(start, begins)
        return _Source(path, start, self._max, _ItemLines(start, self._encode, self._max, self.oversize_notes, path))

    def _emit_fed(self, pending: Pending, at: int, idx: int, data: bytes) -> None:
        source = self._sources[idx]
        lines, ends = source.splitter.feed(data)
        if lines:
            assert source.items is not None
            pending.add(*source.items.elements(lines, ends, False), (at, idx))

    def _emit_final(self, pending: Pending, at: int, idx: int) -> None:
        source = self._sources[idx]
        lines, ends = source.splitter.flush()
        if lines:
            assert source.items is not None
            pending.add(*source.items.elements(lines, ends, True), (at, idx))


def _read_prefix(path: Path, size: int) -> bytes:
    return read_spool(path, 0, size)
