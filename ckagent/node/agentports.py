"""The host-wide registry of ckagent agents' listening ports: what the ``agent`` egress group refuses.

Every agent records the ports it listens on (its status port; at the ``proxy`` egress level its
proxy's listeners) in a small file, and reads every live agent's file: a task of one agent may reach
no agent's port on this host, whoever runs it. One file per agent (JSON, a few hundred bytes)::

    {"ckagent": "agent-ports/1", "pid": 4242, "start": 1234567, "boot": "<boot id>",
     "pidns": "pid:[4026531836]", "ports": [9000, 41234], "workDir": "/opt/ckagent/node/data"}

Where (the first that can be used; readers read all of them that exist):

``agent.ports_registry``   a directory named in the settings: the only one read and written (tests;
                           agents in containers that share the host's network mount one).
``/run/ckagent/ports``     the host-wide registry: owned by root, mode 1777 (sticky: an entry can be
                           removed or replaced only by its owner and root). A root agent creates it;
                           an installer can create it at boot (config/ckagent.tmpfiles, for
                           systemd-tmpfiles). A non-root agent writes there when it exists.
``/tmp/ckagent-ports``     where a non-root agent writes when the host-wide one does not exist (no root
                           agent since boot, no tmpfiles line): mode 1777, made by the first agent.
                           Its owner (not root) could remove other users' entries: on a host shared
                           with untrusted users, create the host-wide one. (Not ``$XDG_RUNTIME_DIR``:
                           mode 0700, so no other user's agent could read it; and a systemd unit with
                           ``PrivateTmp=`` has a /tmp of its own: the host-wide one serves it.)

Hostile or garbled files: the directories are writable by every user, so any local user can plant
files. A planted entry can only add denials, never remove one: an entry's ports are refused when
its process is alive (pid + start time in clock ticks since boot + boot id, read from ``/proc``:
psutil's ``create_time`` follows the wall clock, which a clock step moves, and a live agent must
never look dead), other entries are untouched (the sticky bit), and nothing a file holds can stop
the reader: files are opened without following symlinks and without blocking (a FIFO), only
regular files of at most :data:`MAX_ENTRY_BYTES` are read, anything that is not an entry of the
shape above is skipped (:func:`parse_entry` never raises), and there is no cap on the number of files
(a cap would let a flood hide real entries): a file is read again only when its inode, size or mtime
changed. Entries of dead agents (another boot; the pid gone, a zombie, or a different start time: a
recycled pid) are ignored and their files removed (by whoever may: their owner or root). An entry
from another pid namespace cannot be judged: it counts, and is never removed.

Blocking (a few system calls; a re-read ~10 µs per entry): from a worker thread, or on the loop for
the cached :meth:`PortRegistry.live_ports`. Thread-safe. Errors: writing problems are logged (once
per cause) and leave the entry where it was; nothing here raises to the caller but
:class:`ValueError` for a port outside 1..65535.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckagent.node.procid import ProcessIdentity, boot_id

log = logging.getLogger(__name__)

HOST_DIR = Path("/run/ckagent/ports")
"""The host-wide registry (see the module docstring)."""
FALLBACK_DIR = Path("/tmp/ckagent-ports")
"""Where a non-root agent writes when :data:`HOST_DIR` does not exist."""
FORMAT = "agent-ports/1"
MAX_ENTRY_BYTES = 65536
"""A file larger than this is not an entry (an agent's own entry is a few hundred bytes)."""
MAX_PORTS = 4096
"""The most ports one entry may name (beyond: not an entry)."""
LIVENESS_INTERVAL = 5.0
"""Seconds between liveness checks of the entries when no directory changed."""
RACY_SECONDS = 0.03
"""A directory changed less than this long ago is scanned again at the next call (its mtime is
coarse, one clock tick: ≤ 10 ms; a second change within the same tick would not show)."""
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Entry:
    """One agent's record: its process (``pid``, ``start`` in clock ticks since boot, ``boot`` id,
    ``pidns``), its ``ports``; ``path`` the file it was read from."""

    pid: int
    start: int
    boot: str
    pidns: str
    ports: frozenset[int]
    work_dir: str = ""
    path: str = ""


def parse_entry(data: bytes) -> Entry | None:
    """An entry file's bytes → Entry; None for anything else (garbage, a wrong shape or type, too
    many ports, a port outside 1..65535). Never raises."""
    if len(data) > MAX_ENTRY_BYTES:
        return None
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):  # (UnicodeDecodeError and over-long integers are ValueErrors)
        return None
    if not isinstance(obj, dict) or obj.get("ckagent") != FORMAT:
        return None
    pid, start, boot, pidns, ports = (obj.get(k) for k in ("pid", "start", "boot", "pidns", "ports"))
    work_dir = obj.get("workDir", "")
    if not (_int(pid, 1, 1 << 22) and _int(start, 0, (1 << 63) - 1) and _text(boot) and _text(pidns)
            and isinstance(work_dir, str) and len(work_dir) <= 4096):
        return None
    if not isinstance(ports, list) or len(ports) > MAX_PORTS or not all(_int(p, 1, 65535) for p in ports):
        return None
    assert isinstance(pid, int) and isinstance(start, int) and isinstance(boot, str) and isinstance(pidns, str)
    return Entry(pid, start, boot, pidns, frozenset(ports), work_dir)


