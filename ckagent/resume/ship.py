"""Ship a task's checkpoints to the master durably: :class:`CheckpointShipper`, one per running attempt.

A checkpoint's life, each step on disk before the next (``<task_dir>/snapshots/``)::

    N/          the snapshot the spider wrote (CK_SNAPSHOT_DIR/N) when asked to persist (request N)
    N.json      written here at submit: {n, attempt, itemSeq, logSeq, reason, created, state, …}
                state "taken"   → packed (ckagent.resume.snapshot) → "packed" (+ the manifest's files)
                                → chunks the master lacks uploaded, then the manifest posted → "shipped"
    chunks.known  the chunks the master holds (sha256, one a line): the last shipped manifest's, or the
                restored checkpoint's (:meth:`CheckpointShipper.seed`) — what the next pack need not send

(the folder and its records: ckagent.resume.records)

An agent that stops mid-way leaves these files; the next one (re-adopting the task) makes a shipper of
the same attempt, whose :meth:`~CheckpointShipper.run` reads them and finishes the upload: a "packed"
checkpoint is uploaded from its manifest (each chunk read again from ``N/`` and checked against its
sha256), a "taken" one packed first. The manifest is posted once it is complete (a master that holds
that id already answers 200 again). After a checkpoint is shipped the snapshot dirs up to it and the
older ``*.json`` are removed. Only the newest pending checkpoint is shipped: a newer submit abandons an
older one between two chunks (its chunks already sent are not sent again).

Answers of the master (through :class:`~ckagent.master.client.MasterClient`):

- transport errors, 429/5xx, a 2xx that is not the protocol's → waited with the delivery's
  :class:`~ckagent.delivery.waiting.Backoff` and retried, until cancelled;
- 409 ``missingChunks`` → those chunks are sent again, then the manifest;
- 409 ``storedItems`` (the master holds fewer items than the checkpoint's ``itemSeq``: they are on their
  way) → waited with backoff, posted again;
- 409 ``supersededBy`` (the task moved on to a newer attempt) → :attr:`~CheckpointShipper.superseded_by`
  is set and the shipper stops: nothing more is shipped for this attempt;
- 404/405/501 (a master without checkpoints) → :attr:`~CheckpointShipper.unsupported`, logged once, stops;
- any other 4xx (a 422 for a chunk, a 409 of another kind), or a snapshot that cannot be packed or changed
  after it was packed → that checkpoint fails: one WARNING line, its files removed; the next one is tried.

The snapshot dir and ``N.json`` live in a dir the spider owns: every read and change goes through
ckagent.node.beneath below the task dir (no link followed); a ``N.json`` the spider broke is dropped with
a line — it can spoil only its own task's checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime
from enum import Enum
from pathlib import Path

import trio

from ckagent.delivery.waiting import Backoff
from ckagent.master.client import MasterClient, MasterConflict, MasterRejected, MasterUnavailable
from ckagent.master.protocol.checkpoints import CheckpointManifest, check_sha256
from ckagent.master.protocol.vocabulary import utc_iso
from ckagent.resume.records import KNOWN_FILE, SNAPSHOTS_DIR, MetaState, Record, ShippedCheckpoint, Snapshots
from ckagent.resume.snapshot import ChunkAt, Packed, PackError, PackLimits, chunk_places

__all__ = ["KNOWN_FILE", "SNAPSHOTS_DIR", "UPLOADS", "CheckpointShipper", "MetaState", "ShippedCheckpoint"]

log = logging.getLogger(__name__)

UPLOADS = 4
"""Chunks uploaded at once (a snapshot of many small files is many small requests)."""
MISSING_ROUNDS = 3
"""409 missingChunks answered by re-sending at once this many times; then with backoff."""
_NO_ENDPOINT = frozenset({404, 405, 501})


class _Stop(Exception):
    """This shipper ships nothing more (superseded, or a master without checkpoints)."""


class _Failed(Exception):
    """This checkpoint cannot be shipped (the message says why); the next one is tried."""


class CheckpointShipper:
    """Ships one attempt's checkpoints (see module docstring).

    ``task_dir`` is ``work_dir/tasks/<id>`` (its ``snapshots/`` is CK_SNAPSHOT_DIR); ``limits`` bound each
    pack. Start :meth:`run` in the task's nursery; :meth:`submit` each snapshot the spider acknowledged.
    """

    def __init__(self, master: MasterClient, task_id: str, task_dir: Path, *, attempt: int,
                 limits: PackLimits) -> None:
        self.master = master
        self.task_id = task_id
        self.task_dir = task_dir
        self.attempt = attempt
        self.limits = limits
        self.known: set[str] = set()
        """sha256 of the chunks the master holds (as far as this agent knows)."""
        self.last: ShippedCheckpoint | None = None
        """The newest checkpoint the master took (None: none yet, by this attempt on this node)."""
        self.superseded_by: int | None = None
        """The attempt the master said the task moved on to (409): nothing more is shipped."""
        self.unsupported = False
        """The master has no checkpoint endpoints (404/405/501): nothing more is shipped."""
        self.failed = 0
        """Checkpoints that could not be shipped (each logged)."""
        self.sent_chunks = 0
        """Chunks uploaded (a count for tests and the bench)."""
        self.disk = Snapshots(task_dir, task_id)
        """Its snapshots folder on disk (ckagent.resume.records)."""
        self._pending: dict[int, Record] = {}
        self._packed: dict[int, Packed] = {}
        self._wake = trio.Event()
        self._changed = trio.Event()
        self._running = False

    # ------------------------------------------------------------------ the caller's side

    def seed(self, manifest: CheckpointManifest) -> None:
        """The restored checkpoint's chunks are the master's: the first pack sends only what changed.
        Blocking (writes ``chunks.known``). Never raises (logged)."""
        self.known = {sha for entry in manifest.files for sha in entry.chunks}
        self.disk.save_known(self.known)

    async def submit(self, n: int, *, item_seq: int, log_seq: int, reason: str | Enum, created: datetime) -> str:
        """Queue the snapshot ``snapshots/N`` the spider acknowledged, taken at ``created`` with the
        streams at ``item_seq``/``log_seq``; ``N.json`` is on disk when this returns. Returns the
        checkpoint's id (``<attempt>-<n>``); :meth:`run` packs and ships it. Raises OSError (a full disk:
        nothing queued). Cancellation: as usual (maybe written, then shipped by the next agent)."""
        text = reason.value if isinstance(reason, Enum) else reason
        meta = Record(n, self.attempt, item_seq, log_seq, str(text), utc_iso(created), MetaState.TAKEN)
        await trio.to_thread.run_sync(self.disk.write, meta)
        self._pending[n] = meta
        self._changed_now()
        return meta.id

    async def wait_idle(self) -> str | None:
        """Wait until nothing submitted is left to ship — shipped, failed, or the shipper stopped — and
        return the id of the newest shipped checkpoint (None: none). The caller bounds it
        (``trio.move_on_after``; :attr:`last` then says what was shipped)."""
        while self._pending and self.superseded_by is None and not self.unsupported:
            await self._changed.wait()
        return self.last.id if self.last is not None else None

    @property
    def pending(self) -> int:
        """Checkpoints submitted and not shipped yet."""
        return len(self._pending)

    # ------------------------------------------------------------------ the loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Recover this attempt's records (module docstring), report started, then ship every submitted
        checkpoint, newest first, until cancelled or stopped (superseded, unsupported). Never raises
        for master or snapshot trouble (logged). Cancellation: what was shipped is recorded on disk."""
        await trio.to_thread.run_sync(self._recover)
        task_status.started()
        try:
            while self.superseded_by is None and not self.unsupported:
                if not self._pending:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    continue
                newest = max(self._pending)
                older = [self._pending.pop(n) for n in sorted(self._pending) if n < newest]
                for meta in older:
                    self._packed.pop(meta.n, None)
                if older:
                    await trio.to_thread.run_sync(self.disk.remove, [m.n for m in older])
                meta = self._pending[newest]
                try:
                    await self._ship(meta)
                except _Failed as exc:
                    self.failed += 1
                    log.warning("task %s: checkpoint %s not shipped: %s", self.task_id, meta.id, exc)
                    self._pending.pop(meta.n, None)
                    self._packed.pop(meta.n, None)
                    await trio.to_thread.run_sync(self.disk.remove, [meta.n])
                except _Stop:
                    break
                self._changed_now()
        finally:
            self._changed_now()

    def _changed_now(self) -> None:
        self._wake.set()
        self._changed.set()
        self._changed = trio.Event()

    async def _ship(self, meta: Record) -> None:
        if meta.state is MetaState.TAKEN:
            try:
                packed = await trio.to_thread.run_sync(self.disk.pack, meta.n, frozenset(self.known), self.limits)
            except PackError as exc:
                raise _Failed(str(exc)) from exc
            if packed.skipped_line():
                log.warning("task %s: checkpoint %s: %s", self.task_id, meta.id, packed.skipped_line())
            meta = replace(meta, state=MetaState.PACKED, files=packed.files, size_bytes=packed.size_bytes,
                           packed_bytes=packed.packed_bytes)
            await trio.to_thread.run_sync(self.disk.write, meta)
            self._pending[meta.n] = meta
            self._packed[meta.n] = packed
        manifest = meta.manifest()
        backoff = Backoff(self.master)
        places = dict(chunk_places(manifest.files))
        sending = [(sha, at) for sha, at in places.items() if sha not in self.known]
        rounds = 0
        while True:
            if not await self._put_all(meta, sending):
                return  # a newer snapshot came: that one is shipped instead
            missing = await self._post(meta, manifest, backoff)
            if missing is None:
                break
            self.known.difference_update(missing)
            unknown = [sha for sha in missing if sha not in places]
            if unknown:
                raise _Failed(f"the master asks for chunks the checkpoint does not hold: {unknown[:3]}")
            sending = [(sha, places[sha]) for sha in dict.fromkeys(missing)]
            rounds += 1
            if rounds > MISSING_ROUNDS:
                await backoff.wait()
        shipped = replace(meta, state=MetaState.SHIPPED)
        self.known = set(places)
        await trio.to_thread.run_sync(self.disk.shipped, shipped, self.known)
        del self._pending[meta.n]
        self._packed.pop(meta.n, None)
        self.last = shipped.shipped()
        log.debug("task %s: checkpoint %s shipped (%d bytes, %d packed bytes sent)", self.task_id, meta.id,
                  meta.size_bytes, meta.packed_bytes)

    async def _put_all(self, meta: Record, sending: list[tuple[str, ChunkAt]]) -> bool:
        """Upload ``sending``, :data:`UPLOADS` at a time (each with its own backoff); False when a newer
        snapshot came meanwhile (the rest is left). Raises _Failed or _Stop (the first one raised)."""
        chunks = iter(sending)
        raised: list[Exception] = []
        newer = False

        async def uploads(cancel: trio.CancelScope) -> None:
            nonlocal newer
            backoff = Backoff(self.master)
            for sha, at in chunks:  # shared: each takes the next chunk
                if max(self._pending, default=meta.n) > meta.n:
                    newer = True
                    return
                try:
                    await self._put(meta, sha, at, backoff)
                except (_Failed, _Stop) as exc:
                    raised.append(exc)
                    cancel.cancel()
                    return

        async with trio.open_nursery() as nursery:
            for _ in range(min(UPLOADS, len(sending))):
                nursery.start_soon(uploads, nursery.cancel_scope)
        if raised:
            raise raised[0]
        return not newer

    async def _put(self, meta: Record, sha: str, at: ChunkAt, backoff: Backoff) -> None:
        packed = self._packed.get(meta.n)
        gz = packed.gz.pop(sha, None) if packed is not None else None
        if gz is None:
            try:
                gz = await trio.to_thread.run_sync(self.disk.read_gz, meta.n, at, sha)
            except PackError as exc:
                raise _Failed(str(exc)) from exc
        while True:
            try:
                await self.master.put_checkpoint_chunk(self.task_id, sha, gz)
            except MasterUnavailable as exc:
                retry_after = exc.retry_after
            except MasterRejected as exc:
                self._refused(exc, f"chunk {sha[:12]}…")
            else:
                self.known.add(sha)
                self.sent_chunks += 1
                return
            await backoff.wait(retry_after)

    async def _post(self, meta: Record, manifest: CheckpointManifest, backoff: Backoff) -> list[str] | None:
        """Post the manifest: None once taken, else the chunks the master says it lacks."""
        waited_items = False
        while True:
            retry_after = None
            try:
                await self.master.post_checkpoint(self.task_id, manifest)
                return None
            except MasterUnavailable as exc:
                retry_after = exc.retry_after
            except MasterConflict as exc:
                body = exc.body if isinstance(exc.body, dict) else {}
                missing = body.get("missingChunks")
                if isinstance(missing, list) and missing:
                    try:
                        return [check_sha256(sha, "missingChunks") for sha in missing]
                    except ValueError:
                        raise _Failed(f"the master's missingChunks are not sha256 names ({exc})") from None
                if not isinstance(body.get("storedItems"), int) or exc.superseded_by is not None:
                    self._refused(exc, "the manifest")
                if not waited_items:
                    log.info("task %s: checkpoint %s waits for the master to hold its %d items (it holds %d)",
                             self.task_id, meta.id, meta.item_seq, body["storedItems"])
                    waited_items = True
            except MasterRejected as exc:
                self._refused(exc, "the manifest")
            await backoff.wait(retry_after)

    def _refused(self, exc: MasterRejected, what: str) -> None:
        """Raise what a 4xx means here: _Stop (superseded, unsupported) or _Failed."""
        superseded = exc.superseded_by if isinstance(exc, MasterConflict) else None
        if superseded is not None:
            self.superseded_by = superseded
            log.info("task %s: attempt %d was superseded by attempt %d: no more checkpoints shipped",
                     self.task_id, self.attempt, superseded)
            raise _Stop
        if exc.status in _NO_ENDPOINT:
            self.unsupported = True
            log.warning("task %s: the master does not take checkpoints (%s): the task's state is not saved",
                        self.task_id, exc)
            raise _Stop
        raise _Failed(f"the master refused {what}: {exc}")

    def _recover(self) -> None:
        """Take up what an earlier agent left of this attempt (module docstring). Blocking; never raises."""
        found = self.disk.recover(self.attempt)
        if found.last is not None:
            self.last = found.last.shipped()
        self.known |= found.known
        for record in found.pending:
            self._pending[record.n] = record
        if self._pending:
            log.info("task %s: %d checkpoint(s) of attempt %d left by an earlier agent: shipping the newest",
                     self.task_id, len(self._pending), self.attempt)
