"""Tail a file, cut batches, ship them with sequence numbers — the one mechanism for logs and items.

A task's files are the spool (``output.log``, ``items.jsonl``). A :class:`StreamShipper` reads its
file from the last acknowledged byte offset, splits it into elements (lines, or JSON items), sends
them in batches ``{seq, lines|items}`` and advances the acknowledged position in the state store
only on a 2xx. On 409 ``{expectedSeq}`` it rewinds (or skips) and resends; the master drops what it
already has, so every element arrives exactly once, in order, even across agent restarts.

Splitting works on bytes, so offsets stay exact: a line ends at ``\\n``, ``\\r\\n`` or a lone
``\\r`` (progress bars become lines instead of one endless line); a line longer than
``max_line_bytes`` is cut into pieces at a UTF-8 character boundary; decoding is UTF-8 with
replacement (a character split across reads is kept whole, because bytes are only decoded once a
line is complete; invalid bytes become U+FFFD, never an exception).

Errors: shipping never raises for master trouble — MasterUnavailable is retried with backoff
forever (cancellation stops it; the position on disk lets the next start resume). A batch the
master rejects for good (4xx other than 409) is logged and skipped.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ckagent.master import MasterClient, MasterConflict, MasterRejected
from ckagent.state import AsyncStateStore

log = logging.getLogger(__name__)

MAX_LINE_BYTES = 64 * 1024
MAX_BATCH_BYTES = 1024 * 1024
MAX_BATCH_COUNT = 2000
BATCH_AGE = 1.0
"""Seconds a non-full batch may wait for more elements before it is sent."""
TAIL_INTERVAL = 0.25
"""Seconds between looks at a file written by another process (the spider's items file)."""

_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|KEY)$", re.IGNORECASE)


def secret_values(env: dict[str, str], extra: Iterable[str] = ()) -> list[str]:
    """Values to mask: env variables named like *TOKEN, *SECRET, *PASSWORD, *KEY, plus ``extra``.

    Values shorter than 4 characters are not masked (they would mangle ordinary text).
    """
    values = [v for k, v in env.items() if _SECRET_NAME.search(k)]
    values.extend(extra)
    return sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)


class Masker:
    """Replaces every occurrence of the given secret values with ``***``."""

    def __init__(self, secrets: Iterable[str]) -> None:
        values = sorted({s for s in secrets if s}, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(v) for v in values)) if values else None

    def __call__(self, text: str) -> str:
        """Return ``text`` with secrets masked."""
        return text if self._pattern is None else self._pattern.sub("***", text)


class LineSplitter:
    """Incremental bytes → complete lines with the byte offset where each ends (see module docstring).

    ``feed(data)`` returns ``[(raw_line_bytes, end_offset), ...]`` for the lines completed so far;
    ``flush()`` returns the last, unterminated line (at end of stream). ``offset`` starts at
    ``start_offset`` (the resume position).
    """

    def __init__(self, start_offset: int = 0, max_line_bytes: int = MAX_LINE_BYTES, cr_breaks: bool = True) -> None:
        self._buf = bytearray()
        self._buf_start = start_offset
        self._max = max_line_bytes
        self._cr = cr_breaks

    def feed(self, data: bytes) -> list[tuple[bytes, int]]:
        """Add bytes; return the lines they completed (terminators stripped)."""
        self._buf += data
        return self._take(final=False)

    def flush(self) -> list[tuple[bytes, int]]:
        """End of stream: return what is left as a last line (if anything)."""
        return self._take(final=True)

    def _take(self, final: bool) -> list[tuple[bytes, int]]:
        out: list[tuple[bytes, int]] = []
        buf = self._buf
        pos = 0
        n = len(buf)
        while pos < n:
            nl = buf.find(b"\n", pos)
            cr = buf.find(b"\r", pos) if self._cr else -1
            if cr != -1 and (nl == -1 or cr < nl):
                if cr + 1 == n and not final:
                    # "\r" at the end of what we have: could be the start of "\r\n".
                    end, next_pos = -1, -1
                else:
                    end = cr
                    next_pos = cr + 2 if cr + 1 < n and buf[cr + 1] == 0x0A else cr + 1
            elif nl != -1:
                end, next_pos = nl, nl + 1
            else:
                end, next_pos = -1, -1
            if end == -1 or end - pos > self._max:
                # No terminator (yet), or the line is too long: cut pieces of max_line_bytes.
                if n - pos > self._max:
                    cut = _utf8_boundary(buf, pos + self._max)
                    out.append((bytes(buf[pos:cut]), self._buf_start + cut))
                    pos = cut
                    continue
                if final and n > pos:
                    out.append((bytes(buf[pos:n]), self._buf_start + n))
                    pos = n
                break
            out.append((bytes(buf[pos:end]), self._buf_start + next_pos))
            pos = next_pos
        if pos:
            del buf[:pos]
            self._buf_start += pos
        return out


