"""Spawning processes on pipes — installers, and spiders where no monitor is wanted — and making
sure nothing they start outlives them (a task's spider runs behind its monitor: ckagent.containment.monitor).

A process runs in its own session (own process group, pgid == pid) and inside its task's jail
(:mod:`ckagent.containment`: a cgroup it joins before it execs, or at the last level its process
groups plus the marker sweep). Stopping signals the **main process** only (so a Scrapy spider can
run its close hooks and stop its browser itself); after the grace every process of the task is
killed at once.

Life of one supervised process (:func:`run_supervised`)::

    spawn (own session, in the jail) ──► main exits ──► drain window (≤ 2 s, leftovers may still write)
         │                                                  └──► kill all in the jail, wait until empty ──► done
         ├── deadline passes ─┐
         └── stop requested ──┴──► stop signal to main ──► grace ──► kill all in the jail ──► done

The stop (signal → grace → kill-all) is ckagent.containment.stopping's, the same for every supervisor.
Cancellation from outside (the agent's hard stop, a task stopped while it installs) takes the same
path, shielded, so a cancelled supervisor never leaves a process behind.

Nothing here raises for "process already gone": ``ProcessLookupError`` is the normal outcome of
signalling a process that has finished. Exceptions::

    OSError        run_supervised: the command cannot be started (not found, not executable, its
                   cgroup refused it)
    ValueError     signal_group: a process group id <= 1; RunAs.lookup: no such user
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path

import trio

from ckagent.containment import TaskJail
from ckagent.containment.base import raise_oom_score_adj
from ckagent.containment.process_group import (
    MARKER_VAR,
    SPAWNED,
    ProcessGroupJail,
    find_marked,
    signal_group,
    sweep,
)
from ckagent.containment.stopping import (
    Notice,
    ProcessOutcome,
    StopRequest,
    StopSequence,
    Supervised,
    until_exit_or_stop,
)
from ckagent.node.runas import RunAs, popen_identity

__all__ = ["MARKER_VAR", "SPAWNED", "Notice", "ProcessOutcome", "RunAs", "find_marked", "run_supervised",
           "signal_group", "sweep"]

log = logging.getLogger(__name__)

DRAIN_WINDOW = 2.0
"""Seconds leftovers may keep writing to the spider's pipes after its main process exited."""

PIPE_BYTES = 1 << 20
"""Capacity asked for each of a spider's stdout/stderr pipes (Linux default 64 KiB; at most
/proc/sys/fs/pipe-max-size, 1 MiB by default). A spider whose burst fits never blocks on a write,
which matters beyond speed: under ``PYTHONUNBUFFERED=1`` CPython's stdout is a raw file, and a
write larger than the free pipe space that a signal handler interrupts is silently cut short."""

