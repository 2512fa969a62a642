"""What the node sends back about a task: its result (the claim, the final outcome), live stats, the
log and item batches with their acknowledgements, a release, and the spider-file listing it reads.

Frozen dataclasses, ``X.from_json(obj)`` (validates, raises ProtocolError naming the field) and
``x.to_json()`` (camelCase, ``None`` left out): see :mod:`ckagent.master.protocol`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckagent.master.protocol._fields import (
    ProtocolError,
    drop_none,
    master_id,
    opt_bool,
    opt_int,
    opt_number,
    opt_object,
    opt_str,
    req_choice,
    req_id,
    req_int,
    req_master_id,
    req_object,
    str_list,
)
from ckagent.master.protocol.outputs import ArtifactRef, artifact_list
from ckagent.master.protocol.vocabulary import (
    CAUSE_CLASSES,
    ERROR_CODES,
    FINAL_STATUSES,
    TASK_STATUSES,
    CauseClass,
)


@dataclass(frozen=True)
class TaskResult:
    """``POST /api/tasks/{id}/result``. RUNNING is the claim; SUCCESS/FAILED/CANCELLED are final.

    Times are protocol timestamps (str), ``duration_ms`` integer milliseconds.
    """

    status: str
    exit_code: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    duration_ms: int | None = None
    item_count: int | None = None
    log_lines: int | None = None
    deploy_ms: int | None = None
    install_ms: int | None = None
    run_ms: int | None = None
    finish_reason: str | None = None
    stats: TaskStats | None = None
    cpu_seconds: float | None = None
    """Resource figures of the task's processes, installers included (cgroup levels; None = unknown):
    user + system CPU seconds, memory peak (bytes), most processes+threads at once, block I/O bytes."""
    memory_peak_bytes: int | None = None
    pids_peak: int | None = None
    io_read_bytes: int | None = None
    io_write_bytes: int | None = None
    egress_refused: list[dict[str, Any]] | None = None
    """Connections the task's network policy refused: ``[{"address", "port", "count"}]``, most first
    (``port`` 0: not TCP/UDP); None = nothing refused or no kernel counters."""
    incomplete: bool | None = None
    """True when the master refused part of the task's data for good (a stream it ended with a 409,
    or another 4xx in the protocol's words — "unknown task", 403, … — for longer than the agent's
    ``server.refusal_timeout``): ``logLines`` and ``itemCount`` say what it acknowledged; the rest
    stays in the node's spool. Absent otherwise."""
    incomplete_reason: str | None = None
    """With ``incomplete``: why, in the master's own words, per refused stream (``"items: master
    answered 403 (quota exceeded) for 600 s"``; streams joined by ``; ``). Absent otherwise."""
    artifacts: list[ArtifactRef] | None = None
    """The task's artifacts the master holds (uploaded before this result); None = none collected."""
    attempt: int | None = None
    """The attempt this result (or claim) is of (absent = 1: docs/protocol.md, "Attempts")."""
    cause_class: CauseClass | None = None
    """Why the attempt ended, as a retry policy reads it (ckagent.master.protocol.vocabulary.cause_of);
    None for a success, a cancel or a claim."""
    retryable: bool | None = None
    """Whether another attempt may help (False: a success, BAD_TASK, CANCELLED); None for a claim."""
    checkpoint_id: str | None = None
    """The newest checkpoint this attempt shipped (the next attempt resumes from it); None = none."""

    @classmethod
    def from_json(cls, obj: Any) -> TaskResult:
        """Validate a decoded JSON body. Raises ProtocolError naming the first bad field."""
        o = req_object(obj, "")
        status = req_choice(o, "status", TASK_STATUSES)
        error_code = o.get("errorCode")
        if error_code is not None:
            error_code = req_choice(o, "errorCode", ERROR_CODES)
        if status in ("FAILED", "CANCELLED") and error_code is None:
            raise ProtocolError("errorCode", f"required when status is {status}")
        return cls(
            status=status,
            exit_code=opt_int(o, "exitCode"),
            error_code=error_code,
            error_message=opt_str(o, "errorMessage"),
            started_at=opt_str(o, "startedAt"),
            finished_at=opt_str(o, "finishedAt"),
            duration_ms=opt_int(o, "durationMs", lo=0),
            item_count=opt_int(o, "itemCount", lo=0),
            log_lines=opt_int(o, "logLines", lo=0),
            deploy_ms=opt_int(o, "deployMs", lo=0),
            install_ms=opt_int(o, "installMs", lo=0),
            run_ms=opt_int(o, "runMs", lo=0),
            finish_reason=opt_str(o, "finishReason"),
            stats=None if o.get("stats") is None else TaskStats.from_json(o["stats"], "stats"),
            cpu_seconds=opt_number(o, "cpuSeconds", lo=0),
            memory_peak_bytes=opt_int(o, "memoryPeakBytes", lo=0),
            pids_peak=opt_int(o, "pidsPeak", lo=0),
            io_read_bytes=opt_int(o, "ioReadBytes", lo=0),
            io_write_bytes=opt_int(o, "ioWriteBytes", lo=0),
            egress_refused=_refusals(o.get("egressRefused")),
            incomplete=opt_bool(o, "incomplete"),
            incomplete_reason=opt_str(o, "incompleteReason"),
            artifacts=artifact_list(o.get("artifacts")),
            attempt=opt_int(o, "attempt", lo=1),
            cause_class=None if o.get("causeClass") is None else CauseClass(req_choice(o, "causeClass", CAUSE_CLASSES)),
            retryable=opt_bool(o, "retryable"),
            checkpoint_id=master_id(o, "checkpointId", required=False),
        )

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return drop_none(
            {
                "status": self.status,
                "exitCode": self.exit_code,
                "errorCode": self.error_code,
                "errorMessage": self.error_message,
                "startedAt": self.started_at,
                "finishedAt": self.finished_at,
                "durationMs": self.duration_ms,
                "itemCount": self.item_count,
                "logLines": self.log_lines,
                "deployMs": self.deploy_ms,
                "installMs": self.install_ms,
                "runMs": self.run_ms,
                "finishReason": self.finish_reason,
                "stats": None if self.stats is None else self.stats.to_json(),
                "cpuSeconds": self.cpu_seconds,
                "memoryPeakBytes": self.memory_peak_bytes,
                "pidsPeak": self.pids_peak,
                "ioReadBytes": self.io_read_bytes,
                "ioWriteBytes": self.io_write_bytes,
                "egressRefused": self.egress_refused,
                "incomplete": self.incomplete,
                "incompleteReason": self.incomplete_reason,
                "artifacts": None if self.artifacts is None else [a.to_json() for a in self.artifacts],
                "attempt": self.attempt,
                "causeClass": None if self.cause_class is None else self.cause_class.value,
                "retryable": self.retryable,
                "checkpointId": self.checkpoint_id,
            }
        )


