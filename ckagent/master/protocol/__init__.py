"""The wire protocol between a node agent and the master (docs/protocol.md, openapi.yaml).

Every message is a frozen dataclass with snake_case attributes, built from JSON with
``X.from_json(obj)`` (which validates) and turned back into JSON with ``x.to_json()`` (camelCase
keys, ``None`` fields left out). Both the agent and the reference master use these types, so the
two sides cannot drift apart; ``tests/test_protocol.py`` checks them against ``openapi.yaml``.

Exceptions::

    ValueError
    └── ProtocolError      a payload breaks the schema; ``.field`` is the JSON path ("tasks[2].env.FOO")

Conventions: times are ISO-8601 UTC strings ("2026-11-29T16:03:50.123Z"), durations are integer
milliseconds, ids are strings (integers from an older backend are accepted and turned into strings).
"""

from __future__ import annotations

import shlex
import signal
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

from ckagent.master.protocol._fields import (
    ProtocolError,
    master_id,
    opt_bool,
    opt_int,
    opt_number,
    opt_object,
    opt_str,
    req_choice,
    req_id,
    req_int,
    req_number,
    req_object,
    str_list,
    str_map,
)
from ckagent.master.protocol.outputs import ARTIFACTS, ArtifactRef, TaskOutputs, artifact_list
from ckagent.node.egress_policy import EgressPolicy, PolicyError
from ckagent.node.egress_policy import from_wire as egress_from_wire

__all__ = [
    "ARTIFACTS",
    "ERROR_CODES",
    "FEATURES",
    "FINAL_STATUSES",
    "FRAMEWORKS",
    "NODE_STATUSES",
    "OUTCOME_STATUS",
    "PROTOCOL_VERSION",
    "STOP_SIGNALS",
    "TASK_STATUSES",
    "ArtifactRef",
    "BadTask",
    "CodePackage",
    "Heartbeat",
    "HeartbeatResponse",
    "ItemBatch",
    "LogBatch",
    "PendingTasks",
    "ProtocolError",
    "RegisterRequest",
    "RegisterResponse",
    "SeqAccepted",
    "SeqConflict",
    "SpiderFile",
    "Task",
    "TaskOutputs",
    "TaskRelease",
    "TaskResources",
    "TaskResult",
    "TaskStats",
    "VersionPolicy",
    "parse_stop_signal",
    "utc_iso",
    "utc_now_iso",
]

TASK_STATUSES = ("RUNNING", "SUCCESS", "FAILED", "CANCELLED")
"""Statuses an agent reports. RUNNING is the claim; the other three are final."""
FINAL_STATUSES = ("SUCCESS", "FAILED", "CANCELLED")
ERROR_CODES = (
    "TIMEOUT",
    "CANCELLED",
    "EXIT_NONZERO",
    "SIGNALED",
    "STALLED",
    "OOM_KILLED",
    "LOG_BUDGET",
    "DEPLOY_FAILED",
    "DEPS_FAILED",
    "AGENT_LOST",
    "AGENT_ERROR",
    "BAD_TASK",
    "DISK_FULL",
)
"""Every errorCode of a result: the outcome table of docs/protocol.md lists exactly these (a test checks)."""
OUTCOME_STATUS: dict[str, str] = {
    "SUCCESS": "SUCCESS",
    "EXIT_NONZERO": "FAILED",
    "SIGNALED": "FAILED",
    "TIMEOUT": "FAILED",
    "CANCELLED": "CANCELLED",
    "STALLED": "FAILED",
    "OOM_KILLED": "FAILED",
    "LOG_BUDGET": "SUCCESS",
    "DEPLOY_FAILED": "FAILED",
    "DEPS_FAILED": "FAILED",
    "AGENT_LOST": "FAILED",
    "AGENT_ERROR": "FAILED",
    "BAD_TASK": "FAILED",
    "DISK_FULL": "FAILED",
}
"""The outcome table: ``SUCCESS`` (no errorCode) and every errorCode → the status it goes with."""
FRAMEWORKS = ("scrapy", "python", "node", "playwright", "selenium")
NODE_STATUSES = ("RUNNING", "DRAINING", "TERMINATING", "STOPPING", "STOPPED")
"""A heartbeat's ``status``: the agent's state as it is (docs/protocol.md, Heartbeat)."""
PROTOCOL_VERSION = 1
"""The version of docs/protocol.md this agent speaks (sent at registration as ``protocolVersion``)."""
CLAIM_IN_POLL = "claim-in-poll"
"""Feature: the poll answer carries the claim (docs/protocol.md, "Claims in the poll answer"). A master
that implements it names it in its registration answer's ``features``; the agent then asks for it."""
FEATURES = ("long-poll", "exclude-spider-ids", "log-item-seq", "paused-reason", "node-uid", "agent-version-policy",
            "claim-release", CLAIM_IN_POLL)
