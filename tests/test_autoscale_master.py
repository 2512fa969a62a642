"""The reference master's ``GET /metrics`` (ckagent.devmaster.queuemetrics): the queue an autoscaler scales
on, read by prometheus-client's own parser from the real dev master on 127.0.0.1.

- an empty master: every metric, all 0; OpenMetrics on request; ``promtool check metrics`` when installed;
- the KEDA query of the manifests, ``sum(ckmaster_tasks_pending) + sum(ckmaster_tasks_running)`` over the
  slots per pod, while tasks are created, claimed and finished — by raw nodes step by step, and by a real
  agent;
- nodes by state (live, lost, left, draining, paused) and the slots of the live ones;
- hostile spider names (quotes, backslashes, unicode, a newline written past the API) as label values, and
  any text a file may hold (hypothesis) back whole from both formats;
- more spiders than :data:`MAX_SPIDER_SERIES`: folded into ``spider=""``, the sum still exact;
- scrapes in parallel while the store writes; two masters in one process share nothing; a store that
  cannot be read answers 503;
- the cost: the same statements for 10 and 10,000 pending tasks, and the time of a scrape at 10,000.
"""

from __future__ import annotations

import math
import shutil
import sqlite3
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import (
    GO_SPIDER,
    Node,
    Samples,
    age_heartbeat,
    agent_settings,
    eventually,
    fill_queue,
    keda_desired,
    make_zip,
    parse_samples,
    register,
    running_agent,
    sample_sum,
    sample_value,
    scrape_samples,
    store_spider,
    submit,
    wait_for_log,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

from ckagent.code.frameworks import REGISTRY as FRAMEWORKS
from ckagent.devmaster.app import Notifier, create_app
from ckagent.devmaster.queuemetrics import FRAMEWORK_REQUIRES, MAX_SPIDER_SERIES, METRIC_NAMES, MasterMetrics
from ckagent.devmaster.store import QueueFigures, Store
from ckagent.devmaster.store.queue import NODE_STATES
from ckagent.master.protocol import FRAMEWORKS as WIRE_FRAMEWORKS

SLOTS_PER_POD = 2


@pytest.fixture
async def http(dev_master: Any) -> Any:
    async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=10) as client:
        yield client


async def spider(admin: Any, name: str, framework: str = "python") -> str:
    spider_id = str(await admin.create_spider(name, framework))
    files = {"index.js": b"console.log('hi')\n"} if framework == "node" else {"main.py": b"print('hi')\n"}
    await admin.upload_package(spider_id, make_zip(files))
    return spider_id


async def promtool_accepts(body: bytes) -> None:
    if shutil.which("promtool") is None:
        return
    checked = await trio.run_process(["promtool", "check", "metrics"], stdin=body, capture_stdout=True,
                                     capture_stderr=True, check=False)
    assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr


def spiders_of(samples: Samples) -> dict[str, float]:
    return {dict(labels)["spider"]: v for (name, labels), v in samples.items() if name == "ckmaster_tasks_pending"}


def nodes_of(samples: Samples) -> dict[str, float]:
    return {state: sample_value(samples, "ckmaster_nodes", state=state) for state in NODE_STATES}


async def test_an_empty_master_answers_every_metric_at_zero(dev_master: Any, http: httpx.AsyncClient) -> None:
    with trio.fail_after(20):
        response = await http.get("/metrics")  # no credentials: as /healthz
        assert response.status_code == 200 and response.headers["cache-control"] == "no-store"
        await promtool_accepts(response.content)
        samples = parse_samples(response.text)
        assert {name for name, _ in samples} == METRIC_NAMES
        assert all(v == 0 for v in samples.values()), samples
        assert spiders_of(samples) == {"": 0}
        assert nodes_of(samples) == dict.fromkeys(NODE_STATES, 0)
        assert {dict(labels)["requires"] for name, labels in samples
                if name == "ckmaster_tasks_pending_by_requirements"} == {"uv", "node"}
        assert keda_desired(samples, SLOTS_PER_POD) == 0
        openmetrics = await http.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
        assert openmetrics.text.endswith("# EOF\n")


