"""Who builds the spiders' environments, and how a finished one is made read-only (sealed).

Installers (uv, npm, nvm: ckagent.code.installer) run as the node's **builder**
(:class:`Builder`, from ``ckagent.node.identity.Identities.builder``), never as a spider and never
on a spider's code: they read only the dependency files the agent copied out of the project
(ckagent.code.stage), the project's own code is never built or run by them (ckagent.code.pyreqs,
ckagent.code.deps_node), and they get neither a program nor a file a spider chose
(ckagent.code.installenv). What they still run is third-party code: a package's own build or install
script (an sdist's ``setup.py``, an npm package's ``postinstall``) runs as the builder — the supply
chain, whoever publishes a package a spider asks for (docs/operations.md, "Environments and caches").

A finished environment is **sealed** (:func:`seal`): every entry is given to the owner (root when the
agent is root, else the agent's own uid), no entry keeps a write bit (directories 0555, files 0444 or
0555), set-id bits, device files, FIFOs and sockets are dropped, and a file with other hard links is
replaced by a copy of its own. Its marker (ckagent.code.envstore) is written only then: an
environment is ready exactly when it is sealed. The caches (uv's, npm's) and the builder's home are the
builder's, mode 0700: spiders can neither read nor write them.

=============  =================  =============  =============================================
level          builder            finished env   what a spider cannot do / what it still can
=============  =================  =============  =============================================
spider-uids    a uid of its own   root, a-w      write any environment or cache (EACCES), read
               (task.spider_uids)                the caches; it can read an environment whose
                                                 path it knows (envs/ is 0711: not listable)
one-user       that user          root, a-w      write a finished environment; it can write the
                                                 caches and builds in flight (the builder's uid
                                                 is its own): a later build may be poisoned
agent-user     the agent's uid    the agent's,   write by mistake (EACCES); it owns every file,
                                  a-w            so ``chmod`` gives the write back: nothing holds
root           root               root, a-w      nothing: root ignores the mode bits
=============  =================  =============  =============================================

Every function here blocks (walks, chown, chmod): call it through ``trio.to_thread``. Errors are
OSError as the system calls raise them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import psutil

from ckagent.node.procid import ProcessIdentity, boot_id, scanned
from ckagent.node.runas import RunAs, own_copy, popen_identity

log = logging.getLogger(__name__)

__all__ = ["Builder", "Sealed", "StillWritten", "make_writable", "read_only_hint", "remove_tree", "seal",
           "sealed_by", "writable_by_others", "writers"]

HOME_NAME = "builder-home"
"""The builder's HOME (and TMPDIR below it) in the work dir, when its identity names none of its own."""


