"""A task as the master hands it out (``GET /api/nodes/{id}/tasks/pending``): the task, its code
package, resources, stop signal and egress policy, and the poll answer that carries them.

Frozen dataclasses, ``X.from_json(obj)`` (validates, raises ProtocolError naming the field) and
``x.to_json()`` (camelCase, ``None`` left out): see :mod:`ckagent.master.protocol`.
"""

from __future__ import annotations

import shlex
import signal
from dataclasses import dataclass, field
from typing import Any

from ckagent.master.protocol._fields import (
    ProtocolError,
    drop_none,
    master_id,
    opt_int,
    opt_number,
    opt_object,
    req_choice,
    req_id,
    req_int,
    req_master_id,
    req_object,
    str_list,
    str_map,
)
from ckagent.master.protocol.checkpoints import CheckpointRef, RetryPolicy
from ckagent.master.protocol.outputs import TaskOutputs
from ckagent.master.protocol.vocabulary import FRAMEWORKS, MAX_SENDABLE_ID_CHARS, RESUME_MODES, ResumeMode
from ckagent.node.egress_policy import EgressPolicy, PolicyError
from ckagent.node.egress_policy import from_wire as egress_from_wire


@dataclass(frozen=True)
class CodePackage:
    """Where a task's code zip lives: ``url`` (absolute, or relative to the agent's ``server.url``), hex
    ``sha256``, ``size_bytes``."""

    url: str
    sha256: str
    size_bytes: int

    @classmethod
    def from_json(cls, obj: Any, path: str = "codePackage") -> CodePackage:
        """Validate; ``path`` prefixes field names in errors. Raises ProtocolError."""
        o = req_object(obj, path)
        sha = req_id(o, "sha256", path=path).lower()
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise ProtocolError(f"{path}.sha256", "expected 64 hex digits")
        return cls(url=req_id(o, "url", path=path), sha256=sha, size_bytes=req_int(o, "sizeBytes", lo=0, path=path))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON object."""
        return {"url": self.url, "sha256": self.sha256, "sizeBytes": self.size_bytes}


STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1", "SIGUSR2")
"""Signals a task may name as its ``stopSignal`` (sent to its main process when it is stopped)."""


@dataclass(frozen=True)
class TaskResources:
    """``resources`` of a task: limits of the task's processes (installers included), None = the
    node's default. ``memory_bytes`` bytes, ``pids`` processes+threads, ``cpus`` cores,
    ``disk_bytes`` bytes of disk the task may hold (its task dir, working copy and data dir: past it
    the task ends FAILED DISK_FULL; ckagent.delivery.diskwatch), ``memory_soft_bytes`` the soft memory
    ceiling (bytes: past it the spider is asked to persist and stopped, FAILED MEMORY_LIMIT)."""

    memory_bytes: int | None = None
    pids: int | None = None
    cpus: float | None = None
    disk_bytes: int | None = None
    memory_soft_bytes: int | None = None

    @classmethod
    def from_json(cls, obj: Any, path: str) -> TaskResources:
        """Validate; raises ProtocolError."""
        if obj is None:
            return cls()
        o = req_object(obj, path)
        cpus = opt_number(o, "cpus", lo=0.01, path=path)
        return cls(memory_bytes=opt_int(o, "memoryBytes", lo=1 << 20, path=path),
                   pids=opt_int(o, "pids", lo=1, path=path), cpus=cpus,
                   disk_bytes=opt_int(o, "diskBytes", lo=1 << 20, path=path),
                   memory_soft_bytes=opt_int(o, "memorySoftBytes", lo=1, path=path))

    def to_json(self) -> dict[str, Any]:
        """camelCase, None left out."""
        return drop_none({"memoryBytes": self.memory_bytes, "pids": self.pids, "cpus": self.cpus,
                          "diskBytes": self.disk_bytes, "memorySoftBytes": self.memory_soft_bytes})


@dataclass(frozen=True)
class Task:
    """A task handed out by ``GET /tasks/pending``.

    ``command`` is an argv list or None (the agent picks the framework's default); a string on the
    wire is split like a shell would. ``timeout_seconds``: None = the agent's default, 0 = no limit.
    ``code_package`` None means "sync the spider files".
    """

    id: str
    spider_id: str
    spider_name: str
    framework: str
    command: list[str] | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    timeout_seconds: float | None = None
    code_version: str | None = None
    code_package: CodePackage | None = None
    params: dict[str, Any] = field(default_factory=dict)
    stall_timeout_seconds: float | None = None
    """No output, item or stats change for this long → STALLED; None = the agent's default, 0 = off."""
    resources: TaskResources = field(default_factory=TaskResources)
    stop_signal: str | None = None
    """Signal name sent to the main process when the task is stopped (None = SIGTERM)."""
    egress: EgressPolicy | None = None
    """The task's own network policy, added to the node's (``{"deny": [...], "allow": [...]}``)."""
    claimed: bool = False
    """The master claimed the task for this node in the poll answer (``claim-in-poll``): it is this
    node's already, to run or to give back; False: handed out only, a claim decides."""
    outputs: TaskOutputs | None = None
    """Declared item files and artifacts (globs in the working copy); None = the conventions
    (ckagent.delivery.outputs)."""
    stop_grace_seconds: float | None = None
    """Seconds from the stop signal to the kill of every process of the task (a polite Scrapy crawl's
    graceful close); None = the framework's default (ckagent.code.frameworks), else the node's
    ``task.kill_grace``; capped by the node's ``task.max_stop_grace``."""
    clean_start: bool = False
    """The spider's data kept between its tasks on this node (Scrapy's ``.scrapy``: ckagent.code.scrapydata)
    starts empty for this task."""
    attempt: int = 1
    """Which run of the task this is (1, 2, …: docs/protocol.md, "Attempts")."""
    item_seq_start: int = 0
    """The index of this attempt's first item in the task's items stream (the numbering continues)."""
    log_seq_start: int = 0
    """The index of this attempt's first log line in the task's log stream."""
    checkpoint: CheckpointRef | None = None
    """The checkpoint this attempt resumes from (its state dir is restored from it); None = from scratch."""
    checkpoint_interval_seconds: float | None = None
    """Seconds between periodic checkpoints (> 0); None = the node's ``task.checkpoint_interval``."""
    resume: ResumeMode = ResumeMode.RESTART_REPLACE
    """What a new attempt of a spider that cannot persist does with the earlier attempts' items."""
    retry: RetryPolicy | None = None
    """The retry policy the master applies (informational to the agent: shown in its views)."""

    @property
    def stop_signal_number(self) -> int:
        """:attr:`stop_signal` as a number (SIGTERM when unset)."""
        return int(getattr(signal, self.stop_signal or "SIGTERM"))

    @classmethod
    def from_json(cls, obj: Any, path: str = "task") -> Task:
        """Validate one task; ``path`` prefixes field names in errors. Raises ProtocolError."""
        o = req_object(obj, path)
        command: list[str] | None
        raw_command = o.get("command")
        if raw_command is None:
            command = None
        elif isinstance(raw_command, str):
            try:
                command = shlex.split(raw_command)
            except ValueError as exc:
                raise ProtocolError(f"{path}.command", f"cannot split the command string: {exc}") from exc
        else:
            command = str_list(o, "command", path=path)
        if command is not None and not command:
            raise ProtocolError(f"{path}.command", "must not be empty (leave it out for the default)")
        package = o.get("codePackage")
        return cls(
            id=req_master_id(o, "id", path),
            spider_id=req_master_id(o, "spiderId", path),
            spider_name=_spider_name(o, path),
            framework=req_choice(o, "framework", FRAMEWORKS, path=path),
            command=command,
            args=str_list(o, "args", path=path),
            env=str_map(o, "env", path=path, env_names=True),
            timeout_seconds=opt_number(o, "timeoutSeconds", lo=0, path=path),
            code_version=master_id(o, "codeVersion", path=path, required=False),
            code_package=None if package is None else CodePackage.from_json(package, f"{path}.codePackage"),
            params=opt_object(o, "params", path=path) or {},
            stall_timeout_seconds=opt_number(o, "stallTimeoutSeconds", lo=0, path=path),
            resources=TaskResources.from_json(o.get("resources"), f"{path}.resources"),
            stop_signal=parse_stop_signal(o, path),
            egress=parse_egress(o.get("egress"), f"{path}.egress"),
            claimed=_opt_bool(o, "claimed", path),
            outputs=TaskOutputs.from_json(o.get("outputs"), f"{path}.outputs"),
            stop_grace_seconds=opt_number(o, "stopGraceSeconds", lo=0, path=path),
            clean_start=_opt_bool(o, "cleanStart", path),
            attempt=_opt_int(o, "attempt", 1, 1, path),
            item_seq_start=_opt_int(o, "itemSeqStart", 0, 0, path),
            log_seq_start=_opt_int(o, "logSeqStart", 0, 0, path),
            checkpoint=None if o.get("checkpoint") is None else CheckpointRef.from_json(o["checkpoint"],
                                                                                       f"{path}.checkpoint"),
            checkpoint_interval_seconds=_interval(o, path),
            resume=ResumeMode(req_choice(o, "resume", RESUME_MODES, path=path)) if o.get("resume") is not None
            else ResumeMode.RESTART_REPLACE,
            retry=RetryPolicy.from_json(o.get("retry"), f"{path}.retry"),
        )

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON object (``claimed`` only when true)."""
        return drop_none(
            {
                "id": self.id,
                "spiderId": self.spider_id,
                "spiderName": self.spider_name,
                "framework": self.framework,
                "command": None if self.command is None else list(self.command),
                "args": list(self.args),
                "env": dict(self.env),
                "timeoutSeconds": self.timeout_seconds,
                "codeVersion": self.code_version,
                "codePackage": None if self.code_package is None else self.code_package.to_json(),
                "params": dict(self.params),
                "stallTimeoutSeconds": self.stall_timeout_seconds,
                "resources": self.resources.to_json() or None,
                "stopSignal": self.stop_signal,
                "egress": None if self.egress is None else self.egress.to_json(),
                "claimed": True if self.claimed else None,
                "outputs": None if self.outputs is None else self.outputs.to_json(),
                "stopGraceSeconds": self.stop_grace_seconds,
                "cleanStart": True if self.clean_start else None,
                "attempt": self.attempt if self.attempt != 1 else None,
                "itemSeqStart": self.item_seq_start or None,
                "logSeqStart": self.log_seq_start or None,
                "checkpoint": None if self.checkpoint is None else self.checkpoint.to_json(),
                "checkpointIntervalSeconds": self.checkpoint_interval_seconds,
                "resume": None if self.resume is ResumeMode.RESTART_REPLACE else self.resume.value,
                "retry": None if self.retry is None else self.retry.to_json(),
            }
        )


def parse_egress(obj: Any, path: str) -> EgressPolicy | None:
    """A task's (or spider's) ``egress`` object → its policy; None when absent. Raises ProtocolError."""
    if obj is None:
        return None
    o = req_object(obj, path)
    try:
        return egress_from_wire(o, path)
    except PolicyError as exc:
        where, _, message = str(exc).partition(": ")
        raise ProtocolError(where, message) from None


def _spider_name(o: dict[str, Any], path: str) -> str:
    """``spiderName``: optional (absent, null or empty → ""), otherwise a string ckagent.master.ids accepts."""
    return master_id(o, "spiderName", path=path, required=False) or ""


def _opt_int(o: dict[str, Any], key: str, default: int, lo: int, path: str) -> int:
    """An optional integer >= ``lo`` (absent or null: ``default``). Raises ProtocolError."""
    value = opt_int(o, key, lo=lo, path=path)
    return default if value is None else value


def _interval(o: dict[str, Any], path: str) -> float | None:
    """``checkpointIntervalSeconds``: a number > 0, or None. Raises ProtocolError."""
    value = opt_number(o, "checkpointIntervalSeconds", lo=0, path=path)
    if value == 0:
        raise ProtocolError(f"{path}.checkpointIntervalSeconds", "must be > 0 (leave it out for the node's)")
    return value


def _opt_bool(o: dict[str, Any], key: str, path: str) -> bool:
    """An optional boolean (absent or null: False). Raises ProtocolError for anything else."""
    value = o.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ProtocolError(f"{path}.{key}" if path else key, f"expected true or false, got {type(value).__name__}")
    return value


def parse_stop_signal(o: dict[str, Any], path: str) -> str | None:
    """The optional ``stopSignal`` of a task or spider object (one of :data:`STOP_SIGNALS`). Raises ProtocolError."""
    field_name = f"{path}.stopSignal" if path else "stopSignal"
    value = o.get("stopSignal")
    if value is None:
        return None
    if not isinstance(value, str) or value not in STOP_SIGNALS:
        raise ProtocolError(field_name, f"expected one of {', '.join(STOP_SIGNALS)}, got {value!r}")
    return value


@dataclass(frozen=True)
class BadTask:
    """A task in a poll answer that broke the schema: the agent reports it FAILED/BAD_TASK.

    ``task_id`` is None when even the id was unreadable (then it can only be logged).
    """

    task_id: str | None
    error: ProtocolError
    attempt: int | None = None
    """The task's ``attempt`` when it was readable (an integer ≥ 1), so its BAD_TASK result names it."""


