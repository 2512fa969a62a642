"""Item files by extension → lines of the task's items spool (``items.jsonl``).

=====================  ===========================================================================
extension              read as
=====================  ===========================================================================
.jsonl .ndjson .jl     one JSON object per line; the bytes are appended as they are (in the
                       kernel: ``copy_file_range``); a line that is not an object is wrapped by the
                       items reader (``_invalidItem``), never dropped
.json                  an array of objects (each element one item, read incrementally: a large
                       array is never held whole), or one object (one item); each object's own
                       text is the item, as written (numbers and strings not re-typed; an
                       indented object joined onto one line)
.csv                   a header row, then one item per row (``{column: text}``: every value the
                       text the file holds)
=====================  ===========================================================================

The files are the spider's: each is opened below the tree it lies in (``top``, its path ``rel``
relative to it) by :func:`ckagent.node.beneath.open_file` — no symlink followed, at its name or on the
way; only a regular file; not another owner's hard link — and read from that one descriptor.

All functions block (file I/O): call them in a worker thread. They raise OSError for a file that
cannot be read (NotBeneath for one that is not the tree's regular file) and :class:`ItemFileError`
for one whose content is not what its extension says (the items read before the bad spot are
appended: nothing is lost silently).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from ckagent.node import beneath

__all__ = ["ITEM_EXTENSIONS", "ItemFileError", "append_item_file", "count_lines"]

ITEM_EXTENSIONS = (".jsonl", ".ndjson", ".jl", ".json", ".csv")
CHUNK_BYTES = 1 << 20
_BLANK_FIRST = re.compile(rb"[ \t\r\f\v]*\n")
"""A blank line at the start of a chunk (``match`` only)."""
_BLANK_AFTER = re.compile(rb"\n[ \t\r\f\v]*(?=\n)")
"""A blank line after a line end. It starts with a literal newline, so the regex engine jumps from
newline to newline (a 1 MiB chunk in about 1 ms); a pattern that may match anywhere (a lookbehind
for the newline) tries every byte: 100 MB took over 2 s of CPU, holding the GIL a chunk at a time
while the items of the same file were being shipped on the event loop's thread."""
_WS_BYTES = b" \t\r\f\v"
_WS = " \t\r\n"


class ItemFileError(ValueError):
    """An item file whose content does not fit its extension; ``.items`` were appended before the fault."""

    def __init__(self, path: PurePosixPath | Path, message: str, items: int) -> None:
        super().__init__(f"{path.name}: {message}")
        self.items = items


def open_item_file(top: Path, rel: str) -> BinaryIO:
    """The item file ``rel`` below ``top``, opened for reading as the module docstring says. Raises OSError."""
    return os.fdopen(beneath.open_file(top, rel), "rb")


def append_item_file(top: Path, rel: str, spool: BinaryIO, start: int = 0) -> int:
    """Append the items of the file ``rel`` below ``top`` to ``spool`` (an items.jsonl opened ``ab``),
    one JSON line each.

    ``start``: the byte offset where this run's bytes begin (after the package's sample it appended
    to: ckagent.delivery.outputs.samples); JSON Lines are copied from there, CSV rows read from there
    under the file's own header row (a header row repeated there is skipped), a ``.json`` document is
    always read whole. Returns the number of items appended. Raises OSError, ItemFileError (see module
    docstring), ValueError for an extension that is not an item file's.
    """
    name = PurePosixPath(rel)
    suffix = name.suffix.lower()
    if suffix not in ITEM_EXTENSIONS:
        raise ValueError(f"{name.name}: not an item file (item files end in {', '.join(ITEM_EXTENSIONS)})")
    with open_item_file(top, rel) as fin:
        if suffix in (".jsonl", ".ndjson", ".jl"):
            return _append_lines(fin, spool, start)
        if suffix == ".json":
            return _append_json(fin, name, spool)
        return _append_csv(fin, name, spool, start)


def _append_lines(fin: BinaryIO, spool: BinaryIO, start: int = 0) -> int:
    """JSON Lines from ``start``: copy the bytes (in the kernel where it can), count the non-blank lines."""
    spool.flush()
    last = b"\n"
    size = os.fstat(fin.fileno()).st_size
    start = min(start, size)
    if size > start:
        fin.seek(size - 1)
        last = fin.read(1) or b"\n"
    fin.seek(start)
    out_fd = spool.fileno()
    remaining = size - start
    try:
        while remaining > 0:
            copied = os.copy_file_range(fin.fileno(), out_fd, remaining)
            if copied == 0:
                break
            remaining -= copied
    except OSError:
        fin.seek(size - remaining)
        while remaining > 0 and (chunk := fin.read(min(CHUNK_BYTES, remaining))):
            os.write(out_fd, chunk)
            remaining -= len(chunk)
    if last != b"\n":
        os.write(spool.fileno(), b"\n")
    fin.seek(start)
    return _count_lines(fin)


