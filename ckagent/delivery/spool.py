"""Limits and file names of a task's spool (shared by every part of delivery)."""

from __future__ import annotations

import os
from pathlib import Path

from ckagent.node import beneath
from ckagent.node.beneath import NotBeneath

MAX_LINE_BYTES = 64 * 1024
"""Longest log line (bytes); longer ones are cut into pieces."""
MAX_ITEM_BYTES = 16 * 1024 * 1024
"""Longest items.jsonl line (bytes) read as one item."""
MAX_BATCH_BYTES = 1024 * 1024
"""Most JSON bytes of elements in one batch (one larger element travels alone)."""
MAX_BATCH_COUNT = 5000
"""Most elements in one batch."""
BATCH_AGE = 1.0
"""Seconds a non-full batch of items may wait for more elements before it is sent."""
LOG_BATCH_AGE = 0.7
"""The same for log lines: shorter, so a line reaches the master within a second (bench.manytasks:
delivery lag p99 ≤ 1 s) while a trickling task still costs about one request a second per stream."""
NODE_BATCH_ENTRY_BYTES = 128 * 1024
"""Largest batch body (bytes) sent in a node batch; a larger one (a flood's) goes to its own endpoint:
sharing a request saves a small batch's per-request cost, a large one has none worth saving."""
NODE_LOG_BATCH_AGE = 0.3
"""LOG_BATCH_AGE while lines go in node batches (ckagent.delivery.nodebatch): the request is shared with
every other stream's batch, so waiting less costs the master no extra request."""
TAIL_INTERVAL = 0.25
"""Seconds between looks at the items file while it keeps growing (written by another process)."""
SCAN_INTERVAL = 1.0
"""Seconds between looks for new or grown spider log files and a grown items file (one thread hop)."""
NOTIFY_FALLBACK = 10.0
"""Seconds a shipper with nothing to read waits for a notification before it looks anyway (a safety
net: the journal writer, the scan and the task's end notify)."""
READ_CHUNK = 256 * 1024
"""Bytes read from a spool file at a time."""
SEND_CONCURRENCY = 8
"""Tasks of the outbox that may have a request in flight at the same time."""
BACKOFF_INITIAL = 0.5
EARLY_RETRY_AFTER = 1.0
"""Seconds in backoff after which a shipper retries at once if the master was seen reachable again."""
DEFAULT_REFUSAL_TIMEOUT = 600.0
"""Seconds a stream (or a final result) retries a 404 "unknown task", and a stream a 413 for a single
element, before it gives up on it (``server.refusal_timeout``)."""
MAX_LOG_SOURCES = 64
"""Most spider log files tailed for one task (more are ignored, with a notice in the agent log)."""
CHECKPOINTS_KEPT = 64

OUTPUT_LOG = "output.log"
ITEMS_FILE = "items.jsonl"
JOURNAL_FILE = "output.journal"
ITEMS_JOURNAL = "items.journal"
"""The items stream's journal, for a task that declares item files (``outputs.items``): the order in
which items.jsonl and the declared JSON Lines files enter the one items stream (records as the log's)."""
ITEM_FILES_DIR = "item-files"
"""Hard links to the declared JSON Lines files a task writes while it runs (the items journal's sources)."""
AGENT_FILES = frozenset({OUTPUT_LOG, ITEMS_FILE, JOURNAL_FILE, ITEMS_JOURNAL})
DEFAULT_LOG_GLOBS: tuple[str, ...] = ("*.log",)




SpoolFileError = NotBeneath
"""A spool path that is not a regular file of the task's (a symlink, FIFO, device, directory, another
owner's hard link, a link on the way): it is not read or written. A spider owns its task dir and may
replace any file in it; the agent (possibly root) must neither follow a link out of it nor block on a
FIFO (ckagent.node.beneath)."""


def open_spool(path: Path, flags: int = os.O_RDONLY, mode: int = 0o640) -> int:
    """Open a file of a task's spool, ``path`` a file directly in the task dir: never following a
    symlink, never blocking on a FIFO, only a regular file (:func:`ckagent.node.beneath.open_file`).

    Returns a file descriptor (the caller closes it). Raises FileNotFoundError when it does not
    exist (and ``flags`` lacks O_CREAT), SpoolFileError when it is anything but a regular file of the
    task's, other OSError as ``os.open`` does. Blocking (a few syscalls): call it from a thread where
    it matters.
    """
    return beneath.open_file(path.parent, path.name, flags, mode)


def open_in(task_dir: Path, rel: str, flags: int = os.O_RDONLY, mode: int = 0o640) -> int:
    """Open the spool file ``rel`` (a path relative to ``task_dir``, maybe in a folder: a spider log
    file, an item file's link) as :func:`open_spool` does, every folder on the way walked without
    following a link. Raises as :func:`open_spool`, SpoolFileError also for a path that leaves the dir."""
    return beneath.open_file(task_dir, rel, flags, mode)


def read_spool(path: Path, offset: int = 0, size: int = -1) -> bytes:
    """Read ``size`` bytes (all when -1) of a spool file from ``offset``; see :func:`open_spool`."""
    fd = open_spool(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            fh.seek(offset)
            return fh.read(size)
    finally:
        os.close(fd)
