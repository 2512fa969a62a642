"""The log journal's writer: the order in which a task's log sources enter its one log stream.

The journal (``output.journal``, records ``S``/``D``/``F``/``E``; see the package docstring,
ckagent.delivery) is written by :class:`LogJournal` only, from the outbox's journal task; the shippers
replay it (:mod:`ckagent.delivery.readers`) and the outbox statistics read its ``S`` records
(:mod:`ckagent.delivery.statistics`), both with :func:`parse_journal`. Also here: which spider log
files a task has (:func:`task_log_globs`, :func:`scan_log_files`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

from ckagent.delivery.spool import (
    AGENT_FILES,
    ITEMS_JOURNAL,
    JOURNAL_FILE,
    MAX_LOG_SOURCES,
    OUTPUT_LOG,
    open_spool,
)
from ckagent.master.protocol import Task
from ckagent.node import beneath
from ckagent.node.diskfull import JOURNAL_HEADROOM_BYTES, preallocate, release_beyond

log = logging.getLogger(__name__)

START_MARK = " @"
"""In the items journal, an ``S`` record's path may end in `` @<offset>``: the source starts there
(a declared item file the run appended to a sample of the package: ckagent.delivery.outputs.samples).
Its paths (items.jsonl, ``item-files/<n>-<name>`` with ``[A-Za-z0-9._-]`` names) never hold a space."""


def split_start(arg: str) -> tuple[str, int]:
    """An items journal ``S`` record's argument → (the source's path, the offset it starts at)."""
    path, mark, start = arg.rpartition(START_MARK)
    if mark and start.isdigit():
        return path, int(start)
    return arg, 0


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


class LogJournal:
    """Writes a task's ``output.journal`` (the merge order of its log sources; see module docstring).

    Blocking but tiny: :meth:`open` reads an existing journal (use ``trio.to_thread``); the record
    writes are small ``os.write`` calls on an O_APPEND descriptor (like :class:`LogSink`). Only the
    outbox's journal task writes. Raises OSError when the file cannot be created.

    Blocks beyond the file's end are held for its records (``JOURNAL_HEADROOM_BYTES``, topped up by
    the outbox's looks): a full disk does not stop them. A write that fails anyway (ENOSPC: the
    headroom used up, or a filesystem that cannot preallocate) leaves no torn record: the file is cut back to its
    last whole record and the records wait in memory (:attr:`unwritten`) for the next write or
    :meth:`flush` — the stream's order stays what the records say, it only reaches the file later.
    """

    def __init__(self, task_dir: Path, name: str = JOURNAL_FILE, first: str = OUTPUT_LOG,
                 what: str = "log file") -> None:
        self.task_dir = task_dir
        self.path = task_dir / name
        self._first = first  # source 0 (output.log; items.jsonl for the items journal)
        self._what = what  # a source in the log's words ("log file", "item file")
        self._fd = -1
        self.paths: dict[int, str] = {}  # idx → path (the current idx of each path is in `current`)
        self.current: dict[str, int] = {}
        self.recorded: dict[int, int] = {}
        self.finalized: set[int] = set()
        self.ended = False
        self.on_record: Callable[[], None] | None = None
        self.on_notice: Callable[[str], None] | None = None
        """Told (instead of the agent log) when a source shrank: the items journal says it in the task's log."""
        self._warned_full = False
        self._with_starts = name == ITEMS_JOURNAL  # sources may start past a sample (START_MARK)
        self.unwritten = b""
        """Records a failed write left in memory (written before any later record)."""

    def open(self) -> None:
        """Read what an earlier run wrote (cutting a torn last record), then open for appending."""
        fd = open_spool(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND)  # never through a link the spider planted
        try:
            chunks: list[bytes] = []
            read = 0
            while chunk := os.pread(fd, 1 << 20, read):
                chunks.append(chunk)
                read += len(chunk)
            data = b"".join(chunks)
            records, good = parse_journal(data)
            if good < len(data):
                log.warning("%s: dropping a torn last record (%d bytes)", self.path, len(data) - good)
                os.ftruncate(fd, good)
        except BaseException:
            os.close(fd)
            raise
        for _, kind, idx, arg in records:
            if kind == "S":
                path, start = split_start(arg) if self._with_starts else (arg, 0)
                self.paths[idx] = path
                self.current[path] = idx
                self.recorded[idx] = start
            elif kind == "D":
                self.recorded[idx] = int(arg)
            elif kind == "F":
                self.finalized.add(idx)
            elif kind == "E":
                self.ended = True
        self._fd = fd
        preallocate(fd, JOURNAL_HEADROOM_BYTES)  # records go on through a full disk (ckagent.node.diskfull)
        if 0 not in self.paths:
            self._write([self._declare(self._first)])

    def _declare(self, path: str, starts: dict[str, int] | None = None) -> str:
        """A new source ``path``; from ``starts[path]`` (items journal) on its first declaration (one
        declared again after it shrank starts at 0)."""
        start = starts.get(path, 0) if starts and self._with_starts and path not in self.current else 0
        idx = max(self.paths, default=-1) + 1
        self.paths[idx] = path
        self.current[path] = idx
        self.recorded[idx] = start
        return f"S {idx} {path}{START_MARK}{start}\n" if start > 0 else f"S {idx} {path}\n"

    def _write(self, records: list[str]) -> None:
        if (records or self.unwritten) and self._fd >= 0:
            data = self.unwritten + "".join(records).encode("utf-8", "surrogateescape")
            self.unwritten = b""
            start = os.fstat(self._fd).st_size
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self._fd, view):]
            except OSError as exc:
                self.unwritten = data
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, start)  # no torn record
                log.warning("%s: cannot write %d bytes of records (%s); kept in memory until there is room",
                            self.path, len(data), exc.strerror or exc)
                return
            if self.on_record is not None:
                self.on_record()

    def fileno(self) -> int:
        """The open descriptor (-1 when closed): the outbox tops up the blocks held beyond its end."""
        return self._fd

    def flush(self) -> bool:
        """Write the records a failed write left (:attr:`unwritten`); True when none is left."""
        self._write([])
        return not self.unwritten

    def note(self, sizes: dict[str, int], starts: dict[str, int] | None = None) -> None:
        """Record growth: ``sizes`` maps source path → current size. New paths are declared (the items
        journal's from ``starts[path]`` when given: the end of a sample the run appends to); a file
        that shrank (rotated or truncated) continues as a new source. Does nothing once ended."""
        if self.ended:
            return
        records: list[str] = []
        for path, size in sizes.items():
            idx = self.current.get(path)
            if idx is None:
                if len(self.paths) >= MAX_LOG_SOURCES + 1:
                    if not self._warned_full:
                        log.warning("%s: more than %d %ss; ignoring the others", self.task_dir, MAX_LOG_SOURCES,
                                    self._what)
                        self._warned_full = True
                    continue
                records.append(self._declare(path, starts))
                idx = self.current[path]
            elif idx in self.finalized:
                continue
            elif size < self.recorded[idx]:
                if self.on_notice is None:
                    log.info("%s: %s %s shrank (rotated?); reading it again from its start", self.task_dir,
                             self._what, path)
                else:
                    self.on_notice(f"{self._what} {path} shrank from {self.recorded[idx]} to {size} bytes "
                                   "(truncated or rewritten): what it holds now is read from its start")
                records.append(f"F {idx}\n")
                self.finalized.add(idx)
                records.append(self._declare(path))
                idx = self.current[path]
            if size > self.recorded[idx]:
                records.append(f"D {idx} {size}\n")
                self.recorded[idx] = size
        self._write(records)

    def end(self, sizes: dict[str, int], starts: dict[str, int] | None = None) -> None:
        """The task is over: record the last growth, complete every source, end the stream (idempotent)."""
        if self.ended:
            return
        self.note(sizes, starts)
        records = [f"F {idx}\n" for idx in sorted(self.paths) if idx not in self.finalized]
        self.finalized.update(self.paths)
        records.append("E\n")
        self.ended = True
        self._write(records)

    def close(self) -> None:
        """Close the file, giving back the blocks held beyond its end (idempotent)."""
        if self._fd >= 0:
            release_beyond(self._fd)
            os.close(self._fd)
            self._fd = -1


