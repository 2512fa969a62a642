"""Files in a tree a spider owns, read and changed by the agent without following a link out of it.

A spider owns its directories — its task dir, its working copy, its data and home dirs — and can plant
anything in them: a symlink to another spider's files, to ``/etc/shadow`` or the agent's ``state.db``,
a hard link, a FIFO, a device file, a directory swapped for a link between the agent's look and its
use. Everything the agent (often root) reads back from such a tree, or does in it, goes through here:

- **A path below the top is walked from the top's descriptor**, one component at a time (``openat``
  with ``O_NOFOLLOW`` each), never resolved as a string: no symlink is followed anywhere below the
  top, and a directory swapped for a link between a look and the use gives ELOOP/ENOTDIR, never
  another directory. ``..``, an absolute path, an empty or NUL-bearing component is refused before
  anything is opened (:func:`parts_of`).
- **A file is used only when it is a regular file**: opened ``O_NONBLOCK | O_NOCTTY`` (a FIFO never
  blocks the agent, a terminal never becomes its controlling one) and checked with ``fstat`` on the
  descriptor it then reads — a device or FIFO is never read.
- **Another's hard link is refused**: a regular file with more than one link is used only when it
  belongs to the tree's owner (the owner of the top). With ``fs.protected_hardlinks = 1`` (every
  distribution's default) a spider can link only files it owns or may read and write anyway; where it
  is 0 it could link any file of the filesystem it can reach — the agent's state.db — into its tree.
- **Changes are made relative to directory descriptors** opened the same way: ``renameat``,
  ``linkat`` without ``AT_SYMLINK_FOLLOW``, ``unlinkat``, ``mkdirat``; a directory the agent makes in
  the tree is given to the tree's owner (``fchown``: the spider can use and remove it). A tree is
  removed by descriptor too (:func:`remove`).

The top itself must be a path the spider cannot change — the agent's own directories above it:
``work_dir/tasks/<id>``, ``work_dir/spiders/.runs/<id>``, ``work_dir/spider-data/<spider>`` — and is
opened ``O_NOFOLLOW`` too (a top that is a symlink is refused).

Errors::

    OSError
    └── NotBeneath    the path leaves the tree (``..``, absolute), a symlink on the way or at the end,
                      not a regular file (a FIFO, a device, a directory), another owner's hard link;
                      ``errno`` ELOOP / ENOTDIR / EINVAL / EPERM, the message names the path and why

Other OSError as the system calls raise them (ENOENT: missing). Every function blocks (system calls):
call it in a worker thread where it matters; none takes long (no function reads more than it is asked).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["NotBeneath", "check_regular", "link", "move", "open_dir", "open_file", "open_top", "parts_of",
           "read_bytes", "remove", "remove_empty_dirs", "stat_entry", "walk", "write_new"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
COPY_CHUNK = 1 << 20


class NotBeneath(OSError):
    """A path that is not a regular file of the tree (see module docstring); the message says why."""


Top = Path | int
"""A tree's top: its path (opened ``O_NOFOLLOW``) or a descriptor of it the caller holds."""


def parts_of(rel: str | os.PathLike[str]) -> list[str]:
    """The components of ``rel``, a path relative to a tree's top (``./`` and repeated slashes dropped).
    Raises NotBeneath (EINVAL) for an absolute path, ``..``, a NUL byte or nothing at all."""
    text = os.fspath(rel)
    if text.startswith("/") or "\0" in text:
        raise NotBeneath(errno.EINVAL, f"{text!r}: not a path inside the tree")
    parts = [part for part in text.split("/") if part not in ("", ".")]
    if not parts or ".." in parts:
        raise NotBeneath(errno.EINVAL, f"{text!r}: not a path inside the tree")
    return parts


def open_top(top: Path) -> int:
    """A descriptor of the tree's top directory (not through a symlink). The caller closes it.
    Raises NotBeneath when it is a symlink, OSError (ENOENT, ENOTDIR) otherwise."""
    try:
        return os.open(top, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(top, None):
            raise NotBeneath(errno.ELOOP, f"{top}: a symlink; not followed") from exc
        raise


def _is_link(name: str | Path, dir_fd: int | None) -> bool:
    """``name`` is a symlink (O_DIRECTORY | O_NOFOLLOW on one says ENOTDIR, not ELOOP)."""
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


@contextlib.contextmanager
def _top_fd(top: Top) -> Iterator[int]:
    if isinstance(top, int):
        yield top
        return
    fd = open_top(top)
    try:
        yield fd
    finally:
        os.close(fd)


def _refused(rel: str, exc: OSError, name: str, dir_fd: int) -> OSError:
    """The error of a walk step: a link on the way (ELOOP) or a non-directory (ENOTDIR) → NotBeneath."""
    if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(name, dir_fd)):
        return NotBeneath(errno.ELOOP, f"{rel}: a symlink on the way; not followed")
    if exc.errno == errno.ENOTDIR:
        return NotBeneath(errno.ENOTDIR, f"{rel}: not a directory on the way")
    return exc