"""What this agent supports beyond protocol version 1's core (sent at registration as ``features``)."""
NODE_BATCHES = "node-batches"
"""A master feature (registration answer's ``features``): ``POST /api/nodes/{id}/batches`` takes
several tasks' log and item batches in one request (docs/protocol.md, "Node batches")."""

MAX_SENDABLE_ID_CHARS = 8192
"""Longest id of a refused task the agent still reports BAD_TASK for (longer ones are only logged)."""

TIMEOUT_MESSAGE = "执行超时"
"""errorMessage of a task that hit its timeout: what the existing CrawlerKeeper backend expects."""

_T = TypeVar("_T")


def utc_iso(moment: datetime) -> str:
    """Format an aware or naive-UTC datetime as the protocol's ISO-8601 UTC string (millisecond precision)."""
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def utc_now_iso() -> str:
    """The current wall-clock time as a protocol timestamp."""
    return utc_iso(datetime.now(timezone.utc))


def _drop_none(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if v is not None}


# --------------------------------------------------------------------------- registration


@dataclass(frozen=True)
class RegisterRequest:
    """``POST /api/nodes/register`` body. Sizes in bytes; ``runtimes`` maps a runtime name to what was found."""

    name: str
    ip: str
    port: int
    version: str
    os: str
    arch: str
    python: str
    cpu_count: int
    memory_total_bytes: int
    max_workers: int
    runtimes: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    node_uid: str | None = None
    """The agent's own identity, kept in its work dir (ckagent.master.fleet): one per node, not per name."""
    protocol_version: int | None = None
    features: list[str] = field(default_factory=list)
    containment: dict[str, Any] = field(default_factory=dict)
    """The node's containment level: ``{"level", "details", "limits"}`` (docs/operations.md)."""
    egress: dict[str, Any] = field(default_factory=dict)
    """The node's egress level and policy: ``{"level", "details", "policy", "deny", "allow"}``."""

    @classmethod
    def from_json(cls, obj: Any) -> RegisterRequest:
        """Validate a decoded JSON body. Raises ProtocolError naming the first bad field."""
        o = req_object(obj, "")
        return cls(
            name=req_id(o, "name"),
            ip=opt_str(o, "ip") or "",
            port=req_int(o, "port", lo=0, hi=65535),
            version=opt_str(o, "version") or "",
            os=opt_str(o, "os") or "",
            arch=opt_str(o, "arch") or "",
            python=opt_str(o, "python") or "",
            cpu_count=req_int(o, "cpuCount", lo=0),
            memory_total_bytes=req_int(o, "memoryTotalBytes", lo=0),
            max_workers=req_int(o, "maxWorkers", lo=1),
            runtimes=opt_object(o, "runtimes") or {},
            labels=str_map(o, "labels"),
            node_uid=opt_str(o, "nodeUid"),
            protocol_version=opt_int(o, "protocolVersion", lo=1),
            features=str_list(o, "features"),
            containment=opt_object(o, "containment") or {},
            egress=opt_object(o, "egress") or {},
        )

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return {
            "containment": self.containment,
            "egress": self.egress,
            "name": self.name,
            "ip": self.ip,
            "port": self.port,
            "version": self.version,
            "os": self.os,
            "arch": self.arch,
            "python": self.python,
            "cpuCount": self.cpu_count,
            "memoryTotalBytes": self.memory_total_bytes,
            "maxWorkers": self.max_workers,
            "runtimes": self.runtimes,
            "labels": self.labels,
            **_drop_none({"nodeUid": self.node_uid, "protocolVersion": self.protocol_version,
                          "features": list(self.features) or None}),
        }


