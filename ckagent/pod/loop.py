"""A one-thread event loop for the supervisor: descriptors (``selectors``), timers, signals.

The supervisor must not wake up when nothing happens (PID 1 of every pod): :meth:`Loop.run_once`
blocks in ``epoll_wait`` until a descriptor is ready, a signal arrives or the earliest timer is due —
there is no periodic tick. Signals come in through ``signal.set_wakeup_fd``: the C-level handler
writes the signal's number as one byte to a socket pair the loop reads, so no signal is lost between
two waits and none is handled inside a Python signal handler (:meth:`Loop.on_signals`).

Not thread-safe; callbacks run on the loop's thread, one at a time. A callback that raises is a bug:
the exception ends :meth:`Loop.run_once` (the supervisor logs it and goes on, see its ``run``).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import selectors
import signal
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(order=True)
class Timer:
    """A callback due at ``when`` (``time.monotonic()`` seconds); :meth:`cancel` is idempotent."""

    when: float
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        """Do not call the callback (a no-op once it ran)."""
        self.cancelled = True


class Loop:
    """Descriptors, timers and signals on one thread (module docstring)."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self._timers: list[Timer] = []
        self._seq = itertools.count()
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None

    @staticmethod
    def now() -> float:
        """``time.monotonic()``: the clock of every deadline here."""
        return time.monotonic()

    def add(self, fileobj: socket.socket | int, events: int, callback: Callable[[int], None]) -> None:
        """Call ``callback(mask)`` whenever ``fileobj`` is ready for ``events`` (``selectors.EVENT_*``);
        registering it again changes its events and callback."""
        try:
            self.selector.modify(fileobj, events, callback)
        except KeyError:
            self.selector.register(fileobj, events, callback)

    def remove(self, fileobj: socket.socket | int) -> None:
        """Stop watching ``fileobj`` (a no-op when it is not watched)."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fileobj)

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Call ``callback()`` once at ``when`` (monotonic seconds) or soon after; returns its Timer."""
        timer = Timer(when, next(self._seq), callback)
        heapq.heappush(self._timers, timer)
        return timer

    def call_later(self, delay: float, callback: Callable[[], None]) -> Timer:
        """:meth:`call_at` ``delay`` seconds from now."""
        return self.call_at(self.now() + delay, callback)

    def on_signals(self, signums: Iterable[int], callback: Callable[[int], None]) -> None:
        """Call ``callback(signum)`` on the loop for each of ``signums`` received (in order of arrival).

        Installs a do-nothing Python handler for each (a handled signal also reaches PID 1 of a pid
        namespace, where the kernel drops the signals left at their default) and the wake-up
        descriptor. Call once, from the main thread."""
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (self._wake_r, self._wake_w):
            sock.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for signum in signums:
            signal.signal(signum, _noop)
        wake_r = self._wake_r

        def readable(_mask: int) -> None:
            try:
                data = wake_r.recv(4096)
            except BlockingIOError:
                return
            for signum in data:
                callback(signum)

        self.add(wake_r, selectors.EVENT_READ, readable)

    def run_once(self, limit: float | None = None) -> None:
        """Wait for the next descriptor, signal or due timer (at most ``limit`` seconds; None: no
        limit but the timers'), then run what is ready: descriptors first, then due timers."""
        timeout = limit
        while self._timers and self._timers[0].cancelled:
            heapq.heappop(self._timers)
        if self._timers:
            due_in = max(0.0, self._timers[0].when - self.now())
            timeout = due_in if timeout is None else min(timeout, due_in)
        ready = self.selector.select(timeout)
        # Signals first: an agent's end (SIGCHLD) is known before a probe's failure is judged.
        ready.sort(key=lambda event: event[0].fileobj is not self._wake_r)
        for key, mask in ready:
            key.data(mask)
        now = self.now()
        while self._timers and (self._timers[0].cancelled or self._timers[0].when <= now):
            timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.cancelled = True
                timer.callback()


def _noop(_signum: int, _frame: object) -> None:
    """The Python-level handler: the wake-up descriptor carries the signal (module docstring)."""