async def test_the_keda_query_follows_tasks_created_claimed_and_finished(
    dev_master: Any, http: httpx.AsyncClient
) -> None:
    admin = dev_master.admin
    with trio.fail_after(30):
        a, b = [await register(http, dev_master.registration_token, name) for name in ("node-a", "node-b")]
        for node in (a, b):
            assert (await node.heartbeat(maxWorkers=2, freeSlots=2)).status_code == 200
        samples = await scrape_samples(http)
        assert keda_desired(samples, SLOTS_PER_POD) == 0
        assert (sample_value(samples, "ckmaster_slots_capacity"), sample_value(samples, "ckmaster_slots_busy")) == (4, 0)

        alpha, beta = await spider(admin, "alpha"), await spider(admin, "beta", "node")
        ids = [await admin.create_task(alpha) for _ in range(3)] + [await admin.create_task(beta) for _ in range(2)]
        await trio.sleep(0.05)
        samples = await scrape_samples(http)
        assert spiders_of(samples) == {"alpha": 3, "beta": 2}
        assert sample_value(samples, "ckmaster_tasks_pending_by_requirements", requires="uv") == 3
        assert sample_value(samples, "ckmaster_tasks_pending_by_requirements", requires="node") == 2
        assert sample_value(samples, "ckmaster_tasks_running") == 0
        assert 0.05 <= sample_value(samples, "ckmaster_oldest_pending_age_seconds") < 20
        assert keda_desired(samples, SLOTS_PER_POD) == math.ceil(5 / SLOTS_PER_POD) == 3

        for task_id in ids[:2]:  # node a claims two alpha tasks and says so in its heartbeat
            assert (await a.claim(task_id)).status_code == 200
        await a.heartbeat(maxWorkers=2, freeSlots=0, runningTaskIds=ids[:2])
        samples = await scrape_samples(http)
        assert spiders_of(samples) == {"alpha": 1, "beta": 2}
        assert sample_value(samples, "ckmaster_tasks_running") == 2
        assert (sample_value(samples, "ckmaster_slots_capacity"), sample_value(samples, "ckmaster_slots_busy")) == (4, 2)
        assert keda_desired(samples, SLOTS_PER_POD) == 3  # 3 pending + 2 running over 2 slots a pod

        assert (await a.result(ids[0], "SUCCESS", exitCode=0, durationMs=5)).status_code == 200
        samples = await scrape_samples(http)
        assert sample_value(samples, "ckmaster_tasks_running") == 1
        assert keda_desired(samples, SLOTS_PER_POD) == 2  # 3 pending + 1 running

        for task_id in ids[2:]:  # node b takes the rest: nothing pending, the oldest age back to 0
            assert (await b.claim(task_id)).status_code == 200
        samples = await scrape_samples(http)
        assert spiders_of(samples) == {"": 0} and sample_value(samples, "ckmaster_oldest_pending_age_seconds") == 0
        assert sample_value(samples, "ckmaster_tasks_running") == 4 and keda_desired(samples, SLOTS_PER_POD) == 2

        for task_id in ids[1:]:
            node = a if task_id == ids[1] else b
            assert (await node.result(task_id, "FAILED", exitCode=3, errorCode="EXIT_NONZERO",
                                      durationMs=5)).status_code == 200
        samples = await scrape_samples(http)
        assert sample_sum(samples, "ckmaster_tasks_pending") == sample_value(samples, "ckmaster_tasks_running") == 0
        assert keda_desired(samples, SLOTS_PER_POD) == 0  # scale to zero


