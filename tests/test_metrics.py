"""ckagent.port.metrics on its own: the exposition (names, units, labels, promtool), the hooks, and the
outbox statistics (ckagent.delivery.statistics, what Outbox.statistics() returns) read from a real
state store and real spool files."""

from __future__ import annotations

import random
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import BatchMaster, master_client
from prometheus_client.parser import text_string_to_metric_families

from ckagent.delivery import LineSplitter, Outbox, SpoolCounter
from ckagent.delivery.lifecycle import DepsPrepared, TaskAdmitted, TaskDelivered, TaskFinished, TaskStarted
from ckagent.delivery.spool import MAX_LINE_BYTES as LOG_LINE_BYTES
from ckagent.delivery.statistics import _ElementCount
from ckagent.master.protocol import Task, TaskResult
from ckagent.node.state import AsyncStateStore, StateStore
from ckagent.port.metrics import (
    METRIC_NAMES,
    PHASES,
    AgentMetrics,
    LiveFigures,
)
from ckagent.task.supervisor import RunningTask

TASK_JSON = {"id": "t1", "spiderId": "s1", "spiderName": "shop", "framework": "python"}


def running_task(task_id: str = "t1", claimed_at: float | None = None) -> RunningTask:
    rt = RunningTask(task=Task.from_json({**TASK_JSON, "id": task_id}))
    if claimed_at is not None:
        rt.claimed_at = claimed_at
    return rt


def families(metrics: AgentMetrics, live: LiveFigures | None = None) -> dict[str, Any]:
    body, content_type = metrics.render(live or LiveFigures())
    assert content_type.startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def sample(fams: dict[str, Any], family: str, name: str, **labels: str) -> float:
    for s in fams[family].samples:
        if s.name == name and s.labels == labels:
            return float(s.value)
    raise KeyError((name, labels))


# ------------------------------------------------------------------------------------------ exposition


