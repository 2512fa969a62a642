"""The poller: asks the master for work when a slot is free, claims it, hands it to the supervisor.

Each poll asks for ``limit = free slots`` and ``excludeSpiderIds = spiders running here`` and, with
long poll on, ``waitSeconds``: the master may hold the request until a task is ready. A master
that answers at once with nothing (no long poll) is asked again after ``poll_interval`` (sooner
if a spider running here finishes meanwhile: its next task is no longer excluded); a master
that held the request is asked again at once, and so is one whose held poll excluded a spider that
has since finished here (that spider's next task would otherwise wait out the long poll). When no
slot is free the poller waits for one and polls the moment it frees. Each task is claimed (result
RUNNING; the claims of one answer go out together) before it runs; a 409 drops it. A task that breaks the schema is reported FAILED/BAD_TASK and the others run.

Cancelling the poller (drain) stops claiming; tasks already claimed run on in the work nursery. While
the ``gate`` (ckagent.intake) is closed — disk below its floor, agent older than the master's minimum —
the poller does not poll. A task the node cannot run (``can_run``: its framework's tool is missing,
ckagent.capabilities) is not claimed — the master keeps it for other nodes — and its spider is left
out of the next polls (``excludeSpiderIds``) until :meth:`Poller.forget_unrunnable`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from ckagent.intake import IntakeGate
from ckagent.master import (
    MasterClient,
    MasterConflict,
    MasterError,
    MasterRejected,
    MasterUnavailable,
    json_object,
)
from ckagent.protocol import BadTask, PendingTasks, Task, TaskResult, utc_now_iso
from ckagent.supervisor import Supervisor

log = logging.getLogger(__name__)

CLAIM_RETRY_TIMEOUT = 60.0
"""Seconds a claim is retried through master trouble before the task is left to the master."""


class Poller:
    """See module docstring. ``long_poll_wait`` 0 disables long polling (seconds)."""

    def __init__(
        self,
        master: MasterClient,
        supervisor: Supervisor,
        *,
        poll_interval: float,
        long_poll_wait: float,
        request_timeout: float,
        gate: IntakeGate | None = None,
        cannot_run: Callable[[Task], str | None] | None = None,
    ) -> None:
        self._master = master
        self._gate = gate
        self._cannot_run = cannot_run
        self.unrunnable: set[str] = set()
        """Spider ids this node does not take now (excluded from polls)."""
        self._supervisor = supervisor
        self.poll_interval = poll_interval
        self.long_poll_wait = long_poll_wait
        self._request_timeout = request_timeout
        self.polls = 0

    async def run(self, work: trio.Nursery) -> None:
        """Poll until cancelled; claimed tasks are started in ``work`` (the work nursery)."""
        while True:
            if self._gate is not None:
                await self._gate.wait_open()
            await self._supervisor.wait_for_free_slot()
            started = trio.current_time()
            try:
                answer = await self._poll_until_stale()
            except MasterRejected as exc:  # logged once per episode by the master client
                log.debug("polling for tasks failed: %s; retrying in %g s", exc, self.poll_interval)
                await trio.sleep(self.poll_interval)
                continue
            if answer is None:  # a spider the poll excluded has finished: ask again without it
                continue
            for task_id in answer.cancel_task_ids:
                self._supervisor.cancel(task_id, "cancelled by the master")
            for bad in answer.bad_tasks:
                work.start_soon(self._report_bad_task, bad)
            # Claims go out together; each task starts as soon as its own claim is answered.
            async with trio.open_nursery() as claims:
                for task in answer.tasks:
                    why = self._cannot_run(task) if self._cannot_run is not None else None
                    if why is not None:
                        self._leave(task, why)
                    elif task.id not in self._supervisor.running:
                        claims.start_soon(self._claim_and_start, task, work)
            held = trio.current_time() - started >= self.long_poll_wait / 2
            if not answer.tasks and not (self.long_poll_wait and held):
                await self._pause()

    def _leave(self, task: Task, why: str) -> None:
        """Do not claim ``task``: the node cannot run it. One WARNING per spider; excluded from polls."""
        if task.spider_id not in self.unrunnable:
            log.warning("task %s (spider %s, framework %s) not taken: %s; the master keeps it for other nodes",
                        task.id, task.spider_id, task.framework, why)
        self.unrunnable.add(task.spider_id)

    def forget_unrunnable(self) -> None:
        """Offer every spider again (after a scan found the missing tools)."""
        self.unrunnable.clear()

    async def _pause(self) -> None:
        """Wait ``poll_interval`` seconds before the next poll — or less, when a spider the next poll
        would exclude finishes here (its next task may be waiting: e.g. a task cancelled through
        the answer just received). Cancellation: as usual."""
        excluded = self._supervisor.running_spider_ids()
        with trio.move_on_after(self.poll_interval):
            if excluded:
                await self._supervisor.wait_spider_free(excluded)
            else:
                await trio.sleep_forever()

    async def _poll_until_stale(self) -> PendingTasks | None:
        """:meth:`poll_once`, abandoned (None) once a spider it excluded has finished here: a held
        long poll would otherwise keep that spider's next task waiting up to ``long_poll_wait`` s.

        Raises what poll_once raises. The master has handed out nothing it loses: only a claim assigns.
        """
        excluded = self._supervisor.running_spider_ids()
        if not excluded or not self.long_poll_wait:
            return await self.poll_once()
        answer: PendingTasks | None = None
        error: MasterRejected | None = None
        async with trio.open_nursery() as nursery:

            async def poll() -> None:
                nonlocal answer, error
                try:
                    answer = await self.poll_once()
                except MasterRejected as exc:
                    error = exc
                nursery.cancel_scope.cancel()

            nursery.start_soon(poll)
            await self._supervisor.wait_spider_free(excluded)
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        return answer

    async def poll_once(self) -> PendingTasks:
        """One (long) poll, retried with backoff while the master is unavailable or answers something
        that is not the protocol (a bad envelope is a MasterProtocolError, retried the same way).

        Raises MasterRejected (4xx).
        """
        sup = self._supervisor
        params: dict[str, str | int | float] = {"limit": max(1, sup.free_slots())}
        excluded = sorted(set(sup.running_spider_ids()) | self.unrunnable)
        if excluded:
            params["excludeSpiderIds"] = ",".join(excluded)
        if self.long_poll_wait:
            params["waitSeconds"] = self.long_poll_wait
        answer: PendingTasks = await self._master.call_retrying(
            "poll", "GET", "/api/nodes/{node}/tasks/pending", params=params,
            read_timeout=self.long_poll_wait + self._request_timeout, answer=PendingTasks.from_json,
        )
        self.polls += 1
        return answer

    async def _claim_and_start(self, task: Task, work: trio.Nursery) -> None:
        if await self._claim(task.id):
            rt = self._supervisor.admit(task)
            work.start_soon(self._supervisor.run_task, rt, name=f"task {task.id}")

    async def _claim(self, task_id: str) -> bool:
        body = TaskResult(status="RUNNING", started_at=utc_now_iso()).to_json()
        try:
            await self._master.call_retrying(
                "claim", "POST", f"/api/tasks/{task_id}/result", json=body, retry_timeout=CLAIM_RETRY_TIMEOUT,
                answer=json_object,
            )
        except MasterConflict:
            log.info("task %s: claimed elsewhere or cancelled (409); not running it", task_id)
            return False
        except (MasterRejected, MasterUnavailable) as exc:
            log.warning("task %s: claim failed (%s); leaving it to the master", task_id, exc)
            return False
        return True

    async def _report_bad_task(self, bad: BadTask) -> None:
        log.error("task %s breaks the protocol: %s", bad.task_id or "<no id>", bad.error)
        if bad.task_id is None:
            return
        now = utc_now_iso()
        result = TaskResult(status="FAILED", error_code="BAD_TASK", error_message=str(bad.error),
                            started_at=now, finished_at=now, duration_ms=0, item_count=0, log_lines=0)
        try:
            await self._master.call_retrying("result", "POST", f"/api/tasks/{bad.task_id}/result",
                                             json=result.to_json(), retry_timeout=CLAIM_RETRY_TIMEOUT,
                                             answer=json_object)
        except MasterError as exc:
            log.warning("task %s: could not report BAD_TASK (%s)", bad.task_id, exc)
