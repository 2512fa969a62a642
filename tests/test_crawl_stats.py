"""The stats side channel in pieces: the SDK's writer, the agent's reader, Scrapy's summary, the dev
master's latest + bounded history.

The stall watchdog's logic is in tests/test_task_stop.py. The end-to-end checks (a spider's stats at the master, durability, STALLED) are in
tests/test_crawl_stats_e2e.py.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from ckagent.delivery.crawlstats import MAX_SNAPSHOT_BYTES, read_last_snapshot, summary
from ckagent.delivery.spool import SpoolFileError
from ckagent.delivery.stats import StatsShipper, final_stats
from ckagent.devmaster import stats as master_stats
from ckagent.devmaster.client import zip_files
from ckagent.devmaster.errors import ConflictError, NotFoundError
from ckagent.devmaster.packages import read_package
from ckagent.devmaster.store import Store
from ckagent.master.client import MasterClient
from ckagent.master.protocol import RegisterRequest, TaskResult, TaskStats
from ckagent.port.crawlmetrics import MAX_SPIDERS, CrawlMetrics, status_class

REPO = Path(__file__).resolve().parents[1]
SDK_SRC = REPO / "sdk" / "python" / "src"


def run_sdk(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter with the SDK importable (never imported into the test process).
    No ``CK_*`` or ``PYTHON*`` variable of the caller's reaches it: it behaves the same whoever runs the
    suite (with ``PYTHONUNBUFFERED`` from the caller's environment, a print before ``os._exit``
    reached the pipe there and was lost elsewhere)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("CK_", "PYTHON"))}
    full.update(env, PYTHONPATH=str(SDK_SRC))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True,
                          text=True, timeout=60, check=False)


# ---------------------------------------------------------------------------------------------- SDK


def test_report_stats_and_progress_write_complete_snapshots(tmp_path: Path) -> None:
    stats_file = tmp_path / "stats.jsonl"
    done = run_sdk("""
        from crawlerkeeper_sdk import report_stats, progress
        report_stats({"items": 1, "requests": 2})          # written at once (first)
        progress(3, 10)                                     # coalesced (within MIN_INTERVAL) ...
        report_stats({"items": 5, "requests": 7, "title": "商品"})  # ... with this one: written at exit
    """, CK_STATS_FILE=str(stats_file))
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in stats_file.read_text(encoding="utf-8").splitlines()]
    assert [line["stats"] for line in lines] == [{"items": 1, "requests": 2},
                                                 {"items": 5, "requests": 7, "title": "商品"}]
    assert "progress" not in lines[0] and lines[1]["progress"] == {"done": 3, "total": 10}
    assert all(isinstance(line["time"], float) for line in lines)


def test_report_stats_final_writes_at_once_and_a_timer_flushes_a_pending_one(tmp_path: Path) -> None:
    stats_file = tmp_path / "stats.jsonl"
    done = run_sdk("""
        import os, time
        from crawlerkeeper_sdk import report_stats
        report_stats({"n": 1})
        report_stats({"n": 2})                 # pending: the timer writes it after MIN_INTERVAL
        time.sleep(1.5)
        print(len(open(os.environ["CK_STATS_FILE"]).readlines()), flush=True)
        report_stats({"n": 3}, final=True)     # at once
        print(len(open(os.environ["CK_STATS_FILE"]).readlines()), flush=True)  # (os._exit flushes nothing)
        os._exit(0)                            # no atexit: nothing pending may be lost anyway
    """, CK_STATS_FILE=str(stats_file))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "3"]
    assert [json.loads(line)["stats"]["n"] for line in stats_file.read_text().splitlines()] == [1, 2, 3]


def test_outside_an_agent_stats_are_ignored_and_bad_input_is_named() -> None:
    done = run_sdk("""
        from crawlerkeeper_sdk import report_stats, progress
        report_stats({"items": 1})
        progress(1)
        for bad in (lambda: report_stats([1]), lambda: progress("x"), lambda: progress(-1)):
            try:
                bad()
            except (TypeError, ValueError) as exc:
                print(type(exc).__name__, exc)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "TypeError report_stats() takes a mapping of name -> value, got list",
        "TypeError progress(): done must be a number, got str",
        "ValueError progress(): done must be >= 0, got -1",
    ]


