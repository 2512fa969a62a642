"""The control channel between the agent and a spider that can resume: the spider's side of the files.

The agent appends requests to ``CK_CONTROL_FILE``, one JSON object a line::

    {"event": "persistState", "id": 3, "reason": "interval"}
    {"event": "migrating", "id": 4, "reason": "migrate", "secondsLeft": 18.5}

and the spider answers each one by appending a line to ``CK_CONTROL_ACK_FILE``::

    {"id": 3, "itemsOffset": 12345, "snapshot": "3", "pauseMs": 4.2}
    {"id": 3, "error": "ValueError: ..."}

after copying ``CK_STATE_DIR`` to ``CK_SNAPSHOT_DIR/3`` (through ``3.tmp`` and a rename). This module reads
requests (:class:`ControlReader`), copies snapshots (:func:`take_snapshot`), measures the items file
(:func:`items_offset`) and writes answers (:func:`append_line`); who runs callbacks and when is
:mod:`crawlerkeeper_sdk._state`'s business (and the Scrapy hook's).

The control file is read as untrusted bytes: a line that is not a JSON object with an integer ``id`` ≥ 0
is skipped, a line over :data:`MAX_LINE_BYTES` is skipped whole, a partial last line waits for its
newline, a backlog over :data:`MAX_BACKLOG_BYTES` is skipped but for its last :data:`READ_BYTES`, and a
file that was replaced or truncated is read again from its start (answered ids are never answered twice:
the caller keeps them, :func:`answered_ids` reads them back from the ack file).

Errors: :meth:`ControlReader.poll` raises nothing for a missing, strange or hostile file (it returns no
requests); :func:`take_snapshot`, :func:`items_offset` and :func:`append_line` raise ``OSError``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import stat
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

ENV_STATE_DIR = "CK_STATE_DIR"
ENV_CONTROL_FILE = "CK_CONTROL_FILE"
ENV_CONTROL_ACK_FILE = "CK_CONTROL_ACK_FILE"
ENV_SNAPSHOT_DIR = "CK_SNAPSHOT_DIR"
ENV_ATTEMPT = "CK_ATTEMPT"

EVENT_PERSIST = "persistState"
EVENT_MIGRATING = "migrating"
EVENTS = (EVENT_PERSIST, EVENT_MIGRATING)

POLL_INTERVAL = 0.2
"""Seconds between two looks at the control file (one ``stat``)."""
MAX_LINE_BYTES = 64 * 1024
"""A request line longer than this (bytes) is skipped."""
READ_BYTES = 1 << 20
"""At most this many bytes of the control file are read per poll."""
MAX_BACKLOG_BYTES = 8 << 20
"""Unread bytes beyond this are skipped (but for the last READ_BYTES): requests are small and recent."""
MAX_ID = 2**53
MAX_DEPTH = 64
"""Directories nested deeper than this in the state dir are not copied (counted as skipped)."""
_MAX_ACK_READ_BYTES = 16 << 20

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


@dataclass(frozen=True)
class Request:
    """One request of the agent: ``id`` (int ≥ 0), ``event`` (``persistState``, ``migrating`` or an event
    this SDK does not know, answered with an error), ``reason`` (str or None), ``seconds_left`` (float
    seconds ≥ 0 until the agent stops the spider, ``migrating`` only; None when absent or not a number)."""

    id: int
    event: str
    reason: Optional[str] = None
    seconds_left: Optional[float] = None


def _loads(line: bytes) -> Any:
    try:
        return json.loads(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def parse_request(line: bytes) -> Optional[Request]:
    """The request in one line (without its newline), or None when the line is not one.

    A line whose start was torn (a writer that died mid-line, then a whole line appended after it) is
    read from its last ``{``: requests are flat objects, so the whole one at its end is still found.
    """
    obj = _loads(line)
    if not isinstance(obj, dict):
        start = line.rfind(b"{")
        obj = _loads(line[start:]) if start > 0 else None
        if not isinstance(obj, dict):
            return None
    rid = obj.get("id")
    if type(rid) is float and rid.is_integer():
        rid = int(rid)  # 3.0 is 3 to a JavaScript writer (and to the Node SDK)
    if type(rid) is not int or not 0 <= rid <= MAX_ID:
        return None
    event = obj.get("event")
    reason = obj.get("reason")
    left = obj.get("secondsLeft")
    seconds_left = None
    if isinstance(left, (int, float)) and not isinstance(left, bool) and math.isfinite(left) and left >= 0:
        seconds_left = float(left)
    return Request(
        id=rid,
        event=event[:100] if isinstance(event, str) else "",
        reason=reason[:100] if isinstance(reason, str) else None,
        seconds_left=seconds_left,
    )


class ControlReader:
    """Reads the requests appended to a control file since the last :meth:`poll` (not thread-safe)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.skipped_bytes = 0
        """Bytes of a backlog skipped unread (see MAX_BACKLOG_BYTES)."""
        self._position = 0
        self._identity: Optional[Tuple[int, int]] = None
        self._partial = b""
        self._discarding = False  # inside a line that was too long: drop up to its newline

    def poll(self) -> List[Request]:
        """The whole request lines appended since the last call, in file order (maybe none).

        Never raises for the file's sake: missing, not a regular file, unreadable → no requests.
        """
        try:
            info = os.stat(self.path)
        except OSError:
            return []
        if not stat.S_ISREG(info.st_mode):
            return []
        identity = (info.st_dev, info.st_ino)
        if identity != self._identity or info.st_size < self._position:
            # A new file (or one truncated): read it from its start.
            self._identity = identity
            self._position = 0
            self._partial = b""
            self._discarding = False
        if info.st_size == self._position:
            return []
        try:
            chunk = self._read(info.st_size)
        except OSError:
            return []
        return self._lines(chunk)

    def _read(self, size: int) -> bytes:
        if size - self._position > MAX_BACKLOG_BYTES:
            skip_to = size - READ_BYTES
            self.skipped_bytes += skip_to - self._position
            self._position = skip_to
            self._partial = b""
            self._discarding = True  # the line cut at skip_to is not a request
        fd = os.open(self.path, os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return b""
            chunk = os.pread(fd, min(size - self._position, READ_BYTES), self._position)
        finally:
            os.close(fd)
        self._position += len(chunk)
        return chunk

    def _lines(self, chunk: bytes) -> List[Request]:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        requests = []
        for line in lines:
            if self._discarding:
                self._discarding = False
                continue
            if len(line) > MAX_LINE_BYTES:
                continue
            request = parse_request(line.strip())
            if request is not None:
                requests.append(request)
        if len(self._partial) > MAX_LINE_BYTES:
            self._partial = b""
            self._discarding = True
        return requests


def answered_ids(ack_path: str) -> Set[int]:
    """The ids answered in an ack file (its last 16 MiB; garbage lines skipped; missing file → none)."""
    try:
        fd = os.open(ack_path, os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK)
    except OSError:
        return set()
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - _MAX_ACK_READ_BYTES)
        data = os.pread(fd, size - start, start)
    except OSError:
        return set()
    finally:
        os.close(fd)
    ids = set()
    for line in data.split(b"\n"):
        obj = _loads(line) if len(line) <= MAX_LINE_BYTES else None
        if isinstance(obj, dict) and type(obj.get("id")) is int:
            ids.add(obj["id"])
    return ids


def append_line(fd: int, obj: Dict[str, Any]) -> None:
    """Append ``obj`` as one JSON line to the O_APPEND descriptor ``fd`` (one write). Raises OSError."""
    view = memoryview((json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8"))
    while view:
        view = view[os.write(fd, view):]


def items_offset(items_path: Optional[str]) -> int:
    """The size in bytes of the items file cut back to its last whole line (0 if none or no file).

    The SDK writes whole lines in one ``write``; a partial last line can only be another writer's work in
    progress, and an offset is only true at a line boundary. Raises OSError if the file cannot be read.
    """
    if not items_path:
        return 0
    try:
        fd = os.open(items_path, os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK)
    except FileNotFoundError:
        return 0
    try:
        end = os.fstat(fd).st_size
        while end > 0:
            start = max(0, end - 65536)
            chunk = os.pread(fd, end - start, start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                return start + newline + 1
            end = start
        return 0
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    """Remove a leftover file, link or tree at ``path`` (never following a link)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _copy_file(src: str, dst: str) -> bool:
    """Copy one regular file without following a link; False if ``src`` is not one (any more)."""
    try:
        fd_in = os.open(src, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW | _O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOENT, errno.ENXIO):
            return False
        raise
    try:
        info = os.fstat(fd_in)
        if not stat.S_ISREG(info.st_mode):
            return False
        mode = stat.S_IMODE(info.st_mode) | 0o600
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW, mode)
        try:
            _copy_bytes(fd_in, fd_out, info.st_size)
            os.fchmod(fd_out, mode)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)
    return True


def _copy_bytes(fd_in: int, fd_out: int, size: int) -> None:
    # At most the size seen at open: a file that grows meanwhile (the spider's own log) ends there.
    done = 0
    sendfile = getattr(os, "sendfile", None)
    while done < size:
        if sendfile is not None:
            try:
                sent = sendfile(fd_out, fd_in, done, size - done)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP) or done:
                    raise
                sendfile = None
                continue
        else:
            data = os.pread(fd_in, min(size - done, 1 << 20), done)
            sent = len(data)
            view = memoryview(data)
            while view:
                view = view[os.write(fd_out, view):]
        if sent == 0:
            return  # the file shrank
        done += sent


def copy_tree(src_dir: str, dst_dir: str) -> int:
    """Copy the regular files and directories beneath ``src_dir`` into the new ``dst_dir``.

    Never follows a symbolic link; links, sockets, FIFOs, devices and directories deeper than
    :data:`MAX_DEPTH` are not copied: returns how many entries were skipped. Modes are kept (owner
    read/write added). Raises OSError (``FileExistsError`` if ``dst_dir`` exists).
    """
    os.mkdir(dst_dir, 0o700)
    skipped = 0
    stack: List[Tuple[str, str, int]] = [(src_dir, dst_dir, 0)]
    while stack:
        src, dst, depth = stack.pop()
        try:
            with os.scandir(src) as listing:
                entries = list(listing)
        except FileNotFoundError:
            if depth == 0:
                raise
            skipped += 1  # removed while being copied
            continue
        for entry in entries:
            target = os.path.join(dst, entry.name)
            if entry.is_dir(follow_symlinks=False):
                if depth >= MAX_DEPTH:
                    skipped += 1
                    continue
                os.mkdir(target, 0o700)
                with contextlib.suppress(OSError):
                    os.chmod(target, stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode) | 0o700)
                stack.append((entry.path, target, depth + 1))
            elif not (entry.is_file(follow_symlinks=False) and _copy_file(entry.path, target)):
                skipped += 1
    return skipped


def take_snapshot(state_dir: str, snapshot_dir: str, name: str) -> int:
    """Copy ``state_dir`` to ``snapshot_dir/name`` (through ``name.tmp`` and a rename); returns how many
    entries were skipped (see :func:`copy_tree`). A missing ``state_dir`` gives an empty snapshot; a
    leftover ``name`` or ``name.tmp`` (an answer that never finished) is replaced; a copy that fails
    removes its ``name.tmp``. Raises OSError.
    """
    os.makedirs(snapshot_dir, exist_ok=True)
    final = os.path.join(snapshot_dir, name)
    temporary = final + ".tmp"
    _remove(temporary)
    _remove(final)
    try:
        if os.path.isdir(state_dir):
            skipped = copy_tree(state_dir, temporary)
        else:
            os.mkdir(temporary, 0o700)
            skipped = 0
        os.rename(temporary, final)
    except BaseException:
        with contextlib.suppress(OSError):  # a failed snapshot leaves nothing behind
            _remove(temporary)
        raise
    return skipped
