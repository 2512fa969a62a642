"""Crawl metrics: items, requests, responses by status class and errors per spider, from the stats snapshots.

Counters (registered on the agent's registry by :class:`ckagent.port.metrics.AgentMetrics`)::

    ckagent_crawl_items_total{spider}                       items the spiders reported (stats ``items``)
    ckagent_crawl_requests_total{spider}                    requests (stats ``requests``)
    ckagent_crawl_responses_total{spider, status_class}     responses by class: 1xx 2xx 3xx 4xx 5xx other
    ckagent_crawl_errors_total{spider}                      errors (stats ``errors``)

A snapshot holds a task's totals so far; the counters grow by the difference to the task's
previous snapshot (a smaller value than before counts as a restart from 0). Task outcomes by
errorCode are ``ckagent_tasks_finished_total{status, error_code}`` (ckagent.port.metrics), with the codes
of docs/protocol.md's outcome table.

Bounded label cardinality: the first MAX_SPIDERS spider names seen get a label of their own,
later ones count under ``spider="other"``; a name is cut to 64 characters.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter

MAX_SPIDERS = 50
"""Distinct ``spider`` label values before the rest count as "other"."""
OTHER = "other"
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx", OTHER)


def status_class(code: str) -> str:
    """"404" → "4xx"; anything that is not a 3-digit HTTP status → "other"."""
    if len(code) == 3 and code.isdigit() and code[0] in "12345":
        return f"{code[0]}xx"
    return OTHER


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else 0.0


class CrawlMetrics:
    """The crawl counters and the per-task last totals they are computed from. Thread-safe."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.items = Counter("ckagent_crawl_items", "Items the spiders reported in their stats, per spider "
                             "(first 50 spiders; the rest as spider=\"other\").", ["spider"], registry=registry)
        self.requests = Counter("ckagent_crawl_requests", "Requests the spiders reported, per spider.",
                                ["spider"], registry=registry)
        self.responses = Counter("ckagent_crawl_responses", "Responses the spiders reported, per spider and "
                                 "status class (1xx..5xx, other).", ["spider", "status_class"], registry=registry)
        self.errors = Counter("ckagent_crawl_errors", "Errors the spiders reported, per spider.", ["spider"],
                              registry=registry)
        self._lock = threading.Lock()
        self._spiders: set[str] = set()
        self._last: dict[str, dict[str, float]] = {}

    def label(self, spider: str) -> str:
        """The ``spider`` label value for a spider name (bounded, see module docstring)."""
        name = (spider or "unnamed")[:64]
        with self._lock:
            if name in self._spiders:
                return name
            if len(self._spiders) < MAX_SPIDERS and name != OTHER:
                self._spiders.add(name)
                return name
        return OTHER

    def observe(self, task_id: str, spider: str, stats: dict[str, Any], final: bool) -> None:
        """A task's newest snapshot ``stats``; ``final`` ends the task's bookkeeping."""
        totals = {key: _number(stats.get(key)) for key in ("items", "requests", "errors")}
        by_status = stats.get("responsesByStatus")
        if isinstance(by_status, dict):
            for code, count in by_status.items():
                key = "r:" + status_class(str(code))
                totals[key] = totals.get(key, 0.0) + _number(count)
        label = self.label(spider)
        with self._lock:
            last = self._last.pop(task_id, {}) if final else self._last.get(task_id, {})
            if not final:
                self._last[task_id] = totals
        for key, value in totals.items():
            delta = value - last.get(key, 0.0)
            if delta < 0:  # the spider's count started again
                delta = value
            if not delta:
                continue
            if key == "items":
                self.items.labels(label).inc(delta)
            elif key == "requests":
                self.requests.labels(label).inc(delta)
            elif key == "errors":
                self.errors.labels(label).inc(delta)
            else:
                self.responses.labels(label, key[2:]).inc(delta)