@dataclass(frozen=True)
class Builder:
    """Who runs the installers (``run_as``; None: the agent itself), their HOME (``home``, with ``tmp``
    below it as TMPDIR) and who owns a finished environment (``owner``: uid and gid; root's when the
    agent is root)."""

    run_as: RunAs | None
    home: Path
    owner: tuple[int, int]

    @classmethod
    def of(cls, run_as: RunAs | None, work_dir: Path) -> Builder:
        """The builder running as ``run_as`` (None: the agent) on the node whose work dir is ``work_dir``:
        HOME is the identity's own when it has one of the node's (a dedicated uid), else
        ``work_dir/builder-home``."""
        home = Path(run_as.home) if run_as is not None and run_as.dynamic else work_dir / HOME_NAME
        euid = os.geteuid()
        return cls(run_as, home, (0, 0) if euid == 0 else (euid, os.getegid()))

    @property
    def uid(self) -> int:
        """The uid installers run as."""
        return self.run_as.uid if self.run_as is not None else os.geteuid()

    @property
    def gid(self) -> int:
        """The gid installers run as."""
        return self.run_as.gid if self.run_as is not None else os.getegid()

    @property
    def own_uid(self) -> int | None:
        """The builder's uid when it is its own (a dedicated uid at ``spider-uids``: not root's, not the
        agent's, not a passwd user's every spider shares); else None."""
        if self.run_as is None or not self.run_as.dynamic or self.run_as.uid in (0, os.geteuid()):
            return None
        return self.run_as.uid

    @property
    def identity(self) -> str:
        """The builder's part of an environment's key: who built it and who owns it sealed. A change of
        either (another level, another builder uid) builds new environments; the old ones are collected."""
        return f"sealed:builder={self.uid}:{self.gid},owner={self.owner[0]}:{self.owner[1]}"

    def describe(self) -> str:
        """One phrase for logs: ``uid 61184 (ck-61184)``, ``the agent's own uid 1000``."""
        if self.run_as is None:
            return f"the agent's own uid {os.geteuid()}"
        return f"uid {self.run_as.uid} ({self.run_as.name})"

    def env(self) -> dict[str, str]:
        """HOME, TMPDIR, USER and LOGNAME of the installers (they replace the task's and the agent's)."""
        name = self.run_as.name if self.run_as is not None else os.environ.get("USER", str(os.geteuid()))
        return {"HOME": str(self.home), "TMPDIR": str(self.home / "tmp"), "USER": name, "LOGNAME": name}

    def own(self, path: Path, *, fresh: bool = False) -> bool:
        """Make ``path`` a directory of the builder's, mode 0700 (its parents made as the agent's). A
        directory someone else owns (a cache an older agent or another user filled) is emptied first
        when ``fresh``, else given whole (ckagent.node.runas.RunAs.chown_tree: no link followed).
        Returns True when it changed hands."""
        path.mkdir(parents=True, exist_ok=True)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{path} is not a directory")
        changed = (st.st_uid, st.st_gid) != (self.uid, self.gid)
        if os.geteuid() != 0 and st.st_uid != os.geteuid():
            return False  # not the agent's to take (a shared cache a non-root agent may only write into)
        if changed:
            if fresh:
                for entry in list(os.scandir(path)):
                    if entry.is_dir(follow_symlinks=False):
                        remove_tree(Path(entry.path))
                    else:
                        os.unlink(entry.path)
            if self.run_as is not None:
                self.run_as.chown_tree(path)
            elif os.geteuid() == 0:
                os.lchown(path, self.uid, self.gid)
        os.chmod(path, 0o700)
        return changed

    def cannot_run(self, argv: list[str], env: dict[str, str]) -> str | None:
        """Why the builder cannot run ``argv`` (None: it ran and exited 0). Blocking: one short process
        (30 s at most), as the builder, in its home."""
        try:
            done = subprocess.run(argv, capture_output=True, timeout=30, check=False, stdin=subprocess.DEVNULL,
                                  cwd=self.home, env=env, **popen_identity(self.run_as))
        except subprocess.TimeoutExpired:
            return "it did not answer within 30 s"
        except OSError as exc:
            return exc.strerror or str(exc)
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
            return tail[0][:300]
        return None

    def prepare_home(self) -> None:
        """The builder's HOME and its TMPDIR, made and given to it (mode 0700)."""
        self.own(self.home)
        self.own(self.home / "tmp")

    def give_top(self, env_dir: Path) -> None:
        """Give the (new, empty but for staged files) environment directory to the builder, mode 0700:
        it builds there; no spider sees a half-built environment."""
        if self.run_as is not None:
            os.chown(env_dir, self.uid, self.gid)
        os.chmod(env_dir, 0o700)


@dataclass
class Sealed:
    """What :func:`seal` did: entries made read-only (``entries``), their bytes (``size_bytes``, hard links
    counted once), files with other hard links replaced by a copy (``copied``), special files and set-id
    bits dropped (``dropped``)."""

    entries: int = 0
    size_bytes: int = 0
    copied: int = 0
    dropped: int = 0


_FILE_MODE = 0o444
_EXEC_MODE = 0o555
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def seal(path: Path, owner: tuple[int, int], *, top: bool = True) -> Sealed:
    """Make the tree at ``path`` read-only for everyone and ``owner``'s (see module docstring).

    Walked top-down by descriptor: each directory is taken first (given to ``owner``, mode 0755: only
    the owner may change its entries from then on), then its entries are sealed, then it is made 0555
    — so a process of the builder still alive (it should not be: its box was emptied) cannot slip a
    new entry in behind the walk. Every entry is opened ``O_PATH | O_NOFOLLOW`` and changed through
    that descriptor (an entry swapped for a link meanwhile is the link, never what it names; a link is
    given itself). ``top``: the top directory made 0555 too (else it stays 0755, the owner's: the
    caller writes the marker, then :func:`seal_top`). Ownership changes only when the agent is root.
    Blocking. Raises OSError."""
    chown = os.geteuid() == 0
    done = Sealed()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _seal_dir(fd, owner, chown, done, set(), depth=0)
        if top:
            os.fchmod(fd, _EXEC_MODE)
    finally:
        os.close(fd)
    return done


_MAX_DEPTH = 200
"""Deeper than any environment (node_modules nests a few dozen levels): a deeper tree is refused."""


