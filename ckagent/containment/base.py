"""The common interface of the containment levels, and the kernel helpers they share.

A :class:`Containment` is the node's level (one per agent); a :class:`TaskJail` holds one task's
processes (its installers and its spider). Exceptions::

    Exception
    └── ContainmentError     a forced level cannot be used here, or a task's cgroup cannot be made;
                             the message says what was tried and how to fix it
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import shlex
import shutil
import signal
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ckagent.node.levels import Blocker, ContainmentLevel, LevelError, Unavailable
from ckagent.node.procid import ProvenProcess
from ckagent.node.procid import is_zombie as is_zombie

log = logging.getLogger(__name__)

SPIDER_OOM_SCORE_ADJ = 500
"""oom_score_adj of every task process (GitHub's runner uses +500): the kernel's OOM killer picks a
spider before the agent or anything else on the node."""

AGENT_OOM_SCORE_ADJ = -500
"""oom_score_adj the agent gives itself where it may (root / CAP_SYS_RESOURCE)."""


class ContainmentError(LevelError):
    """A containment level cannot be used (forced level unavailable, cgroup not writable), or a task's
    cgroup cannot be made. ``blocker`` says why in a word (:class:`ckagent.node.levels.Blocker`), the
    message in full."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one task: ``memory_bytes`` (bytes), ``pids`` (processes+threads),
    ``cpus`` (cores, may be fractional); None = no limit."""

    memory_bytes: int | None = None
    pids: int | None = None
    cpus: float | None = None

    def describe(self) -> str:
        """``memory 200 MiB, pids 64, cpus 1.5`` (or ``none``)."""
        parts = []
        if self.memory_bytes is not None:
            parts.append(f"memory {format_bytes(self.memory_bytes)}")
        if self.pids is not None:
            parts.append(f"pids {self.pids}")
        if self.cpus is not None:
            parts.append(f"cpus {self.cpus:g}")
        return ", ".join(parts) or "none"


@dataclass
class Figures:
    """What one task used, as the kernel counted it (None = this level cannot tell).

    ``cpu_seconds`` user + system of every process of the task; ``memory_peak_bytes``;
    ``pids_peak`` most processes+threads at once; ``io_read_bytes``/``io_write_bytes`` block I/O;
    ``oom_kills`` processes the OOM killer killed in the task (None = unknown).
    """

    cpu_seconds: float | None = None
    memory_peak_bytes: int | None = None
    pids_peak: int | None = None
    io_read_bytes: int | None = None
    io_write_bytes: int | None = None
    oom_kills: int | None = None

    def to_json(self) -> dict[str, Any]:
        """camelCase, None left out (for /status and the result)."""
        out = {"cpuSeconds": None if self.cpu_seconds is None else round(self.cpu_seconds, 3),
               "memoryPeakBytes": self.memory_peak_bytes, "pidsPeak": self.pids_peak,
               "ioReadBytes": self.io_read_bytes, "ioWriteBytes": self.io_write_bytes}
        return {k: v for k, v in out.items() if v is not None}


class TaskJail(abc.ABC):
    """Holds every process of one task (see the level modules). All methods are safe to call more
    than once; "already gone" is never an error.

    Use: ``spawn_options()`` into every ``Popen`` of the task (so each child joins before it execs),
    ``watch(pid)`` with the main process, ``kill_all()`` at the end, ``figures()`` then ``close()``.
    """

    level: ContainmentLevel
    limits: Limits = Limits()
    task_id: str = ""

    def join_paths(self) -> list[Path]:
        """The ``cgroup.procs`` files a process of the task writes "0" to (none at the last level)."""
        return []

    def join_fds(self) -> list[int]:
        """The same files opened by the agent (O_WRONLY), for a ``preexec_fn`` after setuid."""
        return []

    def v2_path(self) -> Path | None:
        """The task's cgroup directory in the cgroup v2 tree (what egress rules match), or None."""
        return None

    def spawn(self, argv: list[str], env: Mapping[str, str], *, forking: bool = False) -> tuple[list[str], dict[str, Any]]:
        """``(argv, Popen keyword arguments)`` that start ``argv`` inside the jail: the new process
        joins the task's cgroups and raises its oom_score_adj **before** it execs ``argv``.

        ``forking`` True when Popen forks anyway (``user=``/``group=`` given, i.e. ``run_as``): a
        ``preexec_fn`` writing to :meth:`join_fds` then costs nothing extra and works after setuid.
        Otherwise a ``/bin/sh`` shim does it and execs the command: Popen keeps its vfork spawn
        (a ``preexec_fn`` forces a fork of the whole agent, several ms; bench/containment.py).
        Raises FileNotFoundError/PermissionError, as Popen would, when ``argv[0]`` cannot be run.
        """
        if forking or not os.access(SHELL, os.X_OK):  # no /bin/sh (a distroless image): pay the fork
            return argv, {"preexec_fn": make_preexec(self.join_fds())}
        program = _resolve(argv[0], env.get("PATH"))
        return [SHELL, "-c", shim_script(self.join_paths()), program, *argv[1:]], {}

    def watch(self, pid: int) -> None:
        """Record a main process this agent just spawned (its child, not reaped yet: its pid is
        certainly its own); its process group is the task's at the process-group level."""
        return  # nothing to do by default

    def adopt(self, leader: ProvenProcess) -> None:
        """Record the main process of a task an earlier agent started, proven (ckagent.node.procid):
        its group is reached only through it, only while it lives; the jail does not own it (the
        caller closes it). Nothing to do where a cgroup holds the task."""
        return  # nothing to do by default

    @abc.abstractmethod
    def populated(self) -> bool:
        """True while any process of the task lives (zombies do not count)."""

    @abc.abstractmethod
    async def wait_empty(self) -> None:
        """Return when no process of the task is left, woken by the kernel (cgroup.events ``populated``
        via inotify, or pidfds), not by sleeping; once it returned, :meth:`kill_all` has nothing to do.
        Cancellation: returns nothing, as usual."""

    @abc.abstractmethod
    async def kill_all(self) -> int:
        """SIGKILL every process of the task, forks racing the kill included, and wait until none is
        left (bounded; a process stuck in the kernel is logged and given up). Returns how many
        processes were killed (-1 = unknown count, e.g. cgroup.kill). Cancellation: callers shield it."""

    def figures(self) -> Figures:
        """Sample the task's resource figures now (before :meth:`close`)."""
        return Figures()

    def memory_now(self) -> tuple[int, str] | None:
        """(bytes, what they are) of the task's memory now: the figure its soft memory ceiling is held
        to (ckagent.task.memwatch); None when this level cannot tell. Blocking (small reads)."""
        return None

    def close(self) -> None:
        """Remove the task's cgroups (they must be empty). Never raises."""
        return  # nothing to do by default


class Containment(abc.ABC):
    """The node's containment level. ``level`` the level; ``details`` one line for the log and
    /status; ``can_limit`` the controllers limits work with (subset of memory, pids, cpu);
    ``passed_over`` the stronger levels this node did not get, each with why (set by
    :func:`ckagent.containment.open_containment`); ``privacy`` the tasks' private /tmp, /dev/shm and
    /proc (set by the agent at start: :func:`ckagent.containment.private.open_privacy`; None: TMPDIR only)."""

    level: ContainmentLevel
    details: str = ""
    can_limit: frozenset[str] = frozenset()
    passed_over: tuple[Unavailable, ...] = ()
    privacy: Any = None  # a ckagent.containment.private.Privacy (that module imports this one)

    @abc.abstractmethod
    def jail(self, task_id: str, limits: Limits) -> TaskJail:
        """Create the jail of a task (blocking but quick: a few mkdir/write in cgroupfs).
        Raises ContainmentError when its cgroup cannot be created."""

    @abc.abstractmethod
    async def recover(self, task_id: str, pgid: int | None) -> int:
        """Crash recovery: kill every leftover process of a task the state store lists as running
        when the agent died; ``pgid`` is its recorded process group (None = unknown/stale).
        Returns how many processes were killed (-1 = unknown)."""

    async def sweep_stale(self, keep: set[str] | None = None) -> int:
        """At start, before any task: kill and remove leftover task cgroups of this agent (a crash
        between creating one and recording the task), but not those of the task ids in ``keep``
        (re-adopted tasks). Returns how many cgroups were removed."""
        return 0

    def v2_group(self) -> Path | None:
        """The v2 directory holding this agent's task cgroups (for egress rules), or None."""
        return None

    def to_json(self) -> dict[str, Any]:
        """``{"level", "details", "limits"}`` for registration and /status, and ``privateTmp``
        (:meth:`Privacy.to_json <ckagent.containment.private.Privacy.to_json>`) once it is known."""
        out = {"level": self.level.value, "details": self.details, "limits": sorted(self.can_limit)}
        return out if self.privacy is None else {**out, "privateTmp": self.privacy.to_json()}

    def close(self) -> None:
        """Release what the level holds (the per-agent cgroup directory if empty). Never raises."""
        return  # nothing to do by default


# ------------------------------------------------------------------------------------- helpers


def format_bytes(n: int) -> str:
    """1536 → ``1.5 KiB``; exact MiB/GiB are shown without decimals."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


_libc: Any = None


def libc() -> Any:
    """The C library (ctypes), loaded once."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36


SHELL = "/bin/sh"


def join_lines(join: list[Path], oom_score_adj: int = SPIDER_OOM_SCORE_ADJ) -> list[str]:
    """The shell lines every task process runs before anything else (the spawn shim's, the monitor's:
    ckagent.containment.monitor): join each cgroup (exit 126 with a message if one refuses), then
    raise oom_score_adj (best effort)."""
    lines = [f"echo 0 >{shlex.quote(str(path))} || {{ echo 'ckagent: cannot join the task cgroup "
             f"{shlex.quote(str(path.parent))}' >&2; exit 126; }}" for path in join]
    lines.append(f"echo {oom_score_adj} >/proc/self/oom_score_adj 2>/dev/null")
    return lines


def shim_script(join: list[Path], oom_score_adj: int = SPIDER_OOM_SCORE_ADJ) -> str:
    """The shell script of the spawn shim: :func:`join_lines`, then exec the command ("$0" "$@")."""
    return "\n".join([*join_lines(join, oom_score_adj), 'exec "$0" "$@"'])


def _resolve(program: str, path: str | None) -> str:
    """``program`` as a path the shim can exec; raises the OSError Popen would have raised."""
    if "/" in program:
        found: str | None = program
    else:
        found = shutil.which(program, path=path if path is not None else os.defpath)
    if found is None or not os.path.exists(found):
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    if os.path.isdir(found) or not os.access(found, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
    return found


def make_preexec(join_fds: list[int], oom_score_adj: int | None = SPIDER_OOM_SCORE_ADJ) -> Callable[[], None]:
    """The function a task's child runs between fork and exec: write "0" (= "me") to every
    ``cgroup.procs`` fd in ``join_fds`` (opened by the agent, so it works after setuid too), then
    raise its own oom_score_adj. Runs in the forked child: no locks, no logging, nothing allocated
    beyond a few bytes. A failed join raises, so the child never runs outside its cgroup (Popen
    reports the error as the spawn's OSError).

    After a setuid (Popen's ``user=``) the child is not dumpable — the agent is not, and a credential
    change keeps it so — and its /proc files are root's: the oom_score_adj write fails then, and the
    caller raises it from the agent after the spawn (:func:`raise_oom_score_adj`). The child is never
    made dumpable: until its exec it holds a copy of the agent's memory (its credentials), which a
    process of the same uid — another spider at ``one-user`` — could read while it is."""

    def preexec() -> None:
        for fd in join_fds:
            os.write(fd, b"0")
        if oom_score_adj is not None:
            try:
                fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            except OSError:
                return
            try:
                os.write(fd, str(oom_score_adj).encode())
            except OSError:
                pass
            finally:
                os.close(fd)

    return preexec


def raise_oom_score_adj(pid: int, value: int = SPIDER_OOM_SCORE_ADJ) -> None:
    """Set a task process's oom_score_adj from the agent (root may set any process's), for a child
    started under another identity that could not set its own (:func:`make_preexec`). Best effort:
    a process already gone, or an agent that may not, is no error. Blocking but tiny."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/oom_score_adj", "w") as fh:
        fh.write(str(value))


def lower_own_oom_score_adj(value: int = AGENT_OOM_SCORE_ADJ) -> int | None:
    """Lower the agent's own oom_score_adj to ``value`` where it may (root). Returns the value in
    force afterwards, or None when /proc cannot tell."""
    path = Path("/proc/self/oom_score_adj")
    try:
        current = int(path.read_text())
    except (OSError, ValueError):
        return None
    if current > value:
        with contextlib.suppress(OSError):
            path.write_text(str(value))
            current = value
    return current


def set_child_subreaper(on: bool = True) -> bool:
    """Make the agent the child subreaper of its descendants (orphans re-parent to it, not to
    init; it must reap them), or stop being it. Returns False where prctl refuses."""
    return libc().prctl(PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0) == 0


def read_text(path: Path) -> str | None:
    """The file's text, or None when it is missing/unreadable."""
    try:
        return path.read_text()
    except OSError:
        return None


def read_int(path: Path) -> int | None:
    """The integer in a one-line cgroup file, or None (missing, unreadable, "max")."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def rss_bytes(pids: list[int]) -> int:
    """The resident set sizes of ``pids`` summed (/proc/<pid>/statm; a process gone meanwhile counts 0;
    shared pages count in each process). Blocking (small reads)."""
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_BYTES
        except (OSError, ValueError, IndexError):
            continue
    return total


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def read_keyed(path: Path) -> dict[str, int]:
    """``key value`` lines (cpu.stat, memory.events, memory.oom_control) as a dict; {} if missing."""
    out: dict[str, int] = {}
    for line in (read_text(path) or "").splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[key] = int(value)
    return out


def read_procs(path: Path) -> list[int]:
    """The pids in a ``cgroup.procs`` file ([] when the cgroup is gone)."""
    return [int(p) for p in (read_text(path) or "").split()]


NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
"""The errnos that say a cgroup directory is not the agent's to write (not an error of the moment)."""


@contextlib.contextmanager
def throwaway_cgroup(parent: Path) -> Iterator[Path]:
    """A child cgroup of ``parent`` for the duration of the block (``ckagent-check-<pid>-<hex>``: never
    an agent's), removed on leaving, also on an error or a cancel (it must be empty by then). For the
    checks that judge a level without changing the machine. Blocking (a mkdir, an rmdir). Raises
    ContainmentError when it cannot be made: blocker CGROUP_NOT_WRITABLE when ``parent`` is not this
    process's to write, else FAILED."""
    path = parent / f"ckagent-check-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError as exc:
        raise ContainmentError(f"cannot create a cgroup below {parent}: {exc.strerror or exc}",
                               Blocker.CGROUP_NOT_WRITABLE if exc.errno in NOT_WRITABLE else Blocker.FAILED) from exc
    try:
        yield path
    finally:
        if not rmdir_quietly(path):
            log.warning("cannot remove the check's cgroup %s: remove it by hand (rmdir)", path)


def rmdir_quietly(path: Path) -> bool:
    """Remove an (empty) cgroup directory; True when it is gone."""
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError as exc:
        log.debug("cannot remove cgroup %s: %s", path, exc)
        return False
    return True


async def wait_pids_gone(pids: Iterable[int]) -> None:
    """Wait until every process of ``pids`` has exited, by their pidfds (kernel notifications: a
    pidfd becomes readable when its process exits). Processes already gone count as gone."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                raise
    try:
        for fd in fds:
            await trio.lowlevel.wait_readable(fd)
    finally:
        for fd in fds:
            os.close(fd)


def kill_pids(pids: Iterable[int], members: Callable[[], Iterable[int]], sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to each of ``pids`` (read from a cgroup's ``cgroup.procs``) that is still a member
    when proven: its pidfd is opened first, then ``members()`` (the cgroup's processes now) read
    again — a pid listed then names the process the pidfd holds, so the signal (through the pidfd)
    never reaches a process that took a pid the first read saw (ckagent.node.procid's rule, for a
    cgroup's scan). Returns how many were signalled. Without pidfds (Linux < 5.3): by pid after the
    same second read (racy; the cgroup is frozen meanwhile where it can be)."""
    fds: dict[int, int] = {}
    unpinned: list[int] = []
    for pid in pids:
        try:
            fds[pid] = os.pidfd_open(pid)
        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                unpinned.append(pid)
    n = 0
    try:
        now = set(members())
        for pid, fd in fds.items():
            if pid in now:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    signal.pidfd_send_signal(fd, sig)
                    n += 1
        for pid in unpinned:
            if pid in now:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
                    n += 1
    finally:
        for fd in fds.values():
            os.close(fd)
    return n


