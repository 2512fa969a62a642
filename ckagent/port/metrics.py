"""The agent's Prometheus metrics: its own ``CollectorRegistry`` (never the global one), served on /metrics.

Names follow Prometheus conventions: ``ckagent_`` prefix, ``_total`` counters, ``_seconds`` and
``_bytes`` units, and only bounded labels (status, errorCode, phase, endpoint, outcome — never a
task, spider or node id). The metrics carry no secrets: no token, key, URL, environment or argument
of a task appears in any name, label or value.

Two kinds of figures:

- events, counted as they happen: :meth:`AgentMetrics.master_request` (the master client's
  ``observer``) and :meth:`AgentMetrics.record`, a consumer of the task lifecycle records
  (:mod:`ckagent.delivery.lifecycle`: admitted, started, deps prepared, finished, delivered, lost);
- the live state, read at scrape time: a :class:`LiveFigures` snapshot taken on the Trio thread
  (state, slots, phases, heartbeat age, ...) plus the outbox's :class:`OutboxStatistics` record
  (:meth:`ckagent.delivery.Outbox.figures`, counted on the loop in slices: what the master has not
  acknowledged yet), which this module only renders.

A scrape never holds the event loop for long: :meth:`AgentMetrics.render_sliced` renders on the
loop's own thread, family by family (a large family in pieces; the request histogram one endpoint at
a time), with a checkpoint whenever a slice has run for :data:`SLICE_SECONDS` (the steps and the
collectors made for them are :mod:`ckagent.port.exposition`). (Rendering in a worker thread looks cheaper but is not: a thread running
Python code holds the GIL, and the loop waits for it up to ``sys.getswitchinterval()``, 5 ms, each
time it wants to run — measured with bench/scrape.py.)

Exported (see :data:`METRIC_NAMES`)::

    ckagent_build_info{version,python}                 1
    ckagent_node_info{name,node_id}                    1 (node_id "" until registered)
    ckagent_state{state}                               1 for the current state, 0 for the others
    ckagent_registered, ckagent_master_up              0/1
    ckagent_heartbeat_age_seconds                      since the last acknowledged heartbeat (or the start)
    ckagent_max_workers, ckagent_free_slots            slots
    ckagent_slots_capacity, ckagent_slots_busy            for an autoscaler: max_workers; claimed tasks not ended
                                                       here (re-adopted ones too; not those only delivering)
    ckagent_idle_seconds                               since the node last had a busy slot or an open delivery
                                                       (0 while it has; since the start if never)
    ckagent_tasks_running{phase}                       claimed, unfinished tasks by phase
    ckagent_tasks_started_total                        tasks claimed and admitted
    ckagent_tasks_finished_total{status,error_code}    error_code "none" for a success
    ckagent_task_duration_seconds{status}              histogram: start of the spider (or of the task) → end
    ckagent_task_queue_wait_seconds                    histogram: claim → a slot and the spider's lock held
    ckagent_deps_install_duration_seconds              histogram: dependency installs that ran (cache misses)
    ckagent_deps_cache_hits_total, ckagent_deps_cache_misses_total
    ckagent_code_download_bytes_total                  code packages and spider files downloaded
    ckagent_log_lines_shipped_total, ckagent_items_shipped_total   acknowledged by the master
    ckagent_outbox_log_lines, ckagent_outbox_items     written to the spool, not yet acknowledged
    ckagent_outbox_results                             final results not yet acknowledged
    ckagent_outbox_bytes                               their approximate spool bytes
    ckagent_outbox_oldest_unshipped_seconds            how long the oldest of them has waited for the master
    ckagent_master_requests_total{endpoint,outcome}    endpoint: a name of ckagent.master.endpoints (each
                                                       endpoint's ok series exists from the start); outcome: ok,
                                                       error (transport), protocol_error (an answer not in
                                                       the protocol's words) or the HTTP status
    ckagent_master_request_duration_seconds{endpoint}  histogram (a long poll includes its hold time)
    ckagent_egress_repairs_total                       times the nftables table was deleted by someone else and
                                                       made again with the tasks' rules (ckagent.containment.egress.repair)
    process_*                                          the process collector's series (cpu, memory, fds, start time)
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from ckagent.containment.egress.proxy.taskproxy import OUTCOMES
from ckagent.delivery import OutboxStatistics
from ckagent.delivery.lifecycle import (
    DepsPrepared,
    Record,
    TaskAdmitted,
    TaskDelivered,
    TaskFinished,
    TaskLost,
    TaskStarted,
)
from ckagent.master.endpoints import ENDPOINTS
from ckagent.master.protocol import TaskResult
from ckagent.node.levels import ContainmentLevel, EgressLevel, IdentityLevel
from ckagent.port.crawlmetrics import CrawlMetrics
from ckagent.port.exposition import SLICE_SECONDS, Constant, LatencyByEndpoint, ProcessFigures, render_steps

if TYPE_CHECKING:
    from ckagent.containment.egress.proxy import ProxyServer
    from ckagent.containment.egress.repair import TableKeeper
    from ckagent.delivery import Outbox

log = logging.getLogger(__name__)

STATES = ("STARTING", "RUNNING", "DRAINING", "TERMINATING", "STOPPING", "STOPPED")
"""Every value of ``Agent.state`` (one ``ckagent_state`` series each)."""
PHASES = ("queued", "deploying", "installing", "running", "reporting")
"""Every value of ``RunningTask.phase``."""

TASK_DURATION_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 43200, 86400)
QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)
INSTALL_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
TASK_CPU_BUCKETS = (0.1, 1, 10, 60, 300, 1800, 3600, 14400, 86400)
TASK_MEMORY_BUCKETS = tuple(float(mib << 20) for mib in (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
MASTER_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

METRIC_NAMES = frozenset({
    "ckagent_build_info", "ckagent_node_info", "ckagent_state", "ckagent_registered", "ckagent_master_up",
    "ckagent_heartbeat_age_seconds", "ckagent_max_workers", "ckagent_free_slots", "ckagent_tasks_running",
    "ckagent_tasks_started_total", "ckagent_tasks_finished_total", "ckagent_task_duration_seconds",
    "ckagent_task_queue_wait_seconds", "ckagent_deps_install_duration_seconds",
    "ckagent_deps_cache_hits_total", "ckagent_deps_cache_misses_total", "ckagent_code_download_bytes_total",
    "ckagent_log_lines_shipped_total", "ckagent_items_shipped_total", "ckagent_outbox_log_lines",
    "ckagent_outbox_items", "ckagent_outbox_results", "ckagent_outbox_bytes",
    "ckagent_outbox_oldest_unshipped_seconds", "ckagent_master_requests_total",
    "ckagent_master_request_duration_seconds", "ckagent_containment_level", "ckagent_task_cpu_seconds",
    "ckagent_task_memory_peak_bytes", "ckagent_egress_level", "ckagent_identity_level", "ckagent_egress_refused_total",
    "ckagent_egress_proxy_requests_total", "ckagent_egress_proxy_connections_total",
    "ckagent_slots_capacity", "ckagent_slots_busy", "ckagent_idle_seconds", "ckagent_egress_repairs_total",
})  # fmt: skip
"""The agent's own metric names as they appear on /metrics (histograms add _bucket/_sum/_count)."""