def _take_dir(fd: int, owner: tuple[int, int], chown: bool) -> None:
    """Give the open directory ``fd`` to ``owner`` with mode 0755 (its entries are the owner's to change)."""
    st = os.fstat(fd)
    if chown and (st.st_uid, st.st_gid) != owner:
        os.fchown(fd, *owner)
    if stat.S_IMODE(st.st_mode) != 0o755:
        os.fchmod(fd, 0o755)


def _seal_dir(fd: int, owner: tuple[int, int], chown: bool, done: Sealed, seen: set[tuple[int, int]], *,
              depth: int) -> None:
    """Seal the open directory ``fd`` and everything below it (see :func:`seal`); its own mode stays 0755."""
    if depth > _MAX_DEPTH:
        raise OSError(errno.ELOOP, f"an environment deeper than {_MAX_DEPTH} directories")
    _take_dir(fd, owner, chown)
    for name in sorted(os.listdir(fd)):
        try:
            entry = os.open(name, _PATH_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            continue
        try:
            st = os.fstat(entry)
            if stat.S_ISDIR(st.st_mode):
                os.close(entry)
                entry = -1
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                try:
                    _seal_dir(sub, owner, chown, done, seen, depth=depth + 1)
                    os.fchmod(sub, _EXEC_MODE)
                finally:
                    os.close(sub)
                done.entries += 1
                continue
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and (st.st_dev, st.st_ino) not in seen:
                # Another name of this file may lie outside the tree (a cache's, anyone's): sealed, it
                # would be sealed too, and whoever writes it there would write the environment.
                os.close(entry)
                entry = -1
                own_copy(name, fd)
                done.copied += 1
                entry = os.open(name, _PATH_FLAGS, dir_fd=fd)
            _seal_entry(name, fd, entry, owner, chown, done, seen)
        finally:
            if entry >= 0:
                os.close(entry)


def _seal_entry(name: str, dirfd: int, fd: int, owner: tuple[int, int], chown: bool, done: Sealed,
                seen: set[tuple[int, int]]) -> None:
    """Seal one entry that is not a directory, opened ``O_PATH`` as ``fd`` (see :func:`seal`)."""
    st = os.fstat(fd)
    if stat.S_ISLNK(st.st_mode):
        if chown and (st.st_uid, st.st_gid) != owner:
            os.chown(name, owner[0], owner[1], dir_fd=dirfd, follow_symlinks=False)
        done.entries += 1
        return
    if not stat.S_ISREG(st.st_mode):  # a device, a FIFO, a socket: no place in an environment
        os.unlink(name, dir_fd=dirfd)
        done.dropped += 1
        return
    first = (st.st_dev, st.st_ino) not in seen
    seen.add((st.st_dev, st.st_ino))
    mode = stat.S_IMODE(st.st_mode)
    wanted = _EXEC_MODE if mode & 0o111 else _FILE_MODE
    if first:
        done.size_bytes += st.st_blocks * 512
    if mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX):
        done.dropped += 1
    proc = f"/proc/self/fd/{fd}"  # the inode opened above, whatever the name holds now
    if chown and (st.st_uid, st.st_gid) != owner:
        os.chown(proc, *owner)
    if mode != wanted:
        os.chmod(proc, wanted)
    done.entries += 1


class StillWritten(OSError):
    """A process of the builder still held a file of a sealed environment open for writing (it was killed;
    the environment is not used: its next build starts from nothing)."""


def writers(path: Path, uid: int) -> list[ProcessIdentity]:
    """Processes running as ``uid`` (effective) that hold a file below ``path`` open for writing, or
    mapped shared and writable: the seal changes modes, not descriptors already open. Their
    identities as the scan saw them (ckagent.node.procid: a kill proves each first). Root reads every
    process's /proc entries (through psutil). Blocking (one scan). Never raises."""
    prefix = os.path.realpath(path).rstrip("/") + "/"
    found: list[ProcessIdentity] = []
    me, boot, booted = os.getpid(), boot_id(), psutil.boot_time()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.uids().effective != uid or not _writes_below(proc, prefix):
                continue
        except (psutil.Error, OSError):
            continue
        identity = scanned(proc, boot, booted)
        if identity is not None:
            found.append(identity)
    return found


def _writes_below(proc: psutil.Process, prefix: str) -> bool:
    """Whether ``proc`` holds a regular file below ``prefix`` open for writing or maps one shared and
    writable. Raises psutil.Error (gone, not readable)."""
    for opened in proc.open_files():
        if opened.path.startswith(prefix) and opened.flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR):
            return True
    for mapped in proc.memory_maps(grouped=False):
        perms = mapped.perms
        if len(perms) >= 4 and perms[1] == "w" and perms[3] == "s" and mapped.path.startswith(prefix):
            return True
    return False


