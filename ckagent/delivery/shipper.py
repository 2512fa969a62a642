"""The stream shipper: batches with sequence numbers, acknowledged positions, 409 rewind/skip, backoff.

See the package docstring (ckagent.delivery) for the whole design.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from ckagent.delivery.flight import (
    CEILING_RECOVERY,
    Answer,
    Flight,
    is_placeholder,
    placeholder,
)
from ckagent.delivery.judging import AnswerJudge
from ckagent.delivery.lines import Masker, encode_item
from ckagent.delivery.nodebatch import NodeBatcher
from ckagent.delivery.pending import Pending
from ckagent.delivery.readers import _FileReader, _ItemJournalReader, _JournalReader
from ckagent.delivery.spool import (
    BATCH_AGE,
    CHECKPOINTS_KEPT,
    DEFAULT_REFUSAL_TIMEOUT,
    ITEMS_FILE,
    LOG_BATCH_AGE,
    MAX_BATCH_BYTES,
    MAX_BATCH_COUNT,
    MAX_ITEM_BYTES,
    MAX_LINE_BYTES,
    NODE_BATCH_ENTRY_BYTES,
    NODE_LOG_BATCH_AGE,
    NOTIFY_FALLBACK,
    TAIL_INTERVAL,
)
from ckagent.delivery.waiting import Backoff, Waker
from ckagent.master.client import MasterClient, MasterError
from ckagent.node.state import AsyncStateStore, StateStoreError

log = logging.getLogger(__name__)

class StreamShipper(AnswerJudge):
    """Ships one stream of one task (see module docstring): ``kind`` "logs" or "items".

    Build it with :meth:`logs` or :meth:`items`. Two ways to drive it: :meth:`run` (a Trio task of
    its own, until the stream is complete), or its owner's loop — :meth:`open` once, then
    :meth:`step` whenever its :attr:`waker` wakes or the time :meth:`step` returned has come, and
    :meth:`close` at the end (a task's delivery drives its streams so: ckagent.delivery.taskdelivery).
    A batch on its way needs no task while it goes in a node batch (its answer comes back as a
    call); only a per-task post or a retry after a backoff runs in the owner's nursery.

    :meth:`notify` says the spool grew; :meth:`finish` says the items file is complete (the log
    stream knows it from the journal's E record). ``stats``:
    ``acked`` elements the master holds, ``read`` elements read. ``refused`` is True when the master
    refused the stream for good (a 409 without ``expectedSeq``, or any other 4xx in the protocol's
    words — "unknown task", 403, 400, … — for longer than ``refusal_timeout`` seconds): the stream is
    then incomplete and the result says so, with the master's reason (:attr:`refusal`).
    ``refusing_since`` is the trio time the batch on its way was first refused (None while it is not),
    ``placeholders`` counts elements the master refused on their own (replaced by a placeholder);
    ``waiting_since`` (epoch seconds) how long what was read has waited (see the attribute).
    """

    def __init__(
        self,
        master: MasterClient,
        store: AsyncStateStore,
        task_id: str,
        kind: str,
        reader: _FileReader | _JournalReader,
        limiter: trio.CapacityLimiter | None = None,
        refusal_timeout: float = DEFAULT_REFUSAL_TIMEOUT,
        waker: Waker | None = None,
    ) -> None:
        if kind not in ("logs", "items"):
            raise ValueError(f"unknown stream kind {kind!r}")
        self._master = master
        self._store = store
        self.task_id = task_id
        self.kind = kind
        self.stream = "log" if kind == "logs" else "items"
        self._key = "lines" if kind == "logs" else "items"
        self._batch_age = LOG_BATCH_AGE if kind == "logs" else BATCH_AGE
        self._reader = reader
        self._limiter = limiter or trio.CapacityLimiter(1)
        self.waker = waker or Waker()
        """What :meth:`notify` and an answer set: shared by every stream of a task's delivery."""
        self._count_limit = self._count_ceiling = MAX_BATCH_COUNT
        self._ceiling_successes = 0  # acknowledgements in a row since the ceiling was last lowered
        self._lone_too_large = False  # a single element got a 413: if it is taken later, the 413 was passing
        self._refusal_timeout = refusal_timeout
        self.acked = 0
        self.refused = False
        self.refusal: str | None = None
        """With :attr:`refused`: why, in the master's words (``"logs: master answered 403 (quota)"``)."""
        self.refusing_since: float | None = None
        self.placeholders = 0
        self.seq_start = 0
        """The wire's number of the spool's first element (``Task.item_seq_start`` / ``log_seq_start``:
        an attempt's streams continue the task's numbering); the spool and the state store count from 0."""
        self.attempt: int | None = None
        """The attempt the batches carry (None: not sent, which a master reads as 1)."""
        self.superseded: int | None = None
        """The attempt the master moved on to (a 409 with ``supersededBy``): the stream ended, nothing more sent."""
        self.on_superseded: Callable[[int], None] | None = None
        self.on_acked: Callable[[], None] | None = None
        """Called (on the loop) whenever :attr:`acked` grew: a checkpoint waits for its items (ckagent.task.checkpoints)."""
        self.waiting_since: float | None = None
        """Epoch s since read elements wait for the master: since the last ack, or read after catching up (None: none)."""
        self.end_kept = False
        """True: the stream's last position is kept in :attr:`final` for its owner (a task's delivery,
        which needs it only if its result is not acknowledged at once) instead of being saved."""
        self.final: tuple[int, Any] | None = None
        """With :attr:`end_kept`: the last (seq, position) the master acknowledged, not saved yet."""
        self.requests = 0
        self.batcher: NodeBatcher | None = None
        """Set by the outbox: batches go through it while the master offers node batches."""
        self.hurry = False  # send what is read at once, not waiting for a fuller batch (a hand-over's flush)
        self.on_idle: Callable[[], None] | None = None  # called whenever nothing read waits for the master
        self.done = False
        """True once the stream is complete and acknowledged (or refused): :meth:`step` has nothing left to do."""
        self.poked = True
        """Set by a notification, the stream's end or an answer (cleared by :meth:`step`): with
        :attr:`due_at`, what tells a loop that serves several streams which ones to step (:meth:`due`)."""
        self.due_at = 0.0  # the trio time step last returned (the stream has nothing to do before it)
        # The stream between steps (see step).
        self._nursery: trio.Nursery | None = None  # where a per-task post or a retry runs (set by open)
        self._seq = 0  # elements the master holds (acknowledged, or skipped as already held)
        self._pending = Pending()
        self._skip = 0  # elements the master already holds beyond `_seq`: read them, do not send them
        self._flight: Flight | None = None  # the one batch on its way (its elements lead `_pending`)
        self._checkpoints: dict[int, Any] = {}
        # An acknowledged position not yet in the state store: saved once the next batch is on its
        # way (the save is not on the path from one answer to the next request). A crash before the
        # save only makes the next start send that batch again, which the master drops.
        self._unsaved: tuple[int, Any] | None = None

    @classmethod
    def logs(cls, master: MasterClient, store: AsyncStateStore, task_id: str, task_dir: Path, masker: Masker,
             limiter: trio.CapacityLimiter | None = None, max_line_bytes: int = MAX_LINE_BYTES,
             refusal_timeout: float = DEFAULT_REFUSAL_TIMEOUT, waker: Waker | None = None) -> StreamShipper:
        """The log stream of the task in ``task_dir`` (its journal and sources)."""
        return cls(master, store, task_id, "logs", _JournalReader(task_dir, masker, max_line_bytes), limiter,
                   refusal_timeout, waker)

    @classmethod
    def items(cls, master: MasterClient, store: AsyncStateStore, task_id: str, task_dir: Path,
              limiter: trio.CapacityLimiter | None = None,
              refusal_timeout: float = DEFAULT_REFUSAL_TIMEOUT, journal: bool = False,
              waker: Waker | None = None) -> StreamShipper:
        """The items stream of the task in ``task_dir``: ``items.jsonl``; with ``journal``, the
        merge ``items.journal`` records of items.jsonl and the declared item files."""
        reader: _FileReader | _JournalReader
        if journal:
            reader = _ItemJournalReader(task_dir, encode_item, MAX_ITEM_BYTES)
        else:
            reader = _FileReader(task_dir / ITEMS_FILE, encode_item, MAX_ITEM_BYTES, cr_breaks=False)
        return cls(master, store, task_id, "items", reader, limiter, refusal_timeout, waker)

    @property
    def reader(self) -> _FileReader | _JournalReader:  # (an items reader says oversize items: oversize_notes)
        return self._reader

    def _age(self) -> float:
        """Seconds a non-full batch waits for more elements: shorter for lines going in node batches
        (other tasks' batches share the request, so a short wait costs no extra request)."""
        batcher = self.batcher
        if self.hurry:
            return 0.0
        if self.kind == "logs" and batcher is not None and batcher.enabled:
            return NODE_LOG_BATCH_AGE
        return self._batch_age

    def _acked_now(self) -> None:
        if self.on_acked is not None:
            self.on_acked()

    def notify(self) -> None:
        """The spool grew: wake the shipper."""
        self.poked = True
        self.waker.set()

    def due(self, now: float) -> bool:
        """True when :meth:`step` has something to do at ``now`` (trio time): it was poked, or the
        time it returned has come. A loop serving several streams steps only those."""
        return self.poked or now >= self.due_at

    def finish(self) -> None:
        """The items file is complete (no-op for a journal's stream: its E record says it): ship the
        rest, then :meth:`run` returns."""
        if isinstance(self._reader, _FileReader):
            self._reader.finished = True
        self.notify()

    async def run(self) -> None:
        """Ship until the stream is complete and acknowledged (or refused by the master).

        Resumes from the position in the state store. Cancellation stops shipping at once; the
        acknowledged position is on disk, or the one before it (the master drops the repeat).
        """
        try:
            async with trio.open_nursery() as nursery:
                await self.open(nursery)
                while (deadline := await self.step()) is not None:
                    await self.waker.wait(deadline)
        finally:
            self.close()

    async def open(self, nursery: trio.Nursery) -> None:
        """Resume from the position in the state store (a thread hop only for a stream this run did
        not start, and a journal's replay after a restart). ``nursery``: where a per-task post or a
        retry after a backoff runs (the owner's; it must outlive the stream's steps)."""
        self._nursery = nursery
        seq, position = await self._store.stream_position(self.task_id, self.stream)
        self.acked = self._seq = seq
        await self._reader.restore(position)
        self._checkpoints = {0: None, seq: position}

    def close(self) -> None:
        """The stream's files are closed; an answer that comes later is ignored (idempotent)."""
        self._nursery = None
        self._reader.close()

    async def _save(self) -> None:
        """The stream ends: its position kept (``end_kept``), else into the database now (a full disk: noted)."""
        if self._unsaved is not None and self.end_kept:
            self.final, self._unsaved = self._unsaved, None
        elif self._unsaved is not None:
            saving, self._unsaved = self._unsaved, None
            try:
                await self._store.save_stream_position(self.task_id, self.stream, *saving)
            except StateStoreError as exc:  # the positions stay noted (AsyncStateStore keeps them)
                log.warning("task %s %s: %s; the position is saved later", self.task_id, self.stream, exc)

    def _note(self) -> None:
        """The position to the state store's next batched write (the outbox's once-a-second hop
        for every stream of the agent): no thread hop per acknowledgement. A crash before that
        write only makes the next start send up to a second of batches again (dropped by the master)."""
        if self._unsaved is not None:
            saving, self._unsaved = self._unsaved, None
            self._store.note_stream_position(self.task_id, self.stream, *saving)

    async def _end(self) -> None:
        await self._save()
        self.done = True

    async def step(self) -> float | None:
        """Move the stream as far as it goes without waiting: take the answer that came, read, send
        the next batch. Returns the ``trio.current_time()`` until which nothing is due unless the
        :attr:`waker` wakes it, or None once the stream is complete (:attr:`done`). Awaits only a
        state store write at the stream's end (without ``end_noted``) and a rewind's replay of the
        spool; cancellation then leaves the stream as it was (the next start resumes it)."""
        if self.done:
            return None
        self.poked = False
        reader, pending = self._reader, self._pending
        while True:
            flight = self._flight
            if flight is not None and flight.answer is not None:
                answer, n, self._flight = flight.answer, flight.count, None
                if answer.kind == "superseded":  # the master moved on to a newer attempt: nothing more
                    assert answer.expected is not None
                    self.superseded = answer.expected
                    await self._end()
                    if self.on_superseded is not None:
                        self.on_superseded(answer.expected)
                    return None
                if answer.kind == "refused":
                    self.refused, self.refusal = True, answer.reason
                    await self._end()
                    return None
                if answer.kind == "shrink":
                    if n > 1:  # smaller batches for a while (up to the size that failed)
                        self._count_limit = self._count_ceiling = max(1, n // 2)
                        self._ceiling_successes = 0
                    else:  # too large on its own for longer than refusal_timeout: reported
                        self._drop_first(pending, self._seq, "413 for longer than server.refusal_timeout")
                    continue
                if answer.kind == "element":  # a 422 naming one element: the master's word
                    assert answer.expected is not None
                    if answer.expected == 0 and is_placeholder(pending.first()):
                        log.error("task %s %s: the master refuses even the placeholder of element %d; "
                                  "not sending the stream any more; the result will say incomplete",
                                  self.task_id, self.stream, self._seq)
                        self.refused = True
                        self.refusal = f"{self.stream}: the master refused even the placeholder of element {self._seq}"
                        await self._end()
                        return None
                    if answer.expected == 0:
                        self._drop_first(pending, self._seq, "422 naming it")
                    else:  # send the elements before it first
                        self._count_limit = answer.expected
                    continue
                # The acknowledgement in the protocol's own words: how many elements the
                # master holds (never assumed from a bare 2xx).
                assert answer.expected is not None
                await self._acknowledged(answer.expected)
                continue
            if self._skip and pending and self._flight is None:
                n = min(self._skip, len(pending))
                self._seq += n
                self._skip -= n
                position = reader.commit(pending.take(n))
                if not self._skip:
                    self._checkpoints[self._seq] = position
                    self._unsaved = (self._seq, position)
                self.acked = self._seq
                self._acked_now()
                continue
            # Read ahead (up to one batch beyond the one in flight) while the master works.
            progress = False
            sending_count = self._flight.count if self._flight is not None else 0
            sending_size = self._flight.size if self._flight is not None else 0
            if (not reader.done and len(pending) - sending_count < self._count_limit
                    and pending.size - sending_size < MAX_BATCH_BYTES):
                progress = await reader.read(pending)
                if pending and self.waiting_since is None:
                    self.waiting_since = time.time()
            if self._flight is None and pending and not self._skip and (
                reader.done
                or len(pending) >= self._count_limit
                or pending.size >= MAX_BATCH_BYTES
                or trio.current_time() - pending.since >= self._age()
            ):
                n = pending.batch_len(self._count_limit, MAX_BATCH_BYTES)
                self._launch(Flight(n, pending.size_of(n)), self._seq, n, pending.body(n, self._seq + self.seq_start, self._key,
                                                                                         self.attempt))
                self._note()
                continue
            if reader.done and not pending and self._flight is None:
                await self._end()
                if self._skip:
                    log.warning("task %s %s: the master holds %d more elements than this node has",
                                self.task_id, self.stream, self._skip)
                return None
            if not progress:
                self._note()
                if not pending and self._flight is None and self.on_idle is not None:
                    self.on_idle()
                # A reader whose file grows is looked at again soon; otherwise only a
                # notification wakes the shipper (NOTIFY_FALLBACK is a safety net, not a poll).
                now = trio.current_time()
                wait = TAIL_INTERVAL if reader.polls else NOTIFY_FALLBACK
                if pending and self._flight is None:
                    wait = min(wait, max(0.0, self._age() - (now - pending.since)))
                self.due_at = now + wait
                return self.due_at

    async def _acknowledged(self, expected: int) -> None:
        """The master holds ``expected`` elements of the stream: advance (or rewind) to it."""
        pending, seq = self._pending, self._seq
        if expected >= seq:
            done = min(expected - seq, len(pending))
            if done:
                position = self._reader.commit(pending.take(done))
                seq = self._seq = seq + done
                checkpoints = self._checkpoints
                checkpoints[seq] = position
                while len(checkpoints) > CHECKPOINTS_KEPT:
                    del checkpoints[next(k for k in checkpoints if k)]
                self._unsaved = (seq, position)
            self._skip = expected - seq
            self.acked = seq
            self._acked_now()
            self.waiting_since = time.time() if pending else None  # the rest waits from now
            self._ceiling_successes += 1
            if self._lone_too_large:  # one element was "too large", then taken: a passing 413
                self._lone_too_large = False
                self._count_ceiling = MAX_BATCH_COUNT
            elif self._ceiling_successes >= CEILING_RECOVERY and self._count_ceiling < MAX_BATCH_COUNT:
                # a 413 may have been a moment's (a master restarting behind a proxy)
                self._count_ceiling = min(MAX_BATCH_COUNT, self._count_ceiling * 2)
                self._ceiling_successes = 0
            self._count_limit = min(self._count_ceiling, self._count_limit * 2)
        else:
            start = max(k for k in self._checkpoints if k <= expected)
            log.warning("task %s %s: the master holds %d elements, fewer than acknowledged "
                        "(%d); resending from element %d", self.task_id, self.stream, expected,
                        seq, start)
            self._seq, self._skip = start, expected - start
            self.acked = start
            pending.clear()
            await self._reader.restore(self._checkpoints[start])

    def _launch(self, flight: Flight, seq: int, count: int, body: bytes) -> None:
        """Send a batch: in a node batch, with no task of its own (:meth:`_landed` takes its answer);
        else (or to retry it after a backoff) in the owner's nursery."""
        self._flight = flight
        batcher = self.batcher
        # A small batch goes with other tasks' batches, in one request; a large one (a flood)
        # gains nothing from company and keeps its endpoint's own fast path.
        if batcher is not None and batcher.enabled and len(body) <= NODE_BATCH_ENTRY_BYTES:
            self.requests += 1
            batcher.submit(self.task_id, self.kind, body,
                           lambda value, error: self._landed(flight, seq, count, body, value, error))
            return
        assert self._nursery is not None, "open the shipper first"
        self._nursery.start_soon(self._fly, flight, seq, count, body)

    def _landed(self, flight: Flight, seq: int, count: int, body: bytes, value: int | None,
                error: MasterError | None) -> None:
        """A node batch's answer (on the Trio thread): the flight's answer, or its retry after a backoff."""
        answer = Answer("ok", self.local(value or 0)) if error is None else self._judge(error, seq, count)
        if answer is None or answer.kind == "retry":
            if self._nursery is not None:  # None: the stream was closed meanwhile (the agent stops)
                with contextlib.suppress(RuntimeError):  # its nursery is closing: the data stays for the next start
                    self._nursery.start_soon(self._fly, flight, seq, count, body, True,
                                             answer.retry_after if answer is not None else None)
            return
        self.refusing_since = None
        flight.answer = answer
        self.notify()

    async def _fly(self, flight: Flight, seq: int, count: int, body: bytes, failed: bool = False,
                   retry_after: float | None = None) -> None:
        """The batch's request(s) in a task of its own (``failed``: its first attempt, in a node batch,
        failed: after that attempt's backoff, at least ``retry_after`` seconds)."""
        backoff = Backoff(self._master)
        try:
            if failed:
                await backoff.wait(retry_after)
            flight.answer = await self._post(seq, count, body, backoff)
        finally:
            self.refusing_since = None  # answered, or cancelled: no batch of the stream is being refused
        self.notify()

    def _drop_first(self, pending: Pending, seq: int, why: str) -> None:
        """Replace the first pending element (index ``seq`` of the stream) by its placeholder: the
        master refused it on its own (``why``); said in the agent log, counted in :attr:`placeholders`."""
        element = pending.first()
        log.error("task %s %s: the master refuses element %d on its own (%s); it is replaced by a placeholder "
                  "(the spool keeps the original)", self.task_id, self.stream, seq, why)
        pending.replace_first(placeholder(self.kind, element))
        self.placeholders += 1
        self._count_limit = self._count_ceiling = MAX_BATCH_COUNT

    async def _post(self, seq: int, count: int, body: bytes, backoff: Backoff) -> Answer:
        """POST one batch (``count`` elements from ``seq``, ``body`` its encoded JSON) until the master
        answers in a way that moves the stream (see module docstring): an acknowledgement, a 409, a
        413 for several elements, a 422 naming an element; or a 404 / a lone element's 413 that lasted
        longer than ``refusal_timeout``. Everything else is retried with ``backoff`` (the master
        client's policy, stamina's; it counts the attempts before this one), forever."""
        try:
            while True:
                try:
                    batcher = self.batcher
                    # A small batch goes with other tasks' batches, in one request; a large one (a flood)
                    # gains nothing from company and keeps its endpoint's own fast path.
                    if batcher is not None and batcher.enabled and len(body) <= NODE_BATCH_ENTRY_BYTES:
                        self.requests += 1
                        return Answer("ok", self.local(await batcher.post(self.task_id, self.kind, body)))
                    async with self._limiter:
                        self.requests += 1
                        answer = await self._master.post_stream(self.kind, self.task_id, body)
                    return Answer("ok", self.local(answer.accepted_seq))
                except MasterError as exc:
                    judged = self._judge(exc, seq, count)
                    if judged is None:
                        raise
                    if judged.kind != "retry":
                        return judged
                    await backoff.wait(judged.retry_after)
        finally:
            self.refusing_since = None
