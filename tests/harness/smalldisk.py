"""A small filesystem of the test's own: a tmpfs of a bounded size, mounted and always unmounted.

:func:`small_disk` mounts it (root only; the test is skipped with the reason otherwise) and unmounts
it on the way out — lazily when something still holds it — so a failing test leaves no mount behind.
:func:`fill_disk` takes every free byte of it (``posix_fallocate`` pieces, in milliseconds) and
returns the file holding them; :func:`can_mount_tmpfs` says whether this process may mount at all.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["can_mount_tmpfs", "fill_disk", "small_disk"]


def can_mount_tmpfs() -> str | None:
    """None when this process may mount a tmpfs (root with ``mount``), else the reason it cannot."""
    if os.geteuid() != 0:
        return "mounting a small tmpfs for the work dir needs root"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "mount/umount are not installed"
    return None


@contextlib.contextmanager
def small_disk(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` (bytes) mounted at ``path`` (made if missing, mode 0755); unmounted on
    the way out (``umount -l`` when busy). Skips the test when it cannot be mounted (the reason said)."""
    reason = can_mount_tmpfs()
    if reason is not None:
        pytest.skip(reason)
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, check=False, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False, timeout=30)


def fill_disk(path: Path) -> Path:
    """Take every free byte of the filesystem holding ``path`` into the new file ``path`` (allocated
    pieces of 8 MiB, 64 KiB, 4 KiB until none fits) and return it: the disk is full (0 bytes free)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        offset = 0
        for piece in (8 << 20, 64 << 10, 4096):
            while True:
                try:
                    os.posix_fallocate(fd, offset, piece)
                except OSError:
                    break
                offset += piece
    finally:
        os.close(fd)
    return path
