"""A spider that needs no living agent: its output goes to a file, its exit status is kept by a monitor.

Why (docs/operations.md, "Tasks outlive the agent"): a spider whose stdout is a pipe to the agent dies
of SIGPIPE when the agent dies, and only a process's parent learns its exit status. So each spider
runs behind a **monitor**: the ``/bin/sh`` that already joins the task's cgroup before the spider's
exec (ckagent.containment's spawn shim) stays behind as the spider's parent instead of exec'ing it::

    agent ──spawn──► sh monitor (own session; in the task's cgroup; ignores TERM/INT/HUP/QUIT)
                        └── spider (stdout + stderr = output.log, O_APPEND; signals at their defaults)
                     spider exits ──► monitor writes its status ($?) to the task's exit-status file, exits

The monitor is one dash process per task: ~0.1 MB of private memory (its RSS is mostly shared
libc pages) and no wake-up while the spider runs (it sleeps in wait4). The agent is the monitor's
parent while it lives; a later agent is not, and waits for the monitor's exit on a pidfd (a kernel
notification, no polling). The agent follows output.log by inotify; its supervisor waits for the
monitor's exit, output.log's growth and the task's stop in one task (ckagent.containment.supervision).

What a shell can tell of its child's end: ``$?`` is the exit code, or 128 + N for a death by
signal N; :func:`returncode_of` turns 129..192 back into ``-N`` (an exit code in that range is read
as that signal: the one ambiguity, documented). The monitor's own stderr is /dev/null, so the
shell's "Segmentation fault" notes do not reach the task log.

Exceptions::

    OSError      spawn_monitored: the command cannot be started (not found, not executable, its
                 cgroup refused it); output.log cannot be opened
    ValueError   Handle.from_json: a stored handle of the wrong shape
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

from ckagent.containment import TaskJail
from ckagent.containment.base import (
    SHELL,
    SPIDER_OOM_SCORE_ADJ,
    join_lines,
    make_preexec,
    raise_oom_score_adj,
)
from ckagent.containment.base import _resolve as resolve_program
from ckagent.containment.private import TMP_DIR, Privacy, PrivacyLevel
from ckagent.containment.process_group import MARKER_VAR, SPAWNED
from ckagent.node import beneath
from ckagent.node.diskfull import preallocate
from ckagent.node.levels import ContainmentLevel
from ckagent.node.procid import ProcessIdentity, ProvenProcess, boot_id, children, start_ticks
from ckagent.node.runas import RunAs, popen_identity

log = logging.getLogger(__name__)

STATUS_FILE = "exit-status"
"""The monitor writes the spider's ``$?`` here (task dir), after the spider exited."""

STATUS_HEADROOM_BYTES = 4096
"""Bytes allocated beforehand for the exit-status file (one block: ``$?`` and a newline)."""

IGNORED_BY_MONITOR = ("TERM", "INT", "HUP", "QUIT")
"""Signals the monitor ignores (a stop or a terminal hang-up must reach the spider, not end its
monitor); the spider gets them back at their defaults before its exec."""

def monitor_script(join: list[Path], status_path: Path | None, oom_score_adj: int = SPIDER_OOM_SCORE_ADJ) -> str:
    """The monitor's shell script (``sh -c <script> <program> <args...>``): join each cgroup (exit 126
    with a message if one refuses), raise oom_score_adj, ignore the stop signals, run the program in
    the foreground with them back at their defaults, then write its ``$?`` to ``status_path`` (None:
    nowhere — the monitor's own exit status, read by the agent that is its parent, is the record)
    and exit with it. The monitor's own stderr is /dev/null (the program keeps the real one as fd 2)."""
    lines = join_lines(join, oom_score_adj)  # (the spawn shim's first lines: ckagent.containment.base)
    sigs = " ".join(IGNORED_BY_MONITOR)
    lines.append(f"exec 3>&2 2>/dev/null; trap '' {sigs}")
    lines.append(f'(trap - {sigs}; exec 2>&3 3>&-; exec "$0" "$@")')
    # ``1<>``: written in place over the file :func:`prepare_status_file` made with its block held,
    # never truncated or created anew — a full disk cannot take the exit status.
    record = "" if status_path is None else f"echo $code 1<>{shlex.quote(str(status_path))}; "
    lines.append(f"code=$?; {record}exit $code")
    return "\n".join(lines)


def returncode_of(status: int) -> int:
    """A shell's ``$?`` as a Popen-style return code: 128 + N (N a signal number) → -N."""
    if 128 < status <= 128 + 64:
        return -(status - 128)
    return status


