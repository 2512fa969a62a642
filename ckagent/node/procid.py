"""One proven process identity: what the agent must hold before it signals, watches, kills or adjusts
a process it did not just start (after a restart above all).

A pid alone names nothing for good: once its process has been reaped the kernel may hand the number
to any other program (docs/operations.md; design.md "Prove before you act"). A process is named by
:class:`ProcessIdentity` — (boot id, pid, start time in clock ticks since boot), read through psutil —
and acted on only through a :class:`ProvenProcess`: a pidfd opened **first**, the identity checked
**after** (:meth:`ProcessIdentity.prove`). If the pid named a stranger when the pidfd was opened, the
stranger started later than the recorded start time and the check fails; if it named our process,
the pidfd refers to it for good (a pidfd is bound to a process, not to a number), whatever happens to
the number afterwards.

What the proven process allows:

====================================  ====================================================================
``send_signal(sig)``                  through the pidfd (``pidfd_send_signal``): never a stranger
``exited()`` / ``await wait()``       the pidfd is readable once the process has exited (zombie or gone)
``signal_group(sig)``                 ``killpg`` only while the leader lives: a living process holds its
                                      number, so the group of that number is its own; refused after
``set_oom_score_adj(value)``          the /proc file is opened first, then the process proven alive: the
                                      open file is bound to the process it named when opened
``read_proc(name)``                   the same for reading (``environ``, ``cgroup``)
====================================  ====================================================================

Kernels without pidfds (Linux < 5.3) get the identity check alone (racy; logged once).

Errors: nothing here raises for a process that is gone or not ours (None / False instead); OSError
only for what says the machine is unusable (no /proc). Everything is blocking but tiny (a few small
/proc reads): from the event loop where a single check is made, in a worker thread for many.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil
import trio

log = logging.getLogger(__name__)

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_BOOT_ID: str | None = None
_NO_PIDFD_LOGGED = False


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``; "" when unreadable). Read once."""
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            _BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            _BOOT_ID = ""
    return _BOOT_ID


def _facts(pid: int) -> tuple[int, str] | None:
    """(start ticks since boot, psutil status) of ``pid`` now; None when there is none."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            created, status = proc.create_time(), proc.status()
        boot = psutil.boot_time()  # (what create_time added: the ticks come back exact)
    except (psutil.Error, OSError):
        return None
    return round((created - boot) * _CLOCK_TICKS), status


def scan_stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start ticks since boot, state letter) of ``pid`` from one read of
    ``/proc/<pid>/stat``; None when there is none. For scans of every process of the node (the
    process-group sweep), where psutil doubles the cost (measured: 2.2 → 4.4 ms for 116 processes):
    the one hand-read of a start time, here beside the type it feeds."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if len(fields) <= 19 or not fields[1].isdigit() or not fields[19].isdigit():
        return None
    return int(fields[1]), int(fields[19]), fields[0].decode("ascii", "replace")


def children(pid: int, *, every_thread: bool = False) -> list[int]:
    """The pids of ``pid``'s children (``/proc/<pid>/task/<tid>/children``: the main thread's, or
    ``every_thread``'s — orphans re-parented to a subreaper hang under any of its threads); [] when
    there is none or ``pid`` is gone. A scan's fact, not a proof: prove before acting on one."""
    tids = [pid]
    if every_thread:
        try:
            tids = [int(tid) for tid in os.listdir(f"/proc/{pid}/task") if tid.isdigit()]
        except OSError:
            return []
    found: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                found.extend(int(child) for child in fh.read().split())
        except (OSError, ValueError):
            continue
    return found


