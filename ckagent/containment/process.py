"""Installers on pipes: the agent's one supervisor (ckagent.containment.monitor.spawn_monitored and
ckagent.containment.supervision.supervise, as for a spider) with the output on pipes copied into the task's log as it comes.

A spider and an installer are spawned, watched, stopped and killed the same way: behind a monitor
(the ``/bin/sh`` that joins the jail before the program's exec and stays as its parent), in its own
session, held by the jail (a cgroup, or at the last level its process groups plus the marker sweep),
its end seen on the monitor's pidfd. Stopping signals the **main process** only (so a Scrapy spider
can run its close hooks and stop its browser itself); after the grace every process of the task is
killed at once. What differs is where the output goes and who records the exit: a spider's output
file and exit-status file outlive the agent (a restarted agent re-adopts it); an installer's pipes
and exit status (the monitor's own, read by the agent, its parent) do not need to (a restarted
agent's recovery sweeps what is left of it).

Life of one supervised process (:func:`run_supervised`)::

    spawn (own session, in the jail) ──► main exits ──► drain window (≤ 2 s, leftovers may still write)
         │                                                  └──► kill all in the jail, wait until empty ──► done
         ├── deadline passes ─┐
         └── stop requested ──┴──► stop signal to main ──► grace ──► kill all in the jail ──► done

The stop (signal → grace → kill-all) is ckagent.containment.stopping's. Cancellation from outside
(the agent's hard stop, a task stopped while it installs) takes the same path, shielded, so a
cancelled supervisor never leaves a process behind.

Nothing here raises for "process already gone": ``ProcessLookupError`` is the normal outcome of
signalling a process that has finished. Exceptions::

    OSError        run_supervised: the command cannot be started (not found, not executable, its
                   cgroup refused it)
    ValueError     run_supervised: ``env`` without the task's marker; signal_group: a process group
                   id <= 1; RunAs.lookup: no such user
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path

import trio

from ckagent.containment import TaskJail
from ckagent.containment.monitor import Monitored, spawn_monitored
from ckagent.containment.process_group import (
    MARKER_VAR,
    SPAWNED,
    ProcessGroupJail,
    find_marked,
    signal_group,
    sweep,
)
from ckagent.containment.stopping import Notice, ProcessOutcome, StopRequest, until_exit_or_stop
from ckagent.containment.supervision import supervise
from ckagent.node.runas import RunAs

__all__ = ["MARKER_VAR", "SPAWNED", "Notice", "ProcessOutcome", "RunAs", "find_marked", "run_supervised",
           "signal_group", "sweep"]

log = logging.getLogger(__name__)

DRAIN_WINDOW = 2.0
"""Seconds leftovers may keep writing to an installer's pipes after its main process exited."""

PIPE_BYTES = 1 << 20
"""Capacity asked for each of a spider's stdout/stderr pipes (Linux default 64 KiB; at most
/proc/sys/fs/pipe-max-size, 1 MiB by default). A spider whose burst fits never blocks on a write,
which matters beyond speed: under ``PYTHONUNBUFFERED=1`` CPython's stdout is a raw file, and a
write larger than the free pipe space that a signal handler interrupts is silently cut short."""


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
    """Run ``argv`` (an installer) behind its monitor, inside ``jail``, its pipes copied to ``output``:
    spawned and supervised as a spider is (ckagent.containment.monitor.spawn_monitored and
    ckagent.containment.supervision.supervise), its output on pipes instead of a file.

    The run ends when the main process exits, when ``deadline_seconds`` pass (None = never), or
    when ``stop`` is set: then the **main process** gets ``stop_signal`` (SIGTERM by default), and
    after ``grace`` seconds every process of the task is killed (``jail.kill_all``: cgroup.kill,
    freeze + kill, or group + sweep). After the main process exited, leftovers get
    ``drain_window`` seconds to finish writing; then every process left in the jail is killed and
    waited for. ``jail`` None = a process-group jail (group + marker sweep; ``env`` must hold
    ``CK_TASK_ID=task_id``). ``on_started(pid)`` is awaited once it runs (its monitor's pid: the
    process group's). ``notice(text)`` receives one-line notes of what the agent did (they go
    into the task log). ``run_as``: start the process as that user. The caller owns the jail
    (figures, close). ``on_stderr`` also gets the stderr bytes (after ``output``), e.g. to keep its
    last lines for the failure message.

    The process is started before any nursery (as trio's ``run_process`` does), so OSError (the
    command cannot be started, e.g. not found) comes out bare, never in a group. Cancellation from
    outside (the agent terminating, a task stopped while it installs) still ends the process: stop
    signal → grace → kill-all (ckagent.containment.stopping) run shielded, its notice beginning with
    ``cancelled_why``, what it says meanwhile still reaching ``output``; then Cancelled propagates.
    """
    if jail is None:
        jail = ProcessGroupJail(task_id)
    mon = spawn_monitored(argv, cwd=cwd, env=env, task_id=task_id, task_dir=None, output_path=None, jail=jail,
                          run_as=run_as, deadline_at=None, work=cwd, stall_timeout=0.0)
    assert mon.pipes is not None
    streams = [trio.lowlevel.FdStream(fd) for fd in mon.pipes]
    for stream in streams:
        enlarge_pipe(stream.fileno())
    try:
        return await supervise(
            mon, jail=jail, output=PipeOutput(streams[0], streams[1], output, on_stderr), grace=grace, stop=stop,
            notice=notice, stop_signal=stop_signal, drain_window=drain_window, deadline_seconds=deadline_seconds,
            cancelled_why=cancelled_why, on_started=on_started,
        )  # fmt: skip
    finally:
        for stream in streams:
            stream.close()  # (FdStream.close: no checkpoint needed, nothing else reads them now)