OutboxFigures = OutboxStatistics
"""What the outbox holds unacknowledged (the record :meth:`ckagent.delivery.Outbox.statistics` returns)."""


# --------------------------------------------------------------------------------------------------
# Live figures and the registry


@dataclass(frozen=True)
class LiveFigures:
    """The agent's state at scrape time (taken on the Trio thread; see :meth:`AgentMetrics.render`).

    ``heartbeat_age_seconds``: since the last acknowledged heartbeat, or since the agent started
    when none was acknowledged yet. ``phases``: running tasks per phase.
    """

    state: str = "STARTING"
    registered: bool = False
    master_up: bool = False
    node_id: str | None = None
    heartbeat_age_seconds: float = 0.0
    max_workers: int = 0
    free_slots: int = 0
    slots_busy: int = 0
    idle_seconds: float = 0.0
    phases: Mapping[str, int] = field(default_factory=dict)
    code_download_bytes: int = 0
    outbox: OutboxFigures = field(default_factory=OutboxFigures)


class _LiveCollector(Collector):
    """Yields the scrape-time figures from the last :class:`LiveFigures` handed to it."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m = self._metrics
        live = m.live
        info = GaugeMetricFamily("ckagent_node_info", "This node's name and the id the master gave it.",
                                 labels=["name", "node_id"])
        info.add_metric([m.node_name, live.node_id or ""], 1)
        yield info
        state = GaugeMetricFamily("ckagent_state", "The agent's state: 1 for the current one.", labels=["state"])
        for name in STATES:
            state.add_metric([name], 1 if live.state == name else 0)
        yield state
        yield GaugeMetricFamily("ckagent_registered", "1 once the master has given this node an id and key.",
                                value=int(live.registered))
        yield GaugeMetricFamily("ckagent_master_up", "1 while the last request to the master got an answer.",
                                value=int(live.master_up))
        yield GaugeMetricFamily(
            "ckagent_heartbeat_age_seconds",
            "Seconds since the master last acknowledged a heartbeat (since the start if never).",
            value=live.heartbeat_age_seconds,
        )
        yield GaugeMetricFamily("ckagent_max_workers", "Maximum concurrent tasks on this node.",
                                value=live.max_workers)
        yield GaugeMetricFamily("ckagent_free_slots", "Slots not taken by a claimed, unfinished task.",
                                value=live.free_slots)
        yield GaugeMetricFamily("ckagent_slots_capacity", "Task slots of this node (max_workers): what an "
                                "autoscaler divides the queue by.", value=live.max_workers)
        yield GaugeMetricFamily("ckagent_slots_busy", "Slots held by a claimed task not ended here (re-adopted "
                                "ones included; a task only delivering its data holds none).", value=live.slots_busy)
        yield GaugeMetricFamily("ckagent_idle_seconds", "Seconds since this node last had a busy slot or data "
                                "to deliver (0 while it has; since the start if never).", value=live.idle_seconds)
        running = GaugeMetricFamily("ckagent_tasks_running", "Claimed, unfinished tasks by phase.",
                                    labels=["phase"])
        for phase in PHASES:
            running.add_metric([phase], live.phases.get(phase, 0))
        yield running
        yield CounterMetricFamily("ckagent_code_download_bytes", "Bytes of spider code downloaded from the master.",
                                  value=live.code_download_bytes)
        shipped = m.shipped()
        yield CounterMetricFamily("ckagent_log_lines_shipped", "Task log lines acknowledged by the master.",
                                  value=shipped[0])
        yield CounterMetricFamily("ckagent_items_shipped", "Scraped items acknowledged by the master.",
                                  value=shipped[1])
        proxy = m.egress_proxy  # (the proxy level only: 0 at the others)
        requests = CounterMetricFamily("ckagent_egress_proxy_requests", "Requests of the tasks at the egress "
                                       "proxy, by what became of them.", labels=["outcome"])
        for outcome in OUTCOMES:
            requests.add_metric([outcome], proxy.outcomes.get(outcome, 0) if proxy is not None else 0)
        yield requests
        yield CounterMetricFamily("ckagent_egress_proxy_connections", "Client connections the egress proxy "
                                  "accepted.", value=proxy.connections if proxy is not None else 0)
        keeper = m.egress_table  # (the nftables level only)
        yield CounterMetricFamily("ckagent_egress_repairs", "Times the egress table was deleted by someone else "
                                  "and made again with the tasks' rules.", value=keeper.repairs if keeper else 0)
        out = live.outbox
        yield GaugeMetricFamily("ckagent_outbox_log_lines",
                                "Task log lines written and not yet acknowledged by the master.", value=out.log_lines)
        yield GaugeMetricFamily("ckagent_outbox_items",
                                "Scraped items written and not yet acknowledged by the master.", value=out.items)
        yield GaugeMetricFamily("ckagent_outbox_results",
                                "Final task results not yet acknowledged by the master.", value=out.results)
        yield GaugeMetricFamily("ckagent_outbox_bytes",
                                "Approximate spool bytes of the log lines and items not yet acknowledged.",
                                value=out.bytes)
        yield GaugeMetricFamily("ckagent_outbox_oldest_unshipped_seconds",
                                "How long the oldest unacknowledged log line or item has waited for the master.",
                                value=out.oldest_seconds)


class AgentMetrics:
    """The agent's metrics in their own registry (see module docstring for the list).

    :meth:`master_request` (the master client's observer) and :meth:`record` (a consumer of the
    lifecycle records) run on the Trio thread and never block. :meth:`render` reads /proc (the
    process collector); the status server uses :meth:`render_sliced`.
    """

    def __init__(self, version: str, node_name: str, outbox: Outbox | None = None) -> None:
        # No ``*_created`` series next to every counter and histogram (process-wide setting; the agent
        # process exports nothing else): they double the series count and no dashboard uses them.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.node_name = node_name
        self.outbox = outbox
        self.live = LiveFigures()
        self._render_lock = threading.Lock()
        self._sliced_lock: trio.Lock | None = None  # made on the loop by the first render_sliced
        self._collect_costs: dict[str | None, float] = {}  # see render_steps
        self._shipped_floor = [0, 0]
        r = self.registry
        build = GaugeMetricFamily("ckagent_build_info", "The agent's version.", labels=["version", "python"])
        build.add_metric([version, platform.python_version()], 1)
        r.register(Constant([build]))
        self.tasks_started = Counter("ckagent_tasks_started", "Tasks claimed and admitted to run here.", registry=r)
        self.tasks_finished = Counter(
            "ckagent_tasks_finished", "Tasks finished here, by status and errorCode (\"none\" on success).",
            ["status", "error_code"], registry=r,
        )
        self.task_duration = Histogram(
            "ckagent_task_duration_seconds", "Task run time (from the spider's start; from the claim if it "
            "never started), by status.", ["status"], buckets=TASK_DURATION_BUCKETS, registry=r,
        )
        self.queue_wait = Histogram(
            "ckagent_task_queue_wait_seconds", "Seconds from the claim until the task held a slot and its "
            "spider's lock.", buckets=QUEUE_WAIT_BUCKETS, registry=r,
        )
        self.deps_install = Histogram(
            "ckagent_deps_install_duration_seconds", "Dependency installs that ran (cache misses), seconds.",
            buckets=INSTALL_BUCKETS, registry=r,
        )
        self.deps_cache_hits = Counter("ckagent_deps_cache_hits", "Tasks whose dependencies were already "
                                       "installed.", registry=r)
        self.deps_cache_misses = Counter("ckagent_deps_cache_misses", "Tasks that had to install "
                                         "dependencies.", registry=r)
        self.master_requests = Counter(
            "ckagent_master_requests", "HTTP requests to the master by endpoint and outcome (ok, error for a "
            "transport failure, protocol_error for an answer that is not the protocol's, else the HTTP status).", ["endpoint", "outcome"], registry=r,
        )
        self._request_series: dict[tuple[str, str], Counter] = {}  # (endpoint, outcome) → its series, looked up once
        for endpoint in ENDPOINTS:  # the endpoint table's names are the label's values: each series exists at 0
            self._request_series[(endpoint, "ok")] = self.master_requests.labels(endpoint, "ok")
        self.master_latency = LatencyByEndpoint(
            "ckagent_master_request_duration_seconds", "Latency of requests to the master (a long poll "
            "includes the time the master held it).", MASTER_LATENCY_BUCKETS)
        r.register(self.master_latency)
        self.crawl = CrawlMetrics(r)
        self.containment = Gauge("ckagent_containment_level", "The containment level of tasks here: 1 for "
                                 "the level in force (cgroup-v2, cgroup-v1, process-group).", ["level"], registry=r)
        self.containment_level(None)  # every level's series exists from the start (0 until known)
        self.egress = Gauge("ckagent_egress_level", "How tasks' network policy is enforced here: 1 for the "
                            "level in force (nftables, proxy, off).", ["level"], registry=r)
        self.egress_level(None)
        self.identity = Gauge("ckagent_identity_level", "Whom spiders run as here: 1 for the identity level in "
                              "force (spider-uids, one-user, agent-user, root).", ["level"], registry=r)
        self.identity_level(None)
        self.egress_refused = Counter("ckagent_egress_refused", "Connections of finished tasks refused by "
                                      "their network policy (the kernel's counters at the nftables level, the "
                                      "proxy's at the proxy level).", registry=r)
        self.egress_proxy: ProxyServer | None = None
        """At the proxy egress level: the forward proxy, whose counts are read at each scrape."""
        self.egress_table: TableKeeper | None = None
        """At the nftables egress level: the table's keeper, whose repairs are read at each scrape."""
        self.task_cpu = Histogram(
            "ckagent_task_cpu_seconds", "CPU seconds (user + system) of finished tasks, installers included "
            "(cgroup levels).", buckets=TASK_CPU_BUCKETS, registry=r,
        )
        self.task_memory_peak = Histogram(
            "ckagent_task_memory_peak_bytes", "Memory peak of finished tasks (cgroup levels).",
            buckets=TASK_MEMORY_BUCKETS, registry=r,
        )
        r.register(_LiveCollector(self))
        r.register(ProcessFigures())

    def containment_level(self, level: ContainmentLevel | None) -> None:
        """Export the containment level in force (one series per level, labelled with its text, 1 for
        the one in force; None: not known yet)."""
        for each in ContainmentLevel:
            self.containment.labels(each.value).set(1 if each is level else 0)

    def egress_level(self, level: EgressLevel | None) -> None:
        """Export the egress level in force (one series per level, labelled with its text, 1 for the one
        in force; None: not known yet)."""
        for each in EgressLevel:
            self.egress.labels(each.value).set(1 if each is level else 0)

    def identity_level(self, level: IdentityLevel | None) -> None:
        """Export the identity level in force (one series per level, labelled with its text, 1 for the
        one in force; None: not known yet)."""
        for each in IdentityLevel:
            self.identity.labels(each.value).set(1 if each is level else 0)

    # ------------------------------------------------------------------ hooks

    def master_request(self, endpoint: str, outcome: str, seconds: float) -> None:
        """The master client's ``observer``: one HTTP attempt."""
        series = self._request_series.get((endpoint, outcome))
        if series is None:  # a few outcomes per endpoint (ok, error, protocol_error, HTTP statuses)
            series = self._request_series[(endpoint, outcome)] = self.master_requests.labels(endpoint, outcome)
        series.inc()
        self.master_latency.observe(endpoint, max(0.0, seconds))

    def record(self, record: Record) -> None:
        """The consumer of the lifecycle records (ckagent.delivery.lifecycle): each moves its figures.

        TaskAdmitted counts a started task; TaskStarted observes the queue wait; DepsPrepared counts the
        cache hit or miss (and observes a miss's install seconds); TaskFinished counts the outcome and
        observes duration, cpu, memory peak and refused connections; TaskLost (an earlier run's task,
        AGENT_LOST) counts as finished here; TaskDelivered hands the acknowledged counts to the outbox's
        shipped figures.
        """
        if isinstance(record, TaskAdmitted):
            self.tasks_started.inc()
        elif isinstance(record, TaskStarted):
            self.queue_wait.observe(record.queue_wait_seconds)
        elif isinstance(record, DepsPrepared):
            if record.cache_hit:
                self.deps_cache_hits.inc()
            else:
                self.deps_cache_misses.inc()
                self.deps_install.observe(max(0.0, record.seconds))
        elif isinstance(record, TaskFinished):
            self._finished(record.result)
        elif isinstance(record, TaskLost):
            self.tasks_finished.labels(record.result.status, record.result.error_code or "none").inc()
        elif isinstance(record, TaskDelivered) and self.outbox is not None:
            result = record.result
            self.outbox.task_acknowledged(record.task_id, result.log_lines or 0, result.item_count or 0,
                                          record.claimed_at)

    def _finished(self, result: TaskResult) -> None:
        self.tasks_finished.labels(result.status, result.error_code or "none").inc()
        self.task_duration.labels(result.status).observe(max(0.0, (result.duration_ms or 0) / 1000))
        if result.cpu_seconds is not None:
            self.task_cpu.observe(result.cpu_seconds)
        if result.memory_peak_bytes is not None:
            self.task_memory_peak.observe(result.memory_peak_bytes)
        if result.egress_refused:
            self.egress_refused.inc(sum(r["count"] for r in result.egress_refused))

    # ------------------------------------------------------------------ exposition

    def shipped(self) -> tuple[int, int]:
        """(log lines, items) acknowledged by the master so far — never decreasing."""
        if self.outbox is not None:
            lines, items = self.outbox.shipped()
            self._shipped_floor = [max(self._shipped_floor[0], lines), max(self._shipped_floor[1], items)]
        return self._shipped_floor[0], self._shipped_floor[1]

    def render(self, live: LiveFigures, accept: str = "") -> tuple[bytes, str]:
        """The exposition of every metric with ``live`` as the scrape-time state: (body, content type),
        in one go (blocking the caller for the whole render, a few ms: tests and tools; the agent's
        /metrics uses :meth:`render_sliced`).

        ``accept`` is the request's Accept header (text format 0.0.4 by default, OpenMetrics on request).
        """
        encoder, content_type = choose_encoder(accept)
        parts: list[bytes] = []
        with self._render_lock:
            self.live = live
            for _ in render_steps(self.registry, encoder, parts):
                pass
        return b"".join(parts), content_type

    async def render_sliced(self, live: LiveFigures, accept: str = "") -> tuple[bytes, str]:
        """:meth:`render` on the event loop's thread, in slices (no thread, so no wait for the GIL):
        a checkpoint once a slice has run :data:`SLICE_SECONDS` (or would, with the next family's
        collection as long as last time), between families and between the pieces of a large family
        (see :func:`render_steps`).

        The same bytes as :meth:`render`. Renders run one at a time. Cancellation between slices
        abandons the exposition (rendering changes nothing).
        """
        encoder, content_type = choose_encoder(accept)
        if self._sliced_lock is None:
            self._sliced_lock = trio.Lock()
        parts: list[bytes] = []
        async with self._sliced_lock:
            await trio.lowlevel.checkpoint()  # a fresh slice: not on top of what this step did before
            self.live = live
            deadline = time.perf_counter() + SLICE_SECONDS
            for expected in render_steps(self.registry, encoder, parts, self._collect_costs):
                if time.perf_counter() + expected >= deadline:
                    await trio.lowlevel.checkpoint()
                    deadline = time.perf_counter() + SLICE_SECONDS
        body = b"".join(parts)
        await trio.lowlevel.checkpoint()  # the caller's sending starts a slice of its own
        return body, content_type


