"""The node's levels, opened once at the agent's start: whom spiders run as (ckagent.node.identity), how
tasks are contained (ckagent.containment) and how their egress is enforced (ckagent.containment.egress).
A level named in the settings that this node cannot have is a configuration error (exit 2)."""

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
from ckagent.node.state import AsyncStateStore
from ckagent.task.runconfig import node_identities


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
