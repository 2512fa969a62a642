"""One identity a spider or an installer runs as (:class:`RunAs`: a passwd user, or a spider's uid of its
own with no passwd entry), the Popen options it gives, and the tree walk that gives files to it.

Which identity each spider gets is ckagent.node.identity's (the identity level). Pure data over the
passwd database; imports nothing of the agent.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Given:
    """What :meth:`RunAs.chown_tree` did: entries given (``changed``), files with more than one hard link
    replaced by a copy of their own (``copied``: the other link may lie outside the tree), device files
    removed (``removed``)."""

    changed: int = 0
    copied: int = 0
    removed: int = 0


@dataclass(frozen=True)
class RunAs:
    """An identity spiders or installers run as (needs an agent running as root).

    ``uid``/``gid``/``groups`` go to ``subprocess.Popen(user=, group=, extra_groups=)``; ``home`` is
    the HOME it gets (a passwd user's home directory, or a spider's own ``spider-home`` dir).
    ``dynamic``: a uid of the ``spider-uids`` level, with no passwd entry (``name`` is ``ck-<uid>``,
    no supplementary groups).
    """

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    dynamic: bool = False

    @classmethod
    def of_uid(cls, uid: int, home: str) -> RunAs:
        """A spider's own uid (and the gid of the same number), no passwd entry: ``ck-<uid>``."""
        return cls(f"ck-{uid}", uid, uid, (), home, dynamic=True)

    @classmethod
    def recorded(cls, uid: int, gid: int, home: str) -> RunAs:
        """The identity a process was started as (a re-adopted spider's handle): the passwd user of that
        uid, else a spider's own uid (``home`` its HOME)."""
        try:
            pw = pwd.getpwuid(uid)
        except KeyError:
            return cls(f"ck-{uid}", uid, gid, (), home, dynamic=True)
        groups = tuple(g for g in os.getgrouplist(pw.pw_name, gid) if g != gid)
        return cls(pw.pw_name, uid, gid, groups, pw.pw_dir)

    @classmethod
    def lookup(cls, name: str) -> RunAs:
        """Resolve a user name (or numeric uid) from the passwd database. Raises ValueError when unknown."""
        try:
            pw = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        except KeyError:
            raise ValueError(f"task.run_as_user: no user {name!r} on this node") from None
        groups = tuple(g for g in os.getgrouplist(pw.pw_name, pw.pw_gid) if g != pw.pw_gid)
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir)

    def popen_options(self) -> dict[str, Any]:
        """Keyword arguments for ``subprocess.Popen`` / ``trio.lowlevel.open_process``."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def env(self) -> dict[str, str]:
        """HOME, USER and LOGNAME of this user (they replace the agent's in the spider's environment)."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def chown_tree(self, path: Path) -> Given:
        """Give ``path`` and everything under it to this identity (uid and gid), following no symlink:
        links are given themselves, directories are entered by descriptor (``os.fwalk``), so a link or a
        directory swapped for one while the walk runs leads nowhere outside the tree. A regular file with
        more than one hard link is replaced by a copy of its own first (the other link may name a file
        outside the tree: the agent's, another spider's), a device file is removed (only root makes
        one; given to a spider it would open the device). Entries already this identity's are left as
        they are; ``path`` itself is done last (callers skip a tree whose top is this identity's).

        Blocking (walks the tree): call it through ``trio.to_thread``. Raises OSError (the top missing,
        a full disk while copying).
        """
        uid, gid = self.uid, self.gid
        changed = copied = removed = 0
        top = os.lstat(path)
        if stat.S_ISDIR(top.st_mode):
            for _dirpath, dirnames, filenames, dirfd in os.fwalk(path, topdown=False, follow_symlinks=False):
                for name in (*dirnames, *filenames):
                    try:
                        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode):
                        os.unlink(name, dir_fd=dirfd)
                        removed += 1
                    elif st.st_uid == uid and st.st_gid == gid:
                        continue
                    elif stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                        own_copy(name, dirfd, (uid, gid))
                        copied += 1
                    else:
                        os.chown(name, uid, gid, dir_fd=dirfd, follow_symlinks=False)
                        changed += 1
        if (top.st_uid, top.st_gid) != (uid, gid):  # last: callers check the top's owner to skip done trees
            os.lchown(path, uid, gid)
            changed += 1
        return Given(changed, copied, removed)


def own_copy(name: str, dirfd: int, owner: tuple[int, int] | None = None) -> None:
    """Replace the hard link ``name`` (in the directory ``dirfd``) by a copy of its own — owned by
    ``owner`` (uid, gid) when given — with the same bytes, permission bits (no set-id bits) and times;
    the other links keep the original (which may lie outside the tree). Never follows a link, never
    waits on a FIFO. Blocking. Raises OSError (not a regular file any more: EINVAL)."""
    tmp = f".{name[:200]}.ck-copy-{os.getpid()}"
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file any more")
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dirfd)
        try:
            while chunk := os.read(src, 1 << 20):
                os.write(dst, chunk)
            if owner is not None:
                os.fchown(dst, *owner)
            os.fchmod(dst, stat.S_IMODE(st.st_mode) & 0o777)
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        except BaseException:
            os.close(dst)
            os.unlink(tmp, dir_fd=dirfd)
            raise
        os.close(dst)
    finally:
        os.close(src)
    os.rename(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)


def task_uid(run_as: RunAs | None) -> int:
    """The uid a task's processes run as: ``run_as``'s, else the agent's own."""
    return run_as.uid if run_as is not None else os.geteuid()


def popen_identity(run_as: RunAs | None) -> dict[str, Any]:
    """``run_as.popen_options()``, or nothing when spiders run as the agent's own user."""
    return run_as.popen_options() if run_as is not None else {}
