"""The dev master's ``GET /metrics``: its queue, for an autoscaler (KEDA, HPA) and for dashboards.

No authentication (as ``/healthz``): it tells how many tasks wait and which spiders they belong to,
nothing else — no task or node id, no token, no address. Prometheus text format 0.0.4 (OpenMetrics
when the scraper asks for it), rendered by prometheus-client from a ``CollectorRegistry`` of each app's
own (never the global one: two masters in one process share nothing)::

    ckmaster_tasks_pending{spider}                      PENDING tasks by spider name (retries waiting
                                                        for their backoff included)
    ckmaster_tasks_pending_by_requirements{requires}    the same by what a node needs to run them: the
                                                        tools of the task's framework, sorted,
                                                        comma-joined ("uv", "node"; "" for none known)
    ckmaster_tasks_running                              RUNNING tasks (claimed, attempt not ended)
    ckmaster_oldest_pending_age_seconds                 how long the longest-waiting pending task has
                                                        waited since it could be claimed (0: none)
    ckmaster_nodes{state}                               nodes by state: live, lost, left, draining, paused
    ckmaster_slots_capacity, ckmaster_slots_busy           summed over live nodes from their last heartbeat
    ckmaster_pending_spiders                            distinct spider names with pending tasks

Bounded cardinality: at most :data:`MAX_SPIDER_SERIES` ``spider`` series, the spiders with the most
pending tasks (ties by name); the pending tasks of the others are one series with ``spider=""`` (the
admin API refuses an empty spider name, so no spider has it), so ``sum(ckmaster_tasks_pending)`` is
always every pending task. ``requires`` has one value per runtime; ``state`` five.

A scrape is one thread hop running six or seven aggregate statements in one read transaction on a connection
of its own (:meth:`ckagent.devmaster.store.Store.queue_figures`; it never waits for the store's
writers, nor they for it) and the rendering. Scrapes that arrive while one is being read share its
figures. A store that cannot be read answers 503 with the reason in one line (and logs it).

The KEDA query of the manifests: ``sum(ckmaster_tasks_pending) + sum(ckmaster_tasks_running)`` with a
target value of the slots per pod (docs/observability.md, "Scaling a fleet on the queue").
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Iterable

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ckagent.devmaster.store import QueueFigures, Store
from ckagent.devmaster.store.queue import NODE_STATES
from ckagent.devmaster.web import route

log = logging.getLogger(__name__)

MAX_SPIDER_SERIES = 500
"""Most ``spider`` label values of ``ckmaster_tasks_pending`` (the rest: one series, ``spider=""``)."""
OTHER_SPIDERS = ""
"""The ``spider`` label of the pending tasks of the spiders beyond :data:`MAX_SPIDER_SERIES`."""
FRAMEWORK_REQUIRES: dict[str, tuple[str, ...]] = {
    "scrapy": ("uv",), "python": ("uv",), "playwright": ("uv",), "selenium": ("uv",), "node": ("node",),
}
"""What a node needs to run a framework's tasks: its runtime's tool, the one an agent refuses tasks
without (ckagent.code.capabilities; tests/test_autoscale_master.py holds the table to
ckagent.code.frameworks) — the names a node reports in ``runtimes.missing``."""

METRIC_NAMES = frozenset({
    "ckmaster_tasks_pending", "ckmaster_tasks_pending_by_requirements", "ckmaster_tasks_running",
    "ckmaster_oldest_pending_age_seconds", "ckmaster_nodes", "ckmaster_slots_capacity", "ckmaster_slots_busy",
    "ckmaster_pending_spiders",
})  # fmt: skip
"""Every metric the dev master's /metrics exports."""


def requires_of(framework: str) -> str:
    """The ``requires`` label of a framework's tasks (sorted tools, comma-joined; "" when none is known)."""
    return ",".join(sorted(FRAMEWORK_REQUIRES.get(framework, ())))


