"""A running Scrapy crawl's JOBDIR, as Scrapy's close would leave it, without closing anything.

Scrapy writes the state of its JOBDIR only when the crawl closes: the priority queue's
``requests.queue/active.json`` (which priorities, per download slot, hold requests), each queuelib
FIFO disk queue's ``info.json`` (head, tail, size), each LIFO disk queue's size header, and the
pickled ``spider.state`` (the SpiderState extension). A copy of a running JOBDIR therefore does not
resume. :func:`jobdir_view` reads what close would write from the live objects (the scheduler, its
queues, the dupefilter, the spider) and flushes the files Scrapy buffers (the dupefilter's
``requests.seen``, a LIFO queue's file object); :func:`write_patches` then writes the close-time
files into a *copy* of the JOBDIR. The live JOBDIR is never written (a crash leaves it as Scrapy
would), the queues stay open and in use.

Known classes (Scrapy 2.11 – 2.19, queuelib 1.6 – 1.10): ``scrapy.pqueues.ScrapyPriorityQueue`` and
``DownloaderAwarePriorityQueue``; downstream queues built on queuelib's ``FifoDiskQueue``,
``LifoDiskQueue`` and the SQLite queues (committed at every operation: nothing to write). Anything
else raises :class:`JobdirError` naming the class: the snapshot would not resume, so none is taken.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

__all__ = ["JobdirError", "JobdirView", "close_later", "copy_later", "copy_tree_now_and_later", "jobdir_view",
           "write_patches"]


class JobdirError(Exception):
    """The crawl's JOBDIR cannot be saved consistently (the message says why and how to fix it)."""


@dataclass
class JobdirView:
    """What Scrapy's close would write into a JOBDIR, keyed by path relative to it."""

    files: Dict[str, bytes] = field(default_factory=dict)
    """Whole files (``requests.queue/active.json``, ``<queue>/info.json``, ``spider.state``)."""
    headers: List[Tuple[str, bytes]] = field(default_factory=list)
    """(file, bytes) to write at offset 0 of a file (a LIFO queue's size header)."""
    pending: int = 0
    """Requests in the disk queues."""
    seen: int = 0
    """Fingerprints the dupefilter holds."""


def _rel(path: str, jobdir: str) -> str:
    rel = os.path.relpath(os.path.abspath(path), jobdir)
    if rel.startswith(".."):
        raise JobdirError(f"a scheduler queue lies outside the JOBDIR ({path})")
    return rel


def _queuelib_kind(queue: Any) -> str:
    """``fifo``, ``lifo`` or ``sqlite`` for a queuelib disk queue (Scrapy's wrappers subclass them)."""
    from queuelib import queue as ql

    if isinstance(queue, ql.FifoDiskQueue):
        return "fifo"
    if isinstance(queue, ql.LifoDiskQueue):
        return "lifo"
    if isinstance(queue, ql.FifoSQLiteQueue):  # (LifoSQLiteQueue subclasses it)
        return "sqlite"
    raise JobdirError(f"the scheduler's disk queue {type(queue).__module__}.{type(queue).__qualname__} is not "
                      "one of queuelib's (FIFO, LIFO, SQLite): its state cannot be saved while the crawl runs")


def _downstream(pq: Any) -> List[Any]:
    queues = list(getattr(pq, "queues", {}).values())
    queues += list(getattr(pq, "_start_queues", {}).values())
    return queues


def _pq_state(pq: Any) -> Any:
    """What ``pq.close()`` returns (the ``active.json`` content), from the open queue."""
    if hasattr(pq, "pqueues"):  # DownloaderAwarePriorityQueue: {slot: ScrapyPriorityQueue state}
        return {slot: _pq_state(inner) for slot, inner in pq.pqueues.items()}
    if not hasattr(pq, "queues"):
        raise JobdirError(f"the priority queue {type(pq).__module__}.{type(pq).__qualname__} is not Scrapy's: "
                          "its state cannot be saved while the crawl runs")
    active: List[int] = []
    for queues in (pq.queues, getattr(pq, "_start_queues", {})):
        for priority in queues:
            if priority not in active:
                active.append(priority)
    return active


def _leaf_queues(pq: Any) -> List[Any]:
    if hasattr(pq, "pqueues"):
        return [q for inner in pq.pqueues.values() for q in _leaf_queues(inner)]
    return _downstream(pq)


