"""A new attempt of a task this node ran before (issue 38): the earlier attempt's traces make room.

A task's id is the same across its attempts, and so are its task dir (``work_dir/tasks/<id>``) and its
record in the state store (its stream positions, its result). When the master hands this node a later
attempt of a task it ran (a retry after a spider's failure, a resume after the soft memory ceiling), the
earlier attempt's delivery is over — its result was acknowledged, or its streams were answered
"superseded" — and its files are the master's already: :func:`retire_earlier_attempt` removes its
record and its task dir before the new attempt makes them again, so that the new attempt's streams,
spool and state dir start empty (its numbering continues from the task's seq starts:
ckagent.delivery.shipper). The same attempt claimed again (a master that re-sends a claim) keeps them.

:func:`wait_earlier_delivery` waits (bounded) for an earlier attempt's delivery still running in this
agent's outbox to end first — a superseded one ends at its next batch's 409.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import trio

from ckagent.code.workcopy import remove_tree
from ckagent.master.protocol import Task
from ckagent.node.state import StateStore

__all__ = ["EARLIER_DELIVERY_TIMEOUT", "retire_earlier_attempt", "wait_earlier_delivery"]

log = logging.getLogger(__name__)

EARLIER_DELIVERY_TIMEOUT = 60.0
"""Seconds a new attempt waits for its earlier attempt's delivery on this node to end."""


def _attempt_of(task_json: dict[str, Any]) -> int:
    value = task_json.get("attempt")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def retire_earlier_attempt(store: StateStore, task: Task, task_dir: Path) -> int | None:
    """Remove the record and task dir of an earlier attempt of ``task`` on this node (module docstring);
    returns that attempt's number, or None when there was none (or it is the same attempt). Blocking
    (a state store read and write, a tree removal). Raises StateStoreError."""
    record = store.get(task.id)
    if record is None:
        return None
    earlier = _attempt_of(record.task_json)
    if earlier >= task.attempt:
        return None
    if not record.result_acked:
        log.warning("task %s: attempt %d's result was not acknowledged here; the master moved on to attempt %d, "
                    "which starts afresh", task.id, earlier, task.attempt)
    remove_tree(task_dir)
    store.forget(task.id)
    log.info("task %s: attempt %d's record and files on this node removed for attempt %d", task.id, earlier,
             task.attempt)
    return earlier


async def wait_earlier_delivery(deliveries: dict[str, Any], task: Task) -> None:
    """Return once no delivery of an earlier attempt of ``task`` runs in the outbox (``deliveries``: the
    outbox's, by task id), at most EARLIER_DELIVERY_TIMEOUT seconds. Cancellation: as usual."""
    earlier = deliveries.get(task.id)
    if earlier is None or task.attempt <= 1:
        return
    with trio.move_on_after(EARLIER_DELIVERY_TIMEOUT):
        await earlier.delivered.wait()