def test_exposition_follows_prometheus_conventions() -> None:
    metrics = AgentMetrics("1.2.3", "node-a")
    rt = running_task()
    metrics.record(TaskAdmitted(rt.task.id, rt.task.spider_id, rt.claimed_at))
    metrics.record(TaskFinished(rt.task.id, TaskResult(status="FAILED", error_code="TIMEOUT", duration_ms=1500)))
    metrics.master_request("poll", "ok", 0.2)
    body, _ = metrics.render(LiveFigures(state="RUNNING"))
    text = body.decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    ours = {name for name in fams if name.startswith("ckagent_")}
    # The parser strips _total from counter family names; compare sample names instead.
    exported = {s.name for f in fams.values() for s in f.samples}
    for name in METRIC_NAMES:
        assert name in exported or f"{name}_count" in exported, name
    for family in fams.values():
        if not family.name.startswith("ckagent_"):
            assert family.name.startswith(("process_", "python_")), family.name
            continue
        assert family.documentation, family.name
        if family.type == "counter":
            assert all(s.name.endswith("_total") for s in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith(("_seconds", "_bytes")), family.name
        for s in family.samples:
            assert set(s.labels) <= {"status", "error_code", "phase", "endpoint", "outcome", "state", "le",
                                     "version", "python", "name", "node_id", "level"}, (s.name, s.labels)
    assert len(ours) >= 20
    assert 'ckagent_tasks_finished_total{error_code="TIMEOUT",status="FAILED"} 1.0' in text
    assert 'ckagent_build_info{python=' in text and 'version="1.2.3"' in text
    assert 'ckagent_state{state="RUNNING"} 1.0' in text and 'ckagent_state{state="DRAINING"} 0.0' in text


def test_hooks_move_the_right_figures() -> None:
    metrics = AgentMetrics("0", "n")
    rt = running_task(claimed_at=0.0)  # claimed long ago: a big queue wait
    metrics.record(TaskAdmitted(rt.task.id, rt.task.spider_id, rt.claimed_at))
    metrics.record(TaskStarted(rt.task.id, rt.claimed_at, time.time()))
    metrics.record(DepsPrepared(rt.task.id, 2.5, False))
    metrics.record(DepsPrepared("t2", 0.01, True))
    metrics.record(TaskFinished(rt.task.id, TaskResult(status="SUCCESS", duration_ms=90_000)))
    metrics.master_request("claim", "409", 0.03)
    metrics.master_request("claim", "ok", 0.02)
    metrics.master_request("heartbeat", "error", 5.0)
    fams = families(metrics, LiveFigures(phases={"running": 2, "queued": 1}, free_slots=1, max_workers=4,
                                         code_download_bytes=1234, heartbeat_age_seconds=7.5))
    assert sample(fams, "ckagent_tasks_started", "ckagent_tasks_started_total") == 1
    assert sample(fams, "ckagent_task_queue_wait_seconds", "ckagent_task_queue_wait_seconds_bucket", le="3600.0") == 0
    assert sample(fams, "ckagent_task_queue_wait_seconds", "ckagent_task_queue_wait_seconds_count") == 1
    assert sample(fams, "ckagent_deps_install_duration_seconds", "ckagent_deps_install_duration_seconds_sum") == 2.5
    assert sample(fams, "ckagent_deps_cache_hits", "ckagent_deps_cache_hits_total") == 1
    assert sample(fams, "ckagent_deps_cache_misses", "ckagent_deps_cache_misses_total") == 1
    assert sample(fams, "ckagent_task_duration_seconds", "ckagent_task_duration_seconds_bucket",
                  status="SUCCESS", le="60.0") == 0
    assert sample(fams, "ckagent_task_duration_seconds", "ckagent_task_duration_seconds_bucket",
                  status="SUCCESS", le="120.0") == 1
    assert sample(fams, "ckagent_tasks_finished", "ckagent_tasks_finished_total",
                  status="SUCCESS", error_code="none") == 1
    assert sample(fams, "ckagent_master_requests", "ckagent_master_requests_total",
                  endpoint="claim", outcome="409") == 1
    assert sample(fams, "ckagent_master_request_duration_seconds", "ckagent_master_request_duration_seconds_count",
                  endpoint="claim") == 2
    assert sample(fams, "ckagent_tasks_running", "ckagent_tasks_running", phase="running") == 2
    assert sample(fams, "ckagent_tasks_running", "ckagent_tasks_running", phase="installing") == 0
    assert {s.labels["phase"] for s in fams["ckagent_tasks_running"].samples} == set(PHASES)
    assert sample(fams, "ckagent_free_slots", "ckagent_free_slots") == 1
    assert sample(fams, "ckagent_code_download_bytes", "ckagent_code_download_bytes_total") == 1234
    assert sample(fams, "ckagent_heartbeat_age_seconds", "ckagent_heartbeat_age_seconds") == 7.5


def test_a_registry_of_its_own() -> None:
    import prometheus_client

    AgentMetrics("0", "n").master_request("poll", "ok", 0.1)
    global_text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "ckagent_" not in global_text
    AgentMetrics("0", "n")  # a second instance (tests, restarts in-process) does not collide


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian/Ubuntu: apt-get install prometheus)")
def test_promtool_accepts_the_exposition() -> None:
    metrics = AgentMetrics("0.1.0", "node-a")
    rt = running_task()
    metrics.record(TaskAdmitted(rt.task.id, rt.task.spider_id, rt.claimed_at))
    metrics.record(TaskStarted(rt.task.id, rt.claimed_at, time.time()))
    metrics.record(DepsPrepared(rt.task.id, 1.0, False))
    metrics.record(TaskFinished(rt.task.id, TaskResult(status="SUCCESS", duration_ms=1000)))
    metrics.master_request("heartbeat", "ok", 0.01)
    body, _ = metrics.render(LiveFigures(state="RUNNING", registered=True, master_up=True, node_id="n1"))
    checked = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
    assert checked.stdout.decode().strip() == "" and checked.stderr.decode().strip() == "", checked


