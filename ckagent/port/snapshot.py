"""The agent as its own port shows it: :func:`agent_statistics` takes the frozen snapshot that /status,
/metrics and the status page render (ckagent.port.status), from the parts of a running agent.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ckagent.master.heartbeat import NodeReport
from ckagent.port.status import AgentStatistics, runtime_versions
from ckagent.port.taskstats import task_statistics

if TYPE_CHECKING:
    from ckagent.code.runtimescan import RuntimeScan
    from ckagent.code.workspace import Workspaces
    from ckagent.containment import Containment
    from ckagent.containment.egress import Egress
    from ckagent.delivery import Outbox
    from ckagent.master.client import MasterClient
    from ckagent.master.heartbeat import HeartbeatLoop
    from ckagent.node.config import Settings
    from ckagent.node.ephemeral import EphemeralWatch
    from ckagent.node.identity import Identities
    from ckagent.node.intake import IntakeGate
    from ckagent.node.notices import Notices
    from ckagent.task.adoption import Adoption
    from ckagent.task.supervisor import Supervisor


@dataclass
class AgentHistory:
    """What /status and the page tell of the agent's own life (kept by :class:`ckagent.agent.Agent`):
    when it started (``started_at`` epoch seconds, ``started_monotonic`` for the uptime), the tasks an
    earlier agent left running that it re-adopted at its start (``readopted_ids``) or could not
    (``not_readopted``: (task id, why), reported AGENT_LOST), and the running tasks a hand-over leaves to
    the next agent (``handed_over_ids``; empty unless handing over)."""

    started_at: float = field(default_factory=time.time)
    started_monotonic: float = field(default_factory=time.monotonic)
    readopted_ids: tuple[str, ...] = ()
    not_readopted: tuple[tuple[str, str], ...] = ()
    handed_over_ids: tuple[str, ...] = ()

    def at_start(self, adoptions: Iterable[Adoption], refused: dict[str, str]) -> set[str]:
        """Record the tasks found at the start: those re-adopted (``adoptions``; returns their ids) and
        those refused, with why."""
        adopted = {adoption.record.task_id for adoption in adoptions}
        self.readopted_ids, self.not_readopted = tuple(sorted(adopted)), tuple(sorted(refused.items()))
        return adopted

    def hand_over(self, task_ids: Iterable[str]) -> tuple[str, ...]:
        """Record the running tasks a hand-over leaves to the next agent; returns them."""
        self.handed_over_ids = tuple(task_ids)
        return self.handed_over_ids


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
    history: AgentHistory
    ephemeral: EphemeralWatch | None

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
        slots_busy=len(supervisor.running) if supervisor is not None else 0,
        idle_seconds=idle_seconds(agent),
        tasks=tuple(task_statistics(rt, agent.egress)
                    for rt in (supervisor.running.values() if supervisor is not None else ())),
        code_download_bytes=workspaces.downloaded_bytes if workspaces is not None else 0,
        runtimes=tuple(runtime_versions(agent.scan.runtimes).items()),
        master_problem=connectivity.problem,
        master_problem_age=connectivity.problem_age(),
        intake_reason=agent.intake.unready_reason,
        containment=tuple(agent.containment.to_json().items()) if agent.containment is not None else None,
        egress=tuple(agent.egress.to_json().items()) if agent.egress is not None else None,
        identity=tuple(agent.identities.to_json().items()) if agent.identities is not None else None,
        warnings=agent.notices.texts(),
        started_at=agent.history.started_at,
        uptime_seconds=max(0.0, time.monotonic() - agent.history.started_monotonic),
        readopted_ids=agent.history.readopted_ids,
        not_readopted=agent.history.not_readopted,
        handed_over_ids=agent.history.handed_over_ids,
        disk_culprit=disk_culprit(agent.outbox),
        ephemeral=tuple(agent.ephemeral.to_json().items()) if agent.ephemeral is not None else None,
    )


def idle_seconds(agent: StatusSource) -> float:
    """Seconds since the node last had anything to do (``ckagent_idle_seconds``): 0 while a task is
    claimed and not ended here (queued, deploying, installing, running, reporting; re-adopted ones
    too: :attr:`Admission.running <ckagent.task.admission.Admission.running>`) or while a delivery is
    open in the outbox (a task that ended but whose logs, items or result the master has not all
    acknowledged yet, also one an earlier run left undelivered); otherwise since the later of the
    last task leaving the running set and the last delivery ending, or since the agent started when
    neither ever happened. Claims on the wire (not admitted yet) do not count."""
    supervisor, outbox = agent.supervisor, agent.outbox
    if (supervisor is not None and supervisor.running) or (outbox is not None and outbox.deliveries):
        return 0.0
    ends = [part.idle_since for part in (supervisor, outbox) if part is not None and part.idle_since is not None]
    return max(0.0, time.monotonic() - max([agent.history.started_monotonic, *ends]))


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


def node_report(agent: StatusSource) -> NodeReport:
    """What the next heartbeat says of the node (a snapshot of the state, the running set, the claims
    on the wire and the results the master has not acknowledged). The agent must have been assembled."""
    supervisor, outbox = agent.supervisor, agent.outbox
    assert supervisor is not None and outbox is not None
    return NodeReport(
        status=str(agent.state), max_workers=supervisor.max_workers, free_slots=supervisor.free_slots(),
        running_task_ids=tuple(supervisor.running), running_spider_ids=supervisor.running_spider_ids(),
        claiming_task_ids=tuple(supervisor.claiming), claim_poll_ids=tuple(supervisor.claim_polls),
        last_claim_poll_id=supervisor.last_claim_poll,
        reporting_task_ids=tuple(t for t in outbox.deliveries if t not in supervisor.running),
        runtimes=agent.scan.report(), paused_reason=agent.intake.reason,
    )
