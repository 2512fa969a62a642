"""The agent's Prometheus metrics: its own ``CollectorRegistry`` (never the global one), served on /metrics.

Names follow Prometheus conventions: ``ckagent_`` prefix, ``_total`` counters, ``_seconds`` and
``_bytes`` units, and only bounded labels (status, errorCode, phase, endpoint, outcome — never a
task, spider or node id). The metrics carry no secrets: no token, key, URL, environment or argument
of a task appears in any name, label or value.

Two kinds of figures:

- events, counted as they happen by hooks the agent wires in: :meth:`AgentMetrics.master_request`
  (the master client's ``observer``) and the supervisor observer methods (``task_admitted``,
  ``task_started``, ``deps_prepared``, ``task_finished``, ``task_reported``);
- the live state, read at scrape time: a :class:`LiveFigures` snapshot taken on the Trio thread
  (state, slots, phases, heartbeat age, ...) plus :class:`OutboxReader` figures read from the state
  store and the spool files in a worker thread (what the master has not acknowledged yet).

Exported (see :data:`METRIC_NAMES`)::

    ckagent_build_info{version,python}                 1
    ckagent_node_info{name,node_id}                    1 (node_id "" until registered)
    ckagent_state{state}                               1 for the current state, 0 for the others
    ckagent_registered, ckagent_master_up              0/1
    ckagent_heartbeat_age_seconds                      since the last acknowledged heartbeat (or the start)
    ckagent_max_workers, ckagent_free_slots            slots
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
    ckagent_master_requests_total{endpoint,outcome}    outcome: ok, error (transport) or the HTTP status
    ckagent_master_request_duration_seconds{endpoint}  histogram (a long poll includes its hold time)
    process_*                                          prometheus-client's process collector
"""

from __future__ import annotations

import logging
import platform
import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from ckagent.delivery import ITEMS_FILE, JOURNAL_FILE, OUTPUT_LOG
from ckagent.delivery.spool import read_spool
from ckagent.deps import Prepared
from ckagent.protocol import TaskResult
from ckagent.state import StateStore
from ckagent.supervisor import RunningTask, SupervisorObserver

log = logging.getLogger(__name__)

STATES = ("STARTING", "RUNNING", "DRAINING", "TERMINATING", "STOPPING", "STOPPED")
"""Every value of ``Agent.state`` (one ``ckagent_state`` series each)."""
PHASES = ("queued", "deploying", "installing", "running", "reporting")
"""Every value of ``RunningTask.phase``."""

TASK_DURATION_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 43200, 86400)
QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)
INSTALL_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
MASTER_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

METRIC_NAMES = frozenset({
    "ckagent_build_info", "ckagent_node_info", "ckagent_state", "ckagent_registered", "ckagent_master_up",
    "ckagent_heartbeat_age_seconds", "ckagent_max_workers", "ckagent_free_slots", "ckagent_tasks_running",
    "ckagent_tasks_started_total", "ckagent_tasks_finished_total", "ckagent_task_duration_seconds",
    "ckagent_task_queue_wait_seconds", "ckagent_deps_install_duration_seconds",
    "ckagent_deps_cache_hits_total", "ckagent_deps_cache_misses_total", "ckagent_code_download_bytes_total",
    "ckagent_log_lines_shipped_total", "ckagent_items_shipped_total", "ckagent_outbox_log_lines",
    "ckagent_outbox_items", "ckagent_outbox_results", "ckagent_master_requests_total",
    "ckagent_master_request_duration_seconds",
})  # fmt: skip
"""The agent's own metric names as they appear on /metrics (histograms add _bucket/_sum/_count)."""


# --------------------------------------------------------------------------------------------------
# The outbox: what the master has not acknowledged yet


@dataclass(frozen=True)
class OutboxFigures:
    """What waits for the master: log lines and items written to the spool but not acknowledged,
    final results not acknowledged, and the number of tasks with anything left to deliver."""

    log_lines: int = 0
    items: int = 0
    results: int = 0
    tasks: int = 0


_LINE_BREAK = re.compile(rb"\r\n|\r|\n")
_READ_CHUNK = 1024 * 1024
LOG_LINE_BYTES = 64 * 1024
"""The shippers cut longer log lines into pieces of this size (each piece is one element)."""


