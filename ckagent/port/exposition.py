"""How the agent's /metrics is rendered without holding the event loop: the exposition in steps
(:func:`render_steps`, for :meth:`ckagent.port.metrics.AgentMetrics.render_sliced`), and the two
collectors made for it — the request histogram kept per endpoint (:class:`LatencyByEndpoint`) and the
``process_*`` series from cheap sources (:class:`ProcessFigures`).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence

import psutil
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ckagent.node.procid import start_ticks

__all__ = ["OPENMETRICS_EOF", "SAMPLES_PER_PIECE", "SLICE_SECONDS", "Constant", "LatencyByEndpoint",
           "ProcessFigures", "render_steps"]

SLICE_SECONDS = 0.00025
"""Longest run of rendering on the event loop before :meth:`AgentMetrics.render_sliced` lets other
tasks run. Collecting one family cannot be cut (the largest, the request histogram by endpoint, takes
about 0.6 ms here), so a slice plus that stays under 1 ms."""
SAMPLES_PER_PIECE = 32
"""Samples of one family rendered in one go (about 0.2 ms)."""
OPENMETRICS_EOF = b"# EOF\n"



def render_steps(registry: CollectorRegistry, encoder: Callable[[Collector], bytes], parts: list[bytes],
                  costs: dict[str | None, float] | None = None) -> Iterator[float]:
    """Render ``registry`` into ``parts`` (bytes to join), yielding where a caller may pause: before
    each family is collected and between the pieces of :data:`SAMPLES_PER_PIECE` samples a family is
    rendered in. Each yield gives the seconds the next step is expected to take: ``costs`` (kept by
    the caller across renders) holds, by the name of the family before, what collecting the next one
    took last time — the process collector's /proc reads take a few tenths of a millisecond, so a
    caller can start them in a slice of their own. A collector may also yield one family as
    consecutive pieces of the same name (:class:`LatencyByEndpoint`): the pieces after the first
    lose their ``# HELP``/``# TYPE`` lines."""
    families = iter(registry.collect())
    previous = None
    openmetrics = encoder(Constant([])) == OPENMETRICS_EOF
    costs = {} if costs is None else costs
    while True:
        yield costs.get(previous, 0.0)
        started = time.perf_counter()
        family = next(families, None)
        costs[previous] = time.perf_counter() - started
        if family is None:
            break
        continued = family.name == previous
        previous = family.name
        for index, piece in enumerate(_pieces(family)):
            if index:
                yield 0.0
            text = encoder(Constant([piece]))
            if openmetrics and text.endswith(OPENMETRICS_EOF):  # the encoder ends every call with it
                text = text[: -len(OPENMETRICS_EOF)]
            if index or continued:
                text = _without_headers(text)
            parts.append(text)
    if openmetrics:
        parts.append(OPENMETRICS_EOF)


def _pieces(family: Metric) -> list[Metric]:
    """``family`` cut into families of at most SAMPLES_PER_PIECE samples each (itself when small).
    A family with OpenMetrics-only samples (``_created``, ``_gsum``, ``_gcount``, which the text
    format renders as families of their own after the rest) is never cut."""
    samples = family.samples
    if len(samples) <= SAMPLES_PER_PIECE or any(
            s.name.endswith(("_created", "_gsum", "_gcount")) for s in samples):
        return [family]
    pieces = []
    for at in range(0, len(samples), SAMPLES_PER_PIECE):
        piece = Metric(family.name, family.documentation, family.type, family.unit)
        piece.samples = samples[at:at + SAMPLES_PER_PIECE]
        pieces.append(piece)
    return pieces


def _without_headers(text: bytes) -> bytes:
    """A rendered piece without its leading ``# HELP`` / ``# TYPE`` / ``# UNIT`` lines (the first
    piece of the family carries them)."""
    while text.startswith(b"# "):
        text = text[text.index(b"\n") + 1:]
    return text


class LatencyByEndpoint(Collector):
    """A histogram with an ``endpoint`` label, kept as one unlabelled prometheus-client ``Histogram``
    per endpoint (made at its first observation) and collected one endpoint at a time: consecutive
    pieces of one family, so a sliced render may pause between endpoints (collecting all of them at
    once took 0.6–2 ms here: more than a scrape may hold the loop)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self._name = name
        self._documentation = documentation
        self._buckets = buckets
        self._by_endpoint: dict[str, Histogram] = {}

    def observe(self, endpoint: str, seconds: float) -> None:
        """One observation (seconds) for ``endpoint``."""
        histogram = self._by_endpoint.get(endpoint)
        if histogram is None:
            histogram = self._by_endpoint[endpoint] = Histogram(
                self._name, self._documentation, buckets=self._buckets, registry=None)
        histogram.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        """One piece per endpoint (sorted), or the empty family before any observation."""
        endpoints = sorted(self._by_endpoint.items())
        if not endpoints:
            yield HistogramMetricFamily(self._name, self._documentation, labels=["endpoint"])
        for endpoint, histogram in endpoints:
            for family in histogram.collect():
                piece = Metric(family.name, family.documentation, family.type, family.unit)
                piece.samples = [sample._replace(labels={"endpoint": endpoint, **sample.labels})
                                 for sample in family.samples]
                yield piece


class ProcessFigures(Collector):
    """prometheus-client's process collector, the same ``process_*`` series, from cheaper sources and
    one family per step of a sliced render: CPU from ``os.times()`` and memory from
    ``/proc/self/statm`` instead of ``/proc/self/stat`` (which sums over every thread of the process),
    the fd limit from ``getrlimit``, the start time read once. Counting open fds still lists
    ``/proc/self/fd`` (a few tenths of a millisecond with hundreds of fds): a family of its own.
    Off Linux, only what ``os.times()`` and ``getrlimit`` give."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._start_time = time.time() - time.monotonic() + _process_start_monotonic()

    def collect(self) -> Iterator[Metric]:
        times = os.times()
        yield CounterMetricFamily("process_cpu_seconds", "Total user and system CPU time spent in seconds.",
                                  value=times.user + times.system)
        try:
            memory = self._me.memory_info()  # (psutil reads /proc/self/statm)
        except (psutil.Error, OSError):
            pass
        else:
            yield GaugeMetricFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.",
                                    value=float(memory.vms))
            yield GaugeMetricFamily("process_resident_memory_bytes", "Resident memory size in bytes.",
                                    value=float(memory.rss))
        yield GaugeMetricFamily("process_start_time_seconds",
                                "Start time of the process since unix epoch in seconds.", value=self._start_time)
        try:
            open_fds = self._me.num_fds()
        except (psutil.Error, OSError):
            pass
        else:
            yield GaugeMetricFamily("process_open_fds", "Number of open file descriptors.", value=open_fds)
        yield GaugeMetricFamily("process_max_fds", "Maximum number of open file descriptors.",
                                value=float(resource.getrlimit(resource.RLIMIT_NOFILE)[0]))


def _process_start_monotonic() -> float:
    """When this process started, on the ``time.monotonic()`` clock: its age is the boot-time clock
    now less its start time (clock ticks since boot, ckagent.node.procid through psutil); the import
    of this module when that cannot be told."""
    ticks = start_ticks(os.getpid())
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if ticks is None or boottime is None:
        return _IMPORTED_MONOTONIC
    age = time.clock_gettime(boottime) - ticks / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - max(0.0, age)


_IMPORTED_MONOTONIC = time.monotonic()


class Constant(Collector):
    """A collector of fixed families (the build info; an empty one to find the encoder's format)."""

    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)

