"""The control channel's files (ckagent.task.taskenv): the agent's requests and the spider's answers.

The agent appends one JSON object a line to ``CK_CONTROL_FILE`` (:func:`request_line`)::

    {"event": "persistState", "id": 3, "reason": "interval"}
    {"event": "migrating", "id": 4, "reason": "migrate", "secondsLeft": 18.5}

and the spider appends its answer to ``CK_CONTROL_ACK_FILE`` once its snapshot ``CK_SNAPSHOT_DIR/N`` is
made (``{"id": N, "itemsOffset": 12345, "snapshot": "N", "pauseMs": 4.2}``) or could not be
(``{"id": N, "error": "..."}``). The ack file is the spider's: everything in it is hostile input.
:func:`parse_ack` takes one line and raises :class:`BadAck` (a ValueError, its message what is wrong)
for anything but the protocol's shape: not UTF-8 JSON, not an object, over :data:`MAX_ACK_LINE_BYTES`,
an id that is not an integer ≥ 1, an offset that is not an integer ≥ 0, a snapshot name other than the
request's number, a pause that is not a finite number ≥ 0. :class:`AckReader` follows the file from an
offset, never following a link the spider put in its place (ckagent.node.beneath), reading at most
:data:`MAX_ACK_READ_BYTES` a look and skipping a line longer than the limit to its end.
:func:`snapshot_problem` checks that a named snapshot is a directory of the snapshot dir (not a link).

Everything here is small reads and appends of the page cache (on the Trio loop); nothing raises but
:func:`parse_ack` (BadAck) and :func:`append_request` (OSError: a full disk, NotBeneath).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ckagent.node import beneath
from ckagent.task.taskenv import CONTROL_ACK_FILE, CONTROL_FILE, CONTROL_FILE_MODE, SNAPSHOTS_DIR

__all__ = ["MAX_ACK_LINE_BYTES", "Ack", "AckReader", "BadAck", "append_request", "last_request_id",
           "parse_ack", "request_line", "snapshot_problem"]

MAX_ACK_LINE_BYTES = 4096
"""The longest answer line read (the protocol's lines are under 200 bytes); a longer one is skipped."""
MAX_ACK_READ_BYTES = 256 * 1024
"""The most of the ack file read in one look (the rest is read by the next)."""
MAX_REQUEST_ID = 2**53
"""Request ids stay below this (JSON's exact integers)."""
MAX_ERROR_CHARS = 300
"""An answer's ``error`` is shown cut to this many characters."""
_NAME = re.compile(r"[1-9][0-9]{0,15}")


class BadAck(ValueError):
    """An answer line that is not the protocol's (the message says what is wrong)."""


@dataclass(frozen=True)
class Ack:
    """One answer of the spider: to request ``id``, the snapshot ``snapshot`` (``CK_SNAPSHOT_DIR/<snapshot>``)
    with its items file at ``items_offset`` bytes, its pause ``pause_ms``; or ``error`` (its words, cut)."""

    id: int
    items_offset: int | None = None
    snapshot: str | None = None
    pause_ms: float | None = None
    error: str | None = None


def _int(value: object, lo: int) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and lo <= value < MAX_REQUEST_ID else None


def parse_ack(line: bytes) -> Ack:
    """One line of the ack file (without its newline) → its :class:`Ack`. Raises BadAck (see module docstring)."""
    if len(line) > MAX_ACK_LINE_BYTES:
        raise BadAck(f"a line of {len(line)} bytes (the most read is {MAX_ACK_LINE_BYTES})")
    try:
        value = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadAck(f"not JSON ({type(exc).__name__})") from None
    if not isinstance(value, dict):
        raise BadAck(f"not a JSON object ({type(value).__name__})")
    ack_id = _int(value.get("id"), 1)
    if ack_id is None:
        raise BadAck(f"its id is not an integer >= 1: {str(value.get('id'))[:40]!r}")
    if "error" in value:
        error = value["error"]
        if not isinstance(error, str):
            raise BadAck("its error is not a string")
        return Ack(ack_id, error=error[:MAX_ERROR_CHARS] or "(no reason given)")
    offset = _int(value.get("itemsOffset"), 0)
    if offset is None:
        raise BadAck(f"itemsOffset is not an integer >= 0: {str(value.get('itemsOffset'))[:40]!r}")
    snapshot = value.get("snapshot")
    if not isinstance(snapshot, str) or snapshot != str(ack_id) or not _NAME.fullmatch(snapshot):
        raise BadAck(f"its snapshot is not {str(ack_id)!r} (the request's number): {str(snapshot)[:40]!r}")
    pause = value.get("pauseMs")
    if pause is not None and (isinstance(pause, bool) or not isinstance(pause, (int, float))
                              or not math.isfinite(pause) or pause < 0):
        raise BadAck(f"pauseMs is not a number >= 0: {str(pause)[:40]!r}")
    return Ack(ack_id, items_offset=offset, snapshot=snapshot, pause_ms=None if pause is None else float(pause))


def request_line(request_id: int, reason: str, seconds_left: float | None = None) -> bytes:
    """The control file's line asking for snapshot ``request_id`` (``migrating`` when ``seconds_left``
    is given, else ``persistState``), with its newline."""
    request: dict[str, object] = {"event": "persistState" if seconds_left is None else "migrating",
                                  "id": request_id, "reason": reason}
    if seconds_left is not None:
        request["secondsLeft"] = round(max(0.0, seconds_left), 1)
    return json.dumps(request).encode() + b"\n"


def append_request(task_dir: Path, line: bytes) -> None:
    """Append ``line`` to the task's control file (made, the agent's, when missing; a link or anything
    but a regular file in its place is refused: NotBeneath). Raises OSError."""
    fd = beneath.open_file(task_dir, CONTROL_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, CONTROL_FILE_MODE)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def last_request_id(task_dir: Path) -> int:
    """The highest request id in the task's control file (0: none, or it cannot be read): where a
    re-adopting agent goes on numbering. Reads at most its last 64 KiB."""
    try:
        fd = beneath.open_file(task_dir, CONTROL_FILE)
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, 65536, max(0, size - 65536))
    except OSError:
        return 0
    finally:
        os.close(fd)
    found = 0
    for line in data.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and (request_id := _int(value.get("id"), 1)) is not None:
            found = max(found, request_id)
    return found