def jobdir_view(scheduler: Any, spider: Any, jobdir: str) -> JobdirView:
    """Flush what Scrapy buffers and return what its close would write (blocking, milliseconds).

    ``scheduler`` is the engine's (Scrapy's ``Scheduler``: ``df``, ``dqs``, ``dqdir``), ``jobdir``
    the crawl's JOBDIR. Raises :class:`JobdirError` for a scheduler, priority queue or disk queue this
    module does not know, or a ``spider.state`` pickle cannot hold.
    """
    jobdir = os.path.abspath(jobdir)
    view = JobdirView()
    dupefilter = getattr(scheduler, "df", None)
    seen_file = getattr(dupefilter, "file", None)
    if seen_file is not None:
        seen_file.flush()
    fingerprints = getattr(dupefilter, "_fingerprints", None)  # (Scrapy 2.13+; "fingerprints" before)
    if fingerprints is None:
        fingerprints = getattr(dupefilter, "fingerprints", ())
    view.seen = len(fingerprints)
    if not hasattr(scheduler, "dqs") or not getattr(scheduler, "dqdir", None):
        raise JobdirError(f"the scheduler {type(scheduler).__module__}.{type(scheduler).__qualname__} keeps no "
                          "queue in the JOBDIR (not Scrapy's scheduler, or JOBDIR is off)")
    pq = scheduler.dqs
    if pq is not None:
        view.files[_rel(os.path.join(scheduler.dqdir, "active.json"), jobdir)] = json.dumps(_pq_state(pq)).encode()
        view.pending = len(pq)
        for queue in _leaf_queues(pq):
            kind = _queuelib_kind(queue)
            if kind == "fifo":
                view.files[_rel(os.path.join(queue.path, "info.json"), jobdir)] = json.dumps(queue.info).encode()
            elif kind == "lifo":
                queue.f.flush()
                view.headers.append((_rel(queue.path, jobdir), struct.pack(queue.SIZE_FORMAT, queue.size)))
    if hasattr(spider, "state"):
        try:
            view.files["spider.state"] = pickle.dumps(spider.state, protocol=4)
        except Exception as exc:
            raise JobdirError(f"spider.state cannot be pickled ({type(exc).__name__}: {exc})") from exc
    return view


def write_patches(view: JobdirView, copy: Path) -> None:
    """Write ``view``'s close-time files into ``copy`` (a copy of the JOBDIR; blocking). OSError as raised."""
    for rel, data in view.files.items():
        target = copy / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    for rel, header in view.headers:
        fd = os.open(copy / rel, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.pwrite(fd, header, 0)
        finally:
            os.close(fd)


Later = List[Tuple[int, int, str]]
"""Files copied after the reactor step: (an open descriptor, the size to copy, the target path)."""


def copy_tree_now_and_later(source: str, target: str, later_paths: Set[str]) -> Tuple[int, Later]:
    """Copy ``source`` into the new ``target`` as ``crawlerkeeper_sdk._control.copy_tree`` does (no link
    followed, special files skipped: their count is returned), except the files of ``later_paths``
    (absolute): those are append-only (the dupefilter's ``requests.seen``), so their bytes up to the size
    they have now never change; they are opened and measured now, and :func:`copy_later` copies that
    prefix later, outside the reactor step. Blocking; OSError as raised (descriptors opened are closed)."""
    from crawlerkeeper_sdk import _control

    later: Later = []
    try:
        os.mkdir(target, 0o700)
        skipped = 0
        stack = [(source, target)]
        while stack:
            src, dst = stack.pop()
            with os.scandir(src) as listing:
                entries = list(listing)
            for entry in entries:
                path = os.path.join(dst, entry.name)
                if entry.is_dir(follow_symlinks=False):
                    os.mkdir(path, 0o700)
                    stack.append((entry.path, path))
                elif os.path.abspath(entry.path) in later_paths and entry.is_file(follow_symlinks=False):
                    fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
                    later.append((fd, os.fstat(fd).st_size, path))
                elif not (entry.is_file(follow_symlinks=False) and _control._copy_file(entry.path, path)):
                    skipped += 1
    except BaseException:
        close_later(later)
        raise
    return skipped, later


def copy_later(later: Later) -> None:
    """Copy each (descriptor, size, target) of :func:`copy_tree_now_and_later`, then close the descriptors
    (blocking: run in a thread). OSError as raised (every descriptor closed)."""
    from crawlerkeeper_sdk import _control

    try:
        for fd, size, target in later:
            out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                _control._copy_bytes(fd, out, size)
            finally:
                os.close(out)
    finally:
        close_later(later)


def close_later(later: Later) -> None:
    """Close the descriptors of ``later`` (idempotent for a list emptied by it)."""
    while later:
        fd = later.pop()[0]
        with contextlib.suppress(OSError):
            os.close(fd)