@dataclass(frozen=True)
class VersionPolicy:
    """The master's wishes about agent versions (PEP 440 strings, None = no wish).

    Below ``min_agent_version`` an agent takes no tasks; ``desired_agent_version`` is what an agent with
    ``agent.auto_upgrade`` on upgrades itself to.
    """

    min_agent_version: str | None = None
    desired_agent_version: str | None = None

    @classmethod
    def from_json(cls, o: dict[str, Any]) -> VersionPolicy:
        """The two optional fields of a register or heartbeat answer. Raises ProtocolError."""
        return cls(opt_str(o, "minAgentVersion"), opt_str(o, "desiredAgentVersion"))

    def to_json(self) -> dict[str, Any]:
        """The camelCase fields that are set."""
        return _drop_none({"minAgentVersion": self.min_agent_version,
                           "desiredAgentVersion": self.desired_agent_version})


@dataclass(frozen=True)
class RegisterResponse:
    """Answer to a registration: the node's id and the Bearer key for every later call (and the
    master's version policy, when it has one)."""

    node_id: str
    api_key: str
    policy: VersionPolicy = field(default_factory=VersionPolicy)
    features: list[str] = field(default_factory=list)
    """What the master supports beyond the core (e.g. :data:`CLAIM_IN_POLL`); an older master sends none."""

    def __repr__(self) -> str:  # the key is a secret: keep it out of logs and tracebacks
        return f"RegisterResponse(node_id={self.node_id!r}, api_key='***')"

    @classmethod
    def from_json(cls, obj: Any) -> RegisterResponse:
        """Validate a decoded JSON body. Raises ProtocolError naming the bad field (never its value)."""
        o = req_object(obj, "")
        return cls(node_id=_id(o, "nodeId", ""), api_key=req_id(o, "apiKey", secret=True),
                   policy=VersionPolicy.from_json(o), features=str_list(o, "features"))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body (``features`` left out when empty)."""
        return {"nodeId": self.node_id, "apiKey": self.api_key, **self.policy.to_json(),
                **({"features": list(self.features)} if self.features else {})}


# --------------------------------------------------------------------------- heartbeat


@dataclass(frozen=True)
class Heartbeat:
    """``POST /api/nodes/{id}/heartbeat`` body: the node's health. Percentages 0..100, sizes in bytes."""

    status: str
    cpu_percent: float
    memory_percent: float
    disk_percent: float
    memory_used_bytes: int
    disk_free_bytes: int
    load1: float
    running_task_ids: list[str]
    running_spider_ids: list[str]
    max_workers: int
    free_slots: int
    version: str
    uptime_seconds: float
    runtimes: dict[str, Any] | None = None
    paused_reason: str | None = None
    """Set while the node takes no tasks for a reason of its own (disk below its floor, agent older than
    the master's minimum); ``status`` stays RUNNING so that masters that know no pause keep working."""
    claiming_task_ids: list[str] | None = None
    """Tasks whose claim is on the wire (sent, not answered). None: the node does not say (an older
    agent), and the master must not reconcile its RUNNING tasks against this beat."""
    reporting_task_ids: list[str] | None = None
    """Tasks whose process has ended here and whose final result the master has not acknowledged."""
    claim_poll_ids: list[int] | None = None
    """Claiming polls (their ``pollId``) whose answer the node has not settled yet: on the wire, or
    answered and its tasks not yet admitted or given back. None: the node sends no claiming polls."""
    last_claim_poll_id: int | None = None
    """The newest ``pollId`` the node had sent when it took this beat's snapshot (None: none yet)."""

    @classmethod
    def from_json(cls, obj: Any) -> Heartbeat:
        """Validate a decoded JSON body. Raises ProtocolError naming the first bad field."""
        o = req_object(obj, "")
        return cls(
            status=req_choice(o, "status", NODE_STATUSES),
            cpu_percent=req_number(o, "cpuPercent", lo=0),
            memory_percent=req_number(o, "memoryPercent", lo=0),
            disk_percent=req_number(o, "diskPercent", lo=0),
            memory_used_bytes=req_int(o, "memoryUsedBytes", lo=0),
            disk_free_bytes=req_int(o, "diskFreeBytes", lo=0),
            load1=req_number(o, "load1", lo=0),
            running_task_ids=str_list(o, "runningTaskIds", ids=True),
            running_spider_ids=str_list(o, "runningSpiderIds", ids=True),
            max_workers=req_int(o, "maxWorkers", lo=1),
            free_slots=req_int(o, "freeSlots", lo=0),
            version=opt_str(o, "version") or "",
            uptime_seconds=req_number(o, "uptimeSeconds", lo=0),
            runtimes=opt_object(o, "runtimes"),
            paused_reason=opt_str(o, "pausedReason"),
            claiming_task_ids=str_list(o, "claimingTaskIds", ids=True) if "claimingTaskIds" in o else None,
            reporting_task_ids=str_list(o, "reportingTaskIds", ids=True) if "reportingTaskIds" in o else None,
            claim_poll_ids=_int_list(o, "claimPollIds") if o.get("claimPollIds") is not None else None,
            last_claim_poll_id=opt_int(o, "lastClaimPollId", lo=0),
        )

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return _drop_none(
            {
                "status": self.status,
                "cpuPercent": self.cpu_percent,
                "memoryPercent": self.memory_percent,
                "diskPercent": self.disk_percent,
                "memoryUsedBytes": self.memory_used_bytes,
                "diskFreeBytes": self.disk_free_bytes,
                "load1": self.load1,
                "runningTaskIds": list(self.running_task_ids),
                "runningSpiderIds": list(self.running_spider_ids),
                "maxWorkers": self.max_workers,
                "freeSlots": self.free_slots,
                "version": self.version,
                "uptimeSeconds": self.uptime_seconds,
                "runtimes": self.runtimes,
                "pausedReason": self.paused_reason,
                "claimingTaskIds": None if self.claiming_task_ids is None else list(self.claiming_task_ids),
                "reportingTaskIds": None if self.reporting_task_ids is None else list(self.reporting_task_ids),
                "claimPollIds": None if self.claim_poll_ids is None else list(self.claim_poll_ids),
                "lastClaimPollId": self.last_claim_poll_id,
            }
        )


