"""The heartbeat loop: the node's health to the master every ``heartbeat.interval`` seconds.

The period does not drift when the node is busy: each beat is scheduled at ``start + k·interval``
(``trio.sleep_until``), and a beat that runs late skips the missed slots instead of bunching up.
It keeps beating while the node drains. The master's answer may carry ``cancelTaskIds``. A failed
beat is not retried (the next one is due soon); failures — whatever the network answers — are
logged once per episode by the master client's connectivity tracker, and never end the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import trio

from ckagent import __version__
from ckagent.master.client import MasterClient, MasterError
from ckagent.master.protocol import Heartbeat, VersionPolicy
from ckagent.node.resources import HealthSampler

log = logging.getLogger(__name__)


class RunningSet(Protocol):
    """What a heartbeat reads of the tasks on this node (the task runner's admission gives it).

    ``running``/``claiming``/``claim_polls`` are task and poll ids; ``cancel`` stops one task.
    """

    @property
    def running(self) -> Mapping[str, object]: ...

    @property
    def claiming(self) -> Collection[str]: ...

    @property
    def claim_polls(self) -> Collection[int]: ...

    @property
    def last_claim_poll(self) -> int | None: ...

    @property
    def max_workers(self) -> int: ...
    def running_spider_ids(self) -> list[str]: ...

    def free_slots(self) -> int: ...

    def cancel(self, task_id: str, reason: str) -> object: ...


class HeartbeatLoop:
    """Sends heartbeats; ``status()`` gives the agent's state (ckagent.agent.AgentState);
    ``runtimes()`` the latest scan; ``reporting()`` the tasks whose result is not acknowledged yet.

    ``last_success`` is the ``trio.current_time()`` of the last acknowledged beat (None before the
    first); /readyz and metrics read it. ``first_beat`` is set once :meth:`run` has tried its first
    beat (acknowledged or not): the agent starts what that beat does not need after it.
    """

    def __init__(
        self,
        master: MasterClient,
        supervisor: RunningSet,
        sampler: HealthSampler,
        interval: float,
        status: Callable[[], str],
        runtimes: Callable[[], dict[str, Any]],
        paused_reason: Callable[[], str | None] = lambda: None,
        on_policy: Callable[[VersionPolicy], None] = lambda policy: None,
        reporting: Callable[[], list[str]] = list,
    ) -> None:
        self._master = master
        self._supervisor = supervisor
        self._sampler = sampler
        self.interval = interval
        self._status = status
        self._runtimes = runtimes
        self._paused_reason = paused_reason
        self._on_policy = on_policy
        self._reporting = reporting
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

    async def beat_once(self, *, reporting: list[str] | None = None) -> bool:
        """Send one heartbeat; returns True when the master acknowledged it.

        The beat lists the tasks running here, those whose claim is on the wire and those whose
        result is not acknowledged yet (``reporting``: default ``reporting()``), so that the master
        can tell them from a task no node runs (docs/protocol.md, "Claims and releases").
        """
        sample = await trio.to_thread.run_sync(self._sampler.sample)
        sup = self._supervisor
        body = Heartbeat(
            status=self._status(),
            cpu_percent=sample.cpu_percent,
            memory_percent=sample.memory_percent,
            disk_percent=sample.disk_percent,
            memory_used_bytes=sample.memory_used_bytes,
            disk_free_bytes=sample.disk_free_bytes,
            load1=sample.load1,
            running_task_ids=sorted(sup.running),
            running_spider_ids=sup.running_spider_ids(),
            max_workers=sup.max_workers,
            free_slots=sup.free_slots(),
            version=__version__,
            uptime_seconds=round(time.monotonic() - self._sampler.started, 1),
            runtimes=self._runtimes() or None,
            paused_reason=self._paused_reason(),
            claiming_task_ids=sorted(sup.claiming),
            reporting_task_ids=sorted(self._reporting() if reporting is None else reporting),
            claim_poll_ids=sorted(sup.claim_polls),
            last_claim_poll_id=sup.last_claim_poll,
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
        for task_id in response.cancel_task_ids:
            sup.cancel(task_id, "cancelled by the master")
        self._on_policy(response.policy)
        return True
