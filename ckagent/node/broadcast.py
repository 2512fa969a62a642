"""A re-armable event: what ``event.set(); event = trio.Event()`` did by hand.

:meth:`Broadcast.set` wakes every task waiting in :meth:`Broadcast.wait` at that moment; a ``wait()``
that starts after it waits for the next ``set()``. Nothing is latched: a waiter checks its condition
first and waits only while it does not hold (no checkpoint between the check and the wait, so no
``set()`` can fall between them)::

    while not condition():
        await changed.wait()

A flag that one consumer must not miss while it is busy elsewhere (a shipper's wake-up) is a plain
``trio.Event`` re-armed by that consumer after it woke; a state that stays true (idle, open) is a
plain ``trio.Event`` replaced when the state ends. Use from the Trio loop only.
"""

from __future__ import annotations

import trio

__all__ = ["Broadcast"]


class Broadcast:
    """Wakes every current waiter at each :meth:`set` (see module docstring). ``count``: the
    ``set()`` calls so far."""

    __slots__ = ("_event", "count")

    def __init__(self) -> None:
        self._event = trio.Event()
        self.count = 0

    def set(self) -> None:
        """Wake every task waiting now; later waits wait for the next call."""
        self.count += 1
        event, self._event = self._event, trio.Event()
        event.set()

    async def wait(self) -> None:
        """Return at the next :meth:`set`. Cancellation: the wait just ends."""
        await self._event.wait()
