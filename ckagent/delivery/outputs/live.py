"""Declared JSON Lines item files streamed while the task runs, as ``CK_ITEMS_FILE`` is.

A task whose ``outputs.items`` names files (globs in its working copy) gets an **items journal**
(``items.journal``, records as the log journal's, :class:`ckagent.delivery.journal.LogJournal`):
the items stream is the merge of ``items.jsonl`` (source 0) and the declared ``.jsonl`` /
``.ndjson`` / ``.jl`` files, in the order the journal records their growth — the same after a
crash, so a resend never drops nor repeats an item.

The declared files live in the working copy, which is removed (or becomes the artifacts) at the
task's end, while their items may still wait for the master. So :class:`LiveItemFiles` gives each
one a **hard link** in the task directory (``item-files/<n>-<name>``) when it first sees it: the
spider's appends reach the link (one inode), the link outlives the working copy, and the journal's
sources are the links. A file the spider replaces (another inode at the same path: written anew and
renamed over) gets a new link, a new source; one it truncates continues as a new source from its
start (the journal sees it shrink). Both are said in the task's log. A file that cannot be linked
(another filesystem) is not streamed: its items are read at the task's end, as a ``.json`` file's.
A restarted agent finds the links again by their inodes (nothing else to store).

**The package's samples** (ckagent.delivery.outputs.samples): a declared file that was in the
working copy when it was staged is not linked while it is the sample left alone (the run may never
write it: then it is no item); once the run writes it, it is judged as at the task's end: appended
to → its stream starts at the sample's end (:attr:`LiveItemFiles.starts`, in the journal's ``S``
record); rewritten, truncated or replaced → from its start.

The working copy and the task dir are the spider's: the walk, each look and each link go by
descriptors (ckagent.node.beneath) — a symlink at a declared path, or a folder swapped for one, is
never linked nor read (``linkat`` without following; the new link checked to be a regular file of the
task's), so no file outside the working copy ever becomes an item source.

Blocking (stat, walk, link): :meth:`LiveItemFiles.scan` runs in the outbox's once-a-second worker
thread, :meth:`LiveItemFiles.link` in the end-of-task collection's; a lock keeps them apart.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
from pathlib import Path

from ckagent.delivery.outputs import CACHE_DIRS, match_glob
from ckagent.delivery.outputs.samples import NOTHING, Sample, judge, load
from ckagent.delivery.spool import ITEM_FILES_DIR
from ckagent.node import beneath

__all__ = ["LIVE_EXTENSIONS", "LiveItemFiles", "link_starts"]

LIVE_EXTENSIONS = (".jsonl", ".ndjson", ".jl")
"""Item files streamed while they grow (an object per line); others are read at the task's end."""
_WILD = re.compile(r"[*?\[]")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class LiveItemFiles:
    """The declared JSON Lines files of one running task and their links in its task directory.

    ``work``: the working copy; ``globs``: ``outputs.items``; ``samples``: the package's item files as
    staged (module docstring; None: read from the task dir's record at the first scan). What the task's log should say (a file streamed, replaced, not
    linkable) waits in :meth:`take_notices` (the owner writes it on the loop).
    """

    def __init__(self, task_dir: Path, work: Path, globs: tuple[str, ...] | list[str],
                 samples: dict[str, Sample] | None = None) -> None:
        self.task_dir = task_dir
        self.work = work
        self.globs = [g for g in globs if g.lower().endswith(LIVE_EXTENSIONS) or _WILD.search(g)]
        self.samples: dict[str, Sample] = samples if samples is not None else {}
        self._samples_given = samples is not None
        self.starts: dict[str, int] = {}
        """link → the offset its stream starts at (the end of the sample it appends to; absent: 0)."""
        self._notices: list[str] = []
        self._lock = threading.Lock()
        self._links: dict[int, str] = {}  # inode → link (relative to task_dir)
        self._current: dict[str, tuple[int, str]] = {}  # working-copy path → (inode, link) now streamed
        self._failed: set[str] = set()  # working-copy paths that cannot be linked (not streamed)
        self._loaded = False

    def take_notices(self) -> list[str]:
        """The lines for the task's log since the last call (oldest first)."""
        with self._lock:
            notices, self._notices = self._notices, []
        return notices

    def _notice(self, text: str) -> None:
        self._notices.append(text)

    def _load(self) -> None:
        """The links an earlier run made (a restarted agent re-adopting the task), by inode."""
        self._loaded = True
        if not self._samples_given:
            self.samples = load(self.task_dir)
        with contextlib.suppress(OSError):  # (a folder the spider swapped for a link: no links)
            fd = beneath.open_dir(self.task_dir, ITEM_FILES_DIR)
            try:
                with os.scandir(fd) as entries:
                    for entry in entries:
                        with contextlib.suppress(OSError):
                            st = entry.stat(follow_symlinks=False)
                            if stat.S_ISREG(st.st_mode):
                                name = f"{ITEM_FILES_DIR}/{entry.name}"
                                self._links[st.st_ino] = name
                                sample = next((s for s in self.samples.values()
                                               if (s.dev, s.ino) == (st.st_dev, st.st_ino)), None)
                                if sample is not None and (start := judge(sample, st, self.task_dir, name)) > 0:
                                    self.starts[name] = start
            finally:
                os.close(fd)

    def _matches(self) -> list[str]:
        """Working-copy paths (POSIX, relative) of JSON Lines files the globs name, sorted."""
        found: set[str] = set()
        walk = False
        for pattern in self.globs:
            if _WILD.search(pattern):
                walk = True
            elif pattern.lower().endswith(LIVE_EXTENSIONS):
                while pattern.startswith("./"):
                    pattern = pattern[2:]
                found.add(pattern)
        if walk:
            with contextlib.suppress(OSError):
                for rel_dir, _dirs, entries in beneath.walk(
                        self.work, skip_dir=lambda rel: rel.rsplit("/", 1)[-1] in CACHE_DIRS):
                    for name, st in entries:
                        rel = rel_dir + name
                        if (stat.S_ISREG(st.st_mode) and rel.lower().endswith(LIVE_EXTENSIONS)
                                and any(match_glob(rel, g) for g in self.globs)):
                            found.add(rel)
        return sorted(found)

    def scan(self) -> dict[str, int]:
        """Link what is new, return ``{link: size}`` for every link of a file now in the working copy
        (the items journal notes their growth). Never raises (a file that cannot be seen is skipped)."""
        with self._lock:
            if not self._loaded:
                self._load()
            sizes: dict[str, int] = {}
            for rel in self._matches():
                link = self._link(rel)
                if link is not None:
                    with contextlib.suppress(OSError):
                        sizes[link] = beneath.stat_entry(self.task_dir, link).st_size
            return sizes

    def link(self, rel: str) -> tuple[Path, int] | None:
        """(The link of working-copy file ``rel``, made now when it has none yet; the offset its stream
        starts at), or None: it cannot be streamed (not linkable, not a JSON Lines file, the package's
        sample left alone). For the end-of-task collection."""
        if not rel.lower().endswith(LIVE_EXTENSIONS):
            return None
        with self._lock:
            if not self._loaded:
                self._load()
            link = self._link(rel)
            return None if link is None else (self.task_dir / link, self.starts.get(link, 0))

    def _link(self, rel: str) -> str | None:
        try:
            st = beneath.stat_entry(self.work, rel)  # not through a symlinked folder; ".." refused
            beneath.check_regular(st, os.stat(self.work, follow_symlinks=False).st_uid, rel)
        except OSError:
            return None  # missing, a link, a FIFO, another owner's hard link: never read
        known = self._links.get(st.st_ino)
        current = self._current.get(rel)
        if known is not None:
            if current is None or current[0] != st.st_ino:
                self._current[rel] = (st.st_ino, known)
            return known
        if rel in self._failed:
            return None
        start = judge(self.samples.get(rel), st, self.work, rel)
        if start == NOTHING:
            return None  # the package's sample, as staged: not this run's (looked at again next scan)
        name = f"{ITEM_FILES_DIR}/{len(self._links)}-{_UNSAFE.sub('_', rel)[-100:]}"
        try:
            st = beneath.link(self.work, rel, self.task_dir, name)  # linkat without following; the link's own lstat
        except OSError as exc:
            self._failed.add(rel)
            self._notice(f"outputs: {rel} cannot be streamed while the task runs (cannot link it into the task "
                         f"directory: {exc.strerror or exc}); its items are read at the task's end")
            return None
        self._links[st.st_ino] = name
        if start > 0:
            self.starts[name] = start
            self._notice(f"outputs: {rel} is the package's sample ({start} bytes) and this run appends to it: "
                         "streaming the items it appends")
        elif current is not None:
            self._notice(f"outputs: {rel} was replaced by a new file; its new content is streamed as new items "
                         "(the items already read from the old one stay)")
        elif rel in self.samples:
            self._notice(f"outputs: {rel} (the package's sample) was written anew by this run: streaming its items")
        else:
            self._notice(f"outputs: streaming the items of {rel} while the task runs")
        self._current[rel] = (st.st_ino, name)
        return name


def link_starts(task_dir: Path) -> dict[str, int]:
    """Where the streams of the task's links start (:attr:`LiveItemFiles.starts`, from the task dir's
    links and samples record alone): for a delivery resumed after a restart without a watcher, whose
    journal may not have declared a link made just before the crash. Blocking; never raises."""
    live = LiveItemFiles(task_dir, task_dir, ())
    with live._lock:
        live._load()
    return dict(live.starts)
