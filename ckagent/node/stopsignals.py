"""The agent's stop signals: what each one asks, in one place (the agent's shutdown states are its own).

::

    SIGTERM   a request file of ``ckagent stop`` (ckagent.node.stoprequest) → what it asks (drain or migrate);
              none → ``agent.sigterm`` (drain by default; migrate where Kubernetes should hand crawls over);
              while draining or migrating already: terminate (a second SIGTERM; a migrate request during a
              drain still migrates)
    SIGINT    terminate
    SIGUSR2   hand over (HAND_OVER_SIGNAL: stop, leave the running spiders to the next agent)
    any, while STOPPING (the final flush): skip what is left of it and exit now

A stop that came while no agent ran: the pod's supervisor (ckagent.pod) got SIGTERM or SIGINT between a
crashed agent and the next one while crawls were still running, so it starts the next agent at once with
``CKAGENT_STOP_AT_START`` naming the signal; that agent re-adopts the crawls, then sends the signal to
itself (:func:`stop_at_start`): the crawls are migrated or drained as the signal asks, not left to the
pod's end.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from ckagent.node.stoprequest import StopMode, take_request

log = logging.getLogger(__name__)

HAND_OVER_SIGNAL = signal.SIGUSR2
"""Stop the agent and leave its running tasks to the next agent, which re-adopts them (``run.sh
upgrade``/``restart``). SIGTERM still drains, SIGINT terminates (docs/operations.md)."""


STOP_AT_START_ENV = "CKAGENT_STOP_AT_START"
"""Set by the pod's supervisor: ``SIGTERM`` or ``SIGINT``, the stop to act on once the agent runs."""


def stop_at_start(environ: dict[str, str] | os._Environ[str] = os.environ) -> signal.Signals | None:
    """The stop a supervisor handed to this agent (module docstring), taken out of ``environ`` so no
    spider inherits it; None without one or for another value (logged). Never raises."""
    value = environ.pop(STOP_AT_START_ENV, None)
    if value is None:
        return None
    if value in ("SIGTERM", "SIGINT"):
        return signal.Signals[value]
    log.warning("ignoring %s=%r (SIGTERM or SIGINT expected)", STOP_AT_START_ENV, value[:40])
    return None


@dataclass(frozen=True)
class StopActions:
    """What the signals can ask of the agent (its methods), and the two facts of its state they read."""

    drain: Callable[[], None]
    migrate: Callable[[], None]
    terminate: Callable[[], None]
    hand_over: Callable[[], None]
    hurry: Callable[[], None]
    """Skip the rest of the final flush (a signal while STOPPING)."""
    fresh: Callable[[], bool]
    """True while STARTING or RUNNING (no stop asked yet)."""
    stopping: Callable[[], bool]
    """True while STOPPING (the final flush)."""
    migrating: Callable[[], bool]
    """True once a migrate was asked."""


async def receive_stop_signals(actions: StopActions, work_dir: Path, sigterm: StopMode) -> None:
    """Receive SIGTERM, SIGINT and HAND_OVER_SIGNAL until cancelled and act on each (module docstring).
    ``sigterm``: what a SIGTERM without a request file asks (``agent.sigterm``). Cancellation: as usual."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, HAND_OVER_SIGNAL) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            asked = take_request(work_dir) if signum == signal.SIGTERM else None  # (always taken: never stale)
            if signum == HAND_OVER_SIGNAL and not actions.stopping():
                actions.hand_over()
            elif actions.stopping():
                log.info("%s while flushing: leaving unsent data on disk and exiting now", name)
                actions.hurry()
            elif signum == signal.SIGTERM and asked is StopMode.MIGRATE and not actions.migrating():
                log.info("SIGTERM with `ckagent stop --migrate`: migrating the running tasks")
                actions.migrate()
            elif signum == signal.SIGTERM and actions.fresh():
                mode = asked or sigterm
                if mode is StopMode.MIGRATE:
                    log.info("SIGTERM (agent.sigterm: migrate): migrating the running tasks "
                             "(a second SIGTERM or SIGINT terminates)")
                    actions.migrate()
                else:
                    how = "`ckagent stop`" if asked is not None else "agent.sigterm: drain"
                    log.info("SIGTERM (%s): draining (a second SIGTERM or SIGINT terminates)", how)
                    actions.drain()
            else:
                log.info("%s: terminating", name)
                actions.terminate()