def _utf8_boundary(buf: bytearray, cut: int) -> int:
    """Move ``cut`` back (at most 3 bytes) so it does not split a UTF-8 character."""
    for back in range(4):
        i = cut - back
        if i <= 0:
            break
        if (buf[i] & 0xC0) != 0x80:  # not a continuation byte: a character starts here
            return i
    return cut


@dataclass
class StreamStats:
    """What a shipper has done: elements acknowledged by the master and elements read so far."""

    acked: int = 0
    read: int = 0


Convert = Callable[[bytes], Any]


def log_line(masker: Masker, prefix: str = "") -> Convert:
    """Converter for log streams: decode UTF-8 with replacement, mask secrets, add a source prefix."""

    def convert(raw: bytes) -> Any:
        return prefix + masker(raw.decode("utf-8", errors="replace"))

    return convert


def item_object(raw: bytes) -> Any:
    """Converter for item streams: one JSON object per line; anything else is kept, wrapped, not lost."""
    text = raw.decode("utf-8", errors="replace")
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        return {"_invalidItem": text[:10000], "_error": f"not JSON: {exc}"}
    return value if isinstance(value, dict) else {"_invalidItem": text[:10000], "_error": "not a JSON object"}


class StreamShipper:
    """Ships one file of one task (see module docstring).

    ``stream`` names it in the state store ("log", "items", "log:scrapy.log"); ``kind`` is the
    endpoint and JSON key ("logs" → ``lines``, "items" → ``items``). Call :meth:`notify` when the
    file grew (the agent's own pipe readers do); files written by others are looked at every
    ``TAIL_INTERVAL`` seconds. :meth:`finish` says the file is complete: :meth:`run` then ships
    the rest and returns.
    """

    def __init__(
        self,
        master: MasterClient,
        store: AsyncStateStore,
        task_id: str,
        stream: str,
        kind: str,
        path: Path,
        convert: Convert,
        *,
        cr_breaks: bool = True,
        max_line_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        if kind not in ("logs", "items"):
            raise ValueError(f"unknown stream kind {kind!r}")
        self._master = master
        self._store = store
        self.task_id = task_id
        self.stream = stream
        self._kind = kind
        self._key = "lines" if kind == "logs" else "items"
        self.path = path
        self._convert = convert
        self._cr = cr_breaks
        self._max_line = max_line_bytes
        self._wake = trio.Event()
        self._finished = False
        self.stats = StreamStats()

    def notify(self) -> None:
        """The file grew: wake the shipper."""
        self._wake.set()

    def finish(self) -> None:
        """The file is complete: ship what is left, then :meth:`run` returns."""
        self._finished = True
        self._wake.set()

    async def run(self) -> None:
        """Ship until :meth:`finish` was called and everything is acknowledged.

        Resumes from the position in the state store. Cancellation stops shipping at once; the
        acknowledged position is already on disk.
        """
        seq, offset = await self._store.stream_position(self.task_id, self.stream)
        self.stats.acked = seq
        checkpoints = {seq: offset}  # acknowledged seq → byte offset: where to rewind on a 409
        skip = 0  # elements the master already holds beyond `seq`: count them, do not send them
        pending: list[tuple[Any, int, int]] = []  # (element, end offset, approximate JSON size)
        first_pending_at = 0.0
        splitter = LineSplitter(offset, self._max_line, self._cr)
        read_offset = offset
        fh = None
        try:
            while True:
                data = b""
                if fh is None and self.path.exists():
                    fh = await trio.open_file(self.path, "rb")
                    await fh.seek(read_offset)
                if fh is not None:
                    data = await fh.read(MAX_BATCH_BYTES)
                    read_offset += len(data)
                complete = self._finished and not data
                for raw, end in splitter.flush() if complete else splitter.feed(data):
                    element = self._convert(raw)
                    if element is None:
                        continue
                    self.stats.read += 1
                    if skip:
                        skip -= 1
                        seq, offset = seq + 1, end
                        continue
                    if not pending:
                        first_pending_at = trio.current_time()
                    pending.append((element, end, len(raw) + 16))
                due = bool(pending) and (
                    complete
                    or len(pending) >= MAX_BATCH_COUNT
                    or sum(size for _, _, size in pending) >= MAX_BATCH_BYTES
                    or trio.current_time() - first_pending_at >= BATCH_AGE
                )
                if due:
                    batch = _first_batch(pending)
                    expected = await self._send(seq, [element for element, _, _ in batch])
                    if expected is None:
                        expected = seq + len(batch)
                    if expected >= seq:
                        # The master holds `expected` elements: everything before it is acknowledged.
                        done = min(expected - seq, len(pending))
                        if done:
                            seq, offset = seq + done, pending[done - 1][1]
                            pending = pending[done:]
                            first_pending_at = trio.current_time()
                        skip = expected - seq  # > 0 only when the master holds more than we have read
                    else:
                        # The master lost elements we had acknowledged: resend from a checkpoint.
                        start = max((s for s in checkpoints if s <= expected), default=min(checkpoints))
                        seq, offset = start, checkpoints[start]
                        skip, pending = expected - start, []
                        read_offset = offset
                        splitter = LineSplitter(offset, self._max_line, self._cr)
                        if fh is not None:
                            await fh.seek(read_offset)
                        log.warning("task %s %s: master lost data; resending from element %d",
                                    self.task_id, self.stream, start)
                        continue
                    checkpoints[seq] = offset
                    self.stats.acked = seq
                    await self._store.save_stream_position(self.task_id, self.stream, seq, offset)
                    continue
                if complete and not pending:
                    return
                if not data:
                    wait = TAIL_INTERVAL
                    if pending:
                        wait = min(wait, max(0.0, BATCH_AGE - (trio.current_time() - first_pending_at)))
                    with trio.move_on_after(wait):
                        await self._wake.wait()
                    self._wake = trio.Event()
        finally:
            if fh is not None:
                with trio.CancelScope(shield=True):
                    await fh.aclose()

    async def _send(self, seq: int, elements: list[Any]) -> int | None:
        """POST one batch. None = acknowledged; an int = the master's expectedSeq (resend from there)."""
        path = f"/api/tasks/{self.task_id}/{self._kind}"
        try:
            await self._master.call_retrying(self._kind, "POST", path, json={"seq": seq, self._key: elements})
        except MasterConflict as exc:
            expected = exc.body.get("expectedSeq") if isinstance(exc.body, dict) else None
            if isinstance(expected, int) and expected >= 0:
                log.info("task %s %s: master expects seq %d (sent %d); resending", self.task_id,
                         self.stream, expected, seq)
                return expected
            log.error("task %s %s: master refuses the stream (%s); dropping %d element(s)",
                      self.task_id, self.stream, exc, len(elements))
        except MasterRejected as exc:
            log.error("task %s %s: master rejected a batch (%s); skipping %d element(s)",
                      self.task_id, self.stream, exc, len(elements))
        return None


def _first_batch(pending: list[tuple[Any, int, int]]) -> list[tuple[Any, int, int]]:
    """The first batch of ``pending``: at most MAX_BATCH_COUNT elements and about MAX_BATCH_BYTES."""
    size = 0
    for i, (_, _, element_size) in enumerate(pending):
        size += element_size
        if i and (i >= MAX_BATCH_COUNT or size > MAX_BATCH_BYTES):
            return pending[:i]
    return pending


class LogSink:
    """Appends the spider's stdout/stderr bytes to ``output.log`` as they arrive.

    Writes are plain ``os.write`` calls on an O_APPEND descriptor: page-cache writes of pipe-sized
    chunks take microseconds, so the pipe readers never wait on the network or on a thread hop.
    ``on_write`` is called after every write (the log shipper's :meth:`StreamShipper.notify`).
    """

    def __init__(self, path: Path, on_write: Callable[[], None] | None = None) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        self._on_write = on_write
        self.bytes_written = 0

    def write(self, data: bytes | bytearray) -> None:
        """Append ``data`` (the whole of it)."""
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.bytes_written += len(data)
        if self._on_write is not None:
            self._on_write()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