def test_scrapy_summary_has_the_well_known_keys() -> None:
    done = run_sdk("""
        import datetime, json
        from crawlerkeeper_sdk.scrapy import scrapy_summary
        stats = {"downloader/request_count": 7, "downloader/response_count": 6,
                 "downloader/response_status_count/200": 5, "downloader/response_status_count/404": 1,
                 "downloader/response_bytes": 12345, "item_scraped_count": 30, "item_dropped_count": 2,
                 "retry/count": 1, "log_count/ERROR": 3, "finish_reason": "closespider_itemcount",
                 "start_time": datetime.datetime(2026, 12, 1, tzinfo=datetime.timezone.utc)}
        print(json.dumps(scrapy_summary(stats)))
    """)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert {k: v for k, v in got.items() if k != "scrapy"} == {
        "requests": 7, "responses": 6, "responsesByStatus": {"200": 5, "404": 1}, "bytes": 12345,
        "items": 30, "itemsDropped": 2, "retries": 1, "errors": 3, "finishReason": "closespider_itemcount"}
    assert got["scrapy"]["start_time"] == "2026-12-01T00:00:00+00:00"


def test_scrapy_settings_wrapper_loads_the_project_and_adds_the_extension(tmp_path: Path) -> None:
    project = tmp_path / "proj"
    (project / "shop").mkdir(parents=True)
    (project / "scrapy.cfg").write_text("[settings]\ndefault = shop.settings\n")
    (project / "shop" / "__init__.py").write_text("")
    (project / "shop" / "settings.py").write_text(
        'BOT_NAME = "shop"\nEXTENSIONS = {"shop.ext.Mine": 10}\nlowercase = 1\n')
    fake_scrapy = tmp_path / "fake" / "scrapy" / "utils"
    fake_scrapy.mkdir(parents=True)
    (tmp_path / "fake" / "scrapy" / "__init__.py").write_text("")
    (fake_scrapy / "__init__.py").write_text("")
    # Scrapy's own two helpers, as scrapy/utils/conf.py has them (Scrapy is not installed here).
    (fake_scrapy / "conf.py").write_text(textwrap.dedent("""
        import os
        from configparser import ConfigParser
        from pathlib import Path
        def closest_scrapy_cfg(path="."):
            path = Path(path).resolve()
            while True:
                if (path / "scrapy.cfg").exists():
                    return str(path / "scrapy.cfg")
                if path.parent == path:
                    return ""
                path = path.parent
        def get_config():
            cfg = ConfigParser()
            cfg.read([closest_scrapy_cfg()])
            return cfg
    """))
    code = """
        import json, crawlerkeeper_sdk.scrapy_settings as s
        print(json.dumps({"bot": s.BOT_NAME, "ext": s.EXTENSIONS, "lower": hasattr(s, "lowercase")}))
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("CK_")}
    env["PYTHONPATH"] = f"{SDK_SRC}:{tmp_path / 'fake'}"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=project, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "bot": "shop", "lower": False,
        "ext": {"shop.ext.Mine": 10, "crawlerkeeper_sdk.scrapy.CrawlerKeeperStats": 900}}


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_node_helper_writes_the_same_snapshots(tmp_path: Path) -> None:
    stats_file, items_file = tmp_path / "stats.jsonl", tmp_path / "items.jsonl"
    script = textwrap.dedent(f"""
        const ck = require({json.dumps(str(REPO / "sdk" / "node" / "crawlerkeeper-sdk.cjs"))});
        ck.saveItem({{title: "商品 01"}});
        ck.reportStats({{items: 1, requests: 2}});
        ck.progress(3, 10);
        ck.reportStats({{items: 5, requests: 7, finishReason: "done"}});  // coalesced: written at exit
        try {{ ck.reportStats([1]); }} catch (err) {{ console.log(err.name); }}
        console.log(JSON.stringify(ck.taskContext().params));
    """)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CK_")},
           "CK_STATS_FILE": str(stats_file), "CK_ITEMS_FILE": str(items_file), "CK_PARAMS": '{"a": 1}'}
    done = subprocess.run(["node", "-e", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["TypeError", '{"a":1}']
    assert [json.loads(line) for line in items_file.read_text(encoding="utf-8").splitlines()] == [{"title": "商品 01"}]
    snap = read_last_snapshot(stats_file)
    assert snap is not None and snap.stats == {"items": 5, "requests": 7, "finishReason": "done"}
    assert snap.finish_reason == "done" and snap.data["progress"] == {"done": 3, "total": 10}
    assert len(stats_file.read_text().splitlines()) == 2


# ---------------------------------------------------------------------------------------------- reader


def test_the_newest_complete_line_wins(tmp_path: Path) -> None:
    path = tmp_path / "stats.jsonl"
    assert read_last_snapshot(path) is None
    path.write_bytes(b'{"stats": {"items": 1}}\n{"stats": {"items": 2}}\n{"stats": {"ite')  # a line being written
    snap = read_last_snapshot(path)
    assert snap is not None and snap.stats == {"items": 2}
    assert snap.seq == len(b'{"stats": {"items": 1}}\n{"stats": {"items": 2}}\n')
    assert read_last_snapshot(path, after=snap.seq) is None  # nothing newer
    with path.open("ab") as fh:
        fh.write(b'ms": 3}, "progress": {"done": 1}}\nnot json\n')
    newer = read_last_snapshot(path, after=snap.seq)
    assert newer is not None and newer.stats == {"items": 3} and newer.seq > snap.seq  # garbage skipped
    assert summary(newer.stats) == {"items": 3, "requests": 0, "responses": 0, "errors": 0}
    with path.open("ab") as fh:
        fh.write(b'{"stats": {"x": "' + b"y" * MAX_SNAPSHOT_BYTES + b'"}}\n')
    assert read_last_snapshot(path, after=newer.seq) is None  # too long: ignored, not half-read


def test_a_hostile_stats_file_is_not_followed_or_waited_on(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text('{"stats": {"password": "hunter2"}}\n')
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    (task_dir / "stats.jsonl").symlink_to(secret)
    with pytest.raises(SpoolFileError):
        read_last_snapshot(task_dir / "stats.jsonl")
    assert final_stats(task_dir) is None  # logged, not raised, not followed
    (task_dir / "stats.jsonl").unlink()
    os.mkfifo(task_dir / "stats.jsonl")  # a FIFO without a writer: opening it must not block
    assert final_stats(task_dir) is None


# ---------------------------------------------------------------------------------------------- metrics


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples if s.name.startswith("ckagent_crawl")}


def test_crawl_metrics_count_deltas_per_spider_with_a_label_cap() -> None:
    registry = CollectorRegistry()
    crawl = CrawlMetrics(registry)
    crawl.observe("t1", "shop", {"items": 5, "requests": 8, "responsesByStatus": {"200": 6, "404": 1, "x": 1}}, False)
    crawl.observe("t1", "shop", {"items": 9, "requests": 12, "responsesByStatus": {"200": 9, "404": 1, "503": 2}},
                  False)
    crawl.observe("t1", "shop", {"items": 10, "requests": 12, "errors": 2,
                                 "responsesByStatus": {"200": 9, "404": 1, "503": 2}}, True)
    crawl.observe("t2", "shop", {"items": 1}, True)  # another task of the same spider adds up
    got = _samples(registry)
    assert got[("ckagent_crawl_items_total", (("spider", "shop"),))] == 11
    assert got[("ckagent_crawl_requests_total", (("spider", "shop"),))] == 12
    assert got[("ckagent_crawl_errors_total", (("spider", "shop"),))] == 2
    responses = {dict(k[1])["status_class"]: v for k, v in got.items() if k[0] == "ckagent_crawl_responses_total"}
    assert responses == {"2xx": 9, "4xx": 1, "5xx": 2, "other": 1}
    for i in range(MAX_SPIDERS + 10):
        crawl.observe(f"s{i}", f"spider-{i}", {"items": 1}, True)
    spiders = {dict(k[1])["spider"] for k in _samples(registry) if k[0] == "ckagent_crawl_items_total"}
    assert len(spiders) == MAX_SPIDERS + 1 and "other" in spiders  # "shop" + 49 + "other"
    assert _samples(registry)[("ckagent_crawl_items_total", (("spider", "other"),))] == 11
    assert status_class("200") == "2xx" and status_class("999") == "other" and status_class("20") == "other"


# ---------------------------------------------------------------------------------------------- master


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store(tmp_path / "master.db")
    yield s
    s.close()


def _claimed_task(store: Any) -> tuple[str, str]:
    node_id, _ = store.register_node(RegisterRequest(name="n1", ip="", port=1, version="", os="", arch="",
                                                     python="", cpu_count=1, memory_total_bytes=1, max_workers=1))
    spider_id = store.create_spider(name="s", framework="python", command=None, timeout_seconds=None,
                                    code_mode="package", env={})
    data = zip_files({"main.py": "print(1)\n"})
    store.store_package(spider_id, read_package(data), data)
    task_id = store.create_task(spider_id, args=[], env={}, params={}, timeout_seconds=None)
    store.report_result(task_id, node_id, TaskResult(status="RUNNING"))
    return task_id, node_id


def test_master_keeps_the_newest_and_a_bounded_history(store: Any) -> None:
    task_id, node_id = _claimed_task(store)
    for seq in range(1, 300):
        assert store.save_stats(task_id, node_id, TaskStats(seq=seq * 10, stats={"items": seq}))
    assert not store.save_stats(task_id, node_id, TaskStats(seq=50, stats={"items": -1}))  # late and old
    got = store.task_stats(task_id)
    assert got["latest"]["stats"] == {"items": 299} and not got["final"]
    history = [h["seq"] for h in got["history"]]
    assert len(history) < master_stats.HISTORY_LIMIT and history[0] == 10 and history == sorted(history)
    assert history[-1] == 2990 and len(history) > master_stats.HISTORY_LIMIT // 2  # the whole crawl, thinned
    gaps = [b - a for a, b in itertools.pairwise(history)]
    assert gaps == sorted(gaps, reverse=True)  # denser towards the newest
    final = TaskStats(seq=3000, stats={"items": 300, "finishReason": "finished"})
    store.report_result(task_id, node_id, TaskResult(status="SUCCESS", exit_code=0, stats=final,
                                                     finish_reason="finished"))
    assert not store.save_stats(task_id, node_id, TaskStats(seq=4000, stats={"items": 1}))  # after the final
    got = store.task_stats(task_id)
    assert got["final"] and got["latest"] == final.to_json()
    task = store.get_task(task_id)
    assert task["stats"] == final.to_json() and task["finishReason"] == "finished"


def test_master_stats_of_another_node_or_unknown_task_are_refused(store: Any) -> None:
    task_id, _ = _claimed_task(store)
    with pytest.raises(ConflictError):
        store.save_stats(task_id, "someone-else", TaskStats(seq=1, stats={}))
    with pytest.raises(NotFoundError):
        store.save_stats("nope", "n1", TaskStats(seq=1, stats={}))


# ---------------------------------------------------------------------------------------------- shipper


def _fake_master(answers: list[int], posted: list[tuple[float, dict[str, Any]]]) -> MasterClient:
    """A MasterClient on httpx.MockTransport: registration succeeds; each stats POST gets the next status."""
    def register_body() -> RegisterRequest:
        return RegisterRequest(name="n", ip="127.0.0.1", port=1, version="0", os="linux", arch="x86_64",
                               python="3", cpu_count=1, memory_total_bytes=1, max_workers=1)

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/register"):
            return httpx.Response(200, json={"nodeId": "n1", "apiKey": "k"})
        posted.append((trio.current_time(), json.loads(request.content)))
        status = answers.pop(0) if answers else 200
        return httpx.Response(status, json={"ok": True} if status == 200 else {"error": "no"})

    return MasterClient("http://master.test", "token", register_body, transport=httpx.MockTransport(handler))


async def test_stats_shipper_sends_only_the_newest_at_most_every_interval(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    posted: list[tuple[float, dict[str, Any]]] = []
    master = _fake_master([503], posted)  # the first post finds the master down
    shipper = StatsShipper(master, "t1", tmp_path, interval=5.0)
    ended = trio.Event()
    path = tmp_path / "stats.jsonl"
    start = trio.current_time()

    async def spider() -> None:
        for n in range(1, 41):  # a snapshot every 0.5 s for 20 s
            with path.open("a") as fh:
                fh.write(json.dumps({"time": 1764547200 + n, "stats": {"items": n}}) + "\n")
            shipper.notify()  # what the outbox's scan does when the file's size changed
            await trio.sleep(0.5)
        await trio.sleep(10)
        ended.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(spider)
        nursery.start_soon(shipper.run, ended)
    times = [t - start for t, _ in posted]
    items = [body["stats"]["items"] for _, body in posted]
    assert all(b - a >= 5.0 for a, b in itertools.pairwise(times)), times  # rate-limited
    assert items == sorted(items) and items[-1] == 40 and len(items) <= 6, items  # newest only; the last one too
    assert posted[0][1]["at"] == "2025-12-01T00:00:01.000Z" and posted[1][1]["seq"] > posted[0][1]["seq"]
    assert shipper.sent == len(posted) - 1  # the 503 was not counted, the next newest went later
    assert shipper.latest is not None and shipper.latest.stats == {"items": 40}


async def test_stats_shipper_stops_live_stats_on_404(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    posted: list[tuple[float, dict[str, Any]]] = []
    master = _fake_master([404], posted)  # a master without the endpoint
    shipper = StatsShipper(master, "t1", tmp_path, interval=1.0)
    ended = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shipper.run, ended)
        for n in range(10):
            with (tmp_path / "stats.jsonl").open("a") as fh:
                fh.write(json.dumps({"stats": {"n": n}}) + "\n")
            shipper.notify()
            await trio.sleep(2)
        ended.set()
    assert len(posted) == 1 and shipper.refused
    assert shipper.latest is not None and shipper.latest.stats == {"n": 9}  # still read for the page and metrics


async def test_stats_shipper_of_a_silent_task_never_wakes(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """Issue 18: a task that writes nothing costs no timed look; a notification (the outbox's scan
    saw the file grow) is what wakes the shipper, and the newest snapshot then goes at once."""
    posted: list[tuple[float, dict[str, Any]]] = []
    master = _fake_master([], posted)
    shipper = StatsShipper(master, "t1", tmp_path, interval=5.0)
    ended = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shipper.run, ended)
        await trio.sleep(600)  # ten silent minutes
        assert shipper.looks == 1 and not posted  # the first look only
        with (tmp_path / "stats.jsonl").open("a") as fh:
            fh.write(json.dumps({"stats": {"n": 1}}) + "\n")
        await trio.sleep(300)  # written, but nobody said so: the shipper does not look by itself
        assert shipper.looks == 1 and not posted
        shipper.notify()
        await trio.sleep(0.1)
        assert shipper.looks == 2 and [body["stats"] for _, body in posted] == [{"n": 1}]
        ended.set()
