"""Ephemeral workers: ``agent.exit_when_idle`` and ``agent.max_tasks`` (``ckagent run --exit-when-idle
SECONDS --max-tasks N``), for autoscaled fleets — one-task Kubernetes Jobs, a KEDA ScaledJob, pods that
leave once the queue is empty (as Buildkite's ``--disconnect-after-job`` / ``--disconnect-after-idle-timeout``
and the Actions runner's ``--ephemeral``).

:class:`EphemeralWatch` runs in the agent's root nursery and asks the agent to stop (its ``stop(reason)``:
a drain, then the leaving call that frees the node's name; exit 0) when

- **idle**: for ``exit_when_idle`` seconds no task was claimed (a claim on the wire), running (re-adopted
  ones included) or had results or logs not yet delivered. The timer starts when the node becomes idle
  (at the start, when nothing was left to it). When it fires, the intake gate is closed first (key
  ``exit-when-idle``, *soft*: no new poll, a long poll in flight is cut short, but an answer already in
  hand is settled and its tasks run), then the poller is let settle (:attr:`Activity.settled`), then the
  node is looked at again: a task claimed at that instant keeps the agent (the gate opens again, the timer
  starts over when it is idle again) — no claim lost, nothing handed back. A poll cut short claimed nothing
  (without claims in the poll answer the master assigns only on a claim; with them its claims are taken
  back by the master at once, from the last heartbeat's ``claimPollIds``);
- **max tasks**: ``max_tasks`` tasks were claimed in the agent's life (:mod:`ckagent.node.taskbudget`,
  counted across restarts) and none is claimed or running any more. The gate closes at the N-th claim
  (key ``max-tasks``) and the poller never asks for more than what is left: nothing beyond N is claimed,
  so nothing is handed back. The stop's final flush then delivers what is left (``task.flush_timeout``).

The reason is kept in :attr:`EphemeralWatch.reason` (``exit-when-idle: idle 60 s``, ``max-tasks: 1 of
1 done``) for the log and /status. When the stop's bounded flush leaves results undelivered (a master
down), the agent exits :data:`EXIT_UNDELIVERED` instead of 0: a pod's disk goes with it, so the Job must
not count as done; the pod's supervisor (or a Job's ``restartPolicy: OnFailure``) starts the agent again
on the same work dir, which delivers them and stops again (the budget is still spent).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from ckagent.node.intake import IntakeGate
from ckagent.node.taskbudget import TaskBudget

log = logging.getLogger(__name__)

IDLE_KEY = "exit-when-idle"
BUDGET_KEY = "max-tasks"
EXIT_UNDELIVERED = 3
"""The agent's exit code after an ephemeral stop whose bounded flush left results undelivered."""


@dataclass(frozen=True)
class Activity:
    """What the watch reads of the agent (its supervisor, poller and outbox), all from the Trio thread.

    ``working()``: a task is claimed (its claim on the wire) or admitted and not ended.
    ``delivering()``: a task's logs, items or result are not all delivered.
    ``changed(seen)``: returns once either may have changed since ``seen`` (a count :attr:`mark` returned,
    with no checkpoint between it and the look at the state); cancellation: as usual.
    ``mark()``: the current change count.
    ``settled()``: returns once the poller holds no poll answer it has not settled (every task it claimed
    admitted or given back); called after the gate closed, so no new poll starts meanwhile.
    """

    working: Callable[[], bool]
    delivering: Callable[[], bool]
    mark: Callable[[], int]
    changed: Callable[[int], Awaitable[None]]
    settled: Callable[[], Awaitable[None]]

    def busy(self) -> bool:
        """Not idle: a task claimed, running, or with something undelivered."""
        return self.working() or self.delivering()


class EphemeralWatch:
    """See module docstring. ``exit_when_idle`` seconds (0 = never); ``budget`` None = no task limit.
    ``stop(reason)`` is called once, from the Trio thread."""

    def __init__(self, gate: IntakeGate, activity: Activity, stop: Callable[[str], None], *,
                 exit_when_idle: float, budget: TaskBudget | None) -> None:
        self._gate = gate
        self._activity = activity
        self._stop = stop
        self.exit_when_idle = exit_when_idle
        self.budget = budget
        self.reason: str | None = None
        """Why the watch stopped the agent (None: it did not)."""

    def to_json(self) -> dict[str, object]:
        """What /status shows: the settings, the tasks claimed so far and the stop's reason."""
        return {"exitWhenIdleSeconds": self.exit_when_idle or None,
                "maxTasks": self.budget.limit if self.budget is not None else None,
                "tasksClaimed": len(self.budget.claimed) if self.budget is not None else None,
                "stopReason": self.reason}

    def _spent(self) -> bool:
        """The budget is spent; closes the gate the first time it is seen so (the poller asks for nothing
        more anyway: its free slots count the budget)."""
        if self.budget is None or not self.budget.spent:
            return False
        if not self._gate.is_closed(BUDGET_KEY):
            log.info("max-tasks: %s task(s) claimed: claiming no more; the agent stops once they are done",
                     self.budget.describe())
            self._gate.close(BUDGET_KEY, f"max-tasks: {self.budget.describe()} claimed; stopping once they are done",
                             busy=True)
        return True

    def _finish(self, reason: str) -> None:
        self.reason = reason
        log.info("%s: stopping (a drain), then leaving the master", reason)
        self._stop(reason)

    async def run(self) -> None:
        """Watch until the agent is asked to stop (or cancelled with the root nursery)."""
        act = self._activity
        if self.budget is None and self.exit_when_idle <= 0:
            return
        while True:
            await trio.lowlevel.checkpoint()  # (each round may find its answer without waiting)
            seen = act.mark()
            if self._spent() and not act.working():
                assert self.budget is not None
                self._finish(f"max-tasks: {self.budget.describe()} done")
                return
            if self.exit_when_idle <= 0 or act.busy():
                await act.changed(seen)
                continue
            with trio.move_on_after(self.exit_when_idle) as timer:  # noqa: ASYNC912 - idle from now on; waits unless spent
                while not act.busy() and not self._spent():
                    await act.changed(seen)
                    seen = act.mark()
            if timer.cancelled_caught and await self._still_idle():
                self._finish(f"exit-when-idle: idle {self.exit_when_idle:g} s")
                return

    async def _still_idle(self) -> bool:
        """The idle timer fired: close the gate first (no poll starts, a poll in flight is cut short), let
        the poller settle what it holds, then look again. Busy after all: the gate opens again, False."""
        self._gate.close(IDLE_KEY, f"exit-when-idle: idle for {self.exit_when_idle:g} s; stopping", soft=True)
        await self._activity.settled()
        if self._activity.busy():
            log.info("exit-when-idle: a task was claimed as the idle timer fired; going on")
            self._gate.open(IDLE_KEY)
            return False
        return True