def open_dir(top: Top, rel: str | os.PathLike[str] | None = None, *, create: bool = False) -> int:
    """A descriptor of the directory ``rel`` below ``top`` (``rel`` None or "": the top itself), walked
    as the module docstring says. ``create``: missing directories are made (mode 0700) and given to the
    top's owner. The caller closes it. Raises NotBeneath, OSError (ENOENT without ``create``)."""
    parts = parts_of(rel) if rel not in (None, "", ".") else []
    with _top_fd(top) as topfd:
        fd = os.dup(topfd)
        owner: os.stat_result | None = None
        try:
            for i, part in enumerate(parts):
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    if owner is None:
                        owner = os.fstat(topfd)
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o700, dir_fd=fd)
                        made = os.open(part, _DIR_FLAGS, dir_fd=fd)
                        try:
                            if os.fstat(made).st_uid != owner.st_uid:
                                os.fchown(made, owner.st_uid, owner.st_gid)
                        finally:
                            os.close(made)
                    try:
                        nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    except OSError as exc:
                        raise _refused("/".join(parts[: i + 1]), exc, part, fd) from exc
                except OSError as exc:
                    raise _refused("/".join(parts[: i + 1]), exc, part, fd) from exc
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd


def check_regular(st: os.stat_result, owner_uid: int, rel: str) -> None:
    """Raise NotBeneath unless ``st`` (a file's fstat/lstat) is a regular file and, with more than one
    hard link, belongs to ``owner_uid`` (the tree's owner)."""
    if stat.S_ISLNK(st.st_mode):
        raise NotBeneath(errno.ELOOP, f"{rel}: a symlink; not followed")
    if not stat.S_ISREG(st.st_mode):
        raise NotBeneath(errno.EINVAL, f"{rel}: not a regular file ({_kind(st.st_mode)}); not read")
    if st.st_nlink > 1 and st.st_uid != owner_uid:
        raise NotBeneath(errno.EPERM, f"{rel}: a hard link to a file of uid {st.st_uid}, not the tree's owner "
                                      f"(uid {owner_uid}); not read")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a file"


def _split(rel: str | os.PathLike[str]) -> tuple[list[str], str]:
    parts = parts_of(rel)
    return parts[:-1], parts[-1]