def _int(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def _text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 128


@functools.lru_cache(maxsize=1)
def pid_namespace() -> str:
    """This process's pid namespace (``pid:[<inode>]``; "" when unreadable). A process cannot
    change its own (``setns``/``unshare`` change its children's)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def alive(entry: Entry) -> bool | None:
    """True when the entry's process runs (same boot, same pid namespace, same start time, not a
    zombie); False when it provably does not; None when it cannot be told (another pid namespace)."""
    if entry.boot != boot_id():
        return False
    if entry.pidns != pid_namespace():
        return None
    return ProcessIdentity(entry.pid, entry.start, entry.boot).alive()


@dataclass
class _Dir:
    stamp: tuple[int, ...] | None = None
    files: dict[str, tuple[tuple[int, ...], Entry | None]] | None = None


class PortRegistry:
    """This agent's entry in the registry, and the live entries of every agent (see the module
    docstring). ``directory``: ``agent.ports_registry`` (None: the host-wide one, else the fallback);
    ``work_dir`` (the agent's) is written into the entry for people reading it; ``host_dir``,
    ``fallback_dir`` and ``liveness_interval`` (seconds) are parameters for tests. Nothing is written
    before :meth:`register`."""

    def __init__(self, directory: Path | None = None, *, work_dir: Path | None = None,
                 host_dir: Path = HOST_DIR, fallback_dir: Path = FALLBACK_DIR,
                 liveness_interval: float = LIVENESS_INTERVAL) -> None:
        self.configured = directory
        self.host_dir, self.fallback_dir = host_dir, fallback_dir
        self.read_dirs: tuple[Path, ...] = (directory,) if directory is not None else (host_dir, fallback_dir)
        self.work_dir = "" if work_dir is None else str(work_dir)
        self.liveness_interval = liveness_interval
        self.path: Path | None = None
        """The file of this agent's entry (None: not written, or could not be)."""
        self._ports: set[int] = set()
        self._lock = threading.Lock()
        self._dirs = {d: _Dir() for d in self.read_dirs}
        self._seen: frozenset[int] = frozenset()
        self._entries: list[Entry] = []
        self._check_due = float("-inf")
        self._racy = False
        self._warned: set[str] = set()
        self._identity: tuple[int, int, str, str] | None = None

    # ------------------------------------------------------------------ this agent's entry

    @property
    def ports(self) -> frozenset[int]:
        """The ports this agent registered."""
        with self._lock:
            return frozenset(self._ports)

    def register(self, ports: Iterable[int]) -> None:
        """Add ``ports`` to this agent's entry and write it (blocking, ~100 µs: a new file renamed
        over the old one). Raises ValueError for a port outside 1..65535; a directory that cannot be
        written is logged once (the ports are still refused by this agent's own tasks)."""
        wanted = set(ports)
        for port in wanted:
            if not _int(port, 1, 65535):
                raise ValueError(f"not a port: {port!r}")
        with self._lock:
            if wanted <= self._ports and self.path is not None:
                return
            self._ports |= wanted
            self._write()

    def unregister(self, ports: Iterable[int]) -> None:
        """Remove ``ports`` from this agent's entry (blocking; the file goes with the last port). Never raises."""
        with self._lock:
            gone = self._ports & set(ports)
            if not gone:
                return
            self._ports -= gone
            self._write()

    def close(self) -> None:
        """Remove this agent's entry (at its stop; idempotent, never raises)."""
        with self._lock:
            self._ports.clear()
            self._write()

    def _write(self) -> None:
        """Write the entry (or remove it when no port is left). Called with the lock held."""
        if not self._ports:
            self._remove_file()
            return
        if self._identity is None:
            me = ProcessIdentity.of(os.getpid())
            self._identity = (os.getpid(), me.start if me else 0, boot_id(), pid_namespace())
        pid, start, boot, pidns = self._identity
        data = json.dumps({"ckagent": FORMAT, "pid": pid, "start": start, "boot": boot, "pidns": pidns,
                           "ports": sorted(self._ports), "workDir": self.work_dir}).encode()
        problems = []
        for directory in self._write_dirs():
            try:
                fd = self._open_for_writing(directory)
            except OSError as exc:
                problems.append(f"{directory}: {exc.strerror or exc}")
                continue
            try:
                name = self.path.name if self.path is not None and self.path.parent == directory else \
                    f"{os.getuid()}-{pid}-{secrets.token_hex(6)}.json"
                _replace(fd, name, data)
            except OSError as exc:
                problems.append(f"{directory}: {exc.strerror or exc}")
                continue
            finally:
                os.close(fd)
            if self.path is not None and self.path.parent != directory:
                self._remove_file()  # (moved: the host-wide registry appeared)
            self.path = directory / name
            return
        self._warn("write", "agent ports: cannot record this agent's ports %s for the other agents on this host "
                   "(%s); their tasks may reach them", sorted(self._ports), "; ".join(problems) or "nowhere to write")

    def _remove_file(self) -> None:
        if self.path is None:
            return
        with contextlib.suppress(OSError):
            fd = os.open(self.path.parent, _O_DIR)
            try:
                os.unlink(self.path.name, dir_fd=fd)
            finally:
                os.close(fd)
        self.path = None

    def _write_dirs(self) -> list[Path]:
        if self.configured is not None:
            return [self.configured]
        if os.geteuid() == 0:
            return [self.host_dir]
        return [self.host_dir, self.fallback_dir] if _is_dir(self.host_dir) else [self.fallback_dir]

    def _open_for_writing(self, directory: Path) -> int:
        """A descriptor of ``directory`` that is safe to write this agent's entry into (made when
        missing); raises OSError saying why not."""
        host = directory == self.host_dir and self.configured is None
        if not _is_dir(directory):
            if host and os.geteuid() != 0:
                raise OSError(errno.ENOENT, "does not exist")
            _make_shared_dir(directory, parent_mode=0o755 if host else None)
        fd = os.open(directory, _O_DIR)  # (not through a symlink)
        try:
            st = os.fstat(fd)
            shared = st.st_uid != os.geteuid()
            if host and (st.st_uid != 0 or not st.st_mode & stat.S_ISVTX):
                raise OSError(errno.EPERM, "not owned by root with the sticky bit (mode 1777)")
            if shared and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
                raise OSError(errno.EPERM, "writable by others without the sticky bit: anyone could remove entries")
            if host:
                parent = os.stat(directory.parent, follow_symlinks=False)
                if parent.st_uid != 0 or parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                    raise OSError(errno.EPERM, f"{directory.parent} is not root's alone")
            elif shared and st.st_uid != 0:
                self._warn(f"owner {directory}", "agent ports: %s belongs to uid %d, who could remove other agents' "
                           "entries: create %s (see docs/operations.md, Egress)", directory, st.st_uid, self.host_dir)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _warn(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # ------------------------------------------------------------------ every agent's entries

    def live_ports(self) -> frozenset[int]:
        """The ports of every live agent's entry, this agent's included. Cached: the directories are
        looked at (one ``lstat`` each) on every call and scanned again when one changed, and the
        entries' processes checked every :data:`LIVENESS_INTERVAL` seconds. Never raises."""
        with self._lock:
            self._refresh()
            return self._seen | frozenset(self._ports)

    def entries(self) -> list[Entry]:
        """The live (or undecidable) entries, as of the last scan (for /status and logs)."""
        with self._lock:
            self._refresh()
            return list(self._entries)

    def _refresh(self) -> None:
        now = time.monotonic()
        stamps = {d: _stamp(d) for d in self.read_dirs}
        due = now >= self._check_due
        if not self._racy and not due and all(stamps[d] == self._dirs[d].stamp for d in self.read_dirs):
            return
        self._racy = False
        live: list[Entry] = []
        for directory in self.read_dirs:
            state = self._dirs[directory]
            state.stamp = found = stamps[directory]
            if found is None:
                state.files = None
                continue
            if time.time_ns() - found[2] < RACY_SECONDS * 1e9:
                self._racy = True
            live.extend(self._scan(directory, state, due))
        self._entries = live
        self._seen = frozenset(p for e in live for p in e.ports)
        if due:
            self._check_due = now + self.liveness_interval

    def _scan(self, directory: Path, state: _Dir, due: bool) -> list[Entry]:
        """The live entries in ``directory`` (files read again only when they changed; the files of
        dead agents removed, relative to the directory opened). The processes of the entries read
        before are looked at again only when ``due``. Never raises."""
        try:
            fd = os.open(directory, _O_DIR)
        except OSError:
            return []
        old = state.files or {}
        files: dict[str, tuple[tuple[int, ...], Entry | None]] = {}
        live: list[Entry] = []
        own = self.path.name if self.path is not None and self.path.parent == directory else None
        try:
            with os.scandir(fd) as found:
                for item in found:
                    if item.name.startswith("."):  # (a file being written)
                        continue
                    try:
                        st = item.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    key = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                    cached = old.get(item.name)
                    if cached is not None and cached[0] == key:
                        entry, check = cached[1], due
                    else:
                        entry, check = _read_entry(fd, item.name, st.st_size), True
                        if entry is not None:
                            entry = dataclasses.replace(entry, path=str(directory / item.name))
                    if entry is not None and check and item.name != own and alive(entry) is False:
                        with contextlib.suppress(OSError):  # (only its owner and root may)
                            os.unlink(item.name, dir_fd=fd)
                        continue
                    files[item.name] = (key, entry)
                    if entry is not None:
                        live.append(entry)
        except OSError:
            pass
        finally:
            os.close(fd)
        state.files = files
        return live


def _stamp(directory: Path) -> tuple[int, ...] | None:
    try:
        st = os.stat(directory, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _read_entry(dir_fd: int, name: str, size: int) -> Entry | None:
    """The entry in file ``name`` of ``dir_fd``; None when it is not a regular file of at most
    MAX_ENTRY_BYTES (not opened through a symlink, nor waiting on a FIFO) or not an entry."""
    if size > MAX_ENTRY_BYTES:
        return None
    try:
        fd = os.open(name, _O_READ, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_ENTRY_BYTES:
            return None
        data = os.read(fd, MAX_ENTRY_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_entry(data)


def _make_shared_dir(directory: Path, parent_mode: int | None) -> None:
    """Make ``directory`` with mode 1777 (its parent with ``parent_mode`` when missing too)."""
    if parent_mode is not None and not _is_dir(directory.parent):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory.parent, 0o700)
            _chmod_dir(directory.parent, parent_mode)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        return  # (another agent made it meanwhile: it is checked like any other)
    _chmod_dir(directory, 0o1777)


def _chmod_dir(directory: Path, mode: int) -> None:
    fd = os.open(directory, _O_DIR)  # (the directory just made: not a symlink put in its place)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _replace(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``data`` to ``name`` in ``dir_fd`` atomically (a new file renamed over it), mode 0644."""
    temporary = f".{name}.{secrets.token_hex(4)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                 dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, 0o644)  # (whatever the umask: other users' agents read it)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=dir_fd)
        raise
