"""The agent as its own port shows it: :func:`agent_statistics` takes the frozen snapshot that /status,
/metrics and the status page render (ckagent.port.status), from the parts of a running agent.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from ckagent.port.status import AgentStatistics, runtime_versions, task_statistics

if TYPE_CHECKING:
    from ckagent.code.runtimescan import RuntimeScan
    from ckagent.code.workspace import Workspaces
    from ckagent.containment import Containment
    from ckagent.containment.egress import Egress
    from ckagent.delivery import Outbox
    from ckagent.master.client import MasterClient
    from ckagent.master.heartbeat import HeartbeatLoop
    from ckagent.node.config import Settings
    from ckagent.node.identity import Identities
    from ckagent.node.intake import IntakeGate
    from ckagent.node.notices import Notices
    from ckagent.task.supervisor import Supervisor


class StatusSource(Protocol):
    """What the snapshot reads of the agent (:class:`ckagent.agent.Agent`); the parts built at start
    are None before."""

    settings: Settings
    master: MasterClient
    max_workers: int
    heartbeat: HeartbeatLoop | None
    supervisor: Supervisor | None
    workspaces: Workspaces | None
    scan: RuntimeScan
    intake: IntakeGate
    containment: Containment | None
    egress: Egress | None
    identities: Identities | None
    notices: Notices
    outbox: Outbox | None
    started_at: float
    """When the agent started (epoch seconds)."""
    started_monotonic: float
    """When the agent started (``time.monotonic()``)."""
    readopted_ids: tuple[str, ...]
    not_readopted: tuple[tuple[str, str], ...]
    handed_over_ids: tuple[str, ...]

    @property
    def state(self) -> object:
        """The agent's state (its ``str`` is reported)."""


def agent_statistics(agent: StatusSource) -> AgentStatistics:
    """A frozen snapshot of ``agent`` (state, master, heartbeat, slots, tasks) for /status and /metrics.
    Reads nothing from disk or the kernel: a task's cgroup figures are read by /status alone
    (``TaskStatistics.sample_resources``)."""
    supervisor, heartbeat, workspaces = agent.supervisor, agent.heartbeat, agent.workspaces
    connectivity = agent.master.connectivity
    return AgentStatistics(
        state=str(agent.state),
        name=agent.settings.agent.name,
        node_id=agent.master.node_id,
        registered=agent.master.registered,
        master_up=connectivity.up,
        heartbeat_last_success=heartbeat.last_success if heartbeat is not None else None,
        heartbeat_interval=agent.settings.heartbeat.interval,
        max_workers=agent.max_workers,
        free_slots=supervisor.free_slots() if supervisor is not None else agent.max_workers,
        tasks=tuple(task_statistics(rt, agent.egress)
                    for rt in (supervisor.running.values() if supervisor is not None else ())),
        code_download_bytes=workspaces.downloaded_bytes if workspaces is not None else 0,
        runtimes=tuple(runtime_versions(agent.scan.runtimes).items()),
        master_problem=connectivity.problem,
        master_problem_age=connectivity.problem_age(),
        intake_reason=agent.intake.reason,
        containment=tuple(agent.containment.to_json().items()) if agent.containment is not None else None,
        egress=tuple(agent.egress.to_json().items()) if agent.egress is not None else None,
        identity=tuple(agent.identities.to_json().items()) if agent.identities is not None else None,
        warnings=agent.notices.texts(),
        started_at=agent.started_at,
        uptime_seconds=max(0.0, time.monotonic() - agent.started_monotonic),
        readopted_ids=agent.readopted_ids,
        not_readopted=agent.not_readopted,
        handed_over_ids=agent.handed_over_ids,
        disk_culprit=disk_culprit(agent.outbox),
    )


def disk_culprit(outbox: Outbox | None) -> tuple[tuple[str, Any], ...] | None:
    """The last task blamed for a full disk, from the outbox's disk watch (``outbox.disk.last_culprit``:
    ckagent.delivery.diskwatch's DiskCulprit with ``task_id``, ``used_bytes``, ``at``, ``reason``) as
    /status items; None when none was blamed, or the watch keeps no culprit."""
    found = getattr(getattr(outbox, "disk", None), "last_culprit", None)
    if found is None:
        return None
    return (("taskId", str(getattr(found, "task_id", "") or "") or None),
            ("usedBytes", getattr(found, "used_bytes", None)),
            ("at", getattr(found, "at", None)),
            ("reason", str(getattr(found, "reason", "") or "") or None))
