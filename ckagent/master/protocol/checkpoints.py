"""Wire types of attempts that resume: a checkpoint's reference and manifest, and a task's retry policy.

A checkpoint is a task's state dir (``CK_STATE_DIR``) at one instant, with the positions of its item
and log streams (docs/protocol.md, "Checkpoints"). Its files are cut in chunks of :data:`CHUNK_BYTES`
(uncompressed), each stored once by the sha256 of its uncompressed bytes; the manifest lists the files
and their chunks::

    {"id": "2-5", "attempt": 2, "createdAt": "…", "reason": "interval", "itemSeq": 450, "logSeq": 1200,
     "sizeBytes": 3, "packedBytes": 23,
     "files": [{"path": "jobdir", "type": "dir", "size": 0, "mode": 493, "chunks": []},
               {"path": "jobdir/requests.seen", "type": "file", "size": 3, "mode": 420, "chunks": ["<sha256>"]}]}

A manifest comes back from the network before a restore writes files from it, so
:meth:`CheckpointManifest.from_json` refuses everything a restore must never see, each with a
ProtocolError naming the field: a path that is absolute, climbs (``..``), has an empty or ``.`` part,
holds NUL or lone surrogates, or is longer than :data:`MAX_PATH_CHARS`; a path twice, or beneath a
file; more than :data:`MAX_FILES` files; a negative size or one beyond 2**53; a chunk count other than
``ceil(size / CHUNK_BYTES)`` (a dir: 0); a sha256 that is not 64 lowercase hex digits; a ``sizeBytes``
other than the sum of the files' sizes.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from ckagent.master.protocol._fields import (
    ProtocolError,
    drop_none,
    master_id,
    opt_int,
    opt_number,
    opt_str,
    req_choice,
    req_int,
    req_master_id,
    req_object,
)
from ckagent.master.protocol.vocabulary import CAUSE_CLASSES, CauseClass

__all__ = [
    "CHECKPOINT_REASONS", "CHUNK_BYTES", "FILE_TYPES", "MAX_FILES", "MAX_PATH_CHARS", "CheckpointFile",
    "CheckpointManifest", "CheckpointRef", "ChunkError", "RetryPolicy", "check_sha256", "chunk_count", "unpack_chunk",
]

CHUNK_BYTES = 1 << 20
"""Uncompressed bytes of a checkpoint chunk (the last chunk of a file may be shorter)."""
MAX_FILES = 100_000
"""Most entries (files and dirs) in one checkpoint manifest."""
MAX_PATH_CHARS = 4096
"""Longest path (characters) of a manifest entry."""
MAX_SIZE = 1 << 53
"""Largest size a manifest may state (JSON's exact integers)."""
CHECKPOINT_REASONS = ("interval", "migrate", "memory", "stop")
"""Why a checkpoint was taken (a manifest's ``reason``): at the interval, before a migrate, at the
soft memory ceiling, before a stop meant to be resumed."""
FILE_TYPES = ("file", "dir")
"""The types of a manifest entry."""
MAX_EXIT_CODES = 256
"""Most exit codes a retry policy lists."""

_SHA256 = re.compile(r"[0-9a-f]{64}")


def _name(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def check_sha256(value: Any, where: str) -> str:
    """``value`` when it is 64 lowercase hex digits (a chunk's name); raises ProtocolError naming ``where``."""
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ProtocolError(where, "expected a sha256: 64 lowercase hexadecimal digits")
    return value


def chunk_count(size: int) -> int:
    """How many chunks a file of ``size`` bytes has: ``ceil(size / CHUNK_BYTES)``."""
    return -(-size // CHUNK_BYTES)


class ChunkError(ValueError):
    """A chunk's gzip bytes are not the chunk its sha256 names (:func:`unpack_chunk` says which check failed)."""


def unpack_chunk(gz: bytes, sha256: str, length: int | None = None) -> bytes:
    """The raw bytes of the chunk named ``sha256`` (lowercase hex) from its gzip bytes ``gz``: one complete
    gzip member with nothing after it, unpacking to at most CHUNK_BYTES bytes of that sha256. The one check
    both ends make (the master before it stores a chunk, the agent before it restores one). Raises
    ChunkError saying which check failed. Bounded: never holds more than CHUNK_BYTES + 1 unpacked bytes (a
    gzip bomb stops there). ``length``, when given, is how many bytes the chunk must hold (its place in its
    file: the restoring agent knows it). Blocking (CPU, about 5 ms a chunk): run it in a thread."""
    name = f"chunk {sha256[:12]}…"
    inflater = zlib.decompressobj(wbits=31)  # gzip only
    try:
        data = inflater.decompress(gz, CHUNK_BYTES + 1)
    except zlib.error as exc:
        raise ChunkError(f"{name} is not gzip data ({exc})") from None
    if len(data) > CHUNK_BYTES or inflater.unconsumed_tail:
        raise ChunkError(f"{name} unpacks to more than {CHUNK_BYTES} bytes (CHUNK_BYTES)")
    if not inflater.eof:
        raise ChunkError(f"{name} is not one whole gzip member (truncated)")
    if inflater.unused_data:
        raise ChunkError(f"{name} is not one whole gzip member (bytes after the gzip member)")
    if length is not None and len(data) != length:
        raise ChunkError(f"{name} holds {len(data)} bytes, its place in the file {length}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ChunkError(f"{name}: its bytes do not match its sha256 (they are {digest})")
    return data


def _check_path(value: Any, where: str) -> str:
    """A plain relative POSIX path beneath the state dir; raises ProtocolError naming ``where``."""
    if not isinstance(value, str) or not value:
        raise ProtocolError(where, "expected a non-empty relative path")
    if len(value) > MAX_PATH_CHARS:
        raise ProtocolError(where, f"a path is at most {MAX_PATH_CHARS} characters, got {len(value)}")
    if "\x00" in value:
        raise ProtocolError(where, "a path must not hold NUL")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ProtocolError(where, "a path must be valid Unicode (no lone surrogates)") from None
    if value.startswith("/"):
        raise ProtocolError(where, "a path must be relative (no leading '/')")
    if any(part in ("", ".", "..") for part in value.split("/")):
        raise ProtocolError(where, "a path must not climb ('..') nor hold an empty or '.' part")
    return value


def _req_str(o: dict[str, Any], key: str, path: str) -> str:
    value = opt_str(o, key, path=path)
    if not value:
        raise ProtocolError(_name(path, key), "required: a non-empty string")
    return value


def _check_tree(files: list[CheckpointFile], where: str) -> None:
    """No path twice, none beneath a file. Sorted with ``/`` as the lowest character (NUL, which no path
    holds), an entry's descendants follow it at once: one look at each file's successor (n log n)."""
    order = sorted(range(len(files)), key=lambda i: files[i].path.replace("/", "\x00"))
    for before, after in itertools.pairwise(order):
        first, second = files[before], files[after]
        if first.path == second.path:
            raise ProtocolError(f"{where}[{max(before, after)}].path", "the same path twice")
        if first.type == "file" and second.path.startswith(first.path + "/"):
            raise ProtocolError(f"{where}[{after}].path", f"a path beneath a file ({where}[{before}])")


def _size(o: dict[str, Any], key: str, path: str) -> int:
    return req_int(o, key, lo=0, hi=MAX_SIZE, path=path)


@dataclass(frozen=True)
class CheckpointRef:
    """The checkpoint an attempt resumes from (a task's ``checkpoint``): its ``id`` (``<attempt>-<n>``),
    the ``attempt`` that took it, the task's item and log positions at that instant (``item_seq``,
    ``log_seq``: the first item / line not in it), when (``created_at``), its unpacked ``size_bytes``
    and the manifest's ``url`` (``/api/tasks/{taskId}/checkpoints/{id}``, informational: the client
    reads the manifest by id)."""

    id: str
    attempt: int
    item_seq: int
    log_seq: int
    created_at: str | None = None
    size_bytes: int | None = None
    url: str | None = None

    @classmethod
    def from_json(cls, obj: Any, path: str = "checkpoint") -> CheckpointRef:
        """Validate; ``path`` prefixes field names in errors. Raises ProtocolError."""
        o = req_object(obj, path)
        size = opt_int(o, "sizeBytes", lo=0, path=path)
        if size is not None and size > MAX_SIZE:
            raise ProtocolError(_name(path, "sizeBytes"), f"must be <= {MAX_SIZE}")
        return cls(id=req_master_id(o, "id", path), attempt=req_int(o, "attempt", lo=1, path=path),
                   item_seq=req_int(o, "itemSeq", lo=0, path=path), log_seq=req_int(o, "logSeq", lo=0, path=path),
                   created_at=opt_str(o, "createdAt", path=path), size_bytes=size,
                   url=master_id(o, "url", path=path, required=False))

    def to_json(self) -> dict[str, Any]:
        """camelCase, None left out."""
        return drop_none({"id": self.id, "attempt": self.attempt, "itemSeq": self.item_seq, "logSeq": self.log_seq,
                          "createdAt": self.created_at, "sizeBytes": self.size_bytes, "url": self.url})


@dataclass(frozen=True)
class CheckpointFile:
    """One entry of a manifest: ``path`` relative to the state dir, ``type`` ``file`` or ``dir``, ``size``
    (bytes; a dir 0), ``mode`` (permission bits, at most 0o7777) and ``chunks`` (the sha256 of each
    CHUNK_BYTES piece, in order; a dir none)."""

    path: str
    type: str
    size: int
    mode: int
    chunks: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, obj: Any, path: str = "") -> CheckpointFile:
        """Validate one entry (see module docstring). Raises ProtocolError."""
        o = req_object(obj, path)
        kind = req_choice(o, "type", FILE_TYPES, path=path)
        size = _size(o, "size", path)
        raw = o.get("chunks")
        where = _name(path, "chunks")
        if not isinstance(raw, list):
            raise ProtocolError(where, "required: an array of sha256 strings (a dir's and an empty file's: [])")
        expected = chunk_count(size) if kind == "file" else 0
        if kind == "dir" and size:
            raise ProtocolError(_name(path, "size"), "a dir's size is 0")
        if len(raw) != expected:
            raise ProtocolError(where, f"a {kind} of {size} bytes has {expected} chunk(s), got {len(raw)}")
        return cls(path=_check_path(o.get("path"), _name(path, "path")), type=kind, size=size,
                   mode=req_int(o, "mode", lo=0, hi=0o7777, path=path),
                   chunks=[check_sha256(sha, f"{where}[{i}]") for i, sha in enumerate(raw)])

    def to_json(self) -> dict[str, Any]:
        """The JSON object."""
        return {"path": self.path, "type": self.type, "size": self.size, "mode": self.mode, "chunks": list(self.chunks)}


@dataclass(frozen=True)
class CheckpointManifest:
    """``POST /api/tasks/{taskId}/checkpoints`` (and the answer of its GET): what one checkpoint holds.

    ``id`` ``<attempt>-<n>``; ``attempt`` that took it; ``created_at`` protocol timestamp; ``reason`` one
    of :data:`CHECKPOINT_REASONS`; ``item_seq``/``log_seq`` the task's stream positions at the instant
    of the snapshot (the master must hold ``item_seq`` items before it takes the manifest);
    ``size_bytes`` the files' bytes (their sum), ``packed_bytes`` the gzip bytes of the chunks this
    checkpoint uploaded (informational); ``files`` its entries (see module docstring)."""

    id: str
    attempt: int
    created_at: str
    reason: str
    item_seq: int
    log_seq: int
    size_bytes: int
    packed_bytes: int
    files: list[CheckpointFile] = field(default_factory=list)

    @classmethod
    def from_json(cls, obj: Any, path: str = "") -> CheckpointManifest:
        """Validate a manifest (hostile input: see module docstring). Raises ProtocolError."""
        o = req_object(obj, path)
        raw = o.get("files")
        where = _name(path, "files")
        if not isinstance(raw, list):
            raise ProtocolError(where, "expected an array of {path, type, size, mode, chunks}")
        if len(raw) > MAX_FILES:
            raise ProtocolError(where, f"at most {MAX_FILES} entries, got {len(raw)}")
        files = [CheckpointFile.from_json(entry, f"{where}[{i}]") for i, entry in enumerate(raw)]
        _check_tree(files, where)
        size = _size(o, "sizeBytes", path)
        if size != sum(entry.size for entry in files):
            raise ProtocolError(_name(path, "sizeBytes"), "must be the sum of the files' sizes")
        return cls(id=req_master_id(o, "id", path), attempt=req_int(o, "attempt", lo=1, path=path),
                   created_at=_req_str(o, "createdAt", path), reason=req_choice(o, "reason", CHECKPOINT_REASONS, path=path),
                   item_seq=req_int(o, "itemSeq", lo=0, path=path), log_seq=req_int(o, "logSeq", lo=0, path=path),
                   size_bytes=size, packed_bytes=_size(o, "packedBytes", path), files=files)

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return {"id": self.id, "attempt": self.attempt, "createdAt": self.created_at, "reason": self.reason,
                "itemSeq": self.item_seq, "logSeq": self.log_seq, "sizeBytes": self.size_bytes,
                "packedBytes": self.packed_bytes, "files": [f.to_json() for f in self.files]}

    def ref(self, url: str | None = None) -> CheckpointRef:
        """The reference a task carries to this checkpoint."""
        return CheckpointRef(id=self.id, attempt=self.attempt, item_seq=self.item_seq, log_seq=self.log_seq,
                             created_at=self.created_at, size_bytes=self.size_bytes, url=url)


@dataclass(frozen=True)
class RetryPolicy:
    """A task's (or spider's) ``retry``: informational to the agent (the master decides; docs/protocol.md,
    "Causes and retries"). ``max_attempts`` counted attempts at most (≥ 1; disruptions are never
    counted); ``backoff_seconds`` × ``factor`` ** (n − 1) before the n-th retry; ``on`` the cause classes
    retried; ``exit_codes`` the EXIT_NONZERO exit codes retried."""

    max_attempts: int = 1
    backoff_seconds: float = 30.0
    factor: float = 2.0
    on: list[CauseClass] = field(default_factory=list)
    exit_codes: list[int] = field(default_factory=list)

    @classmethod
    def from_json(cls, obj: Any, path: str = "retry") -> RetryPolicy | None:
        """Validate (absent or null → None; each absent field its default). Raises ProtocolError."""
        if obj is None:
            return None
        o = req_object(obj, path)
        return cls(max_attempts=opt_int(o, "maxAttempts", lo=1, path=path) or 1,
                   backoff_seconds=_opt(opt_number(o, "backoffSeconds", lo=0, path=path), 30.0),
                   factor=_opt(opt_number(o, "factor", lo=1, path=path), 2.0),
                   on=[CauseClass(value) for value in _list(o, "on", path, _cause)],
                   exit_codes=_list(o, "exitCodes", path, _exit_code))

    def to_json(self) -> dict[str, Any]:
        """Every field, camelCase."""
        return {"maxAttempts": self.max_attempts, "backoffSeconds": self.backoff_seconds, "factor": self.factor,
                "on": [c.value for c in self.on], "exitCodes": list(self.exit_codes)}


def _opt(value: float | None, default: float) -> float:
    return default if value is None else value


def _cause(value: Any, where: str) -> str:
    if value not in CAUSE_CLASSES:
        raise ProtocolError(where, f"expected one of {', '.join(CAUSE_CLASSES)}, got {value!r:.60}")
    return str(value)


def _exit_code(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -255 <= value <= 255:
        raise ProtocolError(where, f"expected an exit code (an integer from -255 to 255), got {value!r:.60}")
    return value


def _list(o: dict[str, Any], key: str, path: str, check: Any) -> list[Any]:
    raw = o.get(key)
    where = _name(path, key)
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_EXIT_CODES:
        raise ProtocolError(where, f"expected an array of at most {MAX_EXIT_CODES} values")
    return [check(value, f"{where}[{i}]") for i, value in enumerate(raw)]
