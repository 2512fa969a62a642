"""How delivery waits: the wake-up of a loop that serves several streams, and the backoff of a retry.

:class:`Waker` is what a task's delivery loop (ckagent.delivery.taskdelivery) sleeps on: every
notification of its streams — the journal's records, a grown items or stats file, a batch's answer,
the task's end — sets the one waker, and the loop looks at every stream again. A standalone
:class:`ckagent.delivery.shipper.StreamShipper` has a waker of its own.

:class:`Backoff` is the wait between two attempts of a request the master did not take: the master
client's retry policy (stamina's exponential backoff with jitter), ended early when the master is
reachable again.
"""

from __future__ import annotations

import math

import stamina
import trio

from ckagent.delivery.spool import BACKOFF_INITIAL, EARLY_RETRY_AFTER
from ckagent.master.client import MasterClient

__all__ = ["Backoff", "Waker"]


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


class _Again(Exception):
    """A failed attempt, as stamina is told of it (``retry_after``: the master's Retry-After, or None)."""

    def __init__(self, retry_after: float | None) -> None:
        super().__init__("the master did not take the request")
        self.retry_after = retry_after


def _again_wait(exc: Exception) -> bool | float:
    """stamina's hook: every failed attempt is retried, after the master's Retry-After when it said
    one (else stamina's backoff), as :func:`ckagent.master.errors.retry_wait` decides for the client."""
    if isinstance(exc, _Again):
        return exc.retry_after if exc.retry_after else True
    return False


class Backoff:
    """The waits between the attempts of one request the master did not take (a batch, a result, an
    artifact), under the master client's retry policy: stamina's (``stamina.retry_context``:
    exponential from BACKOFF_INITIAL seconds, doubling, plus up to 1 s of jitter, capped at the
    client's ``max_backoff_interval`` — server.max_backoff_interval — forever), so its instrumentation
    and ``stamina.set_testing`` see these retries as they see the client's.

    Call :meth:`wait` after each failed attempt. A wait ends early (but not before EARLY_RETRY_AFTER
    seconds) when the master becomes reachable again — it waits on the connectivity's event (another
    request got through), it does not poll — unless the master asked for the wait (a 429/503's
    ``Retry-After``: waited in full). Cancellation: as usual; the next :meth:`wait` goes on counting.
    """

    def __init__(self, master: MasterClient) -> None:
        self._connectivity = master.connectivity
        self._attempts = stamina.retry_context(
            on=_again_wait, attempts=None, timeout=None, wait_initial=BACKOFF_INITIAL,
            wait_max=master.max_backoff_interval).__aiter__()
        self._current: stamina.Attempt | None = None  # the attempt that is being made (None: the first)
        self.failed = 0
        """Failed attempts so far."""

    async def wait(self, retry_after: float | None = None) -> None:
        """The attempt just made failed: sleep before the next one (see the class docstring);
        ``retry_after``: seconds the master asked for."""
        if self._current is None:
            self._current = await self._attempts.__anext__()  # the first attempt's (no wait)
        with self._current:
            raise _Again(retry_after)  # recorded by stamina, which decides the wait
        self._current = None
        self.failed += 1
        if retry_after or self._connectivity.up:
            self._current = await self._attempts.__anext__()
            return
        async with trio.open_nursery() as nursery:  # cut short once the master is back

            async def cut() -> None:
                await trio.sleep(EARLY_RETRY_AFTER)
                await self._connectivity.wait_up()
                nursery.cancel_scope.cancel()

            nursery.start_soon(cut)
            self._current = await self._attempts.__anext__()
            nursery.cancel_scope.cancel()
        if self._current is None:  # the wait was cut: stamina's next attempt comes at once
            self._current = await self._attempts.__anext__()
