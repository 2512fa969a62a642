"""A task's snapshots on disk (``<task_dir>/snapshots/``, CK_SNAPSHOT_DIR): the spider's snapshot dirs
and the agent's records of them — what :class:`ckagent.resume.ship.CheckpointShipper` keeps across an
agent restart (its module docstring tells the life of a checkpoint)::

    N/            the snapshot the spider wrote when asked to persist (request N)
    N.json        the agent's :class:`Record` of it: {n, attempt, itemSeq, logSeq, reason, created, state,
                  sizeBytes, packedBytes, files}; ``state`` taken → packed → shipped (:class:`MetaState`)
    chunks.known  the chunks the master holds (sha256, one a line)

The folder is the spider's (it writes the snapshots): :class:`Snapshots` reads and changes it only through
ckagent.node.beneath below the task dir — ``snapshots`` itself may be a link the spider planted, never
followed; a record the spider broke is dropped with a line (it spoils only its own task's checkpoints).
Every method blocks (system calls, hashing): call it in a worker thread.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

from ckagent.master.protocol.checkpoints import CheckpointFile, CheckpointManifest
from ckagent.node import beneath
from ckagent.resume.snapshot import ChunkAt, Packed, PackError, PackLimits, gzip_chunk, pack, read_chunk

__all__ = ["KNOWN_FILE", "SNAPSHOTS_DIR", "MetaState", "Record", "Recovered", "ShippedCheckpoint", "Snapshots"]

log = logging.getLogger(__name__)

SNAPSHOTS_DIR = "snapshots"
"""The task dir's folder of snapshots (CK_SNAPSHOT_DIR) and their ``N.json``."""
KNOWN_FILE = "chunks.known"
MAX_META_BYTES = 64 << 20
"""Largest ``N.json`` / ``chunks.known`` read back (100,000 entries of a manifest fit)."""
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
class Record:
    """One checkpoint's ``N.json``: request ``n`` of ``attempt``, the streams' positions, why, when
    (``created``: a protocol timestamp), its :class:`MetaState`, and once packed its manifest's sizes
    and ``files``."""

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
    def from_json(cls, obj: Any, n: int) -> Record:
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


@dataclass
class Recovered:
    """What an earlier agent left (:meth:`Snapshots.recover`): the newest shipped record, the records not
    shipped after it (oldest first), the chunks the master holds."""

    last: Record | None = None
    pending: list[Record] = field(default_factory=list)
    known: set[str] = field(default_factory=set)


class Snapshots:
    """The snapshots folder of ``task_dir`` (see module docstring); ``task_id`` names it in log lines."""

    def __init__(self, task_dir: Path, task_id: str) -> None:
        self.task_dir = task_dir
        self.task_id = task_id

    def open_snap(self, n: int) -> int:
        """A descriptor of ``snapshots/N``, walked from the task dir. Raises PackError."""
        try:
            return beneath.open_dir(self.task_dir, f"{SNAPSHOTS_DIR}/{n}")
        except OSError as exc:
            raise PackError(f"snapshot {n}: cannot open it: {exc}") from exc

    def pack(self, n: int, known: frozenset[str], limits: PackLimits) -> Packed:
        """Pack ``snapshots/N`` (ckagent.resume.snapshot.pack). Raises PackError."""
        fd = self.open_snap(n)
        try:
            return pack(fd, known, limits)
        finally:
            os.close(fd)

    def read_gz(self, n: int, at: ChunkAt, sha: str) -> bytes:
        """One chunk of ``snapshots/N`` read again, checked, gzipped. Raises PackError."""
        fd = self.open_snap(n)
        try:
            return gzip_chunk(read_chunk(fd, at, sha))
        finally:
            os.close(fd)

    def write(self, record: Record) -> None:
        """Write ``N.json`` (replaced by a rename, fsync'ed). Raises OSError."""
        data = json.dumps(record.to_json(), separators=(",", ":")).encode()
        beneath.write_new(self.task_dir, f"{SNAPSHOTS_DIR}/{record.n}.json", data)

    def save_known(self, known: set[str]) -> None:
        """Write ``chunks.known``. Never raises (logged)."""
        try:
            os.close(beneath.open_dir(self.task_dir, SNAPSHOTS_DIR, create=True))
            data = "".join(f"{sha}\n" for sha in sorted(known)).encode()
            beneath.write_new(self.task_dir, f"{SNAPSHOTS_DIR}/{KNOWN_FILE}", data)
        except OSError as exc:
            log.warning("task %s: cannot record the chunks the master holds (%s)", self.task_id, exc)

    def shipped(self, record: Record, known: set[str]) -> None:
        """Record ``record`` shipped and ``known``; remove its snapshot dir and every older one with its
        record. Raises OSError (the record not written)."""
        self.write(record)
        self.save_known(known)
        self.remove(self._numbers_below(record.n))
        beneath.remove(self.task_dir, f"{SNAPSHOTS_DIR}/{record.n}")

    def _numbers_below(self, n: int) -> Iterable[int]:
        try:
            names = self._listdir()
        except OSError:
            return []
        found = set()
        for name in names:
            match = _META.fullmatch(name) or _SNAP.fullmatch(name)
            if match and int(match.group(1)) < n:
                found.add(int(match.group(1)))
        return sorted(found)

    def remove(self, numbers: Iterable[int]) -> None:
        """Remove the snapshot dirs of ``numbers``, their ``N.tmp`` and records. Never raises (logged)."""
        for n in numbers:
            for name in (str(n), f"{n}.tmp", f"{n}.json"):
                try:
                    beneath.remove(self.task_dir, f"{SNAPSHOTS_DIR}/{name}")
                except OSError as exc:
                    log.warning("task %s: cannot remove snapshot %s (%s)", self.task_id, name, exc)

    def recover(self, attempt: int) -> Recovered:
        """The records ``attempt`` left (:class:`Recovered`); other attempts' and broken ones are
        removed. Never raises (logged)."""
        found = Recovered()
        try:
            names = self._listdir()
        except FileNotFoundError:
            return found
        except OSError as exc:
            log.warning("task %s: cannot read its snapshots (%s)", self.task_id, exc)
            return found
        records: list[Record] = []
        for name in names:
            match = _META.fullmatch(name)
            if not match:
                continue
            n = int(match.group(1))
            try:
                raw = beneath.read_bytes(self.task_dir, f"{SNAPSHOTS_DIR}/{name}", MAX_META_BYTES)
                record = Record.from_json(json.loads(raw), n)
            except (OSError, ValueError) as exc:
                log.warning("task %s: snapshot record %s dropped (%s)", self.task_id, name, exc)
                self.remove([n])
                continue
            if record.attempt != attempt:
                self.remove([n])
                continue
            records.append(record)
        shipped = [r for r in records if r.state is MetaState.SHIPPED]
        found.last = max(shipped, key=lambda r: r.n, default=None)
        if found.last is not None:
            found.known = {sha for entry in found.last.files or [] for sha in entry.chunks}
        newest = found.last.n if found.last is not None else 0
        found.pending = sorted((r for r in records if r.state is not MetaState.SHIPPED and r.n > newest),
                               key=lambda r: r.n)
        try:
            text = beneath.read_bytes(self.task_dir, f"{SNAPSHOTS_DIR}/{KNOWN_FILE}", MAX_META_BYTES).decode()
            found.known |= {line for line in text.splitlines() if len(line) == 64 and line.isalnum()}
        except (OSError, UnicodeDecodeError):
            pass
        return found

    def _listdir(self) -> list[str]:
        fd = beneath.open_dir(self.task_dir, SNAPSHOTS_DIR)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)
