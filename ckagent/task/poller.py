"""The poller: asks the master for work when a slot is free, claims it, hands it to the supervisor.

Each poll asks for ``limit = free slots`` and ``excludeSpiderIds = spiders running here`` and, with
long poll on, ``waitSeconds``: the master may hold the request until a task is ready. A master
that answers at once with nothing (no long poll) is asked again after ``poll_interval`` (sooner
if a spider running here finishes meanwhile: its next task is no longer excluded); a master
that held the request is asked again at once, and so is one whose held poll excluded a spider that
has since finished here (that spider's next task would otherwise wait out the long poll) — unless
the master offers ``poll-follows-results``: then the poll also names the spiders excluded because
they run here (``runningSpiderIds``), the master hands their next task out in the held poll once it
has this node's final result, and the poll — and the connection it holds: httpx closes one whose
request is cancelled — is kept (docs/protocol.md, "A held poll follows the node's results"). A master
that answers at once only because it still lists tasks already stopped here (``cancelTaskIds``
until their CANCELLED results arrive) is asked again as soon as one of those results is delivered
(``reported``: the outbox's event), so the next poll can be held and hears the next cancel at once.
When no slot is free the poller waits for one and polls the moment it frees. Each task is claimed (result
RUNNING; the claims of one answer go out together) before it runs; a 409 drops it. A task that breaks the schema is reported FAILED/BAD_TASK and the others run.

Stopping (drain, :meth:`Poller.stop`) ends the poll in flight and the pauses at once, but never a
claim on the wire: a claim the master answers is a task the master thinks runs here. Each claim
still on the wire gets up to ``request_timeout`` more seconds for its answer; a task whose claim
succeeds after the stop began is given back (``POST /api/tasks/{id}/release``: the master makes it
PENDING again), and so is one whose claim was cut off without an answer (a release of a task the
master never assigned is a no-op). ``run`` returns once every claim is settled: tasks already
admitted run on in the work nursery. While a claim is on the wire its task id is in
``Supervisor.claiming`` (the heartbeat reports it as ``claimingTaskIds``), so the master can tell a
claim in flight from a task no node runs.

**Claims in the poll answer** (``claim-in-poll``, when the master named it at registration): each
poll also asks the master to claim what it hands out (``claim`` = free slots) and names itself
(``pollId``: an integer that grows, by the wall clock across restarts). The answer's tasks are then
this node's already (``claimed``): each is admitted at once, or given back (stopping, or a task the
node cannot run) — one round trip instead of two. A poll whose answer does not arrive (cut off,
timed out, abandoned because a spider it excluded finished here) is ambiguous like a claim cut off:
its id stays open and the next poll (a retry, or the next one) sends it again, so the master answers
the tasks it claimed for it again; the heartbeat lists the open id (``claimPollIds``) and the newest
one sent (``lastClaimPollId``), so the master can take back, without waiting, the claims of a poll
the node has settled without getting them (docs/protocol.md, "Claims in the poll answer"). An id is
settled once its answer's tasks are admitted or given back, or when the poller ends (stopping cuts
the poll in flight: the master's reconciliation takes its claims back).

While the ``gate`` (ckagent.node.intake) is closed — disk below its floor, agent older than the master's minimum —
the poller does not poll; a poll in flight when it closes is cut short, and an answer that arrives
after it closed claims nothing (what the answer claimed is given back at once). A task the node cannot run (``can_run``: its framework's tool is missing,
ckagent.code.capabilities) is not claimed — the master keeps it for other nodes — and its spider is left
out of the next polls (``excludeSpiderIds``) until :meth:`Poller.forget_unrunnable`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import trio

from ckagent.master.client import (
    MasterClient,
    MasterConflict,
    MasterError,
    MasterRejected,
    MasterUnavailable,
)
from ckagent.master.endpoints import Retry
from ckagent.master.ids import shown_id
from ckagent.master.protocol import (
    CLAIM_IN_POLL,
    POLL_FOLLOWS_RESULTS,
    BadTask,
    PendingTasks,
    Task,
    TaskRelease,
    TaskResult,
    utc_now_iso,
)
from ckagent.node.broadcast import Broadcast
from ckagent.node.intake import IntakeGate
from ckagent.task.outcome import cause_fields
from ckagent.task.supervisor import Supervisor

log = logging.getLogger(__name__)

FOLLOW_GRACE = 0.3
"""Seconds a held poll is kept after a spider it excluded finished here, with a master that offers
``poll-follows-results`` (its answer waits for the task's result): then abandoned and sent again."""
CLAIM_RETRY_TIMEOUT = 60.0
"""Seconds a claim is retried through master trouble before the task is left to the master."""
RELEASE_TIMEOUT = 5.0
"""Seconds a release (a claim given back while stopping) may take; a release that does not get
through is left to the master's reconciliation (docs/protocol.md, "Claims and releases")."""
SUPERSEDING = "an older attempt of this task still runs here: it is stopped; claimed again once it has left"
"""Why a newer attempt of a task whose older attempt runs here is given back (it is claimed again later)."""


@dataclass(frozen=True)
class _Answer:
    """One poll's answer and how long the master held it (seconds)."""

    pending: PendingTasks
    held_seconds: float
    poll_id: int | None = None
    """The claiming poll's id (claim-in-poll), None for a poll that claimed nothing."""


MAX_BAD_LOGGED = 1024
"""Refused tasks remembered so each is logged once (the memory starts over when full)."""
_AT_INDEX = re.compile(r"^tasks\[\d+\]")


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
        reported: Callable[[set[str]], Awaitable[None]] | None = None,
    ) -> None:
        self._master = master
        self._reported = reported
        self._gate = gate
        self._cannot_run = cannot_run
        self._bad_logged: set[tuple[str | None, str]] = set()
        """Refused tasks already logged (a master that offers one again gets no second line); bounded."""
        self.unrunnable: set[str] = set()
        """Spider ids this node does not take now (excluded from polls)."""
        self._supervisor = supervisor
        self.poll_interval = poll_interval
        self.long_poll_wait = long_poll_wait
        self._request_timeout = request_timeout
        self.polls = 0
        self._stopping = False
        self._idle_scope: trio.CancelScope | None = None
        self._claim_deadline = math.inf
        self._claim_scopes: set[trio.CancelScope] = set()
        self._poll_id: int | None = None  # the open claiming poll (sent, its answer not settled)
        self.polling = False
        """A poll is on the wire, or its answer is being settled (claims on the wire, admissions)."""
        self._rested = Broadcast()
        self._answered_poll: int | None = None  # the claiming poll the last answer came for

    def stop(self, *, claim_timeout: float | None = None) -> None:
        """Stop polling (idempotent): the poll in flight and any pause end at once; claims on the wire
        get ``claim_timeout`` (default: ``request_timeout``) more seconds, then are cut off and
        released. :meth:`run` returns once the claims are settled."""
        self._stopping = True
        deadline = trio.current_time() + (self._request_timeout if claim_timeout is None else claim_timeout)
        if deadline < self._claim_deadline:  # a terminate after a drain shortens the claims' time
            self._claim_deadline = deadline
            for scope in self._claim_scopes:
                scope.deadline = deadline
        if self._idle_scope is not None:
            self._idle_scope.cancel()

    async def run(self, work: trio.Nursery) -> None:
        """Poll until :meth:`stop` (or cancelled); claimed tasks are started in ``work`` (the work nursery).

        Cancellation from outside cuts claims off; their tasks are released (shielded, at most
        RELEASE_TIMEOUT seconds each) before the Cancelled goes on.
        """
        try:
            while not self._stopping:
                answer: _Answer | None = None
                with trio.CancelScope() as idle:  # what a stop ends at once: waiting, polling, pausing
                    self._idle_scope = idle
                    answer = await self._next_answer()
                self._idle_scope = None
                if answer is None:
                    self._settled()
                    continue  # stopped (the loop ends), or a spider the poll excluded has finished
                self._supervisor.master_cancelled(answer.pending.cancel_task_ids)
                for bad in answer.pending.bad_tasks:
                    work.start_soon(self._report_bad_task, bad)
                # Claims go out together; each task starts as soon as its own claim is answered. A stop
                # does not cut them off (see the module docstring). Tasks the answer claimed start now.
                closed = self._gate.refusal if self._gate is not None else None
                room = self._supervisor.claim_room()  # (agent.max_tasks: what is left of the budget)
                async with trio.open_nursery() as claims:
                    for task in answer.pending.tasks:
                        if closed is not None:  # the gate closed while the answer was on its way
                            if task.claimed and task.id not in self._supervisor.running:
                                claims.start_soon(self._release, task.id, f"not run here: {closed}")
                            continue
                        why = self._cannot_run(task) if self._cannot_run is not None else None
                        if why is None and task.id not in self._supervisor.running:
                            if room <= 0:  # a master that hands out more than the poll asked for
                                if task.claimed:
                                    claims.start_soon(self._release, task.id, "max-tasks: this node claims no more")
                                continue
                            room -= 1
                        if task.claimed:
                            self._settle_claimed(task, why, claims, work)
                        elif why is not None:
                            self._leave(task, why)
                        elif task.id not in self._supervisor.running:
                            claims.start_soon(self._claim_and_start, task, work)
                if answer.poll_id is not None:
                    self._close_claim_poll(answer.poll_id)
                self._settled()
                if self._stopping:
                    return
                held = answer.held_seconds >= self.long_poll_wait / 2
                if not answer.pending.tasks and not (self.long_poll_wait and held):
                    # Cancel ids of tasks already ended here (their results on the way) make a master
                    # answer at once until those results arrive: the pause ends when one has arrived.
                    stale = {t for t in answer.pending.cancel_task_ids if t not in self._supervisor.running}
                    with trio.CancelScope() as idle:
                        self._idle_scope = idle
                        await self._pause(stale)
                    self._idle_scope = None
        finally:
            if self._poll_id is not None:  # cut off unanswered: the master's reconciliation takes it back
                self._close_claim_poll(self._poll_id)
            self._settled()

    def _settled(self) -> None:
        """No poll on the wire and no answer being settled any more."""
        if self.polling:
            self.polling = False
            self._rested.set()

    async def wait_settled(self) -> None:
        """Return once no poll is on the wire and no answer is being settled (at once when none is). Called
        with the intake gate closed, it returns once the poll in flight is cut short or its answer's tasks
        are admitted or given back. Cancellation: as usual."""
        while self.polling:
            await self._rested.wait()

    def _settle_claimed(self, task: Task, why: str | None, claims: trio.Nursery, work: trio.Nursery) -> None:
        """A task the poll answer claimed for this node: admit and start it, or give it back (in
        ``claims``) when stopping or when the node cannot run it. Never awaits before the admission."""
        sup = self._supervisor
        if self._stopping:
            claims.start_soon(self._release, task.id, "claimed while the node started draining")
        elif why is not None:
            self._leave(task, why)
            claims.start_soon(self._release, task.id, f"this node cannot run it: {why}")
        elif self._older_attempt_here(task):
            claims.start_soon(self._release, task.id, SUPERSEDING)
        elif task.id not in sup.running:  # (a task already ours: the answer repeats it)
            rt = sup.admit(task)
            work.start_soon(sup.run_task, rt, name=f"task {task.id}")

    def _older_attempt_here(self, task: Task) -> bool:
        """True when an older attempt of ``task`` still runs here (the master declared this node lost and
        moved on while it was away): that attempt is superseded (its spider stopped, no result sent) and
        the newer one is given back, to be claimed again once the older one has left."""
        rt = self._supervisor.running.get(task.id)
        if rt is None or task.attempt <= rt.task.attempt:
            return False
        rt.mark_superseded(task.attempt)
        return True

    def _open_claim_poll(self) -> int:
        """The id of the claiming poll to send: the open one (its answer never settled), else a new
        one, above every id sent before (microseconds of the wall clock, so also above the ids of
        an earlier run of this node)."""
        sup = self._supervisor
        if self._poll_id is None:
            self._poll_id = max(int(time.time() * 1_000_000), (sup.last_claim_poll or 0) + 1)
            sup.claim_polls.add(self._poll_id)
            sup.last_claim_poll = self._poll_id
        return self._poll_id

    def _close_claim_poll(self, poll_id: int) -> None:
        """The claiming poll ``poll_id`` is settled: its tasks admitted or given back, or never received."""
        self._supervisor.claim_polls.discard(poll_id)
        if self._poll_id == poll_id:
            self._poll_id = None

    async def _next_answer(self) -> _Answer | None:
        """Wait for a free slot, then poll; None when the poll went stale. Master trouble is retried
        here (after ``poll_interval``); cancellation: as usual."""
        while True:
            if self._gate is not None:
                await self._gate.wait_open()
            await self._supervisor.wait_for_free_slot()
            started = trio.current_time()
            self.polling = True
            try:
                pending = await self._poll_until_stale()
            except MasterRejected as exc:  # logged once per episode by the master client
                self._settled()
                log.debug("polling for tasks failed: %s; retrying in %g s", exc, self.poll_interval)
            else:
                if pending is None:
                    self._settled()
                    return None
                return _Answer(pending, trio.current_time() - started, self._answered_poll)
            await trio.sleep(self.poll_interval)

    def _leave(self, task: Task, why: str) -> None:
        """Do not claim ``task``: the node cannot run it. One WARNING per spider; excluded from polls."""
        if task.spider_id not in self.unrunnable:
            log.warning("task %s (spider %s, framework %s) not taken: %s; the master keeps it for other nodes",
                        task.id, task.spider_id, task.framework, why)
        self.unrunnable.add(task.spider_id)

    def forget_unrunnable(self) -> None:
        """Offer every spider again (after a scan found the missing tools)."""
        self.unrunnable.clear()

    async def _pause(self, stale: set[str] | frozenset[str] = frozenset()) -> None:
        """Wait ``poll_interval`` seconds before the next poll — or less, when a spider the next poll
        would exclude finishes here (its next task may be waiting: e.g. a task cancelled through
        the answer just received), or when the result of a task in ``stale`` (cancel ids of tasks
        ended here) has been delivered (a held poll is possible again). Cancellation: as usual."""
        excluded = self._supervisor.running_spider_ids()
        with trio.move_on_after(self.poll_interval):
            async with trio.open_nursery() as nursery:

                async def wake(wait: Callable[[], Awaitable[None]]) -> None:
                    await wait()
                    nursery.cancel_scope.cancel()

                if excluded:
                    nursery.start_soon(wake, partial(self._supervisor.wait_spider_free, excluded))
                if stale and self._reported is not None:
                    nursery.start_soon(wake, partial(self._reported, set(stale)))
                nursery.start_soon(trio.sleep_forever)

    async def _poll_until_stale(self) -> PendingTasks | None:
        """:meth:`poll_once`, abandoned (None) once a spider it excluded has finished here: a held
        long poll would otherwise keep that spider's next task waiting up to ``long_poll_wait`` s (with
        a master that offers ``poll-follows-results``, only :data:`FOLLOW_GRACE` s later: it hands that
        task out in the held poll once the task's result has reached it);
        and cut short (None) when the intake gate closes meanwhile (what it would claim must not run here).

        Both cancel the poll's scope from where they happen (the supervisor's task left, the gate's
        close): no task of its own waits for them. Raises what poll_once raises. The master has
        handed out nothing it loses: only a claim assigns.
        """
        excluded = self._supervisor.running_spider_ids() if self.long_poll_wait else []
        # poll-follows-results: the master answers once the task's result has reached it, which the
        # end of its delivery may delay (its last batches, artifacts); past FOLLOW_GRACE the poll is
        # abandoned as without the feature, so the spider's next task never waits on that.
        grace = FOLLOW_GRACE if POLL_FOLLOWS_RESULTS in self._master.features else 0.0
        with trio.CancelScope() as scope, contextlib.ExitStack() as watching:
            watching.enter_context(self._supervisor.cancel_when_spider_free(excluded, scope, grace))
            if self._gate is not None:
                watching.enter_context(self._gate.cancel_on_close(scope))
            return await self.poll_once()
        if self._gate is not None and self._gate.reason is not None:
            log.info("a task poll in flight was cut short: %s", self._gate.reason)
        return None

    async def poll_once(self) -> PendingTasks:
        """One (long) poll, retried with backoff while the master is unavailable or answers something
        that is not the protocol (a bad envelope is a MasterProtocolError, retried the same way).

        Raises MasterRejected (4xx).
        """
        if not self._master.registered:  # (the agent registers first; the features come with it)
            await self._master.register()
        sup = self._supervisor
        limit = max(1, sup.free_slots())
        features = self._master.features
        claim = poll_id = None
        if CLAIM_IN_POLL in features:  # the answer carries the claims (module docstring)
            claim, poll_id = limit, self._open_claim_poll()
        running = sup.running_spider_ids()
        answer = await self._master.poll(
            limit, exclude_spider_ids=sorted(set(running) | self.unrunnable),
            running_spider_ids=running if POLL_FOLLOWS_RESULTS in features else (),
            wait_seconds=self.long_poll_wait, claim=claim, poll_id=poll_id,
            read_timeout=self.long_poll_wait + self._request_timeout, retry=Retry(),
        )
        self.polls += 1
        self._answered_poll = poll_id
        return answer

    async def _claim_and_start(self, task: Task, work: trio.Nursery) -> None:
        """Claim ``task``; start it when the claim succeeds, give it back when the poller stopped
        meanwhile or the claim was cut off (see the module docstring)."""
        sup = self._supervisor
        sup.claim_started(task.id)
        owed = True  # the master may count the task as ours, and it is neither admitted nor given back
        try:
            claimed = False
            with trio.CancelScope(deadline=self._claim_deadline) as scope:
                self._claim_scopes.add(scope)
                claimed = await self._claim(task.id, task.attempt)
            self._claim_scopes.discard(scope)
            if scope.cancelled_caught:
                reason = "claim cut off: the node is stopping"
            elif not claimed:
                owed = False
            elif self._stopping:
                reason = "claimed while the node started draining"
            elif self._older_attempt_here(task):
                reason = SUPERSEDING
            else:
                rt = sup.admit(task)
                owed = False
                work.start_soon(sup.run_task, rt, name=f"task {task.id}")
            if owed:
                await self._release(task.id, reason)
                owed = False
        finally:
            if owed:  # cancelled from outside (the agent's hard stop) before the task was settled
                with trio.CancelScope(shield=True):
                    await self._release(task.id, "claim cut off: the agent is terminating")
            sup.claim_ended(task.id)

    async def _claim(self, task_id: str, attempt: int) -> bool:
        claim = TaskResult(status="RUNNING", started_at=utc_now_iso(), attempt=attempt)
        try:
            await self._master.claim(task_id, claim, retry=Retry(timeout=CLAIM_RETRY_TIMEOUT))
        except MasterConflict:
            log.info("task %s: claimed elsewhere or cancelled (409); not running it", task_id)
            return False
        except (MasterRejected, MasterUnavailable) as exc:
            log.warning("task %s: claim failed (%s); leaving it to the master", task_id, exc)
            return False
        return True

    async def _release(self, task_id: str, reason: str) -> None:
        """Give a task back to the master (``POST /api/tasks/{id}/release``), at most RELEASE_TIMEOUT
        seconds. Never raises for master trouble: a release that does not get through is left to the
        master's reconciliation (the node will not list the task). Cancellation: as usual."""
        with trio.move_on_after(RELEASE_TIMEOUT) as scope:  # noqa: ASYNC912 - the call checkpoints before it raises
            try:
                await self._master.release(task_id, TaskRelease(reason=reason))
            except MasterError as exc:
                log.warning("task %s: could not give it back to the master (%s); the master's "
                            "reconciliation will", task_id, exc)
                return
            log.info("task %s: given back to the master (%s)", task_id, reason)
        if scope.cancelled_caught:
            log.warning("task %s: giving it back took over %g s; the master's reconciliation will",
                        task_id, RELEASE_TIMEOUT)

    async def _report_bad_task(self, bad: BadTask) -> None:
        shown = "<no id>" if bad.task_id is None else shown_id(bad.task_id)
        key = (bad.task_id, _AT_INDEX.sub("", str(bad.error)))  # the same task at another place of an answer
        first = key not in self._bad_logged
        if first:
            if len(self._bad_logged) >= MAX_BAD_LOGGED:
                self._bad_logged.clear()
            self._bad_logged.add(key)
        if bad.task_id is None:
            if first:
                log.error("a task breaks the protocol and has no id it could be reported with: %s", bad.error)
            return
        if first:
            log.error("task %s breaks the protocol: %s; reporting it FAILED/BAD_TASK", shown, bad.error)
        now = utc_now_iso()
        result = TaskResult(status="FAILED", error_code="BAD_TASK", error_message=str(bad.error),
                            started_at=now, finished_at=now, duration_ms=0, item_count=0, log_lines=0,
                            attempt=bad.attempt, **cause_fields("BAD_TASK"))
        try:
            await self._master.report_result(bad.task_id, result, retry=Retry(timeout=CLAIM_RETRY_TIMEOUT))
        except MasterError as exc:
            log.warning("task %s: could not report BAD_TASK (%s)", shown, exc)
