"""How ``ckagent stop [--migrate] -c CONFIG`` finds the agent of a work dir and asks it to stop.

The agent of a work dir is the process holding ``<work_dir>/agent.lock`` (ckagent.node.workdir). It is
proven, not guessed: the kernel's table of file locks (``/proc/locks``) names the pid holding a
``flock`` on that file's device and inode; the pid written into the file is only the fallback where
``/proc/locks`` cannot be read (then the lock is held — a probe with ``LOCK_SH | LOCK_NB`` fails —
and the pid is the holder's own record).

The request: ``<work_dir>/stop-request.json`` (``{"mode": "migrate", "pid": 1234, "requestedAt": …}``,
written atomically, mode 0644 so an agent of another user than the caller's can read it), then SIGTERM
to the agent. An agent that knows the file (this version on) reads it on SIGTERM, removes it and does
what it says — addressed to its pid, else ignored (a stale one from an earlier agent); without a file
SIGTERM means ``agent.sigterm`` (drain by default). An older agent ignores the file and drains, as
SIGTERM always asked of it — never worse than ``ckagent stop``: :func:`request_stop`'s caller sees the
file still there after :data:`TAKE_TIMEOUT` and says so. SIGTERM was chosen over a signal of its own
because every agent handles it: an unknown signal (SIGUSR1, a real-time one) kills an older agent at once,
without its drain.

Exceptions::

    StopError        the request cannot be made (the message says why and what to do)
    └── NoAgent      no agent runs on that work dir
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import signal
import time
from pathlib import Path

from ckagent.node.workdir import LOCK_FILE

REQUEST_FILE = "stop-request.json"
TAKE_TIMEOUT = 5.0
"""Seconds an agent has to take a request (remove the file) before the caller says it did not."""


class StopMode(str, enum.Enum):
    """What a stop asks of the agent (and ``agent.sigterm``'s value: what SIGTERM asks)."""

    DRAIN = "drain"
    """Stop claiming; running tasks may finish within ``task.drain_timeout``, then they are stopped."""
    MIGRATE = "migrate"
    """Stop claiming; checkpoint every running task, stop it and report it MIGRATED (another node
    resumes it) within ``task.migrate_timeout``."""

    def __str__(self) -> str:
        return self.value


class StopError(Exception):
    """A stop cannot be asked; the message says why and how to fix it."""


class NoAgent(StopError):
    """No agent runs on the work dir."""


def agent_pid(work_dir: Path) -> int:
    """The pid of the agent holding ``work_dir``'s lock. Raises NoAgent when none holds it (or the
    work dir has no lock file), StopError when it cannot be read (no permission). Blocking (small reads)."""
    lock = work_dir / LOCK_FILE
    try:
        st = os.stat(lock)
    except FileNotFoundError:
        raise NoAgent(f"no agent runs on {work_dir}: it has no {LOCK_FILE} (no agent ever ran there; is -c "
                      "the config the agent was started with? a relative task.work_dir is taken from the "
                      "current directory, as the agent took it from its own)") from None
    except OSError as exc:
        raise StopError(f"cannot read {lock}: {exc.strerror or exc}; run as the agent's user or root") from exc
    holder = _lock_holder(st)
    if holder is None:
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise StopError(f"cannot read {lock}: {exc.strerror or exc}; run as the agent's user or root") from exc
        try:
            import fcntl

            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:  # held: its holder wrote its pid
                text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                holder = int(text) if text.isdigit() else None
            else:
                holder = 0
        finally:
            os.close(fd)
    if not holder:
        raise NoAgent(f"no agent runs on {work_dir} (nothing holds its {LOCK_FILE})")
    return holder


def _lock_holder(st: os.stat_result) -> int | None:
    """The pid /proc/locks names as holding a flock on the file of ``st``; 0: none does; None: the
    table cannot be read, or names a holder this pid namespace cannot see."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in text.splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter, not the holder
            continue
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            where = (int(major, 16), int(minor, 16), int(inode))
            pid = int(fields[4])
        except ValueError:
            continue
        if where == want:  # (pid 0: a holder in a pid namespace this one cannot see: the probe decides)
            return pid if pid > 0 else None
    return 0


def request_stop(work_dir: Path, mode: StopMode, pid: int, pidfd: int | None = None) -> None:
    """Ask the agent of ``work_dir`` (``pid``, proven by :func:`agent_pid`; ``pidfd`` its descriptor, so
    the signal cannot reach a stranger that took the pid meanwhile) to stop in ``mode`` (see module
    docstring). Raises NoAgent (it has just exited), StopError (the request file cannot be written, the
    agent cannot be signalled). Blocking (a small write, a signal)."""
    path = work_dir / REQUEST_FILE
    body = json.dumps({"mode": mode.value, "pid": pid, "requestedAt": time.time()})
    part = path.with_name(f".{REQUEST_FILE}.{os.getpid()}")
    try:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            os.fchmod(fd, 0o644)  # (the umask's bits off: an agent of another user reads it)
            os.write(fd, body.encode())
        finally:
            os.close(fd)
        os.replace(part, path)
    except OSError as exc:
        raise StopError(f"cannot write {path}: {exc.strerror or exc}; run as the agent's user or root") from exc
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        else:
            os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        remove_request(work_dir)
        raise NoAgent(f"the agent of {work_dir} (pid {pid}) has just exited") from None
    except PermissionError as exc:
        remove_request(work_dir)
        raise StopError(f"cannot signal the agent of {work_dir} (pid {pid}): {exc.strerror}; run as the "
                        "agent's user or root") from exc


def take_request(work_dir: Path, pid: int | None = None) -> StopMode | None:
    """The agent's side, on SIGTERM: the mode a request file addressed to this process (``pid``, default
    its own) asks, None when there is none (or it is another process's, or unreadable: then SIGTERM
    means ``agent.sigterm``). The file is removed either way — that is how the caller knows it was
    taken. Never raises. Blocking (a small read)."""
    path = work_dir / REQUEST_FILE
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except OSError:
        return None
    remove_request(work_dir)
    try:
        data = json.loads(raw)
        mode = StopMode(data["mode"])
        asked = data["pid"]
    except (ValueError, KeyError, TypeError):
        return None
    if asked != (os.getpid() if pid is None else pid):
        return None
    return mode


def remove_request(work_dir: Path) -> None:
    """Remove the request file (the agent took it, or it is stale). Never raises."""
    with contextlib.suppress(OSError):
        os.unlink(work_dir / REQUEST_FILE)


def request_pending(work_dir: Path) -> bool:
    """True while the request file is there (not taken yet)."""
    return (work_dir / REQUEST_FILE).exists()


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists (a zombie counts as gone: its state in /proc is Z)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]
