"""One running task as the agent's port shows it (/status, the page): :class:`TaskStatistics`, made from a
:class:`~ckagent.task.supervisor.RunningTask` by :func:`task_statistics` when a snapshot of the agent is
taken; the figures that cost a read (cgroupfs, nft counters) are read when /status asks.

Its attempt and last checkpoint (issue 38) come from the task and its ``TaskCheckpoints``
(``rt.checkpoints.last``: a :class:`ckagent.resume.ship.ShippedCheckpoint`); :func:`checkpoint_json` is
the /status shape of a checkpoint, its age counted at the moment of the answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import TYPE_CHECKING, Any

from ckagent.containment.egress import describe_refusals
from ckagent.master.protocol import utc_iso

if TYPE_CHECKING:
    from ckagent.containment import TaskJail
    from ckagent.containment.egress import Egress, TaskRules
    from ckagent.task.supervisor import RunningTask

__all__ = ["TaskStatistics", "checkpoint_json", "task_statistics"]


@dataclass(frozen=True)
class TaskStatistics:
    """One claimed, unfinished task as /status shows it. Times: epoch seconds (None: not yet)."""

    id: str
    spider_id: str
    spider_name: str
    framework: str
    phase: str
    claimed_at: float
    started_at: float | None
    pid: int | None
    resources: tuple[tuple[str, Any], ...] = ()
    """Live figures of the task's cgroup (cpuSeconds, memoryBytes, ...; empty at the process-group level)."""
    sample_resources: Callable[[], tuple[tuple[str, Any], ...]] | None = None
    """Reads :attr:`resources` now (cgroupfs reads, tens of µs a file): /status calls it, one task at a
    time with a checkpoint between tasks; /metrics never does. None: :attr:`resources` as given."""
    sample_egress: Callable[[], tuple[tuple[str, Any], ...]] | None = None
    """Reads the task's refused connections now (``{"refused": [...], "summary": str}``; nft counters,
    /status only). None: no kernel egress rules for the task."""
    attempt: int = 1
    """Which attempt of the task this is (1: the first)."""
    checkpoint: tuple[tuple[str, Any], ...] | None = None
    """The newest checkpoint the master holds of this attempt: ``id``, ``created`` (epoch seconds),
    ``sizeBytes``, ``packedBytes``, ``itemSeq``, ``logSeq``, ``reason``; None: none yet."""


def task_statistics(rt: RunningTask, egress: Egress | None) -> TaskStatistics:
    """One claimed, unfinished task as /status shows it; its cgroup figures and refused connections
    (``egress``: the node's egress level, None = none) are read when /status asks (``sample_*``)."""
    task = rt.task
    last = rt.checkpoints.last if rt.checkpoints is not None else None
    checkpoint = None if last is None else (
        ("id", last.id), ("created", last.created.timestamp()), ("sizeBytes", last.size_bytes),
        ("packedBytes", last.packed_bytes), ("itemSeq", last.item_seq), ("logSeq", last.log_seq),
        ("reason", last.reason))
    return TaskStatistics(
        id=task.id, spider_id=task.spider_id, spider_name=task.spider_name, framework=task.framework,
        phase=rt.phase, claimed_at=rt.claimed_at, started_at=rt.started_at, pid=rt.pid,
        sample_resources=None if rt.jail is None else partial(_jail_figures, rt.jail),
        sample_egress=None if rt.egress is None or egress is None else partial(_egress_refusals, egress, rt.egress),
        attempt=task.attempt, checkpoint=checkpoint)


def checkpoint_json(checkpoint: tuple[tuple[str, Any], ...] | None, now: float | None = None) -> dict[str, Any] | None:
    """A task's last checkpoint as /status shows it: ``id``, ``createdAt`` (ISO-8601 UTC), ``ageSeconds``
    (at ``now``, epoch seconds; default: now), ``sizeBytes``, ``packedBytes``, ``itemSeq`` (the items it
    holds: 0 … itemSeq − 1), ``logSeq``, ``reason``; None: none."""
    if checkpoint is None:
        return None
    out = dict(checkpoint)
    created = out.pop("created", None)
    if isinstance(created, int | float):
        out["createdAt"] = utc_iso(datetime.fromtimestamp(created, timezone.utc))
        out["ageSeconds"] = round(max(0.0, (time.time() if now is None else now) - created), 1)
    return out


def _jail_figures(jail: TaskJail) -> tuple[tuple[str, Any], ...]:
    """A task's live cgroup figures as /status shows them (cgroupfs reads)."""
    return tuple(jail.figures().to_json().items())


def _egress_refusals(egress: Egress, rules: TaskRules) -> tuple[tuple[str, Any], ...]:
    """A task's refused connections so far as /status shows them (nft counters, ~0.5 ms), and at the
    proxy level what became of its requests (``proxy``: outcome → count)."""
    refused = egress.refusals(rules)
    found: tuple[tuple[str, Any], ...] = (
        ("refused", [{"address": r.address, "port": r.port, "count": r.count} for r in refused]),
        ("summary", describe_refusals(refused)))
    outcomes = egress.proxy_outcomes(rules)
    return (*found, ("proxy", outcomes)) if egress.server is not None else found
