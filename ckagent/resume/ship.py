"""Ship a task's checkpoints to the master durably: :class:`CheckpointShipper`, one per running attempt.

A checkpoint's life, each step on disk before the next (``<task_dir>/snapshots/``)::

    N/          the snapshot the spider wrote (CK_SNAPSHOT_DIR/N) when asked to persist (request N)
    N.json      written here at submit: {n, attempt, itemSeq, logSeq, reason, created, state, …}
                state "taken"   → packed (ckagent.resume.snapshot) → "packed" (+ the manifest's files)
                                → chunks the master lacks uploaded, then the manifest posted → "shipped"
    chunks.known  the chunks the master holds (sha256, one a line): the last shipped manifest's, or the
                restored checkpoint's (:meth:`CheckpointShipper.seed`) — what the next pack need not send

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

import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

import trio

from ckagent.delivery.waiting import Backoff
from ckagent.master.client import MasterClient, MasterConflict, MasterRejected, MasterUnavailable
from ckagent.master.protocol.checkpoints import CheckpointFile, CheckpointManifest, check_sha256
from ckagent.master.protocol.vocabulary import utc_iso
from ckagent.node import beneath
from ckagent.resume.snapshot import (
    ChunkAt,
    Packed,
    PackError,
    PackLimits,
    chunk_places,
    gzip_chunk,
    pack,
    read_chunk,
)

__all__ = ["KNOWN_FILE", "SNAPSHOTS_DIR", "CheckpointShipper", "MetaState", "ShippedCheckpoint"]

log = logging.getLogger(__name__)

SNAPSHOTS_DIR = "snapshots"
"""The task dir's folder of snapshots (CK_SNAPSHOT_DIR) and their ``N.json``."""
KNOWN_FILE = "chunks.known"
MAX_META_BYTES = 64 << 20
"""Largest ``N.json`` / ``chunks.known`` read back (100,000 entries of a manifest fit)."""
UPLOADS = 4
"""Chunks uploaded at once (a snapshot of many small files is many small requests)."""
MISSING_ROUNDS = 3
"""409 missingChunks answered by re-sending at once this many times; then with backoff."""
_NO_ENDPOINT = frozenset({404, 405, 501})
_META = re.compile(r"([0-9]{1,18})\.json")
_SNAP = re.compile(r"([0-9]{1,18})(\.tmp)?")


class MetaState(str, Enum):
    """Where a checkpoint is in its life (``N.json``'s ``state``)."""

    TAKEN = "taken"
    PACKED = "packed"
    SHIPPED = "shipped"


@dataclass(frozen=True)
class ShippedCheckpoint:
    """The newest checkpoint the master holds (for the views): ``id`` ``<attempt>-<n>``, ``created``
    (aware UTC: the snapshot's instant), ``size_bytes`` (unpacked), ``packed_bytes`` (gzip bytes this one
    uploaded), ``item_seq``/``log_seq`` (the streams' positions it holds), ``reason``."""

    id: str
    created: datetime
    size_bytes: int
    packed_bytes: int
    item_seq: int
    log_seq: int
    reason: str


