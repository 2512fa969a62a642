"""The stop sequence every process supervisor uses: stop signal → grace → kill every process of the jail.

One sequence for the agent's one supervisor (ckagent.containment.supervision.supervise): a spider behind
its monitor, and an installer behind its monitor on pipes (ckagent.containment.process.run_supervised,
ckagent.code.installer)::

    stop(why) ──► stop signal to the process that does the work (through launchers: stoptarget)
              ──► wait for the main process, at most ``grace`` seconds (the node's kill_grace)
              ──► a launcher that exited: wait for what it ran, within the same grace
              ──► still running: kill every process of the jail, reap the main process (≤ REAP_TIMEOUT)

:class:`StopSequence` remembers what it sent: a second :meth:`~StopSequence.stop` (an outside cancel
after a requested stop) only waits for what is left of the same grace. What a supervisor waits on to
begin is a :class:`StopRequest` (a ``trio.Event`` is one; so is the task's stop, ckagent.task.stop).
Nothing here raises for a process that is already gone.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import trio

from ckagent.containment import TaskJail
from ckagent.containment.process_group import signal_group
from ckagent.containment.stoptarget import StopTarget, describe_targets, send_stop, wait_gone

log = logging.getLogger(__name__)

REAP_TIMEOUT = 5.0
"""Seconds to wait for a SIGKILLed main process to be reaped (a process stuck in the kernel, state D,
cannot die); after that the agent gives up on it rather than hang."""

Notice = Callable[[str], None]
"""Receives one line of what the agent did (it goes into the task log)."""


class StopRequest(Protocol):
    """What a supervisor waits on before it stops its process (``trio.Event`` fits)."""

    def is_set(self) -> bool:
        """True once the stop is requested."""

    async def wait(self) -> None:
        """Return once the stop is requested."""


@runtime_checkable
class ScopedStop(Protocol):
    """A :class:`StopRequest` that cancels scopes itself (the task's stop, ckagent.task.stop): a
    supervisor waits for its process inside :meth:`cancelling`, in its own task, instead of beside
    a task that waits for the stop."""

    def is_set(self) -> bool:
        """True once the stop is requested."""

    async def wait(self) -> None:
        """Return once the stop is requested."""

    def cancelling(self, deadline: float = math.inf) -> AbstractContextManager[trio.CancelScope]:
        """A cancel scope that the stop's request cancels (at once when it was requested already),
        ending at ``deadline`` (Trio's clock) at the latest — or sooner, when the request must look
        at limits of its own (a run-time limit, a stall limit) then; enter it again to go on waiting."""


async def until_exit_or_stop(wait_exit: Callable[[], Awaitable[object]], stop: StopRequest, exited: trio.Event) -> None:
    """Return once the supervised process has exited (``wait_exit()`` returned: ``exited`` is set
    then) or its stop is requested, whichever comes first: in this task for a :class:`ScopedStop`
    (the exit is waited for in a scope the stop cancels), else beside a task waiting for the stop.
    Cancellation: as usual."""
    if isinstance(stop, ScopedStop):
        while not stop.is_set():
            with stop.cancelling():
                await wait_exit()
                exited.set()
                return
        return
    async with trio.open_nursery() as first:

        async def until_exit() -> None:
            await wait_exit()
            exited.set()
            first.cancel_scope.cancel()

        async def until_stop() -> None:
            await stop.wait()
            first.cancel_scope.cancel()

        first.start_soon(until_exit)
        first.start_soon(until_stop)


@dataclass
class ProcessOutcome:
    """How a supervised process ended.

    ``returncode`` is the main process's exit status (negative = killed by that signal; None when it
    could not be reaped); ``timed_out``/``stopped`` say whether the agent ended it (its own deadline /
    a stop request); ``term_sent_at``/``kill_sent_at`` are wall-clock times (epoch seconds) of the
    agent's stop signal to the main process / its kill of every process; ``killed_leftovers`` counts
    processes killed besides the supervised ones (a cgroup kill counts what the cgroup held);
    ``workers_left`` how many processes the stop signal went to below a launcher were still running
    when the grace ended (killed then, though the launcher had exited).
    """

    returncode: int | None = None
    timed_out: bool = False
    stopped: bool = False
    term_sent_at: float | None = None
    kill_sent_at: float | None = None
    killed_leftovers: int = 0
    workers_left: int = 0


@dataclass
class Supervised:
    """The process a :class:`StopSequence` stops, as its supervisor sees it.

    ``leader``: the pid of the process group the supervisor spawned (what is signalled while
    ``main_pid()`` is None); ``main_pid()``: the process doing the work (None: not there yet);
    ``exited()``/``wait()``: whether / once the supervised process (the leader) has ended;
    ``own``: how many of the jail's processes are the supervised ones (not leftovers);
    ``signal_leader_group(sig)``: how the leader's group is signalled when the leader is not this
    agent's own child (a re-adopted monitor: through its proven pidfd, ckagent.node.procid; False
    when it has exited); None: ``killpg(leader)`` (our child, not reaped while supervised).
    """

    leader: int
    main_pid: Callable[[], int | None]
    exited: Callable[[], bool]
    wait: Callable[[], Awaitable[object]]
    own: int = 1
    signal_leader_group: Callable[[int], bool] | None = None


class StopSequence:
    """Stop signal → ``grace`` seconds → kill every process of ``jail`` (see module docstring), for
    ``proc``; what was done goes into ``outcome`` and, one line each, to ``notice``."""

    def __init__(self, proc: Supervised, jail: TaskJail, grace: float, stop_signal: int, notice: Notice,
                 outcome: ProcessOutcome) -> None:
        self.proc, self.jail, self.grace, self.notice, self.outcome = proc, jail, grace, notice, outcome
        self.stop_signal = stop_signal
        self._term_deadline: float | None = None
        self._targets: list[StopTarget] = []
        self._main = proc.leader
        self._gave_up = False

    async def stop(self, why: str) -> None:
        """Run the sequence (``why`` begins its notice); returns once the process is gone or given up
        on. Call it shielded where it must complete. Cancellation: as usual (a later call goes on)."""
        proc = self.proc
        if proc.exited() or self._gave_up:
            return
        name = signal.Signals(self.stop_signal).name
        if self._term_deadline is None:
            self.outcome.term_sent_at = time.time()
            self._term_deadline = trio.current_time() + self.grace
            target = proc.main_pid()
            if target is not None:
                # To the process that does the work, through launchers that pass nothing on (npm start).
                self._targets = await trio.to_thread.run_sync(send_stop, target, self.stop_signal)
                self._main = target
                whom = describe_targets(target, self._targets)
            else:  # not forked yet (a monitor ignores the usual stop signals): its group
                if proc.signal_leader_group is not None:
                    proc.signal_leader_group(self.stop_signal)
                else:
                    signal_group(proc.leader, self.stop_signal)
                whom = f"the main process {proc.leader}"
            self.notice(f"{why}: sent {name} to {whom}; every process of the task is killed in {self.grace:g} s")
        with trio.move_on_at(self._term_deadline):
            await proc.wait()
        if proc.exited() and self._targets and [t.pid for t in self._targets] != [self._main]:
            # The launcher ended; what it ran must end too before the grace counts as kept.
            left = await wait_gone(self._targets, self._term_deadline)
            self.outcome.workers_left = len(left)
            if left:
                self.notice(f"the launcher exited but {describe_targets(self._main, left)} still ran "
                            f"{self.grace:g} s after {name}: killed")
        if not proc.exited():
            self.outcome.kill_sent_at = time.time()
            killed = await self.jail.kill_all()
            self.outcome.killed_leftovers += max(0, killed - proc.own)
            self.notice(f"main process still running {self.grace:g} s after {name}: killed every process "
                        f"of the task ({self.jail.level})")
            with trio.move_on_after(REAP_TIMEOUT):
                await proc.wait()
            if not proc.exited():
                self._gave_up = True
                log.error("process %d did not die %g s after SIGKILL (stuck in the kernel?); giving up on it",
                          proc.leader, REAP_TIMEOUT)
