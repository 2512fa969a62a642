"""What a task's delivery reads at its end (ckagent.delivery.taskdelivery), in one thread hop: the log
files' last sizes, the final stats, the artifacts' state and the items journal's sources' last sizes."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from ckagent.delivery.artifacts import ArtifactState, read_state
from ckagent.delivery.journal import scan_log_files
from ckagent.delivery.spool import ITEM_FILES_DIR, ITEMS_FILE, OUTPUT_LOG
from ckagent.delivery.stats import final_stats
from ckagent.master.protocol import TaskStats
from ckagent.node import beneath

__all__ = ["EndReads", "end_reads", "size_of"]

EndReads = tuple[dict[str, int], TaskStats | None, "ArtifactState | OSError | ValueError", dict[str, int] | None]
"""What a task's end reads (:func:`end_reads`): the log files' last sizes, the final stats, the
artifacts' state (or the error reading it raised), the items journal's sources' last sizes (None:
the task has no items journal)."""


def end_reads(task_dir: Path, globs: list[str], items_journal: bool) -> EndReads:
    """What a task's delivery reads at its end, in one thread hop: the log files' last sizes
    (output.log's and those of ``globs``), the final stats snapshot, the artifacts' state (or the
    error reading it raised: ckagent.delivery.artifacts logs it) and, with ``items_journal``, the
    items journal's sources' last sizes (:func:`final_item_sizes`). Blocking."""
    sizes = scan_log_files(task_dir, globs)
    try:
        sizes[OUTPUT_LOG] = os.lstat(task_dir / OUTPUT_LOG).st_size  # (a link the spider planted: not followed)
    except FileNotFoundError:
        sizes[OUTPUT_LOG] = 0
    try:
        artifact_state: ArtifactState | OSError | ValueError = read_state(task_dir)
    except (OSError, ValueError) as exc:
        artifact_state = exc
    return sizes, final_stats(task_dir), artifact_state, final_item_sizes(task_dir) if items_journal else None


def final_item_sizes(task_dir: Path) -> dict[str, int]:
    """Every items journal source's last size: the streamed files' links first (in the order they
    were made), then items.jsonl, which ends with the item files read at the task's end
    (ckagent.delivery.outputs). Blocking."""
    sizes: dict[str, int] = {}
    with contextlib.suppress(OSError):  # the folder by descriptor: one the spider swapped for a link is not listed
        fd = beneath.open_dir(task_dir, ITEM_FILES_DIR)
        try:
            with os.scandir(fd) as entries:
                found = {entry.name: entry.stat(follow_symlinks=False) for entry in entries}
        finally:
            os.close(fd)
        links = sorted((name for name, st in found.items() if stat.S_ISREG(st.st_mode)),
                       key=lambda n: (len(n.split("-")[0]), n))
        sizes.update({f"{ITEM_FILES_DIR}/{name}": found[name].st_size for name in links})
    sizes[ITEMS_FILE] = size_of(task_dir / ITEMS_FILE)
    return sizes


def size_of(path: Path) -> int:
    """``path``'s size (bytes; 0 when it cannot be seen), without following a symlink. Blocking."""
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0