def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` exists (zombies included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clock(epoch: float) -> str:
    """Epoch seconds → ``HH:MM:SS.mmm`` UTC, for notices in the task log."""
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%H:%M:%S.%f")[:-3]


async def run_supervised(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    task_id: str,
    output: Callable[[bytes], None],
    deadline_seconds: float | None,
    grace: float,
    stop: StopRequest,
    notice: Notice,
    on_started: Callable[[int], Awaitable[None]] | None = None,
    drain_window: float = DRAIN_WINDOW,
    run_as: RunAs | None = None,
    on_stderr: Callable[[bytes], None] | None = None,
    jail: TaskJail | None = None,
    stop_signal: int = signal.SIGTERM,
    cancelled_why: str = "agent terminating",
) -> ProcessOutcome:
    """Run ``argv`` (a spider or an installer): own session, inside ``jail``, pipes copied to ``output``.

    The task ends when the main process exits, when ``deadline_seconds`` pass (None = never), or
    when ``stop`` is set: then the **main process** gets ``stop_signal`` (SIGTERM by default), and
    after ``grace`` seconds every process of the task is killed (``jail.kill_all``: cgroup.kill,
    freeze + kill, or group + sweep). After the main process exited, leftovers get
    ``drain_window`` seconds to finish writing; then every process left in the jail is killed and
    waited for (the cgroup's ``populated 0``). ``jail`` None = a process-group jail (group + marker
    sweep; ``env`` must hold ``CK_TASK_ID=task_id``). ``notice(text)`` receives one-line notes of
    what the agent did (they go into the task log). ``run_as``: start the process as that user.
    The caller owns the jail (figures, close). ``on_stderr`` also gets the stderr bytes (after
    ``output``), e.g. to keep its last lines for the failure message.

    The process is opened before the supervisor's nursery (as trio's ``run_process`` does), so
    OSError (the command cannot be started, e.g. not found) comes out bare, never in a group.
    Cancellation from outside (the agent terminating, a task stopped while it installs) still ends
    the process: stop signal → grace → kill-all (ckagent.containment.stopping) run shielded, its
    notice beginning with ``cancelled_why``; then Cancelled propagates.
    """
    if env.get(MARKER_VAR) != task_id:
        raise ValueError(f"env must carry {MARKER_VAR}={task_id} (the sweep finds escaped processes by it)")
    if jail is None:
        jail = ProcessGroupJail(task_id)
    spawn_argv, spawn_options = jail.spawn(argv, env, forking=run_as is not None)
    proc = await trio.lowlevel.open_process(
        spawn_argv, cwd=str(cwd), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True, **popen_identity(run_as), **spawn_options,
    )  # fmt: skip
    SPAWNED.add(proc.pid)  # trio reaps it; the subreaper's reaper must not
    if run_as is not None:  # its preexec could not raise its own oom_score_adj after the setuid
        raise_oom_score_adj(proc.pid)
    jail.watch(proc.pid)
    for stream in (proc.stdout, proc.stderr):
        if isinstance(stream, trio.lowlevel.FdStream):
            enlarge_pipe(stream.fileno())
    outcome = ProcessOutcome()
    stopper = StopSequence(Supervised(proc.pid, lambda: proc.pid, lambda: proc.returncode is not None, proc.wait),
                           jail, grace, stop_signal, notice, outcome)
    swept = False
    try:
        if on_started is not None:
            await on_started(proc.pid)
        async with trio.open_nursery() as nursery:
            pumps_done = trio.Event()
            exited = trio.Event()  # the main process ended: the pumps stop gathering small writes
            nursery.start_soon(_pumps, proc, output, on_stderr, exited, pumps_done)
            with trio.move_on_after(math.inf if deadline_seconds is None else deadline_seconds) as deadline:
                await until_exit_or_stop(proc.wait, stop, exited)
            if proc.returncode is None:
                outcome.timed_out = deadline.cancelled_caught
                outcome.stopped = not outcome.timed_out
                why = f"timeout after {deadline_seconds:g} s" if outcome.timed_out else "stop requested"
                await stopper.stop(why)
            else:
                # A normal end: what the spider left behind may still be writing its last lines.
                with trio.move_on_after(drain_window):
                    await pumps_done.wait()
            outcome.returncode = proc.returncode
            outcome.killed_leftovers += await jail.kill_all()
            swept = True
            if outcome.killed_leftovers:
                notice(f"killed {outcome.killed_leftovers} leftover process(es) of the task")
            with trio.move_on_after(1.0):  # leftovers are dead: their pipe ends close at once
                await pumps_done.wait()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):  # noqa: ASYNC912 - shielded cleanup; each stream's aclose checkpoints
            if proc.returncode is None or not swept:
                # Cancelled from outside: the processes must still go, and what they say while they
                # stop still reaches ``output`` (as a monitored spider's output.log goes on growing).
                async with trio.open_nursery() as last:
                    pumps_done, now = trio.Event(), trio.Event()
                    now.set()
                    last.start_soon(_pumps, proc, output, on_stderr, now, pumps_done)
                    await stopper.stop(cancelled_why)
                    outcome.killed_leftovers += max(0, await jail.kill_all())
                    with trio.move_on_after(1.0):  # everything is dead: the pipes close at once
                        await pumps_done.wait()
                    last.cancel_scope.cancel()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    await stream.aclose()
            if proc.returncode is not None:
                SPAWNED.discard(proc.pid)
    return outcome


def enlarge_pipe(fd: int, size: int = PIPE_BYTES) -> int:
    """Ask for a pipe capacity of ``size`` bytes on ``fd`` (best effort: the system maximum or a
    per-user limit may refuse it). Returns the capacity the pipe has now (bytes), 0 if unknown."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)  # Linux only
    if set_size is None:
        return 0
    for wanted in (size, size // 4):
        try:
            return int(fcntl.fcntl(fd, set_size, wanted))
        except OSError:
            continue
    return 0


async def _pumps(proc: trio.Process, output: Callable[[bytes], None], on_stderr: Callable[[bytes], None] | None,
                 exited: trio.Event, done: trio.Event) -> None:
    """Copy the process's stdout and stderr into ``output`` (stderr to ``on_stderr`` too) until both
    end; then set ``done``. Cancellation stops at once (a later call may pump on)."""
    async with trio.open_nursery() as inner:
        if proc.stdout is not None:
            inner.start_soon(_copy, proc.stdout, output, exited)
        if proc.stderr is not None:
            inner.start_soon(_copy, proc.stderr, output if on_stderr is None else _tee(output, on_stderr), exited)
    done.set()


def _tee(first: Callable[[bytes], None], second: Callable[[bytes], None]) -> Callable[[bytes], None]:
    def both(chunk: bytes) -> None:
        first(chunk)
        second(chunk)

    return both


PIPE_COALESCE_BELOW = 16 * 1024
"""A read shorter than this many bytes means the spider writes little at a time (a line now and then)."""
PIPE_COALESCE_INTERVAL = 0.05
"""Seconds to let such a spider's output gather in the pipe before the next read: one read, one
output.log write, one journal record and one shipper wake-up for many small writes (bench.manytasks:
a spider printing a line every 10 ms costs 20 reads a second instead of 100). The pipe (1 MiB) holds
far more than a trickle writes in this time, so the spider never blocks; a flood reads full chunks
and never pauses."""


PIPE_READ_BYTES = 64 * 1024
"""Bytes asked of a pipe per read."""
PIPE_FLOOD_READ_BYTES = 1024 * 1024
"""Bytes asked per read after a read that filled PIPE_READ_BYTES (the pipe's size, where the kernel allows it)."""


PARTIAL_LINE_MAX_BYTES = 64 * 1024
"""An unfinished line is held back (per pipe) until its newline comes, up to this many bytes."""


async def _copy(stream: trio.abc.ReceiveStream, output: Callable[[bytes], None],
                exited: trio.Event | None = None) -> None:
    """Copy a pipe into ``output`` until EOF, whole lines at a time (see PIPE_COALESCE_INTERVAL; no
    gathering once ``exited`` is set, so the end of a task is not delayed).

    stdout and stderr go into one task log: an unfinished line of one pipe is held back until its
    newline arrives (or EOF, or PARTIAL_LINE_MAX_BYTES), so a line of the other pipe can never land
    inside it. (Unbuffered Python writes a print's text and its newline apart, and a reader that
    passed on the text alone let the other pipe's line in between.) Cancellation stops at once;
    what was held back is passed on first.
    """
    partial = b""
    size = PIPE_READ_BYTES
    try:
        while True:
            chunk = await stream.receive_some(size)
            # A full read means a flood: read up to the pipe's whole buffer at a time (fewer reads,
            # output.log writes, journal records and shipper wake-ups per MB); a trickle reads small.
            size = PIPE_FLOOD_READ_BYTES if len(chunk) == size else PIPE_READ_BYTES
            if not chunk:
                return
            data = partial + chunk if partial else bytes(chunk)
            cut = data.rfind(b"\n") + 1
            if cut == 0 and len(data) < PARTIAL_LINE_MAX_BYTES:
                partial = data
            elif cut == 0 or len(data) - cut >= PARTIAL_LINE_MAX_BYTES:
                partial = b""
                output(data)
            else:
                partial = data[cut:]
                output(data[:cut])
            if len(chunk) < PIPE_COALESCE_BELOW:
                if exited is None:
                    await trio.sleep(PIPE_COALESCE_INTERVAL)
                elif not exited.is_set():
                    with trio.move_on_after(PIPE_COALESCE_INTERVAL):
                        await exited.wait()
    finally:
        if partial:
            output(partial)
