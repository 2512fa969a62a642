"""One crawl handed from node A to node B (issue 38's acceptance scenarios), and what to check of it.

:func:`hand_over` runs the scenario on a :class:`harness.twonodes.Cluster` and a
:class:`harness.crawlsite.CrawlSite`: node B started and held busy by a task of its own (so the crawl
starts on A), node A started, the crawl queued and run on A until the site served ``at`` of its pages;
then B is let go and A leaves — ``migrate`` (``ckagent stop --migrate``) or ``lost`` (everything of it
SIGKILLed, its work dir deleted) — and the task runs to its end, on B. :class:`Handover` holds what it
gave: the task's final view and attempts, the checkpoint the second attempt resumed from (the task's
newest when that attempt appeared), the items and log at the master, the site's counts and the
figures (how long B took to resume, how old the checkpoint was, pages fetched twice).
:meth:`Handover.problems` lists, in words, everything that is not as the issue promises.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import trio

from harness.core import eventually
from harness.crawlsite import CrawlSite
from harness.nodekill import KilledNode
from harness.twonodes import Cluster

__all__ = ["Handover", "epoch_of", "hand_over", "page_counts"]

DISRUPTIONS = {"migrate": "MIGRATED", "lost": "NODE_LOST"}
"""The errorCode of the first attempt, by how node A left."""


def epoch_of(iso: str | None) -> float | None:
    """Epoch seconds of an ISO 8601 time from the master (None stays None)."""
    return None if not iso else datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def page_counts(items: list[dict[str, Any]]) -> Counter[str]:
    """How many items the master holds per page path (an item's ``url``, without origin and query)."""
    return Counter(urlsplit(str(item.get("url", ""))).path for item in items)


@dataclass
class Handover:
    """What :func:`hand_over` gave (module docstring). Times are epoch seconds."""

    how: str
    task_id: str
    node_a: str
    node_b: str
    left_at: float = 0.0
    """When A left: the migrate command started, or the node died (its kill's first round)."""
    fetched_at_leave: int = 0
    final: dict[str, Any] = field(default_factory=dict)
    resumed_from: dict[str, Any] | None = None
    items: list[dict[str, Any]] = field(default_factory=list)
    log: str = ""
    fetched: int = 0
    twice: int = 0
    killed: KilledNode | None = None
    migrate_output: str = ""
    migrate_codes: tuple[int, int] | None = None
    migrate_seconds: float | None = None

    @property
    def attempts(self) -> list[dict[str, Any]]:
        """The task's attempts as the master's task view lists them (oldest first)."""
        return list(self.final.get("attempts") or [])

    def resumed_after(self) -> float | None:
        """Seconds from A leaving to the second attempt's start on B."""
        attempts = self.attempts
        started = epoch_of(attempts[1].get("startedAt")) if len(attempts) > 1 else None
        return None if started is None else started - self.left_at

    def checkpoint_age(self) -> float | None:
        """Seconds between the checkpoint the second attempt resumed from and A leaving."""
        created = epoch_of((self.resumed_from or {}).get("createdAt"))
        return None if created is None else self.left_at - created

    def figures(self) -> str:
        """One line of the measured figures, for the test's output and the operators' doc."""
        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"
        cp = self.resumed_from or {}
        return (f"{self.how}: left at {self.fetched_at_leave} pages, resumed after {fmt(self.resumed_after())} s"
                f" (migrate took {fmt(self.migrate_seconds)} s), checkpoint {cp.get('id')} ({cp.get('reason')},"
                f" {cp.get('sizeBytes')} bytes, {cp.get('itemSeq')} items) {fmt(self.checkpoint_age())} s old;"
                f" pages fetched {self.fetched}, twice {self.twice}")

    def story(self) -> str:
        """The task log's lines about attempts, checkpoints, migrating and stops: what to read first
        when a scenario went wrong."""
        words = ("attempt", "checkpoint", "migrat", "persist", "stop", "task FAILED", "resum", "superseded")
        return "\n".join(line for line in self.log.splitlines() if any(w in line for w in words))[-6000:]

    def problems(self, site: CrawlSite, *, twice_at_most: int) -> list[str]:
        """Everything not as promised: SUCCESS, two attempts (the first ended MIGRATED / NODE_LOST, a
        disruption not counted, on A; the second SUCCESS on B, resumed from a checkpoint), every page's
        item exactly once, at most ``twice_at_most`` pages fetched twice."""
        out = []
        tail = self.log[-3000:]
        if self.final.get("status") != "SUCCESS":
            out.append(f"task {self.final.get('status')}/{self.final.get('errorCode')}: "
                       f"{self.final.get('errorMessage')}\n{tail}")
        attempts = self.attempts
        if len(attempts) != 2:
            out.append(f"{len(attempts)} attempts, not 2: {attempts}")
        else:
            first, second = attempts
            expected = {"errorCode": DISRUPTIONS[self.how], "causeClass": "disruption", "counted": False,
                        "nodeId": self.node_a}
            got = {key: first.get(key) for key in expected}
            if got != expected:
                out.append(f"attempt 1: {got}, expected {expected}")
            if second.get("status") != "SUCCESS" or second.get("nodeId") != self.node_b:
                out.append(f"attempt 2: {second.get('status')} on {second.get('nodeId')}, expected SUCCESS on {self.node_b}")
            if not second.get("resumedFrom") or self.resumed_from is None \
                    or second.get("resumedFrom") != self.resumed_from.get("id"):
                out.append(f"attempt 2 resumed from {second.get('resumedFrom')!r}, the newest checkpoint then was "
                           f"{self.resumed_from}")
        counts = page_counts(self.items)
        expected_paths = set(site.all_paths())
        missing = sorted(expected_paths - set(counts))
        doubled = sorted(path for path, n in counts.items() if n > 1)
        strange = sorted(set(counts) - expected_paths)
        if missing or doubled or strange:
            out.append(f"{len(self.items)} items for {site.pages} pages: {len(missing)} missing {missing[:5]}, "
                       f"{len(doubled)} twice or more {doubled[:5]}, {len(strange)} not pages {strange[:5]}")
        if self.twice > twice_at_most:
            out.append(f"{self.twice} pages fetched twice, more than {twice_at_most}")
        return out


async def _watch_checkpoints(cluster: Cluster, task_id: str, seen: dict[str, Any], *,
                             task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Until the task's second attempt exists (or the task is final): keep in ``seen["checkpoint"]`` the
    task's newest checkpoint of its first attempt as the master shows it, every 50 ms — the last one
    seen is the one the second attempt resumes from."""
    task_status.started()
    while True:
        view = await cluster.admin.get_task(task_id)
        checkpoint = view.get("checkpoint")
        if checkpoint is not None and checkpoint.get("attempt") == 1:
            seen["checkpoint"] = checkpoint
        if len(view.get("attempts") or []) >= 2 or view.get("status") in ("SUCCESS", "FAILED", "CANCELLED"):
            return
        await trio.sleep(0.05)


async def hand_over(cluster: Cluster, site: CrawlSite, spider_id: str, how: str, *, holder: dict[str, Any],
                    at: float = 0.4, stored_first: int = 0, bound: float = 180.0, **task: Any) -> Handover:
    """Run the scenario (module docstring): ``how`` is "migrate" or "lost"; ``holder`` the create_task
    arguments (``spider`` = the spider id, default ``spider_id``; the rest as create_task's) of B's
    holding task, which must fetch the site's ``/hold``; ``task`` those of the crawl. A leaves once
    the site served ``at`` of its pages and the master holds ``stored_first`` items of the task. Every
    wait is bounded (``bound`` seconds for the crawl to end). Returns the :class:`Handover`."""
    admin = cluster.admin
    holder = dict(holder)
    await cluster.b.start()
    await cluster.b.occupy(holder.pop("spider", spider_id), **holder)
    await cluster.a.start()
    node_a, node_b = await cluster.a.node_id(), await cluster.b.node_id()
    task_id = str(await admin.create_task(spider_id, **task))
    result = Handover(how, task_id, node_a, node_b)
    with trio.fail_after(bound):
        await site.reached(int(at * site.pages))

    async def stored() -> bool:
        return int((await admin.get_task(task_id)).get("storedItems") or 0) >= stored_first

    await eventually(stored, bound, f"{stored_first} items of the crawl at the master")
    site.release()  # B's holding task ends: B has its slot again
    result.left_at, result.fetched_at_leave = time.time(), site.fetched()
    view = await admin.get_task(task_id)
    assert view.get("nodeId") == node_a, f"the crawl is not on node A at {at:.0%}: {view}"
    seen: dict[str, Any] = {}
    with trio.fail_after(bound):
        async with trio.open_nursery() as watching:  # (it ends when the watch does: attempt 2 exists)
            await watching.start(_watch_checkpoints, cluster, task_id, seen)
            if how == "migrate":
                started = time.monotonic()
                code, output, agent_exit = await cluster.a.migrate()
                result.migrate_seconds = time.monotonic() - started
                result.migrate_codes, result.migrate_output = (code, agent_exit), output
            else:
                result.killed = await cluster.a.lose()
                result.left_at = result.killed.died_at  # (the kill's first round: the moment the node died)
    result.resumed_from = seen.get("checkpoint")
    result.final = await admin.wait_task_final(task_id, bound)
    result.items = await admin.get_items(task_id)
    result.log = "\n".join(await admin.get_logs(task_id))
    result.fetched, result.twice = site.fetched(), site.fetched_twice()
    return result