def has_environ_entry(pid: int, entry: bytes) -> bool:
    """True when ``entry`` (``NAME=value``) is one of the variables ``pid`` was started with
    (``/proc/<pid>/environ``); False when it is not, the process is gone, a zombie (it reads empty)
    or not ours to read. For the process-group sweep's marker (psutil's ``environ()`` decodes every
    variable into a dict: the scan reads each process's environ once and looks for one entry)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            data = fh.read()
    except OSError:
        return False
    return entry in data.split(b"\0")


def identities_by_uid() -> dict[int, list[ProcessIdentity]]:
    """Every process of the node by its real and effective uids (a process whose two differ is
    under both): one psutil pass (``/proc/<pid>/status`` and ``stat``). The identities are what the
    scan saw; a signal proves each first (:func:`kill_each`). Blocking: a worker thread's."""
    found: dict[int, list[ProcessIdentity]] = {}
    boot, booted = boot_id(), psutil.boot_time()
    for proc in psutil.process_iter():
        identity = scanned(proc, boot, booted)
        if identity is None:
            continue
        try:
            uids = proc.uids()
        except (psutil.Error, OSError):
            continue
        for uid in {uids.real, uids.effective}:
            found.setdefault(uid, []).append(identity)
    return found


def scanned(proc: psutil.Process, boot: str, booted: float) -> ProcessIdentity | None:
    """The identity of a process a psutil scan found (None: gone meanwhile, or a zombie); ``boot``
    is :func:`boot_id`, ``booted`` ``psutil.boot_time()`` (read once per scan)."""
    try:
        with proc.oneshot():
            created, status = proc.create_time(), proc.status()
        ticks = round((created - booted) * _CLOCK_TICKS)
    except (psutil.Error, OSError):
        return None
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return None
    return ProcessIdentity(proc.pid, ticks, boot)