def _safe_glob(pattern: str) -> bool:
    p = PurePosixPath(pattern)
    return bool(pattern) and not p.is_absolute() and ".." not in p.parts and "\n" not in pattern


def scan_log_files(task_dir: Path, globs: Sequence[str]) -> dict[str, int]:
    """Spider log files under ``task_dir`` matching ``globs``: relative path → size (blocking).

    Only regular files of the task's inside the task dir (no symlink, at the end or on the way: each
    looked at by :func:`ckagent.node.beneath.stat_entry`; no other owner's hard link; nothing of the
    agent's own files, no path with a newline); absolute or ``..`` patterns are ignored. Nothing is
    opened (a FIFO is seen for what it is).
    """
    found: dict[str, int] = {}
    candidates = sorted({path.relative_to(task_dir).as_posix() for pattern in globs if _safe_glob(pattern)
                         for path in task_dir.glob(pattern)})
    candidates = [rel for rel in candidates if rel not in AGENT_FILES and "\n" not in rel]
    if not candidates:
        return found
    try:
        top = beneath.open_top(task_dir)
    except OSError:
        return found
    try:
        owner = os.fstat(top).st_uid
        for rel in candidates:
            try:
                st = beneath.stat_entry(top, rel)
                beneath.check_regular(st, owner, rel)
            except OSError:
                continue
            found[rel] = st.st_size
    finally:
        os.close(top)
    return found


def _task_globs(task: Task) -> list[object] | None:
    extra = task.params.get("logFiles") if isinstance(task.params, dict) else None
    if extra is None:
        return None
    return [extra] if not isinstance(extra, list) else list(extra)


def task_log_globs(task: Task, defaults: Sequence[str]) -> list[str]:
    """The globs of a task's spider log files: ``defaults`` plus ``params.logFiles`` (a str or list of str)."""
    globs = list(defaults)
    globs += [g for g in _task_globs(task) or [] if isinstance(g, str) and _safe_glob(g)]
    return globs


def rejected_log_globs(task: Task) -> str | None:
    """One line saying which of ``params.logFiles`` are ignored and why, or None when all are used.

    Rejected: a value that is not a string (or a list of strings), an empty, absolute or ``..``
    pattern (log files must lie inside the task dir, CK_TASK_DIR).
    """
    rejected = [g for g in _task_globs(task) or [] if not (isinstance(g, str) and _safe_glob(g))]
    if not rejected:
        return None
    shown = ", ".join(repr(g)[:200] for g in rejected)
    return (f"params.logFiles: ignored {shown}: each must be a glob relative to the task dir (CK_TASK_DIR), "
            "not empty, absolute or with '..'")
