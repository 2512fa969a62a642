"""Item files the package ships are the author's samples: only what this run wrote is items.

Six of fourteen public projects commit a sample of their output (``output.jsonl``, ``results.json``,
``scraped.csv``) and name it in ``outputs.items``. Such a file is in the working copy before the
spider starts; delivering it would hand the master the author's old items (200 items for a 100-item
crawl, or the committed 100 from a task that wrote nothing).

**The snapshot.** When the working copy is staged (ckagent.task.deploy, before any process of the
task runs) every item-file candidate in it — a file ``outputs.items`` names, else a crawlee dataset
file — is recorded: ``(dev, inode, size, mtime_ns, sha256 of its first HEAD_BYTES)``. The record is
``samples.json`` in the task directory (written by a rename; read back bounded, by descriptor, so a
restarted agent judges the same way). The task dir is the spider's, so it could rewrite the record:
that changes only which of its own bytes become its own items, never what another task or the node
holds (every path in it is read below the working copy, as any item file is).

**What this run wrote** (:func:`judge`), for a file now at a sample's path:

======================================================  ============================================
the file now                                            this run wrote
======================================================  ============================================
another inode or device (rewritten as a new file,       all of it
renamed into place)
the same inode, smaller (truncated, then written)       all of it
the same inode and size, another mtime                  all of it (written again in place)
the same inode, larger, the first bytes as the          the bytes after the sample's end (appended);
sample's (up to HEAD_BYTES)                             a ``.json`` document: all of it (one cannot
                                                        append to an array)
the same inode, larger, other first bytes               all of it (truncated, then written longer)
the same inode, size and mtime                          nothing: the sample, left alone
======================================================  ============================================

A file with no sample at its path is all this run's. The outputs line names the samples left alone
(``output.jsonl: the package's sample (3 KiB), not written by this run: left alone``) and the
appended ones (``output.jsonl → 100 items (after the package's sample of 3 KiB)``).

Blocking (stat, hash): call in a worker thread. Never raises for one file: a file that cannot be
looked at is no sample.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ckagent.node import beneath

__all__ = ["ALL", "HEAD_BYTES", "NOTHING", "SAMPLES_FILE", "Sample", "judge", "load", "save", "snapshot"]

SAMPLES_FILE = "samples.json"
"""The task directory's record of the package's item files as staged."""
HEAD_BYTES = 1 << 20
"""How much of a sample's start is hashed (an append keeps it; a rewrite rarely does)."""
MAX_SAMPLES = 10_000
"""At most this many samples are recorded (a package of more item files than this is not a sample)."""
_MAX_RECORD_BYTES = 4 << 20
ALL = 0
""":func:`judge`: every byte of the file is this run's."""
NOTHING = -1
""":func:`judge`: the file is the sample as staged; no byte of it is this run's."""


@dataclass(frozen=True)
class Sample:
    """An item file of the package as staged in the working copy (module docstring)."""

    rel: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    head: str
    """sha256 (hex) of the first min(size, HEAD_BYTES) bytes."""


def _head(fd: int, size: int) -> str:
    digest = hashlib.sha256()
    at = 0
    want = min(size, HEAD_BYTES)
    while at < want and (chunk := os.pread(fd, want - at, at)):
        digest.update(chunk)
        at += len(chunk)
    return digest.hexdigest()


def snapshot(work: Path, candidates: Sequence[str]) -> dict[str, Sample]:
    """The samples among ``candidates`` (POSIX paths relative to the working copy ``work``, from
    :func:`ckagent.delivery.outputs.item_candidates`): each regular file of the working copy's owner,
    opened below ``work`` (no link followed). Files that cannot be read are left out."""
    found: dict[str, Sample] = {}
    for rel in candidates[:MAX_SAMPLES]:
        try:
            fd = beneath.open_file(work, rel)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                found[rel] = Sample(rel, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, _head(fd, st.st_size))
        except OSError:
            continue
        finally:
            os.close(fd)
    return found


def save(task_dir: Path, samples: dict[str, Sample]) -> None:
    """Write ``samples.json`` in the task directory (anew, by a rename; nothing is written when there
    are no samples and none was recorded). Raises OSError."""
    if not samples and not os.path.lexists(task_dir / SAMPLES_FILE):
        return
    body = json.dumps([asdict(sample) for sample in samples.values()], ensure_ascii=False).encode()
    beneath.write_new(task_dir, SAMPLES_FILE, body)


def load(task_dir: Path) -> dict[str, Sample]:
    """The samples :func:`save` recorded for the task ({} when none, or when the record is not one:
    read by descriptor, bounded; a damaged record counts every file as this run's)."""
    try:
        body = json.loads(beneath.read_bytes(task_dir, SAMPLES_FILE, _MAX_RECORD_BYTES))
    except (OSError, ValueError):
        return {}
    found: dict[str, Sample] = {}
    if isinstance(body, list):
        for entry in body[:MAX_SAMPLES]:
            with contextlib.suppress(TypeError, ValueError):
                sample = Sample(**entry)
                if (isinstance(sample.rel, str) and isinstance(sample.head, str)
                        and all(isinstance(v, int) and not isinstance(v, bool)
                                for v in (sample.dev, sample.ino, sample.size, sample.mtime_ns))):
                    found[sample.rel] = sample
    return found


def judge(sample: Sample | None, st: os.stat_result, top: Path, rel: str) -> int:
    """Where this run's bytes of the file ``rel`` below ``top`` (now ``st``, its lstat) start:
    :data:`ALL` (0) for the whole file, :data:`NOTHING` for none, else the offset after the sample
    (its appended bytes). See the module docstring's table. ``.json`` files are never split."""
    if sample is None or (st.st_dev, st.st_ino) != (sample.dev, sample.ino) or st.st_size < sample.size:
        return ALL
    if st.st_size == sample.size:
        return NOTHING if st.st_mtime_ns == sample.mtime_ns else ALL
    if rel.lower().endswith(".json"):
        return ALL
    try:
        fd = beneath.open_file(top, rel)
    except OSError:
        return ALL
    try:
        same = _head(fd, sample.size) == sample.head
    except OSError:
        return ALL
    finally:
        os.close(fd)
    return sample.size if same else ALL
