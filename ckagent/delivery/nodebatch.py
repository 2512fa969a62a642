"""Node batches: several tasks' log and item batches in one request, when the master offers it.

With many tasks on one node every stream posting on its own makes the master's time per request
the bottleneck (issue 18: 64 tasks × 2 streams ≈ 80 requests a second, each waiting its turn). A
master whose registration answer lists ``"node-batches"`` (:data:`ckagent.master.protocol.NODE_BATCHES`)
takes ``POST /api/nodes/{id}/batches`` ``{"batches": [{"taskId", "stream", "seq", "lines"|"items"},
...]}`` and answers ``{"results": [...]}``, one per batch in order: ``{"acceptedSeq": n}`` or the
error the per-task endpoint would have answered, ``{"status", "error", ...}`` (docs/protocol.md,
"Node batches").

:class:`NodeBatcher` is what the stream shippers post through then: :meth:`NodeBatcher.submit` queues
one stream's batch and calls its ``on_done`` with its own answer (no task of the shipper's waits for
it); :meth:`NodeBatcher.post` does the same and waits. The senders (:meth:`NodeBatcher.run`, in the
outbox's nursery: ``MAX_IN_FLIGHT`` loops of the node, not a task per request) send whatever is
queued in one request, at most ``MAX_IN_FLIGHT`` requests at a time and one every
``MIN_SEND_INTERVAL`` — so batches queue up while the master is busy or the flow is steady, and a
lone batch after a quiet spell goes at once. Each waiter gets the
same answer or exception as ``MasterClient.call`` on its own endpoint would give it (``acceptedSeq``;
MasterConflict with ``expectedSeq``; MasterRejected; MasterUnavailable for the whole request's
trouble), so the shipper's rules (acknowledged positions, 409 rewind, 413/422 halving, backoff) are
unchanged. A master that does not offer the feature is never sent one: shippers post per task.

Errors: :meth:`NodeBatcher.post` raises what ``MasterClient.call`` raises (see ckagent.master.client);
:meth:`NodeBatcher.submit` hands it to ``on_done`` instead. Cancellation of a waiter leaves its batch
to the request (the master drops a repeat by ``seq``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import trio

from ckagent.master.client import MasterClient, MasterConflict, MasterError, MasterRejected, MasterUnavailable
from ckagent.master.protocol import NODE_BATCHES

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 2
"""Node batch requests on their way at the same time (what queues meanwhile goes in the next one)."""
MIN_SEND_INTERVAL = 0.1
"""Seconds between the starts of two node batch requests while batches keep coming: what queues
meanwhile goes in the next request. A batch after a quiet spell goes at once; under a steady flow
each request carries every stream that aged meanwhile, instead of the one or two that aged since
an answer that came back in 10 ms (64 tasks on a quiet machine: 72 requests a second otherwise).
Adds at most this much to a line's delivery lag."""
MAX_BATCHES = 256
"""Most streams' batches in one request (the reference master's limit)."""
OFF_AFTER_REFUSAL = 60.0
"""Seconds node batches stay off after the master refused a whole request (a master that stopped
offering them, or one restarting behind a proxy that answers 404 for a moment): shippers post per
task meanwhile, then node batches are tried again."""
MAX_REQUEST_BYTES = 6 * 1024 * 1024
"""Most body bytes of one request (below the reference master's 8 MiB; one larger batch goes alone)."""


Done = Callable[[int | None, "MasterError | None"], None]
"""What a submitted batch's owner is called with, on the Trio thread, once: (acceptedSeq, None) or
(None, the error its own endpoint would have raised)."""


class _Waiter:
    __slots__ = ("body", "error", "on_done", "stream", "task_id", "value")

    def __init__(self, task_id: str, stream: str, body: bytes, on_done: Done | None = None) -> None:
        self.task_id = task_id
        self.stream = stream
        self.body = body
        self.on_done = on_done
        self.value: int | None = None
        self.error: MasterError | None = None

    def settled(self) -> None:
        """Hand the answer to the owner (once)."""
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            try:
                on_done(self.value, self.error)
            except Exception:  # a bug of one owner must not cost the other batches their answers
                log.exception("task %s %s: handling a node batch's answer failed", self.task_id, self.stream)