class PipeOutput:
    """A process's stdout and stderr pipes copied into ``output`` (stderr to ``on_stderr`` too), by
    pumps that run while the supervisor waits (ckagent.containment.supervision.Output)."""

    def __init__(self, stdout: trio.abc.ReceiveStream, stderr: trio.abc.ReceiveStream,
                 output: Callable[[bytes], None], on_stderr: Callable[[bytes], None] | None) -> None:
        self.streams = (stdout, stderr)
        self.output, self.on_stderr = output, on_stderr
        self.exited = trio.Event()  # the main process ended: the pumps stop gathering small writes
        self.done = trio.Event()  # both pipes at their end

    def _pump(self, nursery: trio.Nursery) -> None:
        self.done = trio.Event()
        nursery.start_soon(_pumps, *self.streams, self.output, self.on_stderr, self.exited, self.done)

    @contextlib.asynccontextmanager
    async def following(self) -> AsyncIterator[None]:
        async with trio.open_nursery() as nursery:
            self._pump(nursery)
            yield
            nursery.cancel_scope.cancel()

    async def until_exit_or_stop(self, mon: Monitored, stop: StopRequest) -> None:
        await until_exit_or_stop(mon.wait, stop, self.exited)

    @contextlib.asynccontextmanager
    async def while_stopping(self, final: bool) -> AsyncIterator[None]:
        if not final:  # the pumps of following() run on
            yield
            return
        # Cancelled from outside: following()'s pumps are gone, and what the processes say while
        # they stop still reaches the output (as a monitored spider's output.log goes on growing).
        async with trio.open_nursery() as last:
            self.exited.set()
            self._pump(last)
            yield
            await self.finish()  # everything is dead: the pipes close at once
            last.cancel_scope.cancel()

    async def drained(self, jail: TaskJail, window: float) -> bool:
        with trio.move_on_after(window):  # what the process left behind may still be writing its last lines
            await self.done.wait()
        return False  # then whatever is left is killed

    async def finish(self) -> None:
        with trio.move_on_after(1.0):  # leftovers are dead: their pipe ends close at once
            await self.done.wait()


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


async def _pumps(stdout: trio.abc.ReceiveStream, stderr: trio.abc.ReceiveStream, output: Callable[[bytes], None],
                 on_stderr: Callable[[bytes], None] | None, exited: trio.Event, done: trio.Event) -> None:
    """Copy a process's stdout and stderr into ``output`` (stderr to ``on_stderr`` too) until both
    end; then set ``done``. Cancellation stops at once (a later call may pump on)."""
    async with trio.open_nursery() as inner:
        inner.start_soon(_copy, stdout, output, exited)
        inner.start_soon(_copy, stderr, output if on_stderr is None else _tee(output, on_stderr), exited)
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
