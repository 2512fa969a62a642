"""What an autoscaler reads: scrapes parsed by prometheus-client's own parser, the KEDA query over them,
a blocking spider, and a dev master that holds the agents' final results until the test lets them through.

- :func:`scrape_samples` GETs a ``/metrics`` and returns every sample as (name, labels) → value;
  :func:`sample_value` reads one (0 when absent), :func:`sample_sum` sums a metric over its labels.
- :func:`keda_desired` is what the manifests' KEDA ScaledObject computes from a master's scrape:
  ``ceil((sum(ckmaster_tasks_pending) + sum(ckmaster_tasks_running)) / slots_per_pod)``.
- :data:`GO_SPIDER` prints ``ready`` and waits for ``<task dir>/go`` (at most a minute).
- :func:`age_heartbeat` makes a node's last heartbeat ``seconds`` older, straight in the master's file
  (a node that went silent, without waiting); :func:`fill_queue` puts pending tasks in a store fast.
- :func:`serve_result_gate` serves the dev master app behind :class:`ResultGate`: every
  ``POST /api/tasks/{id}/result`` waits until :attr:`ResultGate.open` is set (a task that ended on the
  node and whose result is not acknowledged yet).
"""

from __future__ import annotations

import math
import re
import sqlite3
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from prometheus_client.parser import text_string_to_metric_families

from ckagent.devmaster.app import Notifier, create_app
from ckagent.devmaster.client import AdminClient
from ckagent.devmaster.store import Store
from ckagent.master.protocol import utc_iso

__all__ = ["GO_SPIDER", "ResultGate", "Samples", "age_heartbeat", "fill_queue", "keda_desired", "parse_samples", "sample_sum", "sample_value",
           "scrape_samples", "serve_result_gate"]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""(sample name, labels) → value."""

GO_SPIDER = """\
import os, time
print("ready", flush=True)
go = os.path.join(os.environ["CK_TASK_DIR"], "go")
for _ in range(1200):  # bounded: at most a minute
    if os.path.exists(go):
        break
    time.sleep(0.05)
print("released", flush=True)
"""


def parse_samples(text: str) -> Samples:
    """Every sample of an exposition (prometheus-client's parser, as Prometheus would read it)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


async def scrape_samples(client: httpx.AsyncClient, path: str = "/metrics") -> Samples:
    """GET ``path`` (200, the text format) and parse it."""
    response = await client.get(path)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4"), response.headers
    return parse_samples(response.text)


def sample_value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when absent."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def sample_sum(samples: Samples, name: str) -> float:
    """``sum(name)``: the metric summed over every label set."""
    return sum(v for (n, _), v in samples.items() if n == name)


def keda_desired(samples: Samples, slots_per_pod: int) -> int:
    """The replica count KEDA's Prometheus scaler asks for (an AverageValue target of ``slots_per_pod``)
    with the manifests' query ``sum(ckmaster_tasks_pending) + sum(ckmaster_tasks_running)``."""
    load = sample_sum(samples, "ckmaster_tasks_pending") + sample_sum(samples, "ckmaster_tasks_running")
    return math.ceil(load / slots_per_pod)


def age_heartbeat(db_path: Path, node_id: str, seconds: float) -> None:
    """Move the node's ``last_heartbeat_at`` (and its registration time) ``seconds`` into the past, in the
    dev master's SQLite file (another connection: WAL lets it write beside the running master)."""
    from datetime import datetime, timedelta

    with sqlite3.connect(db_path, timeout=10) as db:
        row = db.execute("SELECT last_heartbeat_at, registered_at FROM nodes WHERE id = ?", (node_id,)).fetchone()
        assert row is not None, node_id
        moved = [utc_iso(datetime.fromisoformat(v.replace("Z", "+00:00")) - timedelta(seconds=seconds))
                 if v else None for v in row]
        db.execute("UPDATE nodes SET last_heartbeat_at = ?, registered_at = ? WHERE id = ?", (*moved, node_id))


def fill_queue(store: Store, spider_ids: list[str], count: int) -> list[str]:
    """``count`` PENDING tasks, round robin over ``spider_ids`` (the store's own create_task); their ids."""
    return [store.create_task(spider_ids[i % len(spider_ids)], args=[], env={}, params={}, timeout_seconds=None)
            for i in range(count)]


_RESULT = re.compile(r"^/api/tasks/[^/]+/result$")


class ResultGate:
    """ASGI wrapper: final-result posts wait for :attr:`open`; :attr:`held` counts those that waited."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.open = trio.Event()
        self.held = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        result = scope["type"] == "http" and scope["method"] == "POST" and _RESULT.match(scope.get("path", ""))
        if result and not self.open.is_set():
            self.held += 1
            await self.open.wait()
        await self.app(scope, receive, send)


@dataclass
class GatedMaster:
    """A running dev master behind a :class:`ResultGate`."""

    base_url: str
    registration_token: str
    admin: AdminClient
    gate: ResultGate = field(repr=False)


@asynccontextmanager
async def serve_result_gate(tmp_path: Path) -> AsyncIterator[GatedMaster]:
    """The dev master app behind a :class:`ResultGate` on 127.0.0.1:0 (its SQLite file in ``tmp_path``)
    until the block ends (the gate is opened at the end, so no request hangs the shutdown)."""
    store = await trio.to_thread.run_sync(Store, tmp_path / "gated.sqlite")
    registration_token, admin_token = uuid.uuid4().hex, uuid.uuid4().hex
    gate = ResultGate(create_app(store, Notifier(), registration_token=registration_token, admin_token=admin_token))
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.loglevel = "WARNING"
    config.graceful_timeout = 0.5
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(hypercorn_serve, gate, config))
            base_url = str(binds[0]).rstrip("/")
            try:
                async with AdminClient(base_url, admin_token) as admin:
                    yield GatedMaster(base_url, registration_token, admin, gate)
            finally:
                gate.open.set()
                nursery.cancel_scope.cancel()
    finally:
        store.close()