class AckReader:
    """Follows the task's ack file from ``offset`` (bytes): :meth:`read` returns the complete lines
    written since, parsed, and the problems of the lines that were not the protocol's."""

    def __init__(self, task_dir: Path, offset: int = 0) -> None:
        self.task_dir = task_dir
        self.offset = offset
        """Bytes of the file read and judged (every line before it)."""
        self._skipping = False  # inside a line longer than MAX_ACK_LINE_BYTES: skip to its end

    def read(self) -> tuple[list[Ack], list[str]]:
        """``(answers, problems)`` of the complete lines since the last read (a torn last line waits for
        the next). A file that cannot be opened (missing, a link, not a regular file) is a problem once
        per read, never followed."""
        try:
            fd = beneath.open_file(self.task_dir, CONTROL_ACK_FILE)
        except FileNotFoundError:
            return [], []
        except OSError as exc:
            return [], [f"{CONTROL_ACK_FILE} cannot be read: {exc}"]
        try:
            data = os.pread(fd, MAX_ACK_READ_BYTES, self.offset)
        except OSError as exc:
            return [], [f"{CONTROL_ACK_FILE} cannot be read: {exc}"]
        finally:
            os.close(fd)
        acks: list[Ack] = []
        problems: list[str] = []
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            line, start = data[start:end], end + 1
            if self._skipping:
                self._skipping = False
                continue
            if not line.strip():
                continue
            try:
                acks.append(parse_ack(line))
            except BadAck as exc:
                problems.append(f"an answer that is not the protocol's: {exc}")
        rest = len(data) - start
        if rest > MAX_ACK_LINE_BYTES and not self._skipping:  # a line with no end in sight: skipped
            problems.append(f"an answer line longer than {MAX_ACK_LINE_BYTES} bytes: skipped")
            self._skipping, start = True, len(data)
        elif self._skipping:
            start = len(data)
        self.offset += start
        return acks, problems


def snapshot_problem(task_dir: Path, name: str) -> str | None:
    """None when ``CK_SNAPSHOT_DIR/<name>`` is a directory (not a link to one), else what is wrong."""
    try:
        st = beneath.stat_entry(task_dir, f"{SNAPSHOTS_DIR}/{name}")
    except OSError as exc:
        return f"its snapshot {name!r} cannot be seen ({exc})"
    if not stat.S_ISDIR(st.st_mode):
        return f"its snapshot {name!r} is not a directory (a link or a file: not followed)"
    return None
