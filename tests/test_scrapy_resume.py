"""A real Scrapy crawl checkpoints at the agent's request and resumes after a kill -9, with no change to
the project (issue 38; crawlerkeeper_sdk._scrapy_state, the hook's ``state`` mode).

The crawl runs under a fake agent (harness.scrapyresume: the ``CK_*`` files of one attempt) against a
paginated site on 127.0.0.1 whose pages answer slowly enough that about 16 requests are in flight at
the checkpoint (downloading, or downloaded and not yet fully processed). The test asks for a
checkpoint, lets the crawl go on, kills it with SIGKILL, makes the snapshot the next attempt's
``CK_STATE_DIR`` (what restore does) and runs the crawl again. What the
master would hold — the first attempt's items up to the ack's ``itemsOffset``, then the second
attempt's — has every page's item exactly once; the pages fetched twice are at most those fetched
after the checkpoint plus those in flight at it (one interval's worth).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import eventually
from harness.scrapyresume import FakeAgent, PagedSite, scrapy_python, write_pages_project
from harness.webclients import ClientUnavailable, clients_dir

pytestmark = pytest.mark.slow

PAGES = 300
"""Pages of the site (each an item)."""
CONCURRENCY = 16
TIMEOUT = 180.0

FIFO = ["-s", "DEPTH_PRIORITY=1", "-s", "SCHEDULER_DISK_QUEUE=scrapy.squeues.PickleFifoDiskQueue",
        "-s", "SCHEDULER_MEMORY_QUEUE=scrapy.squeues.FifoMemoryQueue",
        "-s", "SCHEDULER_PRIORITY_QUEUE=scrapy.pqueues.ScrapyPriorityQueue"]


@pytest.fixture(scope="module")
def scrapy_pythons(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The interpreters of the Scrapy releases the tests run on (built once per session)."""
    base = clients_dir(tmp_path_factory)
    found = {}
    for release in ("2.19", "2.11"):
        try:
            found[release] = scrapy_python(base, release)
        except ClientUnavailable as exc:
            pytest.skip(f"NOT TESTED: Scrapy {release} cannot be installed here: {exc}")
    return found


async def _crawl(python: Path, project: Path, agent: FakeAgent, site: PagedSite, args: list[str]) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CK_", "PYTHON"))}
    env.update(agent.env(), START_URL=site.url)
    with (agent.task_dir / "output.log").open("wb") as log:
        return await trio.lowlevel.open_process(
            [str(python), "-m", "scrapy", "crawl", "pages", "-s", f"CONCURRENT_REQUESTS={CONCURRENCY}", *args],
            cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)