def kill_each(identities: Iterable[ProcessIdentity], sig: int = signal.SIGKILL) -> list[ProcessIdentity]:
    """Send ``sig`` to each process found by a scan, proven first (:meth:`ProcessIdentity.prove`: its
    pidfd opened, then its start time checked again), so a pid that names another process by now is
    never signalled. Returns those that got it. Blocking but tiny per process."""
    sent = []
    for identity in identities:
        proven = identity.prove()
        if proven is None:
            continue
        with proven:
            if proven.send_signal(sig):
                sent.append(identity)
    return sent


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None when there is no process ``pid``."""
    facts = _facts(pid)
    return None if facts is None else facts[0]


def is_zombie(pid: int) -> bool:
    """True for a zombie (or a pid that names no process)."""
    facts = _facts(pid)
    return facts is None or facts[1] in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


@dataclass(frozen=True)
class ProcessIdentity:
    """One process for good: ``pid`` with its ``start`` (clock ticks since boot) on boot ``boot``.

    Two processes of one boot never share (pid, start): a recycled pid starts later. Store it
    (:meth:`to_json`), judge it (:meth:`prove`), never act on ``pid`` alone.
    """

    pid: int
    start: int
    boot: str

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """The identity of process ``pid`` now (None: no such process). Call it while the process is
        certainly the one meant (our own child, not yet reaped)."""
        found = start_ticks(pid)
        return None if found is None else cls(pid, found, boot_id())

    def alive(self) -> bool:
        """True when this process runs now (same boot, same start time, not a zombie). A judgement
        that acts on nothing (e.g. another agent's registry entry); to act, :meth:`prove` it."""
        if self.boot != boot_id():
            return False
        facts = _facts(self.pid)
        return facts is not None and facts[0] == self.start and facts[1] not in (psutil.STATUS_ZOMBIE,
                                                                                 psutil.STATUS_DEAD)

    def prove(self) -> ProvenProcess | None:
        """Open a pidfd of ``pid``, then check that the process it names has this identity. Returns the
        proven process (the caller closes it) or None when the process is gone or the pid names
        another process (the pidfd is closed again). A zombie of ours is proven (``exited()`` True).
        Blocking but tiny."""
        if self.pid <= 1 or self.boot != boot_id():
            return None
        global _NO_PIDFD_LOGGED
        fd = -1
        try:
            fd = os.pidfd_open(self.pid)
        except OSError as exc:
            if exc.errno in (errno.ESRCH, errno.EINVAL):
                return None
            if not _NO_PIDFD_LOGGED:
                _NO_PIDFD_LOGGED = True
                log.warning("no pidfds here (%s): processes are proven by their start time alone", exc)
        facts = _facts(self.pid)
        if facts is None or facts[0] != self.start:
            if fd >= 0:
                os.close(fd)
            return None
        return ProvenProcess(self, fd)


class ProvenProcess:
    """A process proven to be ``identity`` (see the module docstring), held by its pidfd ``fd`` (-1:
    no pidfds on this kernel). Close it (:meth:`close`, or use it as a context manager)."""

    def __init__(self, identity: ProcessIdentity, fd: int) -> None:
        self.identity = identity
        self.fd = fd

    @property
    def pid(self) -> int:
        """The process's pid (never act on it without this object)."""
        return self.identity.pid

    def exited(self) -> bool:
        """True once the process has exited (its pidfd readable; without pidfds: its pid names
        another process, a zombie or none). A closed one counts as exited."""
        if self.fd < 0:
            if self.fd == -2:
                return True
            facts = _facts(self.pid)
            return facts is None or facts[0] != self.identity.start or facts[1] == psutil.STATUS_ZOMBIE
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(0))

    async def wait(self) -> None:
        """Return once the process has exited (a kernel notification on the pidfd; without pidfds
        a look every 0.5 s). Cancellation: as usual."""
        if self.fd >= 0:
            await trio.lowlevel.wait_readable(self.fd)
            return
        while not self.exited():  # noqa: ASYNC110 - without pidfds no kernel notification exists
            await trio.sleep(0.5)

    def send_signal(self, sig: int) -> bool:
        """Send ``sig`` to the process (through its pidfd). False when it has exited or may not be
        signalled; never reaches another process."""
        try:
            if self.fd >= 0:
                signal.pidfd_send_signal(self.fd, sig)
            elif self.exited():
                return False
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the process group this process leads, only while it lives (a living
        leader holds its number, so no other group can have it). False when it has exited, leads no
        group, or may not be signalled."""
        if self.pid <= 1 or self.exited():
            return False
        try:
            if os.getpgid(self.pid) != self.pid:
                return False
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def set_oom_score_adj(self, value: int) -> bool:
        """Write the process's oom_score_adj. The /proc file is opened first and written only when
        the process is still proven alive then (an open /proc file stays bound to the process it
        named at its opening). False when it has exited or the agent may not."""
        try:
            fd = os.open(f"/proc/{self.pid}/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            if self.exited():
                return False
            os.write(fd, str(value).encode())
        except OSError:
            return False
        finally:
            os.close(fd)
        return True

    def read_proc(self, name: str, limit: int = 1 << 20) -> bytes | None:
        """Up to ``limit`` bytes of ``/proc/<pid>/<name>`` (``environ``, ``cgroup``), when the process
        is still proven alive after the file was opened; None otherwise (exited, not readable)."""
        try:
            fd = os.open(f"/proc/{self.pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if self.exited():
                return None
            chunks, size = [], 0
            while size < limit and (chunk := os.read(fd, min(65536, limit - size))):
                chunks.append(chunk)
                size += len(chunk)
            return b"".join(chunks)
        except OSError:
            return None
        finally:
            os.close(fd)

    def children(self) -> list[int]:
        """The pids of its children (its main thread's), read while it is proven alive; [] once it
        has exited. Facts of a scan: prove one before acting on it."""
        text = self.read_proc(f"task/{self.pid}/children", 1 << 16)
        return [] if text is None else [int(child) for child in text.split() if child.isdigit()]

    def dup_fd(self) -> int:
        """A duplicate of the pidfd (the caller closes it); -1 without pidfds or once closed."""
        return os.dup(self.fd) if self.fd >= 0 else -1

    def close(self) -> None:
        """Close the pidfd (idempotent); the object counts as exited afterwards."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self.fd = -2

    def __del__(self) -> None:  # a backstop: owners close it
        self.close()

    def __enter__(self) -> ProvenProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ProvenProcess(pid={self.pid}, start={self.identity.start})"