def open_file(top: Top, rel: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of the regular file ``rel`` below ``top`` (``flags`` as ``os.open``'s: O_WRONLY,
    O_APPEND, O_CREAT …; a file made is the agent's, ``mode``), checked as the module docstring says.
    The caller closes it. Raises NotBeneath, OSError (ENOENT: missing)."""
    dirs, name = _split(rel)
    shown = os.fspath(rel)
    with _top_fd(top) as topfd:
        parent = open_dir(topfd, "/".join(dirs)) if dirs else topfd
        try:
            try:
                fd = os.open(name, flags | _FILE_FLAGS, mode, dir_fd=parent)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise NotBeneath(errno.ELOOP, f"{shown}: a symlink; not followed") from exc
                if exc.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
                    raise NotBeneath(errno.EINVAL, f"{shown}: not a regular file (a FIFO); not used") from exc
                if exc.errno == errno.EISDIR:
                    raise NotBeneath(errno.EINVAL, f"{shown}: not a regular file (a directory); not used") from exc
                raise
            try:
                check_regular(os.fstat(fd), os.fstat(topfd).st_uid, shown)
            except BaseException:
                os.close(fd)
                raise
            return fd
        finally:
            if parent != topfd:
                os.close(parent)


def stat_entry(top: Top, rel: str | os.PathLike[str]) -> os.stat_result:
    """``lstat`` of ``rel`` below ``top`` (the directories on the way walked as the module docstring
    says; the entry itself not followed). Raises NotBeneath for a link on the way, OSError (ENOENT)."""
    dirs, name = _split(rel)
    with _top_fd(top) as topfd:
        parent = open_dir(topfd, "/".join(dirs)) if dirs else topfd
        try:
            return os.stat(name, dir_fd=parent, follow_symlinks=False)
        finally:
            if parent != topfd:
                os.close(parent)


def read_bytes(top: Top, rel: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of the regular file ``rel`` below ``top`` (:func:`open_file`). Raises NotBeneath,
    OSError (EFBIG when it holds more than ``max_bytes``: never read into memory then)."""
    fd = open_file(top, rel)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise OSError(errno.EFBIG, f"{os.fspath(rel)}: {size} bytes, more than the {max_bytes} read here")
        chunks = []
        total = 0
        while total <= max_bytes and (chunk := os.read(fd, min(COPY_CHUNK, max_bytes + 1 - total))):
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise OSError(errno.EFBIG, f"{os.fspath(rel)}: more than the {max_bytes} bytes read here")
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_new(top: Top, rel: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to the file ``rel`` below ``top`` as a new file of the agent's, replacing what is
    there by a rename (a symlink or FIFO planted at its name is replaced, never followed), fsync'ed.
    Raises NotBeneath, OSError (a full disk)."""
    dirs, name = _split(rel)
    tmp = f".{name[:200]}.ck-new-{os.getpid()}"
    with _top_fd(top) as topfd:
        parent = open_dir(topfd, "/".join(dirs)) if dirs else topfd
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, mode, dir_fd=parent)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=parent)
                raise
            os.close(fd)
            os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
        finally:
            if parent != topfd:
                os.close(parent)


def move(src_top: Top, src_rel: str, dst_top: Top, dst_rel: str) -> os.stat_result:
    """Move the regular file ``src_rel`` below ``src_top`` to ``dst_rel`` below ``dst_top`` (missing
    directories made and given to that tree's owner; an existing file there replaced), checked as
    :func:`open_file` checks before it moves. Another filesystem: copied by descriptors, then the
    source removed. Returns the file's lstat. Raises NotBeneath, OSError."""
    sdirs, sname = _split(src_rel)
    ddirs, dname = _split(dst_rel)
    with _top_fd(src_top) as stopfd, _top_fd(dst_top) as dtopfd:
        sparent = open_dir(stopfd, "/".join(sdirs)) if sdirs else os.dup(stopfd)
        try:
            st = os.stat(sname, dir_fd=sparent, follow_symlinks=False)
            check_regular(st, os.fstat(stopfd).st_uid, src_rel)
            dparent = open_dir(dtopfd, "/".join(ddirs), create=True) if ddirs else os.dup(dtopfd)
            try:
                try:
                    os.rename(sname, dname, src_dir_fd=sparent, dst_dir_fd=dparent)
                except OSError as exc:
                    if exc.errno != errno.EXDEV:
                        raise
                    _copy_across(sparent, sname, dparent, dname, st, src_rel)
                    os.unlink(sname, dir_fd=sparent)
                return st
            finally:
                os.close(dparent)
        finally:
            os.close(sparent)


def _copy_across(sparent: int, sname: str, dparent: int, dname: str, st: os.stat_result, rel: str) -> None:
    """Copy a file into another filesystem by descriptors (same owner, mode without set-id bits, times)."""
    src = os.open(sname, os.O_RDONLY | _FILE_FLAGS, dir_fd=sparent)
    try:
        fst = os.fstat(src)
        check_regular(fst, st.st_uid, rel)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise NotBeneath(errno.EINVAL, f"{rel}: replaced while it was moved; not moved")
        tmp = f".{dname[:200]}.ck-new-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dparent)
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, 0o600, dir_fd=dparent)
        try:
            while chunk := os.read(src, COPY_CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(dst, view):]
            with contextlib.suppress(PermissionError):
                os.fchown(dst, fst.st_uid, fst.st_gid)
            os.fchmod(dst, stat.S_IMODE(fst.st_mode) & 0o777)
            os.utime(dst, ns=(fst.st_atime_ns, fst.st_mtime_ns))
        except BaseException:
            os.close(dst)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dparent)
            raise
        os.close(dst)
        os.rename(tmp, dname, src_dir_fd=dparent, dst_dir_fd=dparent)
    finally:
        os.close(src)


def link(src_top: Top, src_rel: str, dst_top: Top, dst_rel: str) -> os.stat_result:
    """A hard link at ``dst_rel`` below ``dst_top`` to the regular file ``src_rel`` below ``src_top``
    (``linkat`` without following a symlink; missing directories made). The new link is checked as
    :func:`open_file` checks (a symlink swapped in at the source gives a link to the symlink itself:
    removed, NotBeneath). Returns its lstat. Raises NotBeneath, OSError (EXDEV: another filesystem;
    EEXIST)."""
    sdirs, sname = _split(src_rel)
    ddirs, dname = _split(dst_rel)
    with _top_fd(src_top) as stopfd, _top_fd(dst_top) as dtopfd:
        sparent = open_dir(stopfd, "/".join(sdirs)) if sdirs else os.dup(stopfd)
        try:
            dparent = open_dir(dtopfd, "/".join(ddirs), create=True) if ddirs else os.dup(dtopfd)
            try:
                os.link(sname, dname, src_dir_fd=sparent, dst_dir_fd=dparent, follow_symlinks=False)
                st = os.stat(dname, dir_fd=dparent, follow_symlinks=False)
                try:
                    check_regular(st, os.fstat(stopfd).st_uid, src_rel)
                except NotBeneath:
                    with contextlib.suppress(OSError):
                        os.unlink(dname, dir_fd=dparent)
                    raise
                return st
            finally:
                os.close(dparent)
        finally:
            os.close(sparent)


def remove(top: Top, rel: str | os.PathLike[str] | None = None) -> None:
    """Remove ``rel`` below ``top`` — a file, a symlink (not followed) or a whole directory, walked by
    descriptors — or, with ``rel`` None, everything below ``top`` (the top itself stays). A missing
    ``rel`` is no error. Raises NotBeneath (a link on the way to ``rel``), OSError."""
    with _top_fd(top) as topfd:
        if rel in (None, "", "."):
            _empty(topfd)
            return
        dirs, name = _split(rel)
        try:
            parent = open_dir(topfd, "/".join(dirs)) if dirs else os.dup(topfd)
        except FileNotFoundError:
            return
        try:
            _remove_entry(parent, name)
        finally:
            os.close(parent)


def _remove_entry(parent: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)
        return
    try:
        fd = _open_to_empty(parent, name, st)
    except OSError as exc:  # swapped for a link or a file meanwhile: remove that entry itself
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)
        return
    try:
        _empty(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=parent)


def _open_to_empty(parent: int, name: str, st: os.stat_result) -> int:
    """The directory ``name`` opened to be emptied. One of our own uid that we may not read or write
    (a spider running as the agent's own user made it 0555 or 0000) is given its owner's rwx first,
    through a descriptor (no link followed): as root nothing needs it; as a plain user, without it the
    removal stops at the first such directory. Raises OSError."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except PermissionError:
        if st.st_uid != os.geteuid():
            raise
        pinned = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            os.chmod(f"/proc/self/fd/{pinned}", stat.S_IMODE(st.st_mode) | 0o700)
        finally:
            os.close(pinned)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o300 != 0o300:
        with contextlib.suppress(OSError):
            os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)
    return fd


def _empty(dirfd: int) -> None:
    """Remove everything in the directory ``dirfd`` (descriptors all the way down; no link followed)."""
    with os.scandir(dirfd) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        _remove_entry(dirfd, name)


def remove_empty_dirs(top: Top) -> None:
    """Remove the empty directories below ``top`` (deepest first; directories left non-empty stay).
    Never follows a link; never raises for one directory."""
    with _top_fd(top) as topfd:
        _prune_empty(topfd)


def _prune_empty(dirfd: int) -> bool:
    """True when ``dirfd`` is empty once its empty subdirectories are gone."""
    empty = True
    with os.scandir(dirfd) as entries:
        found = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    for name, is_dir in found:
        if not is_dir:
            empty = False
            continue
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=dirfd)
        except OSError:
            empty = False
            continue
        try:
            gone = _prune_empty(fd)
        finally:
            os.close(fd)
        if gone:
            try:
                os.rmdir(name, dir_fd=dirfd)
            except OSError:
                empty = False
        else:
            empty = False
    return empty


def walk(top: Top, skip_dir: Callable[[str], bool] | None = None
         ) -> Iterator[tuple[str, list[tuple[str, os.stat_result]], list[tuple[str, os.stat_result]]]]:
    """The tree below ``top``, top-down by descriptors (``os.fwalk``: no link followed, a directory
    swapped for a link is not entered): ``(rel_dir, dirs, entries)`` — ``rel_dir`` POSIX relative
    ("" at the top, else ending in "/"), ``dirs`` the real directories entered next ((name, lstat)),
    ``entries`` everything else ((name, lstat): files, symlinks — to directories too —, FIFOs …).
    ``skip_dir(rel)`` True leaves a directory out (listed in ``entries`` instead, not entered).
    Entries that vanish while it walks are left out."""
    with _top_fd(top) as topfd:
        for dirpath, dirnames, filenames, dirfd in os.fwalk(".", dir_fd=topfd, follow_symlinks=False):
            rel_dir = "" if dirpath == "." else dirpath[2:].replace(os.sep, "/") + "/"
            dirs: list[tuple[str, os.stat_result]] = []
            entries: list[tuple[str, os.stat_result]] = []
            for name in sorted({*dirnames, *filenames}):
                try:
                    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISDIR(st.st_mode) and not (skip_dir is not None and skip_dir(rel_dir + name)):
                    dirs.append((name, st))
                else:
                    entries.append((name, st))
            dirnames[:] = [name for name, _ in dirs]
            yield rel_dir, dirs, entries

