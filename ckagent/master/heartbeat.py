"""The heartbeat loop: the node's health to the master every ``heartbeat.interval`` seconds.

The period does not drift when the node is busy: each beat is scheduled at ``start + k·interval``
(``trio.sleep_until``), and a beat that runs late skips the missed slots instead of bunching up.
It keeps beating while the node drains. What a beat says comes from ONE snapshot, the agent's
:class:`NodeReport`; what the master answers (``cancelTaskIds``, the version policy) goes back to the
agent whole (``on_answer``). A failed
beat is not retried (the next one is due soon); failures — whatever the network answers — are
logged once per episode by the master client's connectivity tracker, and never end the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from ckagent import __version__
from ckagent.master.client import MasterClient, MasterError
from ckagent.master.protocol import Heartbeat, HeartbeatResponse
from ckagent.node.resources import HealthSampler

log = logging.getLogger(__name__)

DEFERRED_START_LIMIT = 1.0
"""Seconds after the start by which the work kept off the way to the first heartbeat (see
:meth:`HeartbeatLoop.after_first_beat`) begins even if that heartbeat has not gone out (master slow or away)."""


@dataclass(frozen=True)
class NodeReport:
    """What one heartbeat says of the node besides its health sample: a snapshot the agent takes
    (its ``report()``) just before each beat. Ids are the task and poll ids as the master gave them.

    ``status``: the agent's state (ckagent.agent.AgentState); ``running_task_ids``: claimed, unfinished
    tasks; ``claiming_task_ids``/``claim_poll_ids``/``last_claim_poll_id``: claims still on the wire
    (the poller's); ``reporting_task_ids``: finished tasks whose result the master has not
    acknowledged yet; ``runtimes``: the latest scan (None: none); ``paused_reason``: why the node
    takes no tasks (None: it takes them).
    """

    status: str
    max_workers: int
    free_slots: int
    running_task_ids: Sequence[str] = ()
    running_spider_ids: Sequence[str] = ()
    claiming_task_ids: Sequence[str] = ()
    claim_poll_ids: Sequence[int] = ()
    last_claim_poll_id: int | None = None
    reporting_task_ids: Sequence[str] = ()
    runtimes: Mapping[str, Any] | None = None
    paused_reason: str | None = None


class HeartbeatLoop:
    """Sends heartbeats: each one the health ``sampler``'s figures plus ``report()`` (a
    :class:`NodeReport`); each acknowledged answer goes to ``on_answer`` (the master's
    ``cancelTaskIds`` and version policy: the agent acts on them). Both are called on the loop and
    must not block.

    ``last_success`` is the ``trio.current_time()`` of the last acknowledged beat (None before the
    first); /readyz and metrics read it. ``first_beat`` is set once :meth:`run` has tried its first
    beat (acknowledged or not): the agent starts what that beat does not need after it.
    """

    def __init__(
        self,
        master: MasterClient,
        sampler: HealthSampler,
        interval: float,
        report: Callable[[], NodeReport],
        on_answer: Callable[[HeartbeatResponse], None] = lambda answer: None,
    ) -> None:
        self._master = master
        self._sampler = sampler
        self.interval = interval
        self._report = report
        self._on_answer = on_answer
        self.last_success: float | None = None
        self.beats = 0
        self.first_beat = trio.Event()

    async def run(self) -> None:
        """Beat until cancelled. Never raises for master trouble."""
        start = trio.current_time()
        k = 0
        while True:
            await self.beat_once()
            self.first_beat.set()
            k = max(k + 1, int((trio.current_time() - start) / self.interval) + 1)
            await trio.sleep_until(start + k * self.interval)

    async def after_first_beat(self) -> None:
        """Return once the first heartbeat was tried, or DEFERRED_START_LIMIT seconds after the call.

        What the first heartbeat does not need waits here, so that it does not compete with the
        start for the CPU: the status server's hypercorn (~45 ms of imports; the port listens from
        the start and early requests wait in its backlog) and the runtime rescan's subprocesses
        (registration uses the cached scan; the fresh one reaches the master with the heartbeats).
        Cancellation: as usual.
        """
        with trio.move_on_after(DEFERRED_START_LIMIT):
            await self.first_beat.wait()

    async def beat_once(self, report: NodeReport | None = None) -> bool:
        """Send one heartbeat (``report``: default ``report()``); returns True when the master
        acknowledged it.

        The beat lists the tasks running here, those whose claim is on the wire and those whose
        result is not acknowledged yet, so that the master can tell them from a task no node runs
        (docs/protocol.md, "Claims and releases"). Never raises for master trouble.
        """
        sample = await trio.to_thread.run_sync(self._sampler.sample)
        node = self._report() if report is None else report
        body = Heartbeat(
            status=node.status,
            cpu_percent=sample.cpu_percent,
            memory_percent=sample.memory_percent,
            disk_percent=sample.disk_percent,
            memory_used_bytes=sample.memory_used_bytes,
            disk_free_bytes=sample.disk_free_bytes,
            load1=sample.load1,
            running_task_ids=sorted(node.running_task_ids),
            running_spider_ids=sorted(node.running_spider_ids),
            max_workers=node.max_workers,
            free_slots=node.free_slots,
            version=__version__,
            uptime_seconds=round(time.monotonic() - self._sampler.started, 1),
            runtimes=dict(node.runtimes) if node.runtimes else None,
            paused_reason=node.paused_reason,
            claiming_task_ids=sorted(node.claiming_task_ids),
            reporting_task_ids=sorted(node.reporting_task_ids),
            claim_poll_ids=sorted(node.claim_poll_ids),
            last_claim_poll_id=node.last_claim_poll_id,
        )
        try:
            # Bounded by server.request_timeout (the master client's deadline), not by the interval: a
            # slow master's answer still arrives and is used (its cancels applied); the beats it made
            # late are skipped, not bunched up (see run()).
            response = await self._master.heartbeat(body)
        except MasterError as exc:  # logged once per episode by the master client
            log.debug("heartbeat failed: %s", exc)
            return False
        self.last_success = trio.current_time()
        self.beats += 1
        self._on_answer(response)
        return True
