"""The node's own messages: registration (``POST /api/nodes/register``) and the heartbeat.

Frozen dataclasses, ``X.from_json(obj)`` (validates, raises ProtocolError naming the field) and
``x.to_json()`` (camelCase, ``None`` left out): see :mod:`ckagent.master.protocol`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckagent.master.protocol._fields import (
    ProtocolError,
    drop_none,
    opt_bool,
    opt_int,
    opt_object,
    opt_str,
    req_choice,
    req_id,
    req_int,
    req_master_id,
    req_number,
    req_object,
    str_list,
    str_map,
)
from ckagent.master.protocol.vocabulary import NODE_STATUSES

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
    name_exclusive: bool = False
    """``nameExclusive``: the orchestrator runs at most one agent with this name (a StatefulSet's pod
    identity; ``agent.name_exclusive``), so a new ``nodeUid`` takes the name over from a live holder at
    once (docs/protocol.md, "Register"). Sent only when true."""

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
            name_exclusive=opt_bool(o, "nameExclusive") or False,
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
            **drop_none({"nodeUid": self.node_uid, "protocolVersion": self.protocol_version,
                          "features": list(self.features) or None, "nameExclusive": self.name_exclusive or None}),
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
        return drop_none({"minAgentVersion": self.min_agent_version,
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
        return cls(node_id=req_master_id(o, "nodeId", ""), api_key=req_id(o, "apiKey", secret=True),
                   policy=VersionPolicy.from_json(o), features=str_list(o, "features"))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body (``features`` left out when empty)."""
        return {"nodeId": self.node_id, "apiKey": self.api_key, **self.policy.to_json(),
                **({"features": list(self.features)} if self.features else {})}


# --------------------------------------------------------------------------- leaving

@dataclass(frozen=True)
class NodeLeaving:
    """``POST /api/nodes/{nodeId}/leaving`` body: the agent stopped on purpose and leaves no task running
    for a successor on its work dir, so the master may give its name to another ``nodeUid`` at once.

    ``node_uid`` is the leaving agent's (the master releases the name only when it is still the holder's);
    ``reason`` is one line for the master's log (the agent sends ``drained`` or ``terminated``).
    """

    node_uid: str | None = None
    reason: str | None = None

    @classmethod
    def from_json(cls, obj: Any) -> NodeLeaving:
        """Validate a decoded JSON body. Raises ProtocolError naming the bad field."""
        o = req_object(obj, "")
        return cls(node_uid=opt_str(o, "nodeUid"), reason=opt_str(o, "reason"))

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON body (``None`` left out)."""
        return drop_none({"nodeUid": self.node_uid, "reason": self.reason})


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
        return drop_none(
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
