"""How delivery waits: the wake-up of a loop that serves several streams, and the backoff of a retry.

:class:`Waker` is what a task's delivery loop (ckagent.delivery.taskdelivery) sleeps on: every
notification of its streams — the journal's records, a grown items or stats file, a batch's answer,
the task's end — sets the one waker, and the loop looks at every stream again. A standalone
:class:`ckagent.delivery.shipper.StreamShipper` has a waker of its own.

:func:`backoff_sleep` is the wait between two attempts of a request the master did not take
(exponential with jitter, ended early when the master is reachable again).
"""

from __future__ import annotations

import math
import random

import trio

from ckagent.delivery.spool import BACKOFF_INITIAL, EARLY_RETRY_AFTER
from ckagent.master.client import MasterClient

__all__ = ["Waker", "backoff_sleep"]


class Waker:
    """A re-armed wake-up: :meth:`set` (on the Trio thread, never blocks) ends the current or the
    next :meth:`wait`. Sets while nobody waits are kept until the next wait returns."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        """Wake the waiter (now, or its next wait at once)."""
        self._event.set()

    async def wait(self, deadline: float = math.inf) -> None:
        """Return when set (at once if it was set since the last wait returned) or at ``deadline``
        (``trio.current_time()`` seconds; inf: no deadline), then re-arm. Always a checkpoint.
        Cancellation: as usual; a set is kept for the next wait."""
        event = self._event
        if event.is_set():
            await trio.lowlevel.checkpoint()
        else:
            with trio.move_on_at(deadline):
                await event.wait()
        if self._event is event:
            self._event = trio.Event()


async def backoff_sleep(master: MasterClient, attempt: int, retry_after: float | None = None) -> None:
    """Sleep the backoff for ``attempt`` (1, 2, ...): exponential with jitter, capped at the master
    client's ``max_backoff_interval`` (server.max_backoff_interval);
    at least ``retry_after`` seconds when the master asked for it (a 429/503's ``Retry-After``).

    Ends early (but not before EARLY_RETRY_AFTER seconds) when the master becomes reachable again:
    it waits on the connectivity's event (another request got through), it does not poll. A wait
    the master asked for is never cut short. Cancellation: as usual.
    """
    base = min(master.max_backoff_interval, BACKOFF_INITIAL * 2 ** (attempt - 1))
    delay = random.uniform(base / 2, base)
    if retry_after:
        await trio.sleep(retry_after)
        return
    connectivity = master.connectivity
    was_up = connectivity.up
    with trio.move_on_after(delay):
        if was_up:
            await trio.sleep_forever()
        await trio.sleep(EARLY_RETRY_AFTER)
        await connectivity.wait_up()