def _refusals(value: Any) -> list[dict[str, Any]] | None:
    """``egressRefused`` of a result: a list of ``{"address": str, "port": int, "count": int}``."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > 1000:
        raise ProtocolError("egressRefused", "expected a list (at most 1000) of {address, port, count}")
    out = []
    for i, item in enumerate(value):
        o = req_object(item, f"egressRefused[{i}]")
        out.append({"address": req_id(o, "address", path=f"egressRefused[{i}]"),
                    "port": req_int(o, "port", lo=0, hi=65535, path=f"egressRefused[{i}]"),
                    "count": req_int(o, "count", lo=0, path=f"egressRefused[{i}]")})
    return out


@dataclass(frozen=True)
class TaskStats:
    """``POST /api/tasks/{id}/stats``, and ``stats`` of a final result: one snapshot of a crawl's statistics.

    ``seq`` grows with every newer snapshot of the task (the master keeps the highest); ``stats`` is
    the spider's object (well-known keys: items, requests, responses, responsesByStatus, bytes,
    itemsDropped, retries, errors, finishReason); ``progress`` ``{"done": n, "total": m|null}``;
    ``at`` when the spider wrote it (protocol timestamp).
    """

    seq: int
    stats: dict[str, Any]
    progress: dict[str, Any] | None = None
    at: str | None = None

    @classmethod
    def from_json(cls, obj: Any, path: str = "") -> TaskStats:
        """Validate a decoded JSON body. Raises ProtocolError."""
        o = req_object(obj, path)
        stats = opt_object(o, "stats", path=path)
        if stats is None:
            raise ProtocolError(f"{path}.stats" if path else "stats", "required: an object")
        return cls(seq=req_int(o, "seq", lo=0, path=path), stats=stats,
                   progress=opt_object(o, "progress", path=path), at=opt_str(o, "at", path=path))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return drop_none({"seq": self.seq, "stats": self.stats, "progress": self.progress, "at": self.at})


@dataclass(frozen=True)
class LogBatch:
    """``POST /api/tasks/{id}/logs``: ``seq`` is the index of the first line of ``lines``; ``attempt``
    the attempt that wrote them (None: left out, which a master reads as 1)."""

    seq: int
    lines: list[str]
    attempt: int | None = None

    @classmethod
    def from_json(cls, obj: Any) -> LogBatch:
        """Validate a decoded JSON body. Raises ProtocolError."""
        o = req_object(obj, "")
        return cls(seq=req_int(o, "seq", lo=0), lines=str_list(o, "lines", required=True),
                   attempt=opt_int(o, "attempt", lo=1))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return drop_none({"seq": self.seq, "lines": list(self.lines), "attempt": self.attempt})


@dataclass(frozen=True)
class ItemBatch:
    """``POST /api/tasks/{id}/items``: ``seq`` is the index of the first item; items are JSON objects;
    ``attempt`` the attempt that wrote them (None: left out, which a master reads as 1)."""

    seq: int
    items: list[dict[str, Any]]
    attempt: int | None = None

    @classmethod
    def from_json(cls, obj: Any) -> ItemBatch:
        """Validate a decoded JSON body. Raises ProtocolError."""
        o = req_object(obj, "")
        raw = o.get("items")
        if not isinstance(raw, list):
            raise ProtocolError("items", "expected an array of objects")
        for i, item in enumerate(raw):
            if not isinstance(item, dict):
                raise ProtocolError(f"items[{i}]", "expected an object")
        return cls(seq=req_int(o, "seq", lo=0), items=raw, attempt=opt_int(o, "attempt", lo=1))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return drop_none({"seq": self.seq, "items": list(self.items), "attempt": self.attempt})


@dataclass(frozen=True)
class SeqAccepted:
    """200 answer to a logs/items batch: ``accepted_seq`` = how many elements the master now holds."""

    accepted_seq: int

    @classmethod
    def from_json(cls, obj: Any) -> SeqAccepted:
        """Validate a decoded JSON body. Raises ProtocolError."""
        return cls(accepted_seq=req_int(req_object(obj, ""), "acceptedSeq", lo=0))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return {"acceptedSeq": self.accepted_seq}


@dataclass(frozen=True)
class ResultAccepted:
    """200 answer to a final result: ``status`` = the task's final status the master now holds
    (SUCCESS, FAILED or CANCELLED: the one sent, or the first of a repeat). Its absence is no
    acknowledgement: a ``200 {}`` of a misrouted gateway or a wrong route says nothing was stored."""

    status: str

    @classmethod
    def from_json(cls, obj: Any) -> ResultAccepted:
        """Validate a decoded JSON body. Raises ProtocolError naming ``status``."""
        return cls(status=req_choice(req_object(obj, ""), "status", FINAL_STATUSES))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return {"status": self.status}


@dataclass(frozen=True)
class SeqConflict:
    """409 answer to a logs/items batch that left a gap: resend from ``expected_seq``."""

    expected_seq: int

    @classmethod
    def from_json(cls, obj: Any) -> SeqConflict:
        """Validate a decoded JSON body. Raises ProtocolError."""
        return cls(expected_seq=req_int(req_object(obj, ""), "expectedSeq", lo=0))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return {"expectedSeq": self.expected_seq}


@dataclass(frozen=True)
class SpiderFile:
    """One entry of ``GET /api/spider-files/spider/{spiderId}``: a file of the spider's code."""

    id: str
    path: str
    size_bytes: int
    sha256: str

    @classmethod
    def from_json(cls, obj: Any, path: str = "") -> SpiderFile:
        """Validate one entry. Raises ProtocolError."""
        o = req_object(obj, path)
        return cls(
            id=req_master_id(o, "id", path),
            path=req_id(o, "path", path=path),
            size_bytes=req_int(o, "sizeBytes", lo=0, path=path),
            sha256=req_id(o, "sha256", path=path).lower(),
        )

    @classmethod
    def list_from_json(cls, obj: Any) -> list[SpiderFile]:
        """Validate the whole listing (a JSON array). Raises ProtocolError."""
        if not isinstance(obj, list):
            raise ProtocolError("", "expected an array of spider files")
        return [cls.from_json(entry, f"[{i}]") for i, entry in enumerate(obj)]

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON object."""
        return {"id": self.id, "path": self.path, "sizeBytes": self.size_bytes, "sha256": self.sha256}


@dataclass(frozen=True)
class TaskRelease:
    """``POST /api/tasks/{id}/release`` body: the node gives back a task it claimed and did not start.

    ``reason`` is one line for the master's log (e.g. "claimed while the node started draining").
    """

    reason: str | None = None

    @classmethod
    def from_json(cls, obj: Any) -> TaskRelease:
        """Validate a decoded JSON body. Raises ProtocolError."""
        o = req_object(obj, "")
        return cls(reason=opt_str(o, "reason"))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return drop_none({"reason": self.reason})