# ------------------------------------------------------------------------------------------ the outbox


@pytest.mark.parametrize("seed", range(4))
def test_log_line_count_matches_the_shippers_splitter(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    pieces = [b"a", b"xy", b"\r", b"\n", b"\r\n", b" ", "é".encode()]
    data = b"".join(
        rnd.choice(pieces) * (rnd.randint(1, 3) if rnd.random() < 0.95 else rnd.randint(1, 3 * LOG_LINE_BYTES))
        for _ in range(rnd.randint(50, 800))
    ) + b"end\n"
    path = tmp_path / "output.log"
    path.write_bytes(b"")
    counter = _ElementCount(path.parent, path.name, log=True)
    splitter = LineSplitter(0, LOG_LINE_BYTES, True)
    expected = pos = 0
    while pos < len(data):
        chunk = data[pos : pos + rnd.randint(1, 9000)]
        pos += len(chunk)
        with path.open("ab") as fh:
            fh.write(chunk)
        expected += len(splitter.feed(chunk)[0])
        assert counter.update() == expected  # the counter cuts with the shippers' own splitter


def test_item_count_skips_blank_lines_and_waits_for_the_newline(tmp_path: Path) -> None:
    path = tmp_path / "items.jsonl"
    counter = _ElementCount(path.parent, path.name, log=False)
    assert counter.update() == 0  # no file yet
    path.write_bytes(b'{"a": 1}\n\n   \n{"b"')
    assert counter.update() == 1
    with path.open("ab") as fh:
        fh.write(b': 2}\r\n{"c": 3}\n')
    assert counter.update() == 3


def _store(tmp_path: Path) -> StateStore:
    return StateStore(tmp_path / "state.db")


def _task_dir(tmp_path: Path, task_id: str) -> Path:
    path = tmp_path / "tasks" / task_id
    path.mkdir(parents=True)
    return path


def test_outbox_counts_what_the_master_has_not_acknowledged(tmp_path: Path) -> None:
    store = _store(tmp_path)
    reader = SpoolCounter(store, started_at=0.0)
    assert reader.read().tasks == 0
    t1 = _task_dir(tmp_path, "t1")
    store.add_task("t1", "s1", TASK_JSON, t1)
    (t1 / "output.log").write_bytes(b"one\ntwo\r\nthree\rfour\npartial")
    (t1 / "items.jsonl").write_bytes(b'{"n": 1}\n{"n": 2}\n{"n": 3}\n')
    # A spider log file merged into the log stream (the delivery's journal names it).
    (t1 / "scrapy.log").write_bytes(b"s1\ns2\n")
    (t1 / "output.journal").write_bytes(b"S 0 output.log\nS 1 scrapy.log\nS 2 ../../etc/passwd\nD 0 10\n")
    figures = reader.read()
    assert (figures.log_lines, figures.items, figures.results, figures.tasks) == (4 + 2, 3, 0, 1)

    store.save_stream_position("t1", "log", 5, {"j": 0, "p": {}})
    store.save_stream_position("t1", "items", 2, {"offset": 18})
    with (t1 / "output.log").open("ab") as fh:
        fh.write(b" five\nsix\n")
    figures = reader.read()
    assert (figures.log_lines, figures.items) == (8 - 5, 1)
    assert (reader.shipped_log_lines, reader.shipped_items) == (5, 2)

    store.set_result("t1", TaskResult(status="SUCCESS").to_json())
    assert reader.read().results == 1
    # The master acknowledges the rest and the result: the shipped counters settle on the final counts.
    store.save_stream_position("t1", "log", 8, {"j": 0, "p": {}})
    store.save_stream_position("t1", "items", 3, {"offset": 27})
    store.mark_result_acked("t1")
    reader.task_done("t1", log_lines=8, items=3, claimed_at=1.0)
    assert (reader.shipped_log_lines, reader.shipped_items) == (8, 3)
    figures = reader.read()
    assert (figures.log_lines, figures.items, figures.results, figures.tasks) == (0, 0, 0, 0)
    assert (reader.shipped_log_lines, reader.shipped_items) == (8, 3)  # not counted twice


def test_shipped_counts_only_what_this_process_saw_acknowledged(tmp_path: Path) -> None:
    store = _store(tmp_path)
    old = _task_dir(tmp_path, "old")
    store.add_task("old", "s1", TASK_JSON, old)
    store.save_stream_position("old", "log", 100, {"j": 0, "p": {}})  # shipped by an earlier run
    reader = SpoolCounter(store)  # started now: "old" was claimed before
    reader.read()
    assert reader.shipped_log_lines == 0
    store.save_stream_position("old", "log", 130, {"j": 0, "p": {}})
    reader.read()
    assert reader.shipped_log_lines == 30
    reader.task_done("old", log_lines=140, items=0, claimed_at=0.0)
    assert reader.shipped_log_lines == 40
    # Acknowledged by an earlier run and never seen here: nothing can be attributed to this run.
    reader.task_done("unseen-old", log_lines=50, items=5, claimed_at=0.0)
    assert (reader.shipped_log_lines, reader.shipped_items) == (40, 0)


async def test_outbox_figures_reach_the_exposition(tmp_path: Path) -> None:
    store = _store(tmp_path)
    outbox = Outbox(None, AsyncStateStore(store), tmp_path)  # type: ignore[arg-type]  # counting needs no master
    t1 = _task_dir(tmp_path, "t1")
    store.add_task("t1", "s1", TASK_JSON, t1)
    (t1 / "output.log").write_bytes(b"a\nb\nc\n")
    store.save_stream_position("t1", "log", 1, {"j": 0, "p": {}})
    store.set_result("t1", TaskResult(status="FAILED", error_code="EXIT_NONZERO").to_json())
    metrics = AgentMetrics("0", "n", outbox)
    assert metrics.outbox is not None
    figures = await trio.to_thread.run_sync(metrics.outbox.statistics)
    fams = families(metrics, LiveFigures(outbox=figures))
    assert sample(fams, "ckagent_outbox_log_lines", "ckagent_outbox_log_lines") == 2
    assert sample(fams, "ckagent_outbox_results", "ckagent_outbox_results") == 1
    assert sample(fams, "ckagent_log_lines_shipped", "ckagent_log_lines_shipped_total") == 1
    metrics.record(TaskDelivered("t1", "shop", 1.0, TaskResult(status="FAILED", log_lines=3, item_count=0)))
    fams = families(metrics)
    assert sample(fams, "ckagent_log_lines_shipped", "ckagent_log_lines_shipped_total") == 3
    store.close()


def test_metrics_carry_no_secret() -> None:
    metrics = AgentMetrics("0", "n")
    rt = RunningTask(task=Task.from_json({
        "id": "task-0f3a9", "spiderId": "spider-77c1", "spiderName": "shop-crawler", "framework": "python",
        "env": {"API_TOKEN": "tok-123456"}, "args": ["--password=hunter22"],
    }))
    metrics.record(TaskAdmitted(rt.task.id, rt.task.spider_id, rt.claimed_at))
    metrics.record(TaskStarted(rt.task.id, rt.claimed_at, time.time()))
    metrics.record(TaskFinished(rt.task.id, TaskResult(status="SUCCESS", duration_ms=1)))
    body, _ = metrics.render(LiveFigures(phases={"running": 1}))
    text = body.decode()
    for secret in ("tok-123456", "hunter22", "task-0f3a9", "spider-77c1", "shop-crawler"):
        assert secret not in text, secret


# ------------------------------------------------------------------------------------------ the loop's share


async def test_a_sliced_render_is_the_same_exposition() -> None:
    """render_sliced (on the loop, family by family) gives the bytes render gives, in both formats."""
    metrics = AgentMetrics("1.2.3", "node-a")
    rt = running_task()
    metrics.record(TaskAdmitted(rt.task.id, rt.task.spider_id, rt.claimed_at))
    metrics.record(TaskFinished(rt.task.id, TaskResult(status="FAILED", error_code="EXIT_NONZERO", duration_ms=5000)))
    for endpoint in ("heartbeat", "logs", "items", "pending", "claim", "result"):
        metrics.master_request(endpoint, "200", 0.02)
    live = LiveFigures(state="RUNNING", registered=True, phases={"running": 1})
    for accept in ("", "application/openmetrics-text; version=1.0.0"):
        with trio.fail_after(10):
            sliced, sliced_type = await metrics.render_sliced(live, accept)
        whole, whole_type = metrics.render(live, accept)
        assert sliced_type == whole_type
        # The process collector's CPU and memory figures move between the two renders: compare the rest.
        keep = [line for line in whole.splitlines() if not line.startswith(b"process_")]
        assert [line for line in sliced.splitlines() if not line.startswith(b"process_")] == keep
        assert sliced.count(b"# EOF") == whole.count(b"# EOF") == (1 if accept else 0)


async def test_counting_the_outbox_lets_the_loop_run(tmp_path: Path) -> None:
    """SpoolCounter.refresh counts on the loop in slices: other tasks run while it counts a big
    spool, and the figures are the same as the blocking read's."""
    store = _store(tmp_path)
    t1 = _task_dir(tmp_path, "t1")
    store.add_task("t1", "s1", TASK_JSON, t1)
    (t1 / "output.log").write_bytes(b"".join(b"line %d of a long log\n" % i for i in range(200_000)))
    (t1 / "items.jsonl").write_bytes(b"".join(b'{"n": %d}\n' % i for i in range(100_000)))
    counter = SpoolCounter(store, started_at=0.0)
    ticks = 0
    done = False

    async def other_task() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await trio.lowlevel.checkpoint()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_task)
            await trio.lowlevel.checkpoint()
            before = ticks
            figures = await counter.refresh([("t1", t1, 1.0, False, 1_000, 10)])
            during = ticks - before
            done = True
    assert (figures.log_lines, figures.items, figures.tasks) == (199_000, 99_990, 1)
    assert during >= 3, "the count held the loop for the whole spool"
    again = SpoolCounter(store, started_at=0.0).read()
    assert (again.log_lines, again.items, again.results, again.tasks) == (200_000, 100_000, 0, 1)
    assert [(b.task_id, b.log_lines, b.items) for b in again.backlog] == [("t1", 200_000, 100_000)]
    assert again.bytes == sum(f.stat().st_size for f in (t1 / "output.log", t1 / "items.jsonl"))  # all unsent
    store.close()