async def _checkpoint_kill_resume(python: Path, tmp_path: Path, args: list[str], *, own_jobdir: bool = False,
                                  event: str = "persistState") -> tuple[FakeAgent, FakeAgent, dict[str, Any]]:
    project = write_pages_project(tmp_path / "project")
    with PagedSite(PAGES, delay=0.25) as site:
        first = FakeAgent(tmp_path / "attempt1")
        crawl = await _crawl(python, project, first, site, args)
        try:
            await eventually(lambda: _count(first, PAGES // 4), TIMEOUT, "a quarter of the items")
            fetched_before = site.fetched()  # (the checkpoint comes after: its interval starts before it)
            number = first.request(event, **({"secondsLeft": 18.5} if event == "migrating" else {}))

            async def acked() -> Any:
                return first.ack(number)

            ack = await eventually(acked, 20, "the ack", interval=0.02)
            assert "error" not in ack, ack
            more = len(first.items_list()) + 30
            await eventually(lambda: _count(first, more), TIMEOUT, "30 items more")
        finally:
            crawl.send_signal(signal.SIGKILL)
            with trio.CancelScope(shield=True), trio.fail_after(30):
                await crawl.wait()
        fetched_in_interval = site.fetched() - fetched_before
        if own_jobdir:  # a new node: the project's working copy has no JOBDIR of its own
            project = write_pages_project(tmp_path / "project-b")
        second = FakeAgent(tmp_path / "attempt2", attempt=2)
        second.resume_from(first, ack["snapshot"])
        crawl = await _crawl(python, project, second, site, args)
        with trio.fail_after(TIMEOUT):
            assert await crawl.wait() == 0, (second.task_dir / "output.log").read_text()[-5000:]
        twice = sum(1 for hits in site.hits.values() if hits > 1)
    items = first.items_list(ack["itemsOffset"]) + second.items_list()
    counts = Counter(item["url"] for item in items)
    assert sorted(counts) == sorted(f"{site.url}/p/{n}" for n in range(PAGES)), "a page without its item"
    assert [url for url, n in counts.items() if n > 1] == [], "items twice"
    said = [line for line in (first.task_dir / "output.log").read_text().splitlines()
            if f"crawlerkeeper: checkpoint {ack['id']}:" in line]
    # In flight: downloading (CONCURRENT_REQUESTS at most) or downloaded and not yet fully processed.
    in_flight = int(said[0].split(" pending, ", 1)[1].split(" in flight", 1)[0])
    assert in_flight >= CONCURRENCY // 2, said  # (16 but between a response's end and the engine's next call)
    assert twice <= fetched_in_interval + in_flight, (twice, fetched_in_interval, in_flight)
    log = (second.task_dir / "output.log").read_text()
    assert "crawlerkeeper: resuming from the checkpoint" in log, log[-3000:]
    closed = [line for line in log.splitlines() if line.startswith("pages spider closed:")]
    resumed = int(closed[-1].rsplit("resumed=", 1)[1])
    assert resumed > 0, closed  # spider.state came back
    return first, second, ack


async def _count(agent: FakeAgent, n: int) -> bool:
    return len(agent.items_list()) >= n


async def test_a_killed_crawl_resumes_from_its_checkpoint_each_item_once(
        scrapy_pythons: dict[str, Path], tmp_path: Path) -> None:
    """Default JOBDIR ($CK_STATE_DIR/jobdir), Scrapy's default queues (LIFO, downloader-aware), ~16 in flight."""
    first, _second, ack = await _checkpoint_kill_resume(scrapy_pythons["2.19"], tmp_path, [])
    snapshot = first.snapshots / ack["snapshot"]
    assert (snapshot / "jobdir" / "spider.state").is_file()
    # requests.seen (append-only) is copied after the reactor step up to its size at the step: a prefix.
    seen = (snapshot / "jobdir" / "requests.seen").read_bytes()
    assert seen and (first.state / "jobdir" / "requests.seen").read_bytes().startswith(seen)
    assert json.loads((snapshot / "jobdir" / "requests.queue" / "active.json").read_text())
    assert isinstance(ack["pauseMs"], float) and ack["itemsOffset"] > 0


async def test_fifo_queues_and_depth_priority_resume_after_a_migrating_request(
        scrapy_pythons: dict[str, Path], tmp_path: Path) -> None:
    first, _second, _ack = await _checkpoint_kill_resume(scrapy_pythons["2.19"], tmp_path, FIFO, event="migrating")
    assert "crawlerkeeper: migrating, 18.5 s left" in (first.task_dir / "output.log").read_text()


async def test_the_projects_own_jobdir_is_kept_and_put_back(scrapy_pythons: dict[str, Path], tmp_path: Path) -> None:
    first, second, ack = await _checkpoint_kill_resume(
        scrapy_pythons["2.19"], tmp_path, ["-s", "JOBDIR=crawls/pages-1"], own_jobdir=True)
    assert (first.snapshots / ack["snapshot"] / "jobdir" / "requests.seen").is_file()
    assert not (first.state / "jobdir").exists()  # the project's JOBDIR was used, not the default
    assert "put back from the checkpoint" in (second.task_dir / "output.log").read_text()
    assert not (second.state / "jobdir").exists()  # (not copied twice into the next snapshots)


async def test_scrapy_2_11_resumes_too(scrapy_pythons: dict[str, Path], tmp_path: Path) -> None:
    await _checkpoint_kill_resume(scrapy_pythons["2.11"], tmp_path, [])


async def test_requests_seen_together_unknown_events_and_a_crawl_without_jobdir(
        scrapy_pythons: dict[str, Path], tmp_path: Path) -> None:
    """Three requests at once: an unknown event is answered as one, the older persist is superseded by the
    newest; a project that turns JOBDIR off cannot be checkpointed, and says so in the ack and the log."""
    project = write_pages_project(tmp_path / "project")
    with PagedSite(PAGES, delay=0.25) as site:
        agent = FakeAgent(tmp_path / "attempt1")
        crawl = await _crawl(scrapy_pythons["2.19"], project, agent, site, ["-s", "JOBDIR="])
        try:
            await eventually(lambda: _count(agent, 5), TIMEOUT, "five items")
            agent.control.write_text("".join(json.dumps(r) + "\n" for r in (
                {"event": "bogus", "id": 1}, {"event": "persistState", "id": 2, "reason": "interval"},
                {"event": "persistState", "id": 3, "reason": "interval"})))

            async def acked() -> Any:
                return agent.ack(3)

            await eventually(acked, 20, "the ack of 3", interval=0.02)
        finally:
            crawl.send_signal(signal.SIGKILL)
            with trio.CancelScope(shield=True), trio.fail_after(30):
                await crawl.wait()
    assert agent.ack(1) == {"id": 1, "error": "unknown event 'bogus'"}
    assert agent.ack(2) == {"id": 2, "error": "superseded by request 3"}
    assert "JOBDIR off" in agent.ack(3)["error"]  # type: ignore[index]
    assert not (agent.snapshots / "3").exists()
    log = (agent.task_dir / "output.log").read_text()
    assert "the project turned JOBDIR off" in log and "checkpoint 3 failed" in log, log[-3000:]


_QUEUES = r"""
import json, pickle, sys
from pathlib import Path
from scrapy import Request, Spider
from scrapy.core.scheduler import Scheduler
from scrapy.utils.test import get_crawler
from crawlerkeeper_sdk._control import copy_tree
from crawlerkeeper_sdk._scrapy_jobdir import jobdir_view, write_patches

mode, base, disk_queue = sys.argv[1], Path(sys.argv[2]), sys.argv[3]


class Shop(Spider):
    name = "shop"


def scheduler(jobdir):
    crawler = get_crawler(Shop, {"JOBDIR": str(jobdir), "SCHEDULER_DISK_QUEUE": disk_queue, "LOG_ENABLED": False,
                                 "SCHEDULER_PRIORITY_QUEUE": "scrapy.pqueues.ScrapyPriorityQueue"})
    spider = Shop.from_crawler(crawler)
    crawler.spider = spider
    opened = Scheduler.from_crawler(crawler)
    opened.open(spider)
    return opened, spider


def drain(opened):
    urls = []
    while (request := opened.next_request()) is not None:
        urls.append(request.url)
    return urls


if mode == "live":
    live, spider = scheduler(base / "live")
    spider.state = {"pages": 7}
    for i in range(300):
        live.enqueue_request(Request(f"http://shop.test/{i}", priority=i % 3))
    popped = [live.next_request().url for _ in range(120)]
    view = jobdir_view(live, spider, str(base / "live"))
    copy_tree(str(base / "live"), str(base / "copy"))
    write_patches(view, base / "copy")
    rest = drain(live)  # the live queues go on after the snapshot
    live.enqueue_request(Request("http://shop.test/late"))
    late = drain(live)
    live.close("finished")
    print(json.dumps({"popped": popped, "rest": rest, "late": late, "seen": view.seen, "pending": view.pending}))
else:
    copied, spider = scheduler(base / "copy")
    state = pickle.loads((base / "copy" / "spider.state").read_bytes())
    print(json.dumps({"rest": drain(copied), "state": state,
                      "filtered": not copied.enqueue_request(Request("http://shop.test/5"))}))
"""


@pytest.mark.parametrize("release", ["2.19", "2.11"])
@pytest.mark.parametrize("disk_queue", ["PickleLifoDiskQueue", "PickleFifoDiskQueue", "MarshalFifoDiskQueue",
                                        "PickleFifoSQLiteQueue"])
def test_a_copy_of_a_running_jobdir_resumes_what_was_left_and_the_live_queues_go_on(
        scrapy_pythons: dict[str, Path], tmp_path: Path, release: str, disk_queue: str) -> None:
    """The close-time files written into a copy (active.json, info.json, a LIFO header, spider.state) make it a
    JOBDIR Scrapy resumes: exactly the requests left, in the order the live crawl pops them; the dupefilter's
    fingerprints; spider.state. The live scheduler, never closed meanwhile, goes on as if nothing happened."""
    if release == "2.11" and "SQLite" in disk_queue:
        pytest.skip("Scrapy 2.11 has no SQLite disk queues")

    def run(mode: str) -> dict[str, Any]:
        done = subprocess.run([str(scrapy_pythons[release]), "-c", _QUEUES, mode, str(tmp_path),
                               f"scrapy.squeues.{disk_queue}"], capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]

    live = run("live")
    assert (live["seen"], live["pending"], len(live["popped"])) == (300, 180, 120)
    assert live["late"] == ["http://shop.test/late"]
    copy = run("copy")
    assert copy["rest"] == live["rest"] and len(copy["rest"]) == 180
    assert copy["state"] == {"pages": 7} and copy["filtered"]


_PROXIES = r"""
import json
from scrapy import Request, Spider
from scrapy.downloadermiddlewares.httpproxy import HttpProxyMiddleware
from scrapy.utils.test import get_crawler
from crawlerkeeper_sdk._scrapy_proxy import CrawlerKeeperProxyReset


class Shop(Spider):
    name = "shop"


crawler = get_crawler(Shop)
proxy, reset = HttpProxyMiddleware.from_crawler(crawler), CrawlerKeeperProxyReset()
# Node A's proxy, written into the request by HttpProxyMiddleware there (in flight, retried, redirected).
moved = Request("http://shop.test/1", meta={"proxy": "http://127.0.0.1:1", "_scheme_proxy": True,
                                            "_auth_proxy": "http://127.0.0.1:1"},
                headers={"Proxy-Authorization": "Basic b2xkOm9sZA=="})
own = Request("http://shop.test/2", meta={"proxy": "http://own.proxy.test:3128"})  # the spider's own
spider = Shop.from_crawler(crawler)
for request in (moved, own):
    reset.process_request(request, spider)
    proxy.process_request(request, spider)
print(json.dumps([[r.meta.get("proxy"), (r.headers.get("Proxy-Authorization") or b"").decode()] for r in (moved, own)]))
"""


@pytest.mark.parametrize("release", ["2.19", "2.11"])
def test_a_request_does_not_carry_the_earlier_nodes_proxy(
        scrapy_pythons: dict[str, Path], release: str) -> None:
    """HttpProxyMiddleware wrote node A's per-task proxy into requests that reach node B (in flight at the
    checkpoint, or retried/redirected into the queues); the hook's middleware makes it take node B's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CK_", "PYTHON")) and "proxy" not in k.lower()}
    env["HTTP_PROXY"] = "http://user:secret@127.0.0.1:2"
    done = subprocess.run([str(scrapy_pythons[release]), "-c", _PROXIES], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    moved, own = json.loads(done.stdout.splitlines()[-1])
    assert moved == ["http://127.0.0.1:2", "Basic dXNlcjpzZWNyZXQ="]
    assert own == ["http://own.proxy.test:3128", ""]