def read_status(path: Path) -> int | None:
    """The return code the monitor recorded in ``path`` (see :func:`returncode_of`), None when it
    recorded none (still running, or killed before it could write) or when the file is not one the
    monitor could have written: the task dir is the spider's, which may plant a symlink, a FIFO (it
    would block the agent's loop) or a huge file there — only a small regular file is read, never
    through a link (ckagent.node.beneath). Blocking but tiny."""
    try:
        text = beneath.read_bytes(path.parent, path.name, 64).decode("ascii", "replace").strip()
    except OSError:
        return None
    return returncode_of(int(text)) if text.isdigit() else None


def prepare_status_file(path: Path, run_as: RunAs | None) -> None:
    """Make ``path`` (the task's exit-status file) anew and empty, owned by ``run_as`` (the monitor
    writes it as that uid), with a block allocated beyond its end (``fallocate(KEEP_SIZE)``): the
    monitor's ``echo $code 1<>path`` then writes into space it already holds, so a disk the spider
    filled cannot lose the exit status (docs/operations.md, "When the disk fills"). An earlier
    record is removed first. Never through a link the spider planted (ckagent.node.beneath). On a
    disk already full the file may not be made: the monitor then creates it itself, as before.
    Blocking (a few system calls); never raises."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    try:
        fd = beneath.open_file(path.parent, path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    except OSError as exc:
        log.debug("exit-status file %s not made beforehand: %s", path, exc)
        return
    try:
        if run_as is not None:
            os.fchown(fd, run_as.uid, run_as.gid)
        preallocate(fd, STATUS_HEADROOM_BYTES)
    except OSError as exc:
        log.debug("exit-status file %s not prepared: %s", path, exc)
    finally:
        os.close(fd)


def main_pid(monitor: int | ProvenProcess) -> int | None:
    """The spider behind its monitor (the monitor's one child), None before its fork or after its
    end. ``monitor``: our own child's pid (not reaped yet), or a proven monitor (after a restart)."""
    found = monitor.children() if isinstance(monitor, ProvenProcess) else children(monitor)
    return found[0] if found else None


@dataclass(frozen=True)
class Handle:
    """What the state store keeps of a running spider so that a later agent can re-adopt it.

    ``monitor_pid``/``monitor_start``/``boot_id`` name the monitor process (:meth:`identity`: acted
    on only once proven, ckagent.node.procid);
    ``status_file`` its exit-status file; ``spawned_at`` and ``deadline_at`` are epoch seconds
    (``deadline_at`` None: no timeout); ``work`` is the task's working copy (removed at its end);
    ``stall_timeout`` seconds (0: off); ``level`` the containment level it was spawned at (None: not
    recorded, an older agent's handle; stored as the level's text);
    ``env_dir`` the dependency environment the spider runs with ("" = none: a later agent keeps it
    from environment collection while it re-adopts the task); ``proxy_port`` the port of the task's
    egress proxy listener its proxy variables name (0 = none: a later agent listens there again);
    ``uid``/``gid`` whom the spider runs as (-1: the agent's own user; a re-adopted task keeps it).
    """

    monitor_pid: int
    monitor_start: int
    boot_id: str
    spawned_at: float
    status_file: str
    deadline_at: float | None
    work: str
    stall_timeout: float
    level: ContainmentLevel | None
    env_dir: str = ""
    proxy_port: int = 0
    uid: int = -1
    gid: int = -1

    def identity(self) -> ProcessIdentity:
        """The monitor's identity (prove it before acting on it: ckagent.node.procid)."""
        return ProcessIdentity(self.monitor_pid, self.monitor_start, self.boot_id)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``from_json`` reads it back)."""
        return {"v": 1, **asdict(self), "level": "" if self.level is None else self.level.value}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Handle:
        """Rebuild a stored handle. Raises ValueError when it does not have the right shape."""
        try:
            return cls(int(data["monitor_pid"]), int(data["monitor_start"]), str(data["boot_id"]),
                       float(data["spawned_at"]), str(data["status_file"]),
                       None if data.get("deadline_at") is None else float(data["deadline_at"]),
                       str(data["work"]), float(data.get("stall_timeout") or 0.0),
                       ContainmentLevel.parse(str(data["level"])) if data.get("level") else None,
                       str(data.get("env_dir") or ""), _port(data.get("proxy_port")),
                       int(data.get("uid", -1)), int(data.get("gid", -1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a stored task handle of the wrong shape: {exc}") from exc


def _port(value: object) -> int:
    """A stored port (0 when absent). Raises ValueError for anything but an integer 0..65535."""
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 65535:
        raise ValueError(f"proxy_port {value!r} is not a port")
    return value


class Monitored:
    """A spider behind its monitor: spawned by this agent (``popen`` set: the monitor is our child)
    or adopted from an earlier one (``proven`` set: the monitor proven by its pidfd, which this
    object then owns; or neither: it ended while no agent ran, ``exited`` set by the caller).

    :meth:`wait` returns once the monitor has exited; :attr:`returncode` is then the spider's
    return code (negative: killed by that signal; None: not recorded, e.g. the monitor itself
    was killed with the whole task at a later agent). An adopted monitor is never reached by its
    pid alone: only through ``proven``.
    """

    def __init__(self, handle: Handle, popen: subprocess.Popen[bytes] | None = None,
                 proven: ProvenProcess | None = None, pipes: tuple[int, int] | None = None) -> None:
        self.handle = handle
        self.popen = popen
        self.proven = proven
        self.pipes = pipes
        """(stdout, stderr): the read ends of the program's pipes when it was spawned on pipes
        (:func:`spawn_monitored` without an output file); the caller owns and closes them."""
        self.exited = False
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        """The monitor's pid (also the task's process group)."""
        return self.handle.monitor_pid

    def main_pid(self) -> int | None:
        """The spider's pid (:func:`main_pid`); None once the monitor ended (or an adopted one that
        is not proven)."""
        if self.exited:
            return None
        if self.popen is not None:
            return main_pid(self.pid)
        return None if self.proven is None else main_pid(self.proven)

    async def wait(self) -> None:
        """Return once the monitor has exited (a pidfd: a kernel notification; our own child is
        reaped then). Cancellation: as usual."""
        if not self.exited:
            if self.popen is None and self.proven is not None:
                await self.proven.wait()
            elif self.popen is not None:
                await _wait_pid_exit(self.pid, self.popen)
            self._ended()

    def ended(self) -> bool:
        """After its pidfd said the monitor exited: our own child reaped, its end recorded (as
        :meth:`wait` does). False when it cannot be reaped yet (never expected: then :meth:`wait`)."""
        if self.popen is not None and self.popen.poll() is None:
            return False
        self._ended()
        return True

    def exit_fd(self) -> int:
        """A pidfd of the monitor (readable once it has exited: then :meth:`wait` returns at once);
        -1 when it is gone already or this kernel has no pidfds. The caller closes it."""
        if self.exited:
            return -1
        if self.popen is None:
            return -1 if self.proven is None else self.proven.dup_fd()
        try:
            return os.pidfd_open(self.pid)
        except OSError:
            return -1

    def _ended(self) -> None:
        self.exited = True
        recorded = read_status(Path(self.handle.status_file)) if self.handle.status_file else None
        if recorded is not None:
            self.returncode = recorded
        elif self.popen is not None and self.popen.returncode is not None:
            self.returncode = returncode_of(self.popen.returncode)  # (the monitor exits with the $? it saw)
        if self.popen is not None and self.popen.returncode is not None:
            SPAWNED.discard(self.pid)
        if self.proven is not None:
            self.proven.close()

    def close(self) -> None:
        """Let go of the adopted monitor's pidfd (idempotent; a handed-over task's next agent proves
        it anew)."""
        if self.proven is not None:
            self.proven.close()


async def _wait_pid_exit(pid: int, child: subprocess.Popen[bytes] | None = None) -> None:
    """Wait for process ``pid`` to exit: its pidfd is readable once it is a zombie or gone; ``child``
    (our own child, that process) is reaped then (at once: it has exited)."""
    fd = -1
    try:
        fd = os.pidfd_open(pid)
    except OSError as exc:
        if exc.errno != errno.ESRCH and child is None:
            raise
        # Gone already, or no pidfds (Linux < 5.3): our own child is waited for in a thread below.
    if fd >= 0:
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)
    if child is not None and child.poll() is None:  # reaped here (it has exited if its pidfd said so)
        await trio.to_thread.run_sync(child.wait)


def spawn_monitored(
    argv: list[str], *, cwd: Path, env: dict[str, str], task_id: str, task_dir: Path | None,
    output_path: Path | None, jail: TaskJail, run_as: RunAs | None, deadline_at: float | None, work: Path,
    stall_timeout: float, env_dir: Path | None = None, proxy_port: int = 0, privacy: Privacy | None = None,
) -> Monitored:
    """Start ``argv`` behind its monitor, in ``jail``, stdout and stderr appended to ``output_path``.
    Blocking (the fork, a few small files): call it in a thread hop (the runner's spawn hop), or on
    the loop where trio's own ``open_process`` would fork there too (an installer).

    The one spawn of the agent's processes: a spider (its output a file, its exit recorded in
    ``task_dir``'s exit-status file: both outlive the agent) and an installer (``output_path`` None:
    stdout and stderr are pipes whose read ends are ``Monitored.pipes``, the caller's to read and
    close; ``task_dir`` None: no status file, the monitor's own exit status is the record — an
    installer never outlives its agent: a restarted agent's recovery sweeps it).

    ``privacy``: the node's private-namespace level (ckagent.containment.private): at
    ``mount-namespace`` the monitor's child makes its namespace and drops to ``run_as`` itself before
    its exec; at ``user-namespace`` the monitor is started through the namespace helper.

    ``env`` must carry ``CK_TASK_ID=task_id`` (the sweep's marker). Raises OSError when the command
    cannot be started (its namespace cannot be made: the message says which step). The caller
    supervises the result (ckagent.containment.supervision.supervise) and stores its handle.
    """
    if env.get(MARKER_VAR) != task_id:
        raise ValueError(f"env must carry {MARKER_VAR}={task_id} (the sweep finds escaped processes by it)")
    if privacy is not None and task_dir is None:
        raise ValueError("a private namespace needs the task dir (its /tmp is there)")
    status_path = None if task_dir is None else task_dir / STATUS_FILE
    if status_path is not None:
        prepare_status_file(status_path, run_as)
    program = resolve_program(argv[0], env.get("PATH"))
    forking = run_as is not None
    options: dict[str, Any] = {}
    identity = popen_identity(run_as)
    level = privacy.level if privacy is not None else PrivacyLevel.TMPDIR
    wrap: Callable[[list[str]], list[str]] = list
    if privacy is not None and task_dir is not None and level is PrivacyLevel.MOUNT_NAMESPACE:
        # The child joins the cgroups, makes its namespace and only then drops to run_as: no user= here.
        script = monitor_script([], status_path)
        options["preexec_fn"] = privacy.preexec(jail.join_fds(), run_as, task_dir / TMP_DIR)
        identity = {}
    elif privacy is not None and task_dir is not None and level is PrivacyLevel.USER_NAMESPACE and not forking:
        script = monitor_script([], status_path)
        joins, tmp = jail.join_paths(), task_dir / TMP_DIR
        wrap = lambda command: privacy.wrap(command, joins, tmp)  # noqa: E731
    elif forking:  # the cgroup is joined between fork and exec (after setuid): the script joins nothing
        script, options["preexec_fn"] = monitor_script([], status_path), make_preexec(jail.join_fds())
    else:
        script = monitor_script(jail.join_paths(), status_path)
    if output_path is not None:
        # The task dir is the spider's: never through a link it planted at output.log's name (as root,
        # that would give the spider's output a file of the agent's choosing), never a FIFO.
        out = beneath.open_file(output_path.parent, output_path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                0o640)
        ends, theirs, pipes = [out], (out, out), None
    else:
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        ends, theirs, pipes = [out_w, err_w], (out_w, err_w), (out_r, err_r)
    try:
        try:
            popen = subprocess.Popen(
                wrap([SHELL, "-c", script, program, *argv[1:]]), cwd=str(cwd), env=env, stdin=subprocess.DEVNULL,
                stdout=theirs[0], stderr=theirs[1], start_new_session=True, **identity, **options,
            )  # fmt: skip
        except subprocess.SubprocessError as exc:  # a preexec_fn that raised (its namespace, its cgroup)
            raise OSError(errno.EPERM, f"cannot set up the process ({level} level: its cgroups, its "
                                       f"private namespace or its identity): {exc}") from exc
        SPAWNED.add(popen.pid)  # we reap it (Monitored.wait); the subreaper's reaper must not
        if forking and "preexec_fn" in options and level is not PrivacyLevel.MOUNT_NAMESPACE:
            raise_oom_score_adj(popen.pid)  # (its preexec could not, after the setuid)
    except BaseException:
        for fd in pipes or ():
            os.close(fd)
        raise
    finally:
        for fd in ends:
            os.close(fd)
    jail.watch(popen.pid)
    handle = Handle(popen.pid, start_ticks(popen.pid) or 0, boot_id(), time.time(),
                    "" if status_path is None else str(status_path), deadline_at, str(work), stall_timeout,
                    jail.level, "" if env_dir is None else str(env_dir), proxy_port,
                    -1 if run_as is None else run_as.uid, -1 if run_as is None else run_as.gid)
    return Monitored(handle, popen, pipes=pipes)