@dataclass
class _Meta:
    n: int
    attempt: int
    item_seq: int
    log_seq: int
    reason: str
    created: str
    state: MetaState
    size_bytes: int = 0
    packed_bytes: int = 0
    files: list[CheckpointFile] | None = None

    @property
    def id(self) -> str:
        return f"{self.attempt}-{self.n}"

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "attempt": self.attempt, "itemSeq": self.item_seq, "logSeq": self.log_seq,
                "reason": self.reason, "created": self.created, "state": self.state.value,
                "sizeBytes": self.size_bytes, "packedBytes": self.packed_bytes,
                "files": None if self.files is None else [f.to_json() for f in self.files]}

    @classmethod
    def from_json(cls, obj: Any, n: int) -> _Meta:
        """Raises ValueError (ProtocolError too) for a meta that is not ours."""
        if not isinstance(obj, dict) or obj.get("n") != n:
            raise ValueError("not a checkpoint record of this name")
        state = MetaState(obj.get("state"))
        files = None
        if state is not MetaState.TAKEN:  # the manifest's own checks (paths, chunk counts, shas)
            body = {**obj, "id": f"{obj.get('attempt')}-{n}", "createdAt": obj.get("created")}
            files = CheckpointManifest.from_json(body).files
        ints = [obj.get(key) for key in ("attempt", "itemSeq", "logSeq", "sizeBytes", "packedBytes")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise ValueError("a count that is not a whole number")
        if not isinstance(obj.get("reason"), str) or not isinstance(obj.get("created"), str):
            raise ValueError("no reason or time")
        attempt, item_seq, log_seq, size, packed = (int(v) for v in ints)  # type: ignore[arg-type]
        return cls(n, attempt, item_seq, log_seq, obj["reason"], obj["created"], state, size, packed, files)

    def manifest(self) -> CheckpointManifest:
        return CheckpointManifest(id=self.id, attempt=self.attempt, created_at=self.created, reason=self.reason,
                                  item_seq=self.item_seq, log_seq=self.log_seq, size_bytes=self.size_bytes,
                                  packed_bytes=self.packed_bytes, files=list(self.files or []))

    def shipped(self) -> ShippedCheckpoint:
        try:
            created = datetime.fromisoformat(self.created.replace("Z", "+00:00"))
        except ValueError:
            created = datetime.fromtimestamp(0, timezone.utc)
        return ShippedCheckpoint(self.id, created, self.size_bytes, self.packed_bytes, self.item_seq, self.log_seq,
                                 self.reason)


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
        self._pending: dict[int, _Meta] = {}
        self._packed: dict[int, Packed] = {}
        self._wake = trio.Event()
        self._changed = trio.Event()
        self._running = False

    # ------------------------------------------------------------------ the caller's side

    def seed(self, manifest: CheckpointManifest) -> None:
        """The restored checkpoint's chunks are the master's: the first pack sends only what changed.
        Blocking (writes ``chunks.known``). Never raises (logged)."""
        self.known = {sha for entry in manifest.files for sha in entry.chunks}
        self._save_known()

    async def submit(self, n: int, *, item_seq: int, log_seq: int, reason: str | Enum, created: datetime) -> str:
        """Queue the snapshot ``snapshots/N`` the spider acknowledged, taken at ``created`` with the
        streams at ``item_seq``/``log_seq``; ``N.json`` is on disk when this returns. Returns the
        checkpoint's id (``<attempt>-<n>``); :meth:`run` packs and ships it. Raises OSError (a full disk:
        nothing queued). Cancellation: as usual (maybe written, then shipped by the next agent)."""
        text = reason.value if isinstance(reason, Enum) else reason
        meta = _Meta(n, self.attempt, item_seq, log_seq, str(text), utc_iso(created), MetaState.TAKEN)
        await trio.to_thread.run_sync(self._write_meta, meta)
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
                    await trio.to_thread.run_sync(self._remove, [m.n for m in older])
                meta = self._pending[newest]
                try:
                    await self._ship(meta)
                except _Failed as exc:
                    self.failed += 1
                    log.warning("task %s: checkpoint %s not shipped: %s", self.task_id, meta.id, exc)
                    self._pending.pop(meta.n, None)
                    self._packed.pop(meta.n, None)
                    await trio.to_thread.run_sync(self._remove, [meta.n])
                except _Stop:
                    break
                self._changed_now()
        finally:
            self._changed_now()

    def _changed_now(self) -> None:
        self._wake.set()
        self._changed.set()
        self._changed = trio.Event()

    async def _ship(self, meta: _Meta) -> None:
        if meta.state is MetaState.TAKEN:
            try:
                packed = await trio.to_thread.run_sync(self._pack, meta.n, frozenset(self.known))
            except PackError as exc:
                raise _Failed(str(exc)) from exc
            if packed.skipped_line():
                log.warning("task %s: checkpoint %s: %s", self.task_id, meta.id, packed.skipped_line())
            meta = replace(meta, state=MetaState.PACKED, files=packed.files, size_bytes=packed.size_bytes,
                           packed_bytes=packed.packed_bytes)
            await trio.to_thread.run_sync(self._write_meta, meta)
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
        await trio.to_thread.run_sync(self._shipped, shipped)
        del self._pending[meta.n]
        self._packed.pop(meta.n, None)
        self.last = shipped.shipped()
        log.debug("task %s: checkpoint %s shipped (%d bytes, %d packed bytes sent)", self.task_id, meta.id,
                  meta.size_bytes, meta.packed_bytes)

    async def _put_all(self, meta: _Meta, sending: list[tuple[str, ChunkAt]]) -> bool:
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

    async def _put(self, meta: _Meta, sha: str, at: ChunkAt, backoff: Backoff) -> None:
        packed = self._packed.get(meta.n)
        gz = packed.gz.pop(sha, None) if packed is not None else None
        if gz is None:
            try:
                gz = await trio.to_thread.run_sync(self._read_gz, meta.n, at, sha)
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

    async def _post(self, meta: _Meta, manifest: CheckpointManifest, backoff: Backoff) -> list[str] | None:
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

    # ------------------------------------------------------------------ on disk (blocking)

    def _open_snap(self, n: int) -> int:
        """A descriptor of ``snapshots/N``, walked from the task dir (the spider may have made
        ``snapshots`` a link). Raises PackError."""
        try:
            return beneath.open_dir(self.task_dir, f"{SNAPSHOTS_DIR}/{n}")
        except OSError as exc:
            raise PackError(f"snapshot {n}: cannot open it: {exc}") from exc

    def _pack(self, n: int, known: frozenset[str]) -> Packed:
        fd = self._open_snap(n)
        try:
            return pack(fd, known, self.limits)
        finally:
            os.close(fd)

    def _read_gz(self, n: int, at: ChunkAt, sha: str) -> bytes:
        fd = self._open_snap(n)
        try:
            return gzip_chunk(read_chunk(fd, at, sha))
        finally:
            os.close(fd)

    def _write_meta(self, meta: _Meta) -> None:
        data = json.dumps(meta.to_json(), separators=(",", ":")).encode()
        beneath.write_new(self.task_dir, f"{SNAPSHOTS_DIR}/{meta.n}.json", data)

    def _save_known(self) -> None:
        try:
            os.close(beneath.open_dir(self.task_dir, SNAPSHOTS_DIR, create=True))
            data = "".join(f"{sha}\n" for sha in sorted(self.known)).encode()
            beneath.write_new(self.task_dir, f"{SNAPSHOTS_DIR}/{KNOWN_FILE}", data)
        except OSError as exc:
            log.warning("task %s: cannot record the chunks the master holds (%s)", self.task_id, exc)

    def _shipped(self, meta: _Meta) -> None:
        """Record ``meta`` shipped; remove the snapshots up to it and older records."""
        self._write_meta(meta)
        self._save_known()
        self._remove(self._names_up_to(meta.n))
        beneath.remove(self.task_dir, f"{SNAPSHOTS_DIR}/{meta.n}")

    def _names_up_to(self, n: int) -> Iterable[int]:
        try:
            names = _listdir(self.task_dir)
        except OSError:
            return []
        found = set()
        for name in names:
            match = _META.fullmatch(name) or _SNAP.fullmatch(name)
            if match and int(match.group(1)) < n:
                found.add(int(match.group(1)))
        return sorted(found)

    def _remove(self, numbers: Iterable[int]) -> None:
        """Remove the snapshot dirs of ``numbers``, their ``N.tmp`` and records. Never raises (logged)."""
        for n in numbers:
            for name in (str(n), f"{n}.tmp", f"{n}.json"):
                try:
                    beneath.remove(self.task_dir, f"{SNAPSHOTS_DIR}/{name}")
                except OSError as exc:
                    log.warning("task %s: cannot remove snapshot %s (%s)", self.task_id, name, exc)

    def _recover(self) -> None:
        """Read this attempt's records (module docstring); remove other attempts'. Never raises."""
        try:
            names = _listdir(self.task_dir)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("task %s: cannot read its snapshots (%s)", self.task_id, exc)
            return
        metas: list[_Meta] = []
        for name in names:
            match = _META.fullmatch(name)
            if not match:
                continue
            n = int(match.group(1))
            try:
                raw = beneath.read_bytes(self.task_dir, f"{SNAPSHOTS_DIR}/{name}", MAX_META_BYTES)
                meta = _Meta.from_json(json.loads(raw), n)
            except (OSError, ValueError) as exc:
                log.warning("task %s: snapshot record %s dropped (%s)", self.task_id, name, exc)
                self._remove([n])
                continue
            if meta.attempt != self.attempt:
                self._remove([n])
                continue
            metas.append(meta)
        shipped = [m for m in metas if m.state is MetaState.SHIPPED]
        newest = max(shipped, key=lambda m: m.n, default=None)
        if newest is not None:
            self.last = newest.shipped()
            self.known = set(sha for entry in newest.files or [] for sha in entry.chunks)
        for meta in metas:
            if meta.state is not MetaState.SHIPPED and (newest is None or meta.n > newest.n):
                self._pending[meta.n] = meta
        try:
            text = beneath.read_bytes(self.task_dir, f"{SNAPSHOTS_DIR}/{KNOWN_FILE}", MAX_META_BYTES).decode()
            self.known |= {line for line in text.splitlines() if len(line) == 64 and line.isalnum()}
        except (OSError, UnicodeDecodeError):
            pass
        if self._pending:
            log.info("task %s: %d checkpoint(s) of attempt %d left by an earlier agent: shipping the newest",
                     self.task_id, len(self._pending), self.attempt)


def _listdir(task_dir: Path) -> list[str]:
    fd = beneath.open_dir(task_dir, SNAPSHOTS_DIR)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)
