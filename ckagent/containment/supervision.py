"""The agent's one supervisor: a process it spawned behind a monitor (ckagent.containment.monitor:
a spider, an installer) followed to its end — its exit, its deadline, its stop — with the stop
sequence (ckagent.containment.stopping), the jail's kill of what is left, and the output taken in
meanwhile: from the spider's output file (:class:`FileOutput`, here) or from an installer's pipes
(ckagent.containment.process.PipeOutput).

Nothing here raises for a process that is already gone; cancellation: see :func:`supervise`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import trio

from ckagent.containment import TaskJail
from ckagent.containment.filewatch import FileWatch
from ckagent.containment.monitor import Monitored
from ckagent.containment.stopping import (
    Notice,
    ProcessOutcome,
    ScopedStop,
    StopRequest,
    StopSequence,
    Supervised,
    until_exit_or_stop,
)

log = logging.getLogger(__name__)

OUTPUT_COALESCE_BELOW = 16 * 1024
"""Growth of output.log below this many bytes means a trickle: let more gather before the next look."""
OUTPUT_COALESCE_INTERVAL = 0.05
"""Seconds a trickle's output gathers before the next look (one journal record for many lines)."""


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
                limit = getattr(stop, "grace_limit", None)  # (a migrate's time left: ckagent.task.stop)
                if limit is not None and not outcome.timed_out:
                    stopper.grace = max(0.0, min(stopper.grace, limit))
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
