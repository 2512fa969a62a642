"""A task's private working copy of its code version, and the per-spider directories that outlive runs.

Each task runs in ``work_dir/spiders/.runs/<task-id>/``, a copy of its (immutable, cached) code
version made just before the install and removed when the task ends, so nothing one run writes
into its working directory is seen by the next. The copy is cheap — a spider project is usually
small, and on filesystems with reflinks (btrfs, XFS, bcachefs, ZFS 2.2) each file is a
copy-on-write clone (``FICLONE``), elsewhere an in-kernel copy (``copy_file_range``) — and safe: it is never made of hard links, which a spider
rewriting a shipped file in place would use to change the cached
version for every later run.

What a spider keeps between its runs goes into its own directories (created on first use, given to
the spider's identity — its own uid, or ``task.run_as_user`` — when it is not the agent's own):

- ``CK_DATA_DIR`` = ``work_dir/spider-data/<spiderId>/``: Scrapy's ``JOBDIR``, an HTTP cache, a
  dedup database;
- ``HOME`` = ``work_dir/spider-home/<spiderId>/``: what tools put in the user's home (Scrapy's
  job files, caches), per spider instead of the agent's.

All functions here block (they walk and copy files): call them through ``trio.to_thread``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from ckagent.master.ids import safe_name
from ckagent.node.runas import RunAs
from ckagent.node.workmodes import PRIVATE_DIR_MODE

log = logging.getLogger(__name__)

FICLONE = 0x40049409
"""Linux ioctl: make the destination file a copy-on-write clone of the source (``linux/fs.h``)."""
_NO_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM}


@dataclass
class CopyStats:
    """What :func:`make_working_copy` did: files cloned (reflink), copied (bytes), symlinks recreated."""

    cloned: int = 0
    copied: int = 0
    symlinks: int = 0

    def describe(self) -> str:
        """``"12 files (reflinks)"`` / ``"12 files (copied)"`` — for the task log."""
        files = self.cloned + self.copied
        how = "reflinks" if self.cloned and not self.copied else "copied" if not self.cloned else "reflinks and copies"
        return f"{files} file(s) ({how})"


def _clone_or_copy(src: str, dst: str, mode: int, try_clone: bool) -> bool:
    """Write ``dst`` (new) from ``src``: a reflink when the filesystem can, else a byte copy. True = cloned."""
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        if try_clone:
            try:
                fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
            except OSError as exc:
                if exc.errno not in _NO_CLONE:
                    raise
            else:
                os.chmod(dst, stat.S_IMODE(mode))
                return True
        _copy_bytes(fin.fileno(), fout.fileno())
    os.chmod(dst, stat.S_IMODE(mode))
    return False


def _copy_bytes(fd_in: int, fd_out: int) -> None:
    """Copy in the kernel (``copy_file_range``: no bytes through user space, and itself a reflink on
    XFS/btrfs/NFS 4.2); a plain read/write loop where it is not supported."""
    try:
        while os.copy_file_range(fd_in, fd_out, 1 << 30):
            pass
        return
    except OSError as exc:
        if exc.errno not in _NO_CLONE:  # a full disk and the like: the caller fails the task
            raise
    os.lseek(fd_in, 0, os.SEEK_SET)
    os.lseek(fd_out, 0, os.SEEK_SET)
    os.ftruncate(fd_out, 0)
    while chunk := os.read(fd_in, 1 << 20):
        os.write(fd_out, chunk)


def make_working_copy(src: Path, dst: Path) -> CopyStats:
    """Copy the tree ``src`` to ``dst`` (which must not exist): reflinks where possible, never hard links.

    Symlinks are recreated as symlinks (their targets are not followed). Raises OSError (a full disk:
    the caller removes ``dst``).
    """
    stats = CopyStats()
    try_clone = True
    dst.mkdir(mode=PRIVATE_DIR_MODE, parents=True)  # the task's alone from the start (not the umask's 0755)
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target_dir = dst if rel == "." else dst / rel
        for name in list(dirnames):
            source = os.path.join(dirpath, name)
            if os.path.islink(source):
                os.symlink(os.readlink(source), target_dir / name)
                stats.symlinks += 1
                dirnames.remove(name)
            else:
                (target_dir / name).mkdir()
        for name in filenames:
            source = os.path.join(dirpath, name)
            st = os.lstat(source)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(source), target_dir / name)
                stats.symlinks += 1
            elif stat.S_ISREG(st.st_mode):
                if _clone_or_copy(source, str(target_dir / name), st.st_mode, try_clone):
                    stats.cloned += 1
                else:
                    stats.copied += 1
                    try_clone = stats.cloned > 0  # a filesystem without reflinks: stop asking
    return stats


def remove_tree(path: Path) -> None:
    """Remove a working copy (whatever the spider left in it; never raises)."""
    shutil.rmtree(path, ignore_errors=True)


def spider_paths(work_dir: Path, spider_id: str) -> tuple[Path, Path]:
    """(``CK_DATA_DIR``, ``HOME``) of the spider ``spider_id`` (an id from the network: named safely)."""
    safe_id = safe_name(spider_id)
    return work_dir / "spider-data" / safe_id, work_dir / "spider-home" / safe_id


def spider_dirs(work_dir: Path, safe_id: str, run_as: RunAs | None, *, spider_id: str | None = None) -> tuple[Path, Path]:
    """(``CK_DATA_DIR``, ``HOME``) of a spider, created if missing and given to ``run_as`` (its identity)
    when set. Dirs another identity owns (an earlier root or one-user node, another uid of the spider)
    are given to it whole — the migration of a node to ``spider-uids``: one log line per spider says
    what changed hands (``spider_id`` names it; files with other hard links are copied, device files
    removed: RunAs.chown_tree). Nothing is removed. Blocking."""
    dirs = (work_dir / "spider-data" / safe_id, work_dir / "spider-home" / safe_id)
    moved: list[str] = []
    for path in dirs:
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)  # 0700 from the start, not the umask's
        if run_as is None:
            continue
        before = path.stat()
        if (before.st_uid, before.st_gid) != (run_as.uid, run_as.gid):
            given = run_as.chown_tree(path)
            extra = "".join(f", {n} {what}" for n, what in ((given.copied, "hard-linked file(s) copied"),
                                                            (given.removed, "device file(s) removed")) if n)
            moved.append(f"{path} (uid {before.st_uid}'s, {given.changed} entries{extra})")
    if moved and run_as is not None:
        log.info("spider %s: its files are given to its identity %s (uid %d, gid %d): %s",
                 spider_id if spider_id is not None else safe_id, run_as.name, run_as.uid, run_as.gid,
                 "; ".join(moved))
    return dirs
