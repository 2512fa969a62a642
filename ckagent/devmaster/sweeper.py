"""The dev master's periodic work: nodes lost after their grace, retries that come due.

:func:`sweep` runs beside the HTTP server in :func:`ckagent.devmaster.server.serve`'s nursery until
cancelled. Every ``tick`` it ends the attempts of RUNNING tasks whose node has been silent for
``node_lost_after`` seconds (NODE_LOST, a disruption: they get a new attempt at once,
:meth:`ckagent.devmaster.store.Store.lose_nodes`), and it wakes the held polls when a retried task's
not-before time passes (the poll hands out no task before it).
"""

from __future__ import annotations

import logging
import time

import trio

from ckagent.devmaster.store import Store
from ckagent.devmaster.web import Notifier

NODE_LOST_AFTER_SECONDS = 600.0
"""The default node-lost grace (``ckagent dev-master --node-lost-after``): the protocol's restart grace
(docs/protocol.md, "The restart grace") — a node's tasks are its own for at least 10 minutes of silence,
so an agent that restarts, or a master that was away, loses nothing."""

_log = logging.getLogger(__name__)


def tick_for(node_lost_after: float) -> float:
    """How often the sweep looks (seconds): a quarter of the grace, between 0.05 s and 1 s."""
    return max(0.05, min(1.0, node_lost_after / 4))


async def sweep(store: Store, notifier: Notifier, node_lost_after: float) -> None:
    """Run the periodic work until cancelled (see the module doc). A store error is logged and retried at
    the next tick; cancellation ends it between two looks (a look in a thread runs to its end)."""
    tick = tick_for(node_lost_after)
    looked = time.time()  # retries due up to here have woken the polls
    while True:
        try:
            if await trio.to_thread.run_sync(store.lose_nodes, node_lost_after):
                notifier.notify()  # their next attempts wait in the queue
            due = await trio.to_thread.run_sync(store.next_due, looked)
        except Exception:  # one bad look must not end the master's sweeps
            _log.exception("dev master sweep failed; trying again in %g s", tick)
            due = None
        now = time.time()
        if due is not None and due <= now:  # a retry came due since the last look: held polls look again
            notifier.notify()
            looked, due = now, None
        await trio.sleep(tick if due is None else min(tick, due - now + 0.001))