def seal_top(path: Path, owner: tuple[int, int]) -> None:
    """The last step of :func:`seal` with ``top=False``: the top directory given to ``owner`` (when the
    agent is root) and made 0555. Raises OSError (a top that is not a directory: ENOTDIR)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    if os.geteuid() == 0 and (st.st_uid, st.st_gid) != owner:
        os.lchown(path, *owner)
    os.chmod(path, _EXEC_MODE)


def sealed_by(path: Path, owner: tuple[int, int]) -> bool:
    """Whether the top of ``path`` is sealed for ``owner``: a directory it owns (when the agent is root)
    with no write bit. One lstat; never raises."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o222:
        return False
    return os.geteuid() != 0 or (st.st_uid, st.st_gid) == owner


def make_writable(path: Path) -> None:
    """Give the owner back the write bit of every directory of the tree at ``path`` (top included, no
    link followed), so that it can be removed by an owner that is not root. Never raises."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return
        if not st.st_mode & stat.S_IWUSR:
            os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_IRWXU)
        for _dirpath, dirnames, _files, dirfd in os.fwalk(path, follow_symlinks=False):
            for name in dirnames:
                with contextlib.suppress(OSError):
                    sub = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                    if stat.S_ISDIR(sub.st_mode) and not sub.st_mode & stat.S_IWUSR:
                        os.chmod(name, stat.S_IMODE(sub.st_mode) | stat.S_IRWXU, dir_fd=dirfd)


def remove_tree(path: Path) -> None:
    """Remove the tree at ``path`` (a sealed one too: a non-root owner gets its write bits back
    first). A link at ``path`` is removed itself. Never raises for what vanished meanwhile; other
    errors are left (the directory stays, collection tries again)."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    if os.geteuid() != 0:
        make_writable(path)
    shutil.rmtree(path, ignore_errors=True)


def writable_by_others(path: Path, trusted: set[int]) -> str | None:
    """Why a uid outside ``trusted`` could change what ``path`` names (None: it cannot): ``path`` and
    every directory above it must belong to a trusted uid and have no group or other write bit (a
    sticky other-writable directory counts: a link in it could be replaced by its owner). For a
    directory, everything below it too. Blocking (a walk for a directory). Never raises."""
    try:
        real = Path(os.path.realpath(path))
        for item in (real, *real.parents):
            why = _loose(item, trusted)
            if why is not None:
                return why
        if real.is_dir():
            for dirpath, dirnames, filenames in os.walk(real):
                for name in (*dirnames, *filenames):
                    why = _loose(Path(dirpath) / name, trusted)
                    if why is not None:
                        return why
    except OSError as exc:
        return f"{path} cannot be checked ({exc.strerror or exc})"
    return None


def _loose(item: Path, trusted: set[int]) -> str | None:
    st = os.lstat(item)
    if stat.S_ISLNK(st.st_mode):
        return None  # a link's own mode means nothing; what it names is checked where it is reached
    if st.st_uid not in trusted:
        return f"{item} belongs to uid {st.st_uid}"
    # A sticky directory (/tmp) lets no one rename or remove an entry it does not own: the entry's own
    # owner, checked as the next component, is what counts.
    if st.st_mode & 0o022 and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        return f"{item} is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


_DENIED = re.compile(r"(Permission denied|EACCES|Read-only file system|EROFS|Operation not permitted|EPERM)")
_ENV_PATH = re.compile(r"(/envs/(?:py|node)-[0-9a-f]+|site-packages|node_modules)")
READ_ONLY_HINT = (
    "the spider wrote into its environment, which is read-only (built by the node's builder and shared with "
    "every spider whose project declares the same): declare dependencies in the project's files "
    "(requirements.txt, pyproject.toml, package.json with its lock) instead of installing them at run time, and "
    "let a tool download into the spider's HOME or CK_DATA_DIR (docs/operations.md, Environments and caches)")
"""What the task log says when a failed spider's last output shows a refused write into its environment."""


def read_only_hint(output: str) -> str | None:
    """:data:`READ_ONLY_HINT` when ``output`` (the last lines of a failed spider's output) has a refused
    write (EACCES, EROFS, EPERM) on a line naming its environment (``envs/py-…``, ``site-packages``,
    ``node_modules``); None otherwise."""
    for line in output.splitlines():
        if _DENIED.search(line) and _ENV_PATH.search(line):
            return READ_ONLY_HINT
    return None