async def test_outbox_figures_of_a_resumed_delivery_start_from_its_stored_positions(tmp_path: Path) -> None:
    """Outbox.figures counts from the deliveries in memory: a task an earlier run left unsent counts
    what its stored positions do not cover from the first look (not everything, nor as shipped now)."""

    store = _store(tmp_path)
    t1 = _task_dir(tmp_path, "t1")
    store.add_task("t1", "s1", TASK_JSON, t1)
    (t1 / "output.log").write_bytes(b"".join(b"line %d\n" % i for i in range(5)))
    (t1 / "items.jsonl").write_bytes(b'{"n": 0}\n{"n": 1}\n{"n": 2}\n')
    store.save_stream_position("t1", "log", 2, {"j": 0, "p": {}})
    store.save_stream_position("t1", "items", 1, {"offset": 9})
    store.set_result("t1", TaskResult(status="SUCCESS").to_json())
    fake = BatchMaster()
    fake.fault = lambda kind, seq, batch: httpx.Response(503, json={"error": "away"})  # nothing is acknowledged
    outbox = Outbox(master_client(fake), AsyncStateStore(store), tmp_path)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            (record,) = store.pending_delivery()
            await outbox.resume(record)
            figures = await outbox.figures()
            nursery.cancel_scope.cancel()
    assert (figures.log_lines, figures.items, figures.results, figures.tasks) == (3, 2, 1, 1)
    assert outbox.shipped() == (0, 0)
    store.close()