def count_lines(top: Path, rel: str, start: int = 0) -> int:
    """The items of the JSON Lines file ``rel`` below ``top`` from byte ``start``: its lines that are
    not blank (an unterminated last one counts unless it is blank). One pass in 1 MiB chunks; no
    object per line (only blank lines are matched, found from line end to line end: see
    ``_BLANK_AFTER``). Raises OSError."""
    with open_item_file(top, rel) as fin:
        fin.seek(start)
        return _count_lines(fin)


def _count_lines(fin: BinaryIO) -> int:
    count = blank = 0
    carry = b""  # the unterminated line at the end of the chunks so far: b"" none, b" " blank so far, b"x" not
    while chunk := fin.read(CHUNK_BYTES):
        count += chunk.count(b"\n")
        data = carry + chunk if carry else chunk
        if _BLANK_FIRST.match(data):
            blank += 1
        blank += sum(1 for _ in _BLANK_AFTER.finditer(data))
        end = data.rfind(b"\n")
        tail = data[end + 1:]
        carry = b" " if tail and not tail.strip(_WS_BYTES) else (b"x" if tail else b"")
    if carry:
        count += 1
        blank += carry == b" "
    return count - blank


def _write(spool: BinaryIO, value: object) -> None:
    spool.write(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")


_LINE_BREAK = re.compile(r"[\r\n][ \t\r\n]*")


def _write_as_written(spool: BinaryIO, text: str) -> None:
    """One JSON object's own text as one line: its numbers, strings and spacing as the file has
    them (no re-typing: ``1.10`` stays ``1.10``). A line break in JSON text is always white space
    between tokens (a string holds none raw), so an indented object is joined onto one line by
    dropping its line breaks and the indentation after them."""
    if "\n" in text or "\r" in text:
        text = _LINE_BREAK.sub("", text)
    spool.write(text.encode("utf-8", "surrogatepass") + b"\n")


def _append_json(raw: BinaryIO, source: PurePosixPath, spool: BinaryIO) -> int:
    """A JSON array (read element by element) or one object."""
    decoder = json.JSONDecoder()
    count = 0
    with io.TextIOWrapper(raw, encoding="utf-8-sig", errors="replace") as fin:
        buf = fin.read(CHUNK_BYTES)
        eof = not buf
        pos = _skip(buf, 0)
        while pos >= len(buf) and not eof:
            more = fin.read(CHUNK_BYTES)
            eof = not more
            buf += more
            pos = _skip(buf, pos)
        if pos >= len(buf):
            return 0  # an empty file: no items
        if buf[pos] != "[":
            text = (buf[pos:] + fin.read()).rstrip(_WS)
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise ItemFileError(source, f"not JSON ({exc})", 0) from exc
            if not isinstance(value, dict):
                raise ItemFileError(source, "expected an array of objects or one object", 0)
            _write_as_written(spool, text)
            return 1
        pos += 1
        while True:
            pos = _skip(buf, pos, commas=count > 0)
            if pos < len(buf) and buf[pos] == "]":
                return count
            try:
                value, end = decoder.raw_decode(buf, pos)
                if end >= len(buf) and not eof:  # a number may go on in the next chunk
                    raise ValueError("at the chunk's end")
            except ValueError as exc:
                if eof:
                    raise ItemFileError(source, f"array element {count + 1} is not JSON ({exc})", count) from exc
                more = fin.read(CHUNK_BYTES)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            if isinstance(value, dict):
                _write_as_written(spool, buf[pos:end])
            else:
                _write(spool, {"_invalidItem": json.dumps(value)[:10000], "_error": "not a JSON object"})
            count += 1
            pos = end
            if pos > CHUNK_BYTES:  # keep the buffer small: drop what was read
                buf, pos = buf[pos:], 0


def _skip(buf: str, pos: int, commas: bool = False) -> int:
    """The index of the next character that is not white space (nor, with ``commas``, one comma)."""
    while pos < len(buf) and buf[pos] in _WS:
        pos += 1
    if commas and pos < len(buf) and buf[pos] == ",":
        pos += 1
        while pos < len(buf) and buf[pos] in _WS:
            pos += 1
    return pos


def _append_csv(raw: BinaryIO, source: PurePosixPath, spool: BinaryIO, start: int = 0) -> int:
    """A header row, then one item per row (from ``start``: the rows there, under the first row's header)."""
    count = 0
    header: list[str] = []
    if start > 0:
        first = raw.readline(CHUNK_BYTES).decode("utf-8-sig", "replace")
        header = next(csv.reader([first]), [])
        raw.seek(start)
    with io.TextIOWrapper(raw, newline="", encoding="utf-8" if start > 0 else "utf-8-sig", errors="replace") as fin:
        try:
            reader = csv.DictReader(fin, fieldnames=header) if start > 0 else csv.DictReader(fin)
            for row in reader:
                if start > 0 and count == 0 and list(row.values()) == header:
                    continue  # the header row written again by an appending writer
                extra = row.pop(None, None)
                if extra:
                    row["_extra"] = extra
                _write(spool, row)
                count += 1
        except csv.Error as exc:
            raise ItemFileError(source, f"not CSV ({exc})", count) from exc
    return count
