"""A running task's checkpoints, the agent's side (issue 38): ask the spider to persist, read its answer,
record where its item and log streams stand, and hand the snapshot to the shipper.

One :class:`TaskCheckpoints` per running attempt (``RunningTask.checkpoints``), made before the spawn:

- **Before the spawn** (:meth:`TaskCheckpoints.prepare`): an attempt that resumes (``Task.checkpoint``)
  gets its state dir restored from it (ckagent.resume.restore, as the spider's uid; a failure is
  DEPLOY_FAILED saying why), and the task log says how the attempt starts: ``attempt 2: resuming from
  checkpoint 1-4 of attempt 1 (items 0–449 kept)`` or ``attempt 2: no checkpoint; restarting from
  scratch, earlier items replaced (resume: restart-replace)``.
- **While the spider runs** (:func:`checkpointing`, around its supervision: one Trio task, a timer): every
  interval (``Task.checkpoint_interval_seconds``, else the node's ``task.checkpoint_interval``; 0 = none)
  :meth:`~TaskCheckpoints.take` appends a persist request to the control file and waits for its answer
  in the ack file (an inotify watch on it while an answer is awaited, a look every
  :data:`ACK_LOOK_INTERVAL` besides; nothing between requests). A spider that does not answer within
  the interval is said once in the task log, and asked again at the next one. Answers that are not the
  protocol's (ckagent.task.control) are said and ignored.
- **An answer's positions**: its ``itemsOffset`` (a byte offset of ``CK_ITEMS_FILE``) becomes the number
  of items before it, counted by the items reader's own rules (ckagent.delivery.itemscan; a torn line at
  the offset is not counted) from the previous answer's offset on; the snapshot is handed to the
  shipper (ckagent.resume.ship) once the master acknowledged the items stream up to there, with the log
  stream's acknowledged position. Both in the task's numbering (the attempt's seq starts added).
- **At the end** (:func:`checkpointing`'s exit): a checkpoint still on its way is waited for, at most
  :data:`END_SHIP_TIMEOUT` seconds, so the result names it (``checkpointId``: :attr:`TaskCheckpoints.newest_id`).

A re-adopted task (ckagent.task.adoption) keeps its attempt and seq starts (the task's record in the state
store) and gets a new TaskCheckpoints (:meth:`~TaskCheckpoints.adopt`): its requests go on numbering after
the control file's last, old answers are skipped, the shipper finishes an upload the previous agent left
(its ``snapshots/N.json``). Tasks that declare item files (``outputs.items``) take no checkpoints yet: their
items stream merges several files, which one offset cannot place (said once in the task log).

Errors: nothing here raises for the spider's or the master's trouble (logged, False/None returned) but
:meth:`~TaskCheckpoints.prepare` (DeployError). Cancellation: as usual; what was submitted is on disk
(``snapshots/N.json``) for the next agent.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trio

from ckagent.containment.filewatch import FileWatch
from ckagent.delivery.itemscan import count_items
from ckagent.delivery.lines import encode_item
from ckagent.delivery.spool import ITEMS_FILE, MAX_ITEM_BYTES
from ckagent.master.client import MasterClient
from ckagent.master.protocol import ResumeMode, Task
from ckagent.node.errors import DeployError
from ckagent.node.runas import RunAs
from ckagent.resume.restore import RestoreError, RestoreLimits, restore
from ckagent.resume.ship import CheckpointShipper, ShippedCheckpoint
from ckagent.resume.snapshot import PackLimits
from ckagent.task.admission import RunningTask
from ckagent.task.control import (
    Ack,
    AckReader,
    append_request,
    last_request_id,
    request_line,
    snapshot_problem,
)
from ckagent.task.outcome import Notice
from ckagent.task.runconfig import RunnerConfig
from ckagent.task.taskenv import CONTROL_ACK_FILE, STATE_DIR

__all__ = [
    "ACK_LOOK_INTERVAL",
    "END_SHIP_TIMEOUT",
    "CheckpointReason",
    "Taken",
    "TaskCheckpoints",
    "checkpointing",
    "checkpoints_for",
]

log = logging.getLogger(__name__)

ACK_LOOK_INTERVAL = 1.0
"""Seconds between looks at the ack file while an answer is awaited, beside its inotify watch (a
watch that cannot be set up, a file the spider replaced)."""
ANSWER_SHARE = 0.9
"""The part of an interval a periodic request waits for its answer (and its items' acknowledgement)."""
ITEMS_ACK_WAIT = 30.0
"""Seconds a periodic checkpoint waits (at least) for the master to hold its items, once answered."""
END_SHIP_TIMEOUT = 30.0
"""Seconds a task's end waits for a checkpoint still on its way (its result names the newest shipped)."""
DEFAULT_STATE_BYTES = 4 << 30
"""The most a state dir may hold (restored or packed) for a task without a disk limit (bytes)."""
MAX_PROBLEMS_SAID = 5
"""Answers that are not the protocol's said in the task log (then one line that more were ignored)."""


class CheckpointReason(str, enum.Enum):
    """Why a checkpoint is taken (the manifest's ``reason``: ckagent.master.protocol.CHECKPOINT_REASONS)."""

    INTERVAL = "interval"
    MIGRATE = "migrate"
    MEMORY = "memory"
    STOP = "stop"


@dataclass(frozen=True)
class Taken:
    """The newest snapshot handed to the shipper: checkpoint ``id``, its ``reason``, when it was answered
    (``created``, aware UTC), the streams' positions it holds (the task's numbering), the spider's pause."""

    id: str
    reason: str
    created: datetime
    item_seq: int
    log_seq: int
    pause_ms: float | None


class TaskCheckpoints:
    """One attempt's checkpoints (see the module docstring). ``delivery``: the task's
    ``ckagent.delivery.TaskDelivery`` (None: items are counted, not waited for — tests);
    ``interval``: seconds between periodic requests (0: none); ``max_bytes``: the most its state dir may
    hold; ``run_as``: the spider's identity (a restored state dir is its)."""

    def __init__(self, master: MasterClient, task: Task, task_dir: Path, *, interval: float, delivery: Any,
                 notice: Notice, run_as: RunAs | None = None, max_bytes: int = DEFAULT_STATE_BYTES) -> None:
        self.task = task
        self.task_dir = task_dir
        self.interval = interval
        self.delivery = delivery
        self.run_as = run_as
        self.max_bytes = max_bytes
        self._master = master
        self._notice = notice
        self.shipper = CheckpointShipper(master, task.id, task_dir, attempt=task.attempt,
                                         limits=PackLimits(max_bytes))
        self.taken: Taken | None = None
        """The newest snapshot handed to the shipper (shipped or not: :attr:`last` is the newest shipped)."""
        self.answered = 0
        """Requests the spider answered with a snapshot (this agent's)."""
        self._next_id = 1
        self._reader = AckReader(task_dir)
        self._acks: dict[int, Ack] = {}
        self._anchor = (0, 0)  # (an items.jsonl offset at a line's end, the items before it)
        self._counting = trio.Lock()
        self._acked_grew = trio.Event()
        self._silent_said = False
        self._problems_said = 0
        self._nursery: trio.Nursery | None = None
        self._shipping = False  # the shipper's run is started
        self._recover = False  # a re-adopted task: the shipper starts at once (an upload left to finish)
        self.unsupported = task.outputs is not None and bool(task.outputs.items)
        """True: the task declares item files; it takes no checkpoints (see the module docstring)."""
        self.due = math.inf
        """When the first periodic checkpoint is due (Trio's clock; inf: none), set by :func:`checkpointing`."""

    @property
    def last(self) -> ShippedCheckpoint | None:
        """The newest checkpoint the master took (id, created, size_bytes, item_seq, reason …), for the views."""
        return self.shipper.last

    @property
    def newest_id(self) -> str | None:
        """The id of the newest shipped checkpoint (the result's ``checkpointId``), or None."""
        return self.shipper.last.id if self.shipper.last is not None else None

    # ------------------------------------------------------------------ before the spawn, at adoption

    async def prepare(self) -> None:
        """Restore the state dir from the attempt's checkpoint (when it has one) and say how the attempt
        starts (module docstring). Raises DeployError when the checkpoint cannot be restored."""
        task = self.task
        ref = task.checkpoint
        if ref is not None:
            try:
                manifest = await restore(self._master, task.id, ref, self.task_dir / STATE_DIR,
                                         RestoreLimits(max_bytes=self.max_bytes), self.run_as)
            except RestoreError as exc:
                raise DeployError(f"attempt {task.attempt}: {exc}") from exc
            await trio.to_thread.run_sync(self.shipper.seed, manifest)
            kept = f"items 0–{ref.item_seq - 1} kept" if ref.item_seq else "no items before it"
            self._notice(f"attempt {task.attempt}: resuming from checkpoint {ref.id} of attempt {ref.attempt} ({kept})")
        elif task.attempt > 1:
            what = "replaced" if task.resume is ResumeMode.RESTART_REPLACE else "kept"
            self._notice(f"attempt {task.attempt}: no checkpoint; restarting from scratch, earlier items {what} "
                         f"(resume: {task.resume.value})")
        if self.unsupported and self.interval > 0:
            self._notice("checkpoints: none: the task declares item files (outputs.items), whose position in "
                         "the items stream a checkpoint cannot record yet")

    async def adopt(self) -> None:
        """Carry on after an agent restart (module docstring): requests numbered after the control file's
        last, the answers written so far skipped, the shipper started at once. One thread hop."""
        def look() -> tuple[int, int]:
            try:
                size = os.lstat(self.task_dir / CONTROL_ACK_FILE).st_size
            except OSError:
                size = 0
            return last_request_id(self.task_dir), size

        last, size = await trio.to_thread.run_sync(look)
        self._next_id, self._reader.offset, self._recover = last + 1, size, True

    # ------------------------------------------------------------------ while the spider runs

    def fire(self) -> None:
        """The first interval is over (the task's Watchdog woke: ckagent.task.stop.Alarm): the timer's task
        starts now — a task that ends within its first interval never has one."""
        self.due = math.inf
        if self._nursery is not None:
            self._nursery.start_soon(self.run)

    async def run(self) -> None:
        """Ask for a checkpoint now and every interval after, until cancelled (in :func:`checkpointing`'s
        nursery). Never raises for the spider's or the master's trouble."""
        due = trio.current_time()
        while True:
            await trio.sleep_until(due)
            await self._take(CheckpointReason.INTERVAL, None, self.interval * ANSWER_SHARE,
                             max(self.interval, ITEMS_ACK_WAIT))
            while due <= trio.current_time():  # the next slot of the interval's grid
                due += self.interval

    async def take(self, reason: CheckpointReason, *, seconds_left: float | None = None,
                   timeout: float) -> bool:  # noqa: ASYNC109 - bounds the answer and the items ack
        """Ask the spider to persist now (``migrating`` with ``seconds_left`` when given) and, once it
        answered, hand its snapshot to the shipper with the streams' positions. True: a snapshot was
        answered and queued within ``timeout`` seconds (:meth:`shipped` waits for its upload); False:
        no answer, an error answer, a snapshot that is not one, or its items never acknowledged (each
        said in the task log). Never raises for the spider's or the master's trouble."""
        return await self._take(reason, seconds_left, timeout, timeout)

    async def _take(self, reason: CheckpointReason, seconds_left: float | None, answer_timeout: float,
                    bound: float) -> bool:
        """:meth:`take`, the answer awaited at most ``answer_timeout`` seconds, all of it ``bound``."""
        if self.unsupported:
            return False
        request_id, self._next_id = self._next_id, self._next_id + 1
        answered = False
        deadline = trio.current_time() + bound
        with trio.move_on_after(answer_timeout) as answering, trio.move_on_at(deadline):
            try:
                append_request(self.task_dir, request_line(request_id, reason.value, seconds_left))
            except OSError as exc:
                self._notice(f"checkpoint: cannot write the persist request to the control file ({exc})")
                return False
            ack = await self._answer(request_id)
            answered = True
            self.answered += 1
            answering.deadline = deadline  # answered: the rest of the time is its items'
            return await self._queue(ack, reason)
        if not answered and not self._silent_said:
            self._silent_said = True
            self._notice("the spider does not answer persist requests: a new attempt restarts it from scratch "
                         f"(resume: {self.task.resume.value})")
        elif answered:
            self._notice(f"checkpoint {self.task.attempt}-{request_id}: not taken within {bound:g} s "
                         "(its items were not acknowledged by the master in time)")
        return False

    async def shipped(self, timeout: float) -> str | None:  # noqa: ASYNC109 - a bound, not a deadline
        """Wait (at most ``timeout`` seconds) until every snapshot queued is shipped (or given up); the
        id of the newest checkpoint the master holds, or None. Never raises."""
        if self._shipping:
            with trio.move_on_after(timeout):
                await self.shipper.wait_idle()
        return self.newest_id

    @property
    def pending(self) -> bool:
        """True while a queued snapshot is not shipped (nor given up)."""
        return self._shipping and self.shipper.pending > 0 and self.shipper.superseded_by is None

    async def _answer(self, request_id: int) -> Ack:
        """The spider's answer to ``request_id`` (waits for it: inotify on the ack file, a look every
        ACK_LOOK_INTERVAL besides). Other answers read meanwhile are kept for their waiters."""
        path = self.task_dir / CONTROL_ACK_FILE
        while True:
            self._pump()
            if request_id in self._acks:
                return self._acks.pop(request_id)
            with contextlib.ExitStack() as stack:
                try:
                    watch = stack.enter_context(FileWatch(path))
                except OSError:
                    watch = None
                self._pump()  # what was written before the watch
                if request_id in self._acks:
                    return self._acks.pop(request_id)
                with trio.move_on_after(ACK_LOOK_INTERVAL):
                    if watch is not None:
                        await watch.changed()
                    else:
                        await trio.sleep_forever()

    def _pump(self) -> None:
        """Read the answers written since the last look (on the loop: a small read of the page cache)."""
        acks, problems = self._reader.read()
        for ack in acks:
            if ack.id < self._next_id:
                self._acks[ack.id] = ack
        for problem in problems:
            log.warning("task %s: checkpoint: %s", self.task.id, problem)
            self._problems_said += 1
            if self._problems_said <= MAX_PROBLEMS_SAID:
                self._notice(f"checkpoint: {problem}; ignored")
            elif self._problems_said == MAX_PROBLEMS_SAID + 1:
                self._notice("checkpoint: more answers that are not the protocol's; ignored, not said any more")
        if len(self._acks) > 1000:  # answers nobody waits for (ids no request of this agent's has)
            self._acks.clear()

    async def _queue(self, ack: Ack, reason: CheckpointReason) -> bool:
        """Hand an answer's snapshot to the shipper once its items are acknowledged; False (said) when
        it is an error answer, not a snapshot, or its items stream ended short of it."""
        name = f"{self.task.attempt}-{ack.id}"
        if ack.error is not None:
            self._notice(f"checkpoint {name}: the spider could not persist its state: {ack.error}")
            return False
        assert ack.snapshot is not None and ack.items_offset is not None
        created = datetime.now(timezone.utc)
        problem = await trio.to_thread.run_sync(snapshot_problem, self.task_dir, ack.snapshot)
        if problem is not None:
            self._notice(f"checkpoint {name}: {problem}; ignored")
            return False
        local = await self._items_before(ack.items_offset)
        if not await self._items_acknowledged(local):
            self._notice(f"checkpoint {name}: not shipped: the items stream ended before its item {local}")
            return False
        items, logs = (self.delivery.items, self.delivery.logs) if self.delivery is not None else (None, None)
        item_seq = local + (items.seq_start if items is not None else self.task.item_seq_start)
        log_seq = logs.acked + logs.seq_start if logs is not None else self.task.log_seq_start
        await self._start_shipper()
        try:
            checkpoint_id = await self.shipper.submit(ack.id, item_seq=item_seq, log_seq=log_seq,
                                                      reason=reason.value, created=created)
        except OSError as exc:
            self._notice(f"checkpoint {name}: cannot record it for shipping ({exc})")
            return False
        self.taken = Taken(checkpoint_id, reason.value, created, item_seq, log_seq, ack.pause_ms)
        log.info("task %s: checkpoint %s (%s) taken: items %d, log lines %d, spider paused %s ms", self.task.id,
                 checkpoint_id, reason.value, item_seq, log_seq, "?" if ack.pause_ms is None else f"{ack.pause_ms:g}")
        return True

    async def _items_before(self, offset: int) -> int:
        """How many items of this attempt's items.jsonl end at or before byte ``offset`` (one thread hop
        over what was written since the previous answer's offset)."""
        async with self._counting:
            start, before = self._anchor
            if offset < start:  # an offset behind an earlier one (the spider's file shrank?): from the start
                start, before = 0, 0
            count, end = await trio.to_thread.run_sync(count_items, self.task_dir / ITEMS_FILE, start, offset,
                                                       encode_item, MAX_ITEM_BYTES)
            self._anchor = (end, before + count)
            return before + count

    async def _items_acknowledged(self, local: int) -> bool:
        """Wait until the master holds this attempt's first ``local`` items; False when the stream ended
        (refused, superseded) short of them."""
        items = self.delivery.items if self.delivery is not None else None
        if items is None:
            return True
        hurried, items.hurry = items.hurry, True  # send what is read at once, not a fuller batch
        try:
            while items.acked < local:
                if items.done:
                    return False
                items.on_acked = self._acked_grew.set
                items.notify()  # read the items file now (not at the outbox's next look at it)
                await self._acked_grew.wait()
                self._acked_grew = trio.Event()
        finally:
            items.hurry = hurried
        return True

    async def _start_shipper(self) -> None:
        if not self._shipping and self._nursery is not None:
            self._shipping = True
            with contextlib.suppress(RuntimeError):  # it failed before it started (said by _ship)
                await self._nursery.start(self._ship)

    async def _ship(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:  # noqa: ASYNC128 - shipper.run calls started()
        """The shipper's run; a bug of it ends the task's checkpoints, never the task (logged)."""
        try:
            await self.shipper.run(task_status=task_status)
        except Exception:
            log.exception("task %s: the checkpoint shipper failed; no more checkpoints for this attempt", self.task.id)
            self._notice("checkpoints: the agent's shipper failed (an agent bug, in its log); none more are shipped")
            self.unsupported = True


def checkpoints_for(config: RunnerConfig, master: MasterClient, rt: RunningTask, task_dir: Path,
                    notice: Notice) -> TaskCheckpoints:
    """``rt``'s checkpoints (set as ``rt.checkpoints``): its own interval, else the node's
    (``config.checkpoint_interval``); its state dir bounded by its disk limit (else the node's, else
    :data:`DEFAULT_STATE_BYTES`)."""
    task = rt.task
    interval = task.checkpoint_interval_seconds
    disk = task.resources.disk_bytes if task.resources is not None else None
    max_bytes = disk or config.default_disk_bytes or DEFAULT_STATE_BYTES
    rt.checkpoints = TaskCheckpoints(master, task, task_dir, delivery=rt.delivery, notice=notice, run_as=rt.run_as,
                                     interval=config.checkpoint_interval if interval is None else interval,
                                     max_bytes=max_bytes)
    return rt.checkpoints


@contextlib.asynccontextmanager
async def checkpointing(checkpoints: TaskCheckpoints | None) -> AsyncIterator[None]:
    """Checkpoints while the block runs (the spider's supervision, whose Watchdog wakes
    :meth:`TaskCheckpoints.fire` at the first interval's end): their nursery, the shipper of an upload a
    previous agent left; at the end a checkpoint still on its way is waited for (at most
    END_SHIP_TIMEOUT seconds), then the timer is stopped. Nothing for None."""
    if checkpoints is None:
        yield
        return
    async with trio.open_nursery() as nursery:
        checkpoints._nursery = nursery
        try:
            if checkpoints._recover:
                await checkpoints._start_shipper()
            if checkpoints.interval > 0 and not checkpoints.unsupported:
                checkpoints.due = trio.current_time() + checkpoints.interval
            yield
            if checkpoints.pending:
                await checkpoints.shipped(END_SHIP_TIMEOUT)
        finally:
            checkpoints.due = math.inf
            checkpoints._nursery = None
            nursery.cancel_scope.cancel()