def _sendable(task_id: str) -> bool:
    """True when a refused task's id can still name it in a URL (non-empty, UTF-8, not absurdly long)."""
    try:
        task_id.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return 0 < len(task_id) <= MAX_SENDABLE_ID_CHARS


@dataclass(frozen=True)
class PendingTasks:
    """Answer of ``GET /tasks/pending``. One bad task does not spoil the others: it lands in ``bad_tasks``."""

    tasks: list[Task] = field(default_factory=list)
    cancel_task_ids: list[str] = field(default_factory=list)
    bad_tasks: list[BadTask] = field(default_factory=list)

    @classmethod
    def from_json(cls, obj: Any) -> PendingTasks:
        """Validate the envelope strictly and each task on its own. Raises ProtocolError for a bad envelope."""
        o = req_object(obj, "")
        raw_tasks = o.get("tasks")
        if raw_tasks is None:  # absent or null → no tasks, like every other optional list
            raw_tasks = []
        if not isinstance(raw_tasks, list):
            raise ProtocolError("tasks", "expected an array")
        tasks: list[Task] = []
        bad: list[BadTask] = []
        for i, raw in enumerate(raw_tasks):
            try:
                tasks.append(Task.from_json(raw, f"tasks[{i}]"))
            except ProtocolError as exc:
                task_id = raw.get("id") if isinstance(raw, dict) else None
                ok_id = isinstance(task_id, (str, int)) and not isinstance(task_id, bool) and _sendable(str(task_id))
                attempt = raw.get("attempt") if isinstance(raw, dict) else None
                ok_attempt = isinstance(attempt, int) and not isinstance(attempt, bool) and attempt >= 1
                bad.append(BadTask(task_id=str(task_id) if ok_id else None, error=exc,
                                   attempt=attempt if ok_attempt else None))
        return cls(tasks=tasks, cancel_task_ids=str_list(o, "cancelTaskIds", ids=True), bad_tasks=bad)

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body (bad tasks are not re-serialised)."""
        return {"tasks": [t.to_json() for t in self.tasks], "cancelTaskIds": list(self.cancel_task_ids)}