def _int_list(o: dict[str, Any], key: str) -> list[int]:
    """A list of non-negative integers (``claimPollIds``). Raises ProtocolError naming the element."""
    raw = o.get(key)
    if not isinstance(raw, list):
        raise ProtocolError(key, "expected an array of integers")
    return [req_int({f"{key}[{i}]": v}, f"{key}[{i}]", lo=0) for i, v in enumerate(raw)]


@dataclass(frozen=True)
class HeartbeatResponse:
    """The master's answer to a heartbeat: tasks of this node to cancel (and its version policy)."""

    cancel_task_ids: list[str] = field(default_factory=list)
    policy: VersionPolicy = field(default_factory=VersionPolicy)

    @classmethod
    def from_json(cls, obj: Any) -> HeartbeatResponse:
        """Validate a decoded JSON body (an empty object is fine). Raises ProtocolError."""
        o = req_object(obj, "")
        return cls(cancel_task_ids=str_list(o, "cancelTaskIds", ids=True), policy=VersionPolicy.from_json(o))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return {"cancelTaskIds": list(self.cancel_task_ids), **self.policy.to_json()}


# --------------------------------------------------------------------------- tasks


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
    node's default. ``memory_bytes`` bytes, ``pids`` processes+threads, ``cpus`` cores."""

    memory_bytes: int | None = None
    pids: int | None = None
    cpus: float | None = None

    @classmethod
    def from_json(cls, obj: Any, path: str) -> TaskResources:
        """Validate; raises ProtocolError."""
        if obj is None:
            return cls()
        o = req_object(obj, path)
        cpus = opt_number(o, "cpus", lo=0.01, path=path)
        return cls(memory_bytes=opt_int(o, "memoryBytes", lo=1 << 20, path=path),
                   pids=opt_int(o, "pids", lo=1, path=path), cpus=cpus)

    def to_json(self) -> dict[str, Any]:
        """camelCase, None left out."""
        return _drop_none({"memoryBytes": self.memory_bytes, "pids": self.pids, "cpus": self.cpus})


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
            id=_id(o, "id", path),
            spider_id=_id(o, "spiderId", path),
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
        )

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON object (``claimed`` only when true)."""
        return _drop_none(
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


def _id(o: dict[str, Any], key: str, path: str) -> str:
    """A required id chosen by the master (see ckagent.master.ids: what is accepted). Raises ProtocolError."""
    value = master_id(o, key, path=path)
    assert value is not None
    return value


def _spider_name(o: dict[str, Any], path: str) -> str:
    """``spiderName``: optional (absent, null or empty → ""), otherwise a string ckagent.master.ids accepts."""
    return master_id(o, "spiderName", path=path, required=False) or ""


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
                bad.append(BadTask(task_id=str(task_id) if ok_id else None, error=exc))
        return cls(tasks=tasks, cancel_task_ids=str_list(o, "cancelTaskIds", ids=True), bad_tasks=bad)

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body (bad tasks are not re-serialised)."""
        return {"tasks": [t.to_json() for t in self.tasks], "cancelTaskIds": list(self.cancel_task_ids)}