class NodeBatcher:
    """Posts several streams' batches in one request (see module docstring). ``requests`` and
    ``batches`` count what was sent (requests, stream batches in them)."""

    def __init__(self, master: MasterClient) -> None:
        self._master = master
        self._queue: list[_Waiter] = []
        self._wake = trio.Event()
        self._running = False
        self._last_send = -MIN_SEND_INTERVAL  # trio.current_time() of the last request's start
        self._off_until = float("-inf")  # trio time until which node batches are off (a refusal)
        self.requests = 0
        self.batches = 0

    @property
    def enabled(self) -> bool:
        """True while the senders run and the master offered node batches at its last registration."""
        return (self._running and NODE_BATCHES in self._master.features
                and (self._off_until == float("-inf") or trio.current_time() >= self._off_until))

    def submit(self, task_id: str, stream: str, body: bytes, on_done: Done) -> None:
        """Queue one stream's batch (``body``: the per-task endpoint's JSON ``{"seq":…,"lines"|"items":[…]}``,
        UTF-8 bytes; ``stream`` "logs" or "items") to go with others; ``on_done(acceptedSeq, error)``
        is called once, on the Trio thread, with the master's ``acceptedSeq`` or the MasterConflict,
        MasterRejected or MasterUnavailable the per-task call would have raised (MasterUnavailable too
        when the senders stop first). Never blocks, never raises."""
        self._queue.append(_Waiter(task_id, stream, body, on_done))
        self._wake.set()

    async def post(self, task_id: str, stream: str, body: bytes) -> int:
        """:meth:`submit` and wait: returns the master's ``acceptedSeq``. Raises MasterConflict,
        MasterRejected, MasterUnavailable as the per-task call would. Cancellation leaves the batch
        to its request."""
        done = trio.Event()
        answer: list[Any] = []

        def on_done(value: int | None, error: MasterError | None) -> None:
            answer[:] = [value, error]
            done.set()

        self.submit(task_id, stream, body, on_done)
        await done.wait()
        value, error = answer
        if error is not None:
            raise error
        assert value is not None
        return int(value)

    async def run(self) -> None:
        """The senders: until cancelled, send what is queued (see module docstring). Batches still
        queued at the end get MasterUnavailable (their shippers retry them)."""
        self._running = True
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(MAX_IN_FLIGHT):
                    nursery.start_soon(self._sender)
        finally:
            self._running = False
            queued, self._queue = self._queue, []
            for waiter in queued:  # never sent: their shippers retry (per task, or here again)
                waiter.error = MasterUnavailable("node batches: the sender stopped")
                waiter.settled()

    async def _sender(self) -> None:
        """One of the MAX_IN_FLIGHT loops: wait for queued batches and the send interval, take what is
        queued (what came meanwhile goes in the same request), send it, again."""
        while True:
            while not self._queue:
                await self._wake.wait()
                if not self._queue:
                    self._wake = trio.Event()
            due = self._last_send + MIN_SEND_INTERVAL
            if trio.current_time() < due:  # meanwhile more batches queue (and the other sender may send)
                await trio.sleep_until(due)
                continue
            self._last_send = trio.current_time()
            taken, size = 0, 0
            for waiter in self._queue:
                if taken and (taken >= MAX_BATCHES or size + len(waiter.body) > MAX_REQUEST_BYTES):
                    break
                taken += 1
                size += len(waiter.body) + 64
            batch, self._queue = self._queue[:taken], self._queue[taken:]
            await self._send(batch)

    async def _send(self, batch: list[_Waiter]) -> None:
        try:
            parts = []
            for waiter in batch:
                head = b'{"taskId":%s,"stream":"%s",' % (json.dumps(waiter.task_id).encode(), waiter.stream.encode())
                parts.append(head + waiter.body[1:])  # the per-task body's members follow
            content = b'{"batches":[' + b",".join(parts) + b"]}"
            self.requests += 1
            self.batches += len(batch)
            try:
                results = await self._master.post_batches(content)
            except MasterRejected as exc:  # the request as a whole: e.g. a master that no longer offers it
                if exc.status == 413 and len(batch) == 1:  # one batch too large on its own: its own answer
                    batch[0].error = exc
                    return
                log.warning("node batches refused (%s); posting per task for %g s", exc, OFF_AFTER_REFUSAL)
                self._off_until = trio.current_time() + OFF_AFTER_REFUSAL
                for waiter in batch:
                    waiter.error = MasterUnavailable(f"node batches refused: {exc}")
                return
            except MasterError as exc:
                for waiter in batch:
                    waiter.error = exc
                return
            if len(results) != len(batch):
                error = MasterUnavailable(f"node batches: {len(results)} results for {len(batch)} batches")
                for waiter in batch:
                    waiter.error = error
                return
            for waiter, result in zip(batch, results, strict=True):
                _settle(waiter, result)
        finally:
            for waiter in batch:
                if waiter.value is None and waiter.error is None:  # cut short (a bug, or the stop)
                    waiter.error = MasterUnavailable("node batches: the request did not complete")
                waiter.settled()


def _settle(waiter: _Waiter, result: Any) -> None:
    """One result → the waiter's value or error, as ``MasterClient.call`` would classify the same answer."""
    endpoint = waiter.stream
    if isinstance(result, dict) and "acceptedSeq" in result:
        accepted = result["acceptedSeq"]
        if isinstance(accepted, int) and not isinstance(accepted, bool) and accepted >= 0:
            waiter.value = accepted
            return
    status = result.get("status") if isinstance(result, dict) else None
    if not isinstance(status, int) or isinstance(status, bool) or not isinstance(result.get("error"), str):
        waiter.error = MasterUnavailable(f"{endpoint}: a node batch result that is not the protocol's")
        return
    body = {k: v for k, v in result.items() if k != "status"}
    if status == 409:
        waiter.error = MasterConflict(endpoint, status, body)
    elif status == 429 or status >= 500:
        waiter.error = MasterUnavailable(f"{endpoint}: master answered {status} ({body['error']})")
    elif 400 <= status < 500:
        waiter.error = MasterRejected(endpoint, status, body)
    else:
        waiter.error = MasterUnavailable(f"{endpoint}: a node batch result with status {status}")
