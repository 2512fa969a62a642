"""The soft memory ceiling (issue 38, item 6): a running task whose memory crosses its
``resources.memorySoftBytes`` (else the node's ``task.memory_soft_bytes``) is asked to persist its state,
then stopped FAILED/MEMORY_LIMIT (a resource cause, retryable): its next attempt resumes from the
checkpoint, so a long crawl's leak becomes a restart that loses nothing instead of an OOM kill.

The figure is the containment level's (``TaskJail.memory_now``): at the cgroup levels the cgroup's
working set (memory.current, or v1's memory.usage_in_bytes, less inactive file pages — what the kubelet
evicts by), at the process-group level the RSS of the task's processes summed. One watch for the node
(:class:`SoftMemoryWatch`, in the agent's root nursery) samples every running task that has a ceiling
every :data:`SAMPLE_INTERVAL` seconds, all of them in one thread hop; while no claimed task has a
ceiling it sleeps until a task is admitted (no wake-up at all on an idle node). A task over its ceiling
goes through :func:`ckagent.task.migrating.checkpoint_then_stop` (bounded by ``task.migrate_timeout``) in
a task of its own, so the watch goes on for the others.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import trio

from ckagent.containment.base import format_bytes
from ckagent.task.admission import Admission, RunningTask
from ckagent.task.migrating import checkpoint_then_stop
from ckagent.task.stop import StopReason

log = logging.getLogger(__name__)

SAMPLE_INTERVAL = 2.0
"""Seconds between two samples of the running tasks' memory (only while a claimed task has a ceiling)."""


def ceiling_of(rt: RunningTask, node_default: int | None) -> tuple[int, str] | None:
    """(bytes, where it comes from) of a task's soft memory ceiling, None: it has none."""
    resources = rt.task.resources
    own = resources.memory_soft_bytes if resources is not None else None
    if own is not None:
        return own, "resources.memorySoftBytes"
    return (node_default, "task.memory_soft_bytes") if node_default is not None else None


class SoftMemoryWatch:
    """Holds the node's running tasks to their soft memory ceilings (see module docstring).

    ``node_default``: ``task.memory_soft_bytes`` (bytes, None: none); ``bound``: seconds a task over its
    ceiling has to checkpoint and stop (``task.migrate_timeout``)."""

    def __init__(self, admission: Admission, *, node_default: int | None, bound: float,
                 interval: float = SAMPLE_INTERVAL) -> None:
        self._admission = admission
        self.node_default = node_default
        self.bound = bound
        self.interval = interval
        self.samples = 0
        """How many samples were taken (a sample: one thread hop over every watched task)."""
        self._unmeasurable: set[str] = set()
        self._stopping: set[str] = set()

    async def run(self) -> None:
        """Watch until cancelled. Never raises for a task's trouble. Cancellation: as usual."""
        async with trio.open_nursery() as nursery:
            while True:
                if not any(ceiling_of(rt, self.node_default) for rt in self._admission.running.values()):
                    await self._admission.admitted.wait()  # (nothing to watch: no wake-up until a task comes)
                    continue
                watched = [rt for rt in self._admission.running.values()
                           if rt.phase == "running" and rt.jail is not None and not rt.stop.is_set()
                           and rt.task.id not in self._stopping and ceiling_of(rt, self.node_default)]
                if watched:
                    for rt, figure, what in await trio.to_thread.run_sync(self._over, watched):
                        self._stopping.add(rt.task.id)
                        nursery.start_soon(self._stop, rt, figure, what, name=f"memory ceiling {rt.task.id}")
                    self.samples += 1
                self._stopping &= set(self._admission.running)
                await trio.sleep(self.interval)

    def _over(self, watched: Iterable[RunningTask]) -> list[tuple[RunningTask, int, str]]:
        """In a thread: the tasks over their ceilings now, with their figure and what it is."""
        over = []
        for rt in watched:
            ceiling = ceiling_of(rt, self.node_default)
            jail = rt.jail
            if ceiling is None or jail is None:
                continue
            try:
                sample = jail.memory_now()
            except OSError:
                sample = None
            if sample is None:
                if rt.task.id not in self._unmeasurable:
                    self._unmeasurable.add(rt.task.id)
                    log.warning("task %s: its soft memory ceiling (%s) cannot be held: the %s level gives no "
                                "memory figure", rt.task.id, format_bytes(ceiling[0]), jail.level)
                continue
            if sample[0] > ceiling[0]:
                over.append((rt, *sample))
        return over

    async def _stop(self, rt: RunningTask, figure: int, what: str) -> None:
        ceiling = ceiling_of(rt, self.node_default)
        assert ceiling is not None
        why = (f"over its soft memory ceiling: {format_bytes(figure)} ({what}) > {format_bytes(ceiling[0])} "
               f"({ceiling[1]})")
        log.warning("task %s: %s; asking it to persist, then stopping it (MEMORY_LIMIT)", rt.task.id, why)
        await checkpoint_then_stop(rt, reason=StopReason.MEMORY_LIMIT, checkpoint="MEMORY",
                                   deadline=trio.current_time() + self.bound, why=why)