class _QueueCollector(Collector):
    """Yields the families of the figures :class:`MasterMetrics` hands it (under its render lock)."""

    def __init__(self) -> None:
        self.figures = QueueFigures()

    def collect(self) -> Iterable[Metric]:
        f = self.figures
        pending = GaugeMetricFamily("ckmaster_tasks_pending", "PENDING tasks by spider name (the spiders beyond "
                                    f"the {MAX_SPIDER_SERIES} with the most: spider=\"\").", labels=["spider"])
        for name, n in f.pending_by_spider:
            pending.add_metric([name], n)
        if f.pending_other or (not f.pending_by_spider and not f.pending):
            pending.add_metric([OTHER_SPIDERS], f.pending_other)  # (an empty queue: one series at 0)
        yield pending
        by_requirements: dict[str, int] = {}
        for framework, n in f.pending_by_framework:
            key = requires_of(framework)
            by_requirements[key] = by_requirements.get(key, 0) + n
        requires = GaugeMetricFamily("ckmaster_tasks_pending_by_requirements", "PENDING tasks by what a node needs "
                                     "to run them (tools, sorted, comma-joined; \"\" for none).", labels=["requires"])
        for key in sorted({*(requires_of(fw) for fw in FRAMEWORK_REQUIRES), *by_requirements}):
            requires.add_metric([key], by_requirements.get(key, 0))
        yield requires
        yield GaugeMetricFamily("ckmaster_tasks_running", "RUNNING tasks (claimed by a node, attempt not ended).",
                                value=f.running)
        yield GaugeMetricFamily("ckmaster_oldest_pending_age_seconds", "Seconds the longest-waiting PENDING task "
                                "has waited since it could be claimed (0 when none waits).",
                                value=f.oldest_pending_age_seconds)
        nodes = GaugeMetricFamily("ckmaster_nodes", "Nodes by state (live, lost, left, draining, paused).",
                                  labels=["state"])
        for state in NODE_STATES:
            nodes.add_metric([state], f.nodes.get(state, 0))
        yield nodes
        yield GaugeMetricFamily("ckmaster_slots_capacity", "Task slots (maxWorkers) of the live nodes, from their "
                                "last heartbeat.", value=f.slots_capacity)
        yield GaugeMetricFamily("ckmaster_slots_busy", "Busy slots of the live nodes (maxWorkers - freeSlots of "
                                "their last heartbeat).", value=f.slots_busy)
        yield GaugeMetricFamily("ckmaster_pending_spiders", "Distinct spider names with PENDING tasks.",
                                value=f.spiders_pending)


class MasterMetrics:
    """One dev master's /metrics over ``store``: its own registry, its own collector."""

    def __init__(self, store: Store, max_spiders: int = MAX_SPIDER_SERIES) -> None:
        self.store = store
        self.max_spiders = max_spiders
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _QueueCollector()
        self.registry.register(self._collector)
        self._render_lock = threading.Lock()
        self._reading: trio.Event | None = None  # set when the read in flight ends
        self._read: QueueFigures | BaseException | None = None

    async def figures(self) -> QueueFigures:
        """The queue now, read in a thread; a caller that comes while a read is in flight gets that
        read's figures. Raises sqlite3.Error. Cancellation: the read in flight finishes in its thread."""
        if self._reading is not None:
            reading = self._reading
            await reading.wait()
        else:
            reading = self._reading = trio.Event()
            try:
                self._read = await trio.to_thread.run_sync(self._read_figures)
            except BaseException as exc:  # the waiters see it too; this caller gets it raised
                self._read = exc
                raise
            finally:
                self._reading = None
                reading.set()
        got = self._read
        if isinstance(got, BaseException):
            if isinstance(got, sqlite3.Error):
                raise got
            raise sqlite3.OperationalError(f"the queue's figures could not be read ({type(got).__name__})")
        assert got is not None
        return got

    def _read_figures(self) -> QueueFigures:
        return self.store.queue_figures(max_spiders=self.max_spiders)

    def render(self, figures: QueueFigures, accept: str = "") -> tuple[bytes, str]:
        """The exposition of ``figures``: (body, content type); ``accept`` the scraper's Accept header."""
        encoder, content_type = choose_encoder(accept)
        with self._render_lock:
            self._collector.figures = figures
            return encoder(self.registry), content_type

    async def endpoint(self, request: Request) -> Response:
        """``GET /metrics``."""
        try:
            figures = await self.figures()
        except sqlite3.Error as exc:
            log.warning("dev master /metrics: the store cannot be read: %s", exc)
            return PlainTextResponse(f"the store cannot be read: {exc}\n", status_code=503)
        body, content_type = self.render(figures, request.headers.get("accept", ""))
        return Response(body, media_type=content_type, headers={"Cache-Control": "no-store"})


def routes(store: Store) -> list[Route]:
    """The ``page`` side's ``GET /metrics`` over ``store`` (a :class:`MasterMetrics` of its own)."""
    metrics = MasterMetrics(store)

    async def metrics_page(request: Request) -> Response:
        return await metrics.endpoint(request)

    return [route("page", "/metrics", metrics_page, "GET")]