async def test_a_real_agent_moves_the_query_and_the_slots(
    dev_master: Any, http: httpx.AsyncClient, nursery: trio.Nursery, tmp_path: Path
) -> None:
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    with trio.fail_after(180):
        ids = [await submit(dev_master.admin, f"go-{i}", {"main.py": GO_SPIDER}) for i in range(3)]
        samples = await scrape_samples(http)
        assert sample_sum(samples, "ckmaster_tasks_pending") == 3 and keda_desired(samples, SLOTS_PER_POD) == 2
        async with running_agent(nursery, settings) as agent:

            async def two_running() -> Samples | None:
                got = await scrape_samples(http)
                done = (sample_value(got, "ckmaster_tasks_running") == 2
                        and sample_value(got, "ckmaster_slots_busy") == 2)
                return got if done else None

            samples = await eventually(two_running, 60, "two tasks running, two busy slots heartbeated")
            assert sample_sum(samples, "ckmaster_tasks_pending") == 1
            assert sample_value(samples, "ckmaster_slots_capacity") == 2
            assert nodes_of(samples) == {**dict.fromkeys(NODE_STATES, 0), "live": 1}
            assert keda_desired(samples, SLOTS_PER_POD) == 2  # a second pod for the third task

            for task_id in ids:  # each as it is claimed: the third runs once a slot is free
                await wait_for_log(dev_master.admin, task_id, "ready", 60)
                (agent.settings.task.work_dir / "tasks" / task_id / "go").touch()
                await dev_master.admin.wait_task_final(task_id, 30)

            async def drained() -> Samples | None:
                got = await scrape_samples(http)
                return got if keda_desired(got, SLOTS_PER_POD) == 0 and not sample_value(got, "ckmaster_slots_busy") else None

            await eventually(drained, 15, "nothing pending or running, no busy slot")
        samples = await scrape_samples(http)  # the agent stopped and said it was leaving
        assert nodes_of(samples) == {**dict.fromkeys(NODE_STATES, 0), "left": 1}
        assert sample_value(samples, "ckmaster_slots_capacity") == 0


async def test_nodes_by_state_and_the_slots_of_the_live_ones(dev_master: Any, http: httpx.AsyncClient) -> None:
    with trio.fail_after(30):
        nodes: dict[str, Node] = {name: await register(http, dev_master.registration_token, name)
                                  for name in ("live", "fresh", "draining", "paused", "left", "lost")}
        await nodes["live"].heartbeat(maxWorkers=4, freeSlots=1)
        await nodes["draining"].heartbeat(status="DRAINING", maxWorkers=8, freeSlots=0)
        await nodes["paused"].heartbeat(pausedReason="the work dir's disk is below its floor", maxWorkers=8,
                                        freeSlots=8)
        await nodes["left"].heartbeat(maxWorkers=8, freeSlots=8)
        left = await http.post(f"/api/nodes/{nodes['left'].node_id}/leaving", json={"reason": "drained"},
                               headers=nodes["left"].auth)
        assert left.status_code == 200, left.text
        await nodes["lost"].heartbeat(maxWorkers=8, freeSlots=8)
        await trio.to_thread.run_sync(age_heartbeat, dev_master.db_path, nodes["lost"].node_id, 91)
        samples = await scrape_samples(http)
        # "fresh" registered and has not heartbeated yet: live, with its registration's maxWorkers (2), none busy
        assert nodes_of(samples) == {"live": 2, "lost": 1, "left": 1, "draining": 1, "paused": 1}
        assert sample_value(samples, "ckmaster_slots_capacity") == 4 + 2
        assert sample_value(samples, "ckmaster_slots_busy") == 3
        await trio.to_thread.run_sync(age_heartbeat, dev_master.db_path, nodes["fresh"].node_id, 91)
        samples = await scrape_samples(http)  # registered long ago, never a heartbeat: lost
        assert nodes_of(samples) == {"live": 1, "lost": 2, "left": 1, "draining": 1, "paused": 1}
        assert sample_value(samples, "ckmaster_slots_capacity") == 4


async def test_hostile_spider_names_are_escaped_label_values(dev_master: Any, http: httpx.AsyncClient) -> None:
    names = ['say "hi"', "back\\slash\\", "ünï ⚡ 蜘蛛", "} ckmaster_tasks_running 99 {", "a=\"b\",c=\"d"]
    with trio.fail_after(30):
        for name in names:
            await dev_master.admin.create_task(await spider(dev_master.admin, name))
        refused = await http.post("/api/spiders", json={"name": "line\nbreak", "framework": "python"},
                                  headers={"Authorization": f"Bearer {dev_master.admin_token}"})
        assert refused.status_code == 422  # the API refuses control characters; an older file may hold one:
        store = await trio.to_thread.run_sync(Store, dev_master.db_path)
        try:
            for name in ("line\nbreak", "tab\there"):
                await trio.to_thread.run_sync(fill_queue, store, [store_spider(store, name)], 2)
        finally:
            store.close()
        response = await http.get("/metrics")
        await promtool_accepts(response.content)
        samples = parse_samples(response.text)
        assert spiders_of(samples) == {**dict.fromkeys(names, 1), "line\nbreak": 2, "tab\there": 2}
        assert sample_value(samples, "ckmaster_tasks_running") == 0  # the injected text stayed a label value
        assert 'spider="line\\nbreak"' in response.text and 'spider="say \\"hi\\""' in response.text


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(st.lists(st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40), min_size=1,
                max_size=8, unique=True))
