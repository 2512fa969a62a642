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
monitor's exit, output.log's growth and the task's stop in one task (:func:`follow_until_exit_or_stop`).

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
import math
import os
import select
import shlex
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

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
from ckagent.containment.filewatch import FileWatch
from ckagent.containment.private import TMP_DIR, Privacy, PrivacyLevel
from ckagent.containment.process_group import MARKER_VAR, SPAWNED
from ckagent.containment.stopping import (
    Notice,
    ProcessOutcome,
    ScopedStop,
    StopRequest,
    StopSequence,
    Supervised,
    until_exit_or_stop,
)
from ckagent.node import beneath
from ckagent.node.levels import ContainmentLevel
from ckagent.node.procid import ProcessIdentity, ProvenProcess, boot_id, children, start_ticks
from ckagent.node.runas import RunAs, popen_identity

log = logging.getLogger(__name__)

STATUS_FILE = "exit-status"
"""The monitor writes the spider's ``$?`` here (task dir), after the spider exited."""

IGNORED_BY_MONITOR = ("TERM", "INT", "HUP", "QUIT")
"""Signals the monitor ignores (a stop or a terminal hang-up must reach the spider, not end its
monitor); the spider gets them back at their defaults before its exec."""

OUTPUT_COALESCE_BELOW = 16 * 1024
"""Growth of output.log below this many bytes means a trickle: let more gather before the next look."""
OUTPUT_COALESCE_INTERVAL = 0.05
"""Seconds a trickle's output gathers before the next look (one journal record for many lines)."""


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
    record = "" if status_path is None else f"echo $code >{shlex.quote(str(status_path))}; "
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
    supervises the result (:func:`supervise`) and stores its handle.
    """
    if env.get(MARKER_VAR) != task_id:
        raise ValueError(f"env must carry {MARKER_VAR}={task_id} (the sweep finds escaped processes by it)")
    if privacy is not None and task_dir is None:
        raise ValueError("a private namespace needs the task dir (its /tmp is there)")
    status_path = None if task_dir is None else task_dir / STATUS_FILE
    if status_path is not None:
        with contextlib.suppress(FileNotFoundError):
            status_path.unlink()
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


async def follow_output(sink: Any, exited: trio.Event) -> None:
    """Take in output.log's growth as the kernel reports it (inotify IN_MODIFY), trickles gathered
    for OUTPUT_COALESCE_INTERVAL (not once ``exited`` is set). A silent spider wakes nothing. Runs
    until cancelled; an inotify that cannot be set up leaves it to the end of the task (logged)."""
    sink.grown()  # what was written before the watch (or while no agent ran)
    try:
        watch = FileWatch(sink.path)
    except OSError as exc:
        log.warning("%s: cannot watch it (%s); its lines are sent at the task's end", sink.path, exc)
        await trio.sleep_forever()
    with watch:
        while True:
            await watch.changed()
            if sink.grown() < OUTPUT_COALESCE_BELOW and not exited.is_set():
                with trio.move_on_after(OUTPUT_COALESCE_INTERVAL):
                    await exited.wait()


class Output(Protocol):
    """How :func:`supervise` takes in a supervised process's output while it waits for its end: from
    its output file (:class:`FileOutput`: a spider, whose output outlives the agent) or from its pipes
    (ckagent.containment.process.PipeOutput: an installer, whose output streams into the task's log)."""

    def following(self) -> AbstractAsyncContextManager[None]:
        """Take in the output in the background for the block (nothing for a file: it is looked at
        in :meth:`until_exit_or_stop`). Cancellation ends the background work at the block's end."""

    async def until_exit_or_stop(self, mon: Monitored, stop: StopRequest) -> None:
        """Take in the output until the monitor has exited (``mon.exited``) or ``stop`` is requested."""

    def while_stopping(self, final: bool) -> AbstractAsyncContextManager[None]:
        """Take in what the process says while the block stops it (``final``: the supervisor was
        cancelled from outside, its :meth:`following` block is over; the block kills every process
        of the task too, and the last output is taken in at its end)."""

    async def drained(self, jail: TaskJail, window: float) -> bool:
        """After a normal exit: give leftovers ``window`` seconds to finish writing; True when the
        jail is empty (no kill needed), False when the supervisor must kill what is left."""

    async def finish(self) -> None:
        """After the last kill: take in the last of the output."""


class FileOutput:
    """A spider's output file, followed by ``sink`` (``grown()`` takes in what was appended, and
    ``path`` is the file; ckagent.delivery.capture.LogSink): see :class:`Output`."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    @contextlib.asynccontextmanager
    async def following(self) -> AsyncIterator[None]:
        yield  # (looked at in until_exit_or_stop, in the supervisor's own task)

    async def until_exit_or_stop(self, mon: Monitored, stop: StopRequest) -> None:
        await follow_until_exit_or_stop(mon, self.sink, stop)

    @contextlib.asynccontextmanager
    async def while_stopping(self, final: bool) -> AsyncIterator[None]:
        if final:  # the agent terminates (or hands over): the next reader takes the rest from the file
            yield
            return
        async with trio.open_nursery() as nursery:  # what the spider says while it stops reaches the log
            exited = trio.Event()
            exited.set()  # no trickle is waited for: the grace is short
            nursery.start_soon(follow_output, self.sink, exited)
            yield
            nursery.cancel_scope.cancel()

    async def drained(self, jail: TaskJail, window: float) -> bool:
        self.sink.grown()
        with trio.move_on_after(window) as drain:  # what the spider left behind may still write
            await jail.wait_empty()
        # An emptied jail needs no kill: nothing can join an empty cgroup any more, and at the
        # process-group level wait_empty's last scan is the one the kill's sweep would make (it
        # also reaps leftovers that ended as the agent's, the subreaper's, zombies).
        return not drain.cancelled_caught

    async def finish(self) -> None:
        self.sink.grown()


async def supervise(
    mon: Monitored, *, jail: TaskJail, sink: Any = None, output: Output | None = None, grace: float,
    stop: StopRequest, notice: Notice, why: Callable[[], str] = lambda: "stop requested",
    stop_signal: int = signal.SIGTERM, drain_window: float = 2.0, leave_running: Callable[[], bool] = lambda: False,
    deadline_seconds: float | None = None, cancelled_why: str = "agent terminating",
    on_started: Callable[[int], Awaitable[None]] | None = None,
) -> ProcessOutcome:
    """Supervise a monitored process (a spider, an installer: :func:`spawn_monitored`) to its end:
    the one supervisor of the agent's processes.

    The end is the monitor's exit, ``deadline_seconds`` passing (None: never; a spider's run-time
    and stall limits are its ``stop``'s instead: ckagent.task.stop.Watchdog) or ``stop``: then the
    stop signal goes to the process doing the work, ``grace`` seconds pass, and every process of the
    task is killed (ckagent.containment.stopping), its notice beginning with ``why()`` (or the
    timeout). After a normal exit leftovers get ``drain_window`` seconds before they are killed.
    ``output`` takes in the output meanwhile (:class:`Output`; ``sink`` is short for
    ``FileOutput(sink)``: output.log followed as it grows). ``notice(text)`` gets one line per thing
    the agent did (they go into the task log). The outcome's ``returncode`` is the monitor's record
    (negative: killed by that signal).

    Cancellation from outside: when ``leave_running()`` is true (the agent hands its tasks over to
    the next one) the process is left running, untouched; otherwise it is stopped (signal → grace →
    kill-all, shielded, the notice beginning with ``cancelled_why``), then Cancelled propagates —
    also while ``on_started(monitor pid)`` is awaited, first thing.
    """
    if output is None:
        output = FileOutput(sink)
    outcome = ProcessOutcome()
    # The program and its monitor are the task's own two processes (not leftovers).
    stopper = StopSequence(Supervised(mon.pid, mon.main_pid, lambda: mon.exited, mon.wait, own=2,
                                      signal_leader_group=None if mon.proven is None else mon.proven.signal_group),
                           jail, grace, stop_signal, notice, outcome)
    swept = False
    try:
        if on_started is not None:
            await on_started(mon.pid)
        async with output.following():
            with trio.move_on_after(math.inf if deadline_seconds is None else deadline_seconds) as deadline:
                await output.until_exit_or_stop(mon, stop)
            if not mon.exited:
                outcome.timed_out = deadline.cancelled_caught
                outcome.stopped = not outcome.timed_out
                async with output.while_stopping(final=False):
                    await stopper.stop(f"timeout after {deadline_seconds:g} s" if outcome.timed_out else why())
                outcome.killed_leftovers += max(0, await jail.kill_all())
            elif not await output.drained(jail, drain_window):
                outcome.killed_leftovers += max(0, await jail.kill_all())
            outcome.returncode = mon.returncode
            swept = True
            if outcome.killed_leftovers:
                notice(f"killed {outcome.killed_leftovers} leftover process(es) of the task")
            await output.finish()
    finally:
        with trio.CancelScope(shield=True):  # noqa: ASYNC912 - shielded cleanup
            if mon.exited and swept:
                pass
            elif leave_running():
                pass  # handed over: the next agent re-adopts the spider (its handle is in the state store)
            else:
                async with output.while_stopping(final=True):
                    await stopper.stop(cancelled_why)
                    outcome.killed_leftovers += max(0, await jail.kill_all())
    return outcome


async def follow_until_exit_or_stop(mon: Monitored, sink: Any, stop: StopRequest) -> None:
    """Take in output.log's growth (as :func:`follow_output` does) until the monitor has exited
    (``mon.exited`` then) or ``stop`` is requested — in this task: one epoll descriptor over the
    monitor's pidfd and the file's inotify watch, waited on in a scope the stop cancels
    (ckagent.containment.stopping.ScopedStop). A stop that cannot cancel scopes, or a kernel
    without pidfds, gets the same beside a task of its own. Cancellation: as usual."""
    pidfd = mon.exit_fd() if isinstance(stop, ScopedStop) else -1
    if pidfd < 0:
        if mon.exited:
            return
        async with trio.open_nursery() as nursery:
            exited = trio.Event()
            nursery.start_soon(follow_output, sink, exited)
            await until_exit_or_stop(mon.wait, stop, exited)
            nursery.cancel_scope.cancel()
        return
    assert isinstance(stop, ScopedStop)
    with contextlib.ExitStack() as held:
        held.callback(os.close, pidfd)
        poller = select.epoll(2)
        held.callback(poller.close)
        poller.register(pidfd, select.EPOLLIN)
        sink.grown()  # what was written before the watch (or while no agent ran)
        try:
            watch: FileWatch | None = held.enter_context(FileWatch(sink.path))
        except OSError as exc:
            log.warning("%s: cannot watch it (%s); its lines are sent at the task's end", sink.path, exc)
            watch = None
        if watch is not None:
            poller.register(watch.fd, select.EPOLLIN)
        gather_until = math.inf  # a trickle gathers until then: the watch is not looked at
        while True:
            with stop.cancelling(gather_until):
                await trio.lowlevel.wait_readable(poller.fileno())
            if stop.is_set():
                return
            ready = {fd for fd, _ in poller.poll(0)}
            if pidfd in ready:  # it has exited
                if not mon.ended():
                    await mon.wait()
                return
            if watch is None:
                continue
            if gather_until < math.inf and trio.current_time() >= gather_until:
                gather_until = math.inf
                poller.modify(watch.fd, select.EPOLLIN)
            if watch.fd in ready and watch.drain() and sink.grown() < OUTPUT_COALESCE_BELOW:
                gather_until = trio.current_time() + OUTPUT_COALESCE_INTERVAL
                poller.modify(watch.fd, 0)
