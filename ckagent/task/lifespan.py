"""The agent's life as an ephemeral worker (``agent.exit_when_idle``, ``agent.max_tasks``): the watch of
ckagent.node.ephemeral wired to the supervisor, the poller and the outbox, and the exit code a life ends with.

The rules themselves (what idle means, when the budget is spent, the order of the gate and the check) are
ckagent.node.ephemeral's and ckagent.node.taskbudget's; this module only says where the facts come from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import trio

from ckagent.delivery import Outbox
from ckagent.node.config import Settings
from ckagent.node.ephemeral import EXIT_UNDELIVERED, Activity, EphemeralWatch
from ckagent.node.errors import EXIT_OK
from ckagent.node.intake import IntakeGate
from ckagent.node.taskbudget import BUDGET_FILE, TaskBudget
from ckagent.task.poller import Poller
from ckagent.task.supervisor import Supervisor


async def open_lifespan(settings: Settings, supervisor: Supervisor, poller: Poller, outbox: Outbox,
                        gate: IntakeGate, stop: Callable[[], None]) -> EphemeralWatch | None:
    """The watch of an ephemeral worker (None when neither setting is on); with ``agent.max_tasks`` the
    life's budget is read from the work dir (a thread hop) and counted by ``supervisor``'s admissions.
    ``stop()``: the agent's drain. Start :meth:`EphemeralWatch.run` once the agent runs."""
    a = settings.agent
    if a.exit_when_idle <= 0 and a.max_tasks <= 0:
        return None
    budget = None
    if a.max_tasks > 0:
        budget = supervisor.budget = await trio.to_thread.run_sync(TaskBudget.load, a.max_tasks, settings.task.work_dir)

    async def changed(seen: int) -> None:
        deliveries = set(outbox.deliveries)
        async with trio.open_nursery() as nursery:
            async def admissions() -> None:
                if supervisor.changed.count == seen:  # (no checkpoint between the look and the wait)
                    await supervisor.changed.wait()
                nursery.cancel_scope.cancel()

            async def delivered() -> None:
                await outbox.wait_delivered(deliveries)
                nursery.cancel_scope.cancel()

            nursery.start_soon(admissions)
            if deliveries:  # (a delivery opens only for an admitted task: admissions wake the other waiter)
                nursery.start_soon(delivered)

    activity = Activity(
        working=lambda: bool(supervisor.running or supervisor.claiming),
        delivering=lambda: bool(outbox.deliveries),
        mark=lambda: supervisor.changed.count,
        changed=changed,
        settled=poller.wait_settled,
    )
    return EphemeralWatch(gate, activity, lambda _reason: stop(), exit_when_idle=a.exit_when_idle, budget=budget)


async def end_of_life(watch: EphemeralWatch | None, work_dir: Path, *, undelivered: int, handed_over: bool) -> int:
    """The exit code of an agent that stopped (no start-up failure), and the end of its life's budget:
    :data:`EXIT_UNDELIVERED` after an ephemeral stop that left ``undelivered`` tasks' results or logs on disk
    (the budget file stays: the next start on the work dir delivers them and stops again), else 0 — and
    unless the agent handed its tasks over (the next agent goes on with this life), the budget file of
    ``work_dir`` is removed, also by an agent without ``agent.max_tasks`` (a count an earlier, crashed life
    left must not carry over into a later one): the next start counts from 0."""
    if watch is not None and watch.reason is not None and undelivered:
        return EXIT_UNDELIVERED
    if not handed_over:
        budget = watch.budget if watch is not None and watch.budget is not None else TaskBudget(1, work_dir / BUDGET_FILE, [])
        await trio.to_thread.run_sync(budget.end_life)
    return EXIT_OK