# --------------------------------------------------------------------------- results and streams


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
    or "unknown task" for longer than the agent's ``server.refusal_timeout``): ``logLines`` and
    ``itemCount`` say what it acknowledged; the rest stays in the node's spool. Absent otherwise."""
    artifacts: list[ArtifactRef] | None = None
    """The task's artifacts the master holds (uploaded before this result); None = none collected."""

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
            artifacts=artifact_list(o.get("artifacts")),
        )

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return _drop_none(
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
                "artifacts": None if self.artifacts is None else [a.to_json() for a in self.artifacts],
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
        return _drop_none({"seq": self.seq, "stats": self.stats, "progress": self.progress, "at": self.at})


@dataclass(frozen=True)
class LogBatch:
    """``POST /api/tasks/{id}/logs``: ``seq`` is the index of the first line of ``lines``."""

    seq: int
    lines: list[str]

    @classmethod
    def from_json(cls, obj: Any) -> LogBatch:
        """Validate a decoded JSON body. Raises ProtocolError."""
        o = req_object(obj, "")
        return cls(seq=req_int(o, "seq", lo=0), lines=str_list(o, "lines", required=True))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return {"seq": self.seq, "lines": list(self.lines)}


@dataclass(frozen=True)
class ItemBatch:
    """``POST /api/tasks/{id}/items``: ``seq`` is the index of the first item; items are JSON objects."""

    seq: int
    items: list[dict[str, Any]]

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
        return cls(seq=req_int(o, "seq", lo=0), items=raw)

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body."""
        return {"seq": self.seq, "items": list(self.items)}


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
            id=_id(o, "id", path),
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
        return _drop_none({"reason": self.reason})