def test_any_spider_name_comes_back_whole_from_either_format(names: list[str]) -> None:
    """Whatever a file holds as a spider name (control characters, NUL, line separators, quotes): the
    exposition is parsed back to the same label values, in the text format and in OpenMetrics."""
    metrics = MasterMetrics(None)  # type: ignore[arg-type]  # the rendering alone: no store read
    figures = QueueFigures(pending=len(names), pending_by_spider=tuple((name, 1) for name in names))
    text, _ = metrics.render(figures)
    assert spiders_of(parse_samples(text.decode())) == dict.fromkeys(names, 1)
    body, content_type = metrics.render(figures, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    parsed = {s.labels["spider"]: s.value for f in openmetrics_families(body.decode()) for s in f.samples
              if f.name == "ckmaster_tasks_pending"}
    assert parsed == dict.fromkeys(names, 1)


async def test_more_spiders_than_series_are_folded_into_one_and_the_sum_stays_exact(
    dev_master: Any, http: httpx.AsyncClient
) -> None:
    extra = 12
    with trio.fail_after(120):
        store = await trio.to_thread.run_sync(Store, dev_master.db_path)
        try:
            def fill() -> dict[str, int]:
                counts: dict[str, int] = {}
                for i in range(MAX_SPIDER_SERIES + extra):
                    name = f"s{i:04d}"
                    counts[name] = 1 + (i % 3 == 0)  # every third spider has two pending tasks
                    fill_queue(store, [store_spider(store, name)], counts[name])
                return counts

            counts = await trio.to_thread.run_sync(fill)
        finally:
            store.close()
        samples = await scrape_samples(http)
    spiders = spiders_of(samples)
    kept = sorted(counts, key=lambda name: (-counts[name], name))[:MAX_SPIDER_SERIES]
    assert set(spiders) == {*kept, ""}
    assert all(spiders[name] == counts[name] for name in kept)
    assert spiders[""] == sum(counts.values()) - sum(counts[name] for name in kept) == extra  # the rest: 1 each
    assert sample_sum(samples, "ckmaster_tasks_pending") == sum(counts.values())
    assert sample_value(samples, "ckmaster_pending_spiders") == MAX_SPIDER_SERIES + extra


async def test_scrapes_in_parallel_while_the_store_writes(dev_master: Any, http: httpx.AsyncClient) -> None:
    admin = dev_master.admin
    created = finished = 0
    scrapes: list[Samples] = []
    done = trio.Event()
    with trio.fail_after(60):
        node = await register(http, dev_master.registration_token, "writer")
        spider_ids = [await spider(admin, name) for name in ("p", "q", "r")]

        async def write() -> None:
            nonlocal created, finished
            for i in range(20):
                task_id = await admin.create_task(spider_ids[i % 3])
                created += 1
                if i % 2:
                    assert (await node.claim(task_id)).status_code == 200
                    assert (await node.result(task_id, "SUCCESS", exitCode=0, durationMs=1)).status_code == 200
                    finished += 1
                await node.heartbeat(maxWorkers=2, freeSlots=2)
            done.set()

        async def scrape() -> None:
            async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=10) as client:
                while not done.is_set():
                    before = created
                    samples = await scrape_samples(client)
                    after = created
                    load = sample_sum(samples, "ckmaster_tasks_pending") + sample_sum(samples, "ckmaster_tasks_running")
                    # one snapshot: by spider and by requirements count the same tasks
                    assert sample_sum(samples, "ckmaster_tasks_pending") == sample_sum(
                        samples, "ckmaster_tasks_pending_by_requirements")
                    # (a task the writer's request has committed and it has not counted yet: + 1)
                    assert before - finished - 1 <= load <= after + 1, (before, after, load)
                    scrapes.append(samples)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            for _ in range(4):
                nursery.start_soon(scrape)
        samples = await scrape_samples(http)
    assert len(scrapes) >= 20
    assert sample_sum(samples, "ckmaster_tasks_pending") == 10 and sample_value(samples, "ckmaster_tasks_running") == 0


