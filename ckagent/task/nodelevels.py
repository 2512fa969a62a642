"""The node's levels, opened once at the agent's start: whom spiders run as (ckagent.node.identity), how
tasks are contained (ckagent.containment) and how their egress is enforced (ckagent.containment.egress).
A level named in the settings that this node cannot have is a configuration error (exit 2). While it runs:
what the node does when its egress table is gone for good (:class:`EgressLost`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import trio

from ckagent.containment import Containment, ContainmentError, open_containment
from ckagent.containment.egress import Egress, EgressError, PolicyError, open_egress, parse_text
from ckagent.containment.hierarchy import agent_group_name
from ckagent.node.agentports import PortRegistry
from ckagent.node.config import ConfigError, Settings
from ckagent.node.identity import Identities, IdentityError
from ckagent.node.intake import IntakeGate
from ckagent.node.state import AsyncStateStore
from ckagent.task.admission import Admission
from ckagent.task.runconfig import node_identities
from ckagent.task.stop import StopReason

EGRESS_INTAKE_KEY = "egress"
"""The intake gate's key while the egress table cannot be made (ckagent.node.intake)."""


@dataclass(frozen=True)
class NodeLevels:
    """The levels in force."""

    identities: Identities
    containment: Containment
    egress: Egress


async def open_levels(settings: Settings, store: AsyncStateStore, busy: Callable[[], Iterable[str]]) -> NodeLevels:
    """Open the identity, containment and egress levels of ``settings`` (each in a thread: probes,
    cgroups, nftables). ``busy``: the spiders with a claimed task here (their uids stay theirs). Raises
    ConfigError naming what is wrong (a ``task.run_as_user``, a named level this node cannot have, an
    egress policy that does not parse). Cancellation: as usual (between the steps)."""
    s, work_dir = settings, settings.task.work_dir
    try:
        identities = await trio.to_thread.run_sync(node_identities, s, store.sync, busy)
    except IdentityError as exc:
        raise ConfigError(str(exc)) from exc
    try:
        containment = await trio.to_thread.run_sync(partial(  # (+ the tasks' private /tmp)
            open_containment, s.task.containment, work_dir, node=s))
    except ContainmentError as exc:
        raise ConfigError(str(exc)) from exc
    try:
        policy = parse_text(s.task.egress_deny, s.task.egress_allow)
        egress = await trio.to_thread.run_sync(partial(
            open_egress, s.task.egress, containment, agent_group_name(work_dir), policy,
            agent_port=s.agent.port or None, work_dir=work_dir,
            registry=PortRegistry(s.agent.ports_registry, work_dir=work_dir)))
    except (EgressError, PolicyError) as exc:
        containment.close()
        raise ConfigError(str(exc)) from exc
    return NodeLevels(identities, containment, egress)


class EgressLost:
    """The agent's side of :class:`ckagent.containment.egress.repair.LostRules`: tasks whose rules are gone
    for good are stopped (EGRESS_LOST: they must not crawl without their network policy), and while the
    table cannot be made the node takes no tasks (intake key ``egress``; /readyz and the heartbeats say
    why). On the Trio thread."""

    def __init__(self, admission: Admission, gate: IntakeGate) -> None:
        self._admission, self._gate = admission, gate

    def stop(self, task_ids: list[str], why: str) -> None:
        """Stop each of ``task_ids`` running here for EGRESS_LOST, saying ``why``."""
        for task_id in task_ids:
            self._admission.cancel(task_id, StopReason.EGRESS_LOST,
                                   f"egress: {why}; the task is stopped (it must not run without its network policy)")

    def intake(self, why: str | None) -> None:
        """Close the intake (``why``) or open it again (None)."""
        if why is None:
            self._gate.open(EGRESS_INTAKE_KEY)
        else:
            self._gate.close(EGRESS_INTAKE_KEY, f"egress: {why}: taking no tasks until it can be made again")