def _pieces(line: bytes) -> int:
    return max(1, -(-len(line) // LOG_LINE_BYTES))


class _LineCount:
    """Complete elements of one growing spool file, counted the way the shippers cut them.

    Logs: a line ends at LF, CR LF or a lone CR; a line longer than LOG_LINE_BYTES counts once per
    piece. Items: one per non-blank LF-terminated line. Incremental: :meth:`update` reads only what
    was appended since the last call (spool files only grow).
    """

    def __init__(self, path: Path, *, log: bool) -> None:
        self.path = path
        self._log = log
        self._read_to = 0
        self._carry = b""
        self.count = 0

    def update(self) -> int:
        """Read what was appended (blocking); returns the count. A missing file counts 0."""
        try:
            while chunk := read_spool(self.path, self._read_to, _READ_CHUNK):
                self._read_to += len(chunk)
                self._feed(chunk)
        except OSError:  # missing, or not a regular file (never followed, never blocked on)
            pass
        return self.count

    def _feed(self, data: bytes) -> None:
        buf = self._carry + data
        if not self._log:
            parts = buf.split(b"\n")
            self._carry = parts.pop()
            self.count += sum(1 for part in parts if part.strip())
            return
        # A CR at the very end may be the first half of CR LF: keep it (and its line) open, like the
        # shippers' splitter does.
        held = buf.endswith(b"\r")
        parts = _LINE_BREAK.split(buf[:-1] if held else buf)
        tail = parts.pop()
        self.count += sum(_pieces(part) for part in parts)
        open_bytes = len(tail) + held
        if open_bytes > LOG_LINE_BYTES:
            whole = (open_bytes - 1) // LOG_LINE_BYTES  # pieces cut; 1..LOG_LINE_BYTES bytes stay open
            self.count += whole
            tail = tail[whole * LOG_LINE_BYTES:]
        self._carry = tail + b"\r" if held else tail


class _TaskSpool:
    """The spool files of one task in the outbox: its log sources (output.log and the spider log
    files named by the journal's "S <idx> <path>" records) and items.jsonl."""

    def __init__(self, task_dir: Path) -> None:
        self.task_dir = task_dir
        self.logs: dict[str, _LineCount] = {OUTPUT_LOG: _LineCount(task_dir / OUTPUT_LOG, log=True)}
        self.items = _LineCount(task_dir / ITEMS_FILE, log=False)
        self._journal_read_to = 0
        self._journal_carry = b""

    def log_lines(self) -> int:
        """Lines written to every log source so far (blocking)."""
        self._scan_journal()
        return sum(counter.update() for counter in self.logs.values())

    def _scan_journal(self) -> None:
        try:
            data = read_spool(self.task_dir / JOURNAL_FILE, self._journal_read_to)
        except OSError:
            return
        self._journal_read_to += len(data)
        lines = (self._journal_carry + data).split(b"\n")
        self._journal_carry = lines.pop()
        for line in lines:
            fields = line.decode("utf-8", "replace").split(" ", 2)
            if len(fields) == 3 and fields[0] == "S" and fields[2] not in self.logs:
                relative = Path(fields[2])
                if not relative.is_absolute() and ".." not in relative.parts:
                    self.logs[fields[2]] = _LineCount(self.task_dir / relative, log=True)


class OutboxReader:
    """Reads the outbox from the state store and the spool files. **Blocking**: call it in a thread.

    Unacknowledged elements = complete elements in the spool files (counted the way the shippers
    cut them; a last line without its newline counts once the task ends) minus the acknowledged
    count in the state store. Counting is incremental — each call reads only the bytes written
    since the previous one — so a scrape costs little even while the master is away.

    It also keeps the ``shipped`` counters (elements acknowledged by the master while this process
    runs): the growth of each task's acknowledged position between calls, plus the rest when the
    task leaves the outbox (:meth:`task_done`). Tasks already in the outbox when the agent started
    count from where they were first seen.
    """

    def __init__(self, store: StateStore, started_at: float | None = None) -> None:
        self._store = store
        self._started_at = time.time() if started_at is None else started_at
        self._lock = threading.Lock()
        self._spools: dict[str, _TaskSpool] = {}
        self._seen: dict[str, list[int]] = {}  # task id -> [log seq, items seq] already counted as shipped
        self._done: set[str] = set()  # settled by task_done; may still be in a read that started before
        self.shipped_log_lines = 0
        self.shipped_items = 0
        self.last = OutboxFigures()

    def read(self) -> OutboxFigures:
        """Figures now (blocking: SQLite and file reads). Also advances the shipped counters."""
        records = self._store.pending_delivery()
        with self._lock:
            lines = items = results = 0
            for record in records:
                if record.result is not None:
                    results += 1
                spool = self._spools.get(record.task_id)
                if spool is None or spool.task_dir != record.task_dir:
                    spool = self._spools[record.task_id] = _TaskSpool(record.task_dir)
                acked = [int(self._store.stream_position(record.task_id, stream)[0]) for stream in ("log", "items")]
                lines += max(0, spool.log_lines() - acked[0])
                items += max(0, spool.items.update() - acked[1])
                self._advance(record.task_id, acked, before_start=record.claimed_at < self._started_at)
            pending_ids = {record.task_id for record in records}
            for task_id in set(self._spools) - pending_ids:
                del self._spools[task_id]
            self._done &= pending_ids
            self.last = OutboxFigures(log_lines=lines, items=items, results=results, tasks=len(records))
            return self.last

    def task_done(self, task_id: str, log_lines: int, items: int, claimed_at: float) -> None:
        """The master acknowledged the task's final result with these counts: settle its shipped figures."""
        with self._lock:
            self._done.add(task_id)
            seen = self._seen.pop(task_id, None)
            if seen is None:
                if claimed_at < self._started_at:
                    return  # shipped (at least partly) by an earlier run: unknown share, count nothing
                seen = [0, 0]
            self.shipped_log_lines += max(0, log_lines - seen[0])
            self.shipped_items += max(0, items - seen[1])

    def _advance(self, task_id: str, acked: list[int], *, before_start: bool) -> None:
        if task_id in self._done:
            return
        seen = self._seen.get(task_id)
        if seen is None:
            seen = self._seen[task_id] = list(acked) if before_start else [0, 0]
        self.shipped_log_lines += max(0, acked[0] - seen[0])
        self.shipped_items += max(0, acked[1] - seen[1])
        seen[0], seen[1] = max(seen[0], acked[0]), max(seen[1], acked[1])


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
        out = live.outbox
        yield GaugeMetricFamily("ckagent_outbox_log_lines",
                                "Task log lines written and not yet acknowledged by the master.", value=out.log_lines)
        yield GaugeMetricFamily("ckagent_outbox_items",
                                "Scraped items written and not yet acknowledged by the master.", value=out.items)
        yield GaugeMetricFamily("ckagent_outbox_results",
                                "Final task results not yet acknowledged by the master.", value=out.results)


class AgentMetrics(SupervisorObserver):
    """The agent's metrics in their own registry (see module docstring for the list).

    Hook methods are called on the Trio thread and never block or raise. :meth:`render` reads
    /proc (the process collector): the status server calls it in a worker thread.
    ``install_info`` keeps (install seconds, cache hit) per running task for the canonical log
    line; whoever logs that line pops the entry.
    """

    def __init__(self, version: str, node_name: str, outbox: OutboxReader | None = None) -> None:
        # No ``*_created`` series next to every counter and histogram (process-wide setting; the agent
        # process exports nothing else): they double the series count and no dashboard uses them.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.node_name = node_name
        self.outbox = outbox
        self.live = LiveFigures()
        self.install_info: dict[str, tuple[float, bool]] = {}
        self._render_lock = threading.Lock()
        self._shipped_floor = [0, 0]
        r = self.registry
        build = GaugeMetricFamily("ckagent_build_info", "The agent's version.", labels=["version", "python"])
        build.add_metric([version, platform.python_version()], 1)
        r.register(_Constant([build]))
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
            "transport failure, else the HTTP status).", ["endpoint", "outcome"], registry=r,
        )
        self.master_latency = Histogram(
            "ckagent_master_request_duration_seconds", "Latency of requests to the master (a long poll "
            "includes the time the master held it).", ["endpoint"], buckets=MASTER_LATENCY_BUCKETS, registry=r,
        )
        r.register(_LiveCollector(self))
        ProcessCollector(registry=r)

    # ------------------------------------------------------------------ hooks

    def master_request(self, endpoint: str, outcome: str, seconds: float) -> None:
        """The master client's ``observer``: one HTTP attempt."""
        self.master_requests.labels(endpoint, outcome).inc()
        self.master_latency.labels(endpoint).observe(max(0.0, seconds))

    def task_admitted(self, rt: RunningTask) -> None:
        """A claimed task was admitted."""
        self.tasks_started.inc()

    def task_started(self, rt: RunningTask) -> None:
        """The task holds its slot and its spider's lock: observe the queue wait."""
        self.queue_wait.observe(max(0.0, time.time() - rt.claimed_at))

    def deps_prepared(self, rt: RunningTask, prepared: Prepared) -> None:
        """Dependencies are ready: count the cache hit or miss, observe the install time."""
        self.install_info[rt.task.id] = (float(prepared.seconds), bool(prepared.cache_hit))
        if prepared.cache_hit:
            self.deps_cache_hits.inc()
        else:
            self.deps_cache_misses.inc()
            self.deps_install.observe(max(0.0, float(prepared.seconds)))

    def task_finished(self, rt: RunningTask, result: TaskResult) -> None:
        """The task's outcome is known (before its streams are flushed and the result is sent)."""
        self.tasks_finished.labels(result.status, result.error_code or "none").inc()
        self.task_duration.labels(result.status).observe(max(0.0, (result.duration_ms or 0) / 1000))

    def task_reported(self, task_id: str, result: TaskResult, claimed_at: float) -> None:
        """The master acknowledged the final result (with its item and log line counts)."""
        if self.outbox is not None:
            self.outbox.task_done(task_id, result.log_lines or 0, result.item_count or 0, claimed_at)

    # ------------------------------------------------------------------ exposition

    def shipped(self) -> tuple[int, int]:
        """(log lines, items) acknowledged by the master so far — never decreasing."""
        if self.outbox is not None:
            self._shipped_floor = [max(self._shipped_floor[0], self.outbox.shipped_log_lines),
                                   max(self._shipped_floor[1], self.outbox.shipped_items)]
        return self._shipped_floor[0], self._shipped_floor[1]

    def render(self, live: LiveFigures, accept: str = "") -> tuple[bytes, str]:
        """The exposition of every metric with ``live`` as the scrape-time state: (body, content type).

        ``accept`` is the request's Accept header (text format 0.0.4 by default, OpenMetrics on request).
        """
        encoder, content_type = choose_encoder(accept)
        with self._render_lock:
            self.live = live
            return encoder(self.registry), content_type


class _Constant(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)