async def test_two_masters_in_one_process_share_nothing(tmp_path: Path) -> None:
    stores = [await trio.to_thread.run_sync(Store, tmp_path / f"{n}.sqlite") for n in ("one", "two")]
    try:
        spider_id = await trio.to_thread.run_sync(store_spider, stores[0], "only-in-one")
        await trio.to_thread.run_sync(fill_queue, stores[0], [spider_id], 3)
        apps = [create_app(store, Notifier(), registration_token="r", admin_token="a") for store in stores]
        pending = []
        with trio.fail_after(20):  # noqa: ASYNC912 (two apps: the loop runs)
            for app in apps:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://master") as c:
                    pending.append(spiders_of(await scrape_samples(c)))
        assert pending == [{"only-in-one": 3}, {"": 0}]
        assert not [m for m in REGISTRY.collect() if m.name.startswith("ckmaster_")]  # not the global registry
        one, two = MasterMetrics(stores[0]), MasterMetrics(stores[1])
        assert one.registry is not two.registry
    finally:
        for store in stores:
            store.close()


async def test_a_store_that_cannot_be_read_answers_503_in_one_line(tmp_path: Path) -> None:
    store = await trio.to_thread.run_sync(Store, tmp_path / "broken.sqlite")
    try:
        with sqlite3.connect(tmp_path / "broken.sqlite") as db:
            db.execute("DROP TABLE task_attempts")
        app = create_app(store, Notifier(), registration_token="r", admin_token="a")
        with trio.fail_after(20):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://master") as c:
                response = await c.get("/metrics")
        assert response.status_code == 503
        assert response.text.count("\n") == 1 and "task_attempts" in response.text
    finally:
        store.close()


def test_the_requires_label_follows_the_frameworks_runtimes() -> None:
    """What a node needs for a framework, as the agent refuses tasks without it (ckagent.code.capabilities)."""
    assert set(FRAMEWORK_REQUIRES) == set(WIRE_FRAMEWORKS)
    assert {name: (f.runtime.tool,) for name, f in FRAMEWORKS.items()} == FRAMEWORK_REQUIRES


@pytest.mark.slow  # 10,000 tasks made one by one: ~1.5 s alone, 5 s beside the suite
def test_a_scrape_costs_the_same_statements_for_ten_and_ten_thousand_pending_tasks(tmp_path: Path) -> None:
    store = Store(tmp_path / "queue.sqlite")
    try:
        spider_ids = [store_spider(store, f"spider-{i}") for i in range(20)]
        statements: dict[int, list[str]] = {}
        have = 0
        for total in (10, 10_000):
            fill_queue(store, spider_ids, total - have)
            have = total
            store.queue_figures()  # (opens the reader connection)
            seen: list[str] = []
            assert store._queue_conn is not None
            store._queue_conn.set_trace_callback(seen.append)
            figures = store.queue_figures()
            store._queue_conn.set_trace_callback(None)
            statements[total] = seen
            assert figures.pending == total
        assert len(statements[10]) == len(statements[10_000]) <= 10
        app_metrics = MasterMetrics(store)
        times = []
        for _ in range(7):
            started = time.perf_counter()
            body, _ = app_metrics.render(store.queue_figures())
            times.append(time.perf_counter() - started)
        assert sample_sum(parse_samples(body.decode()), "ckmaster_tasks_pending") == 10_000
        median = statistics.median(times)
        print(f"scrape with 10,000 pending tasks (20 spiders): median {median * 1000:.1f} ms, "
              f"max {max(times) * 1000:.1f} ms over {len(times)}")
        assert median < 1.0  # ~20 ms here (docs/observability.md); a bound the loaded suite keeps
    finally:
        store.close()
