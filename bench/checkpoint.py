"""Checkpoint cost: pack and ship a Scrapy JOBDIR of 100,000 seen requests and 10,000 pending to the
reference master, then 1,000 more of each (the incremental part), then restore it on another "node".

Setup: the dev master as its own process (``python -m ckagent.devmaster``, psutil measures it apart);
this process is the agent's side — a real :class:`~ckagent.master.client.MasterClient` registered as a
node that claimed the task (the master takes checkpoints only from the node running the task's attempt),
a :class:`~ckagent.resume.ship.CheckpointShipper` and :func:`~ckagent.resume.restore.restore`, exactly
what a running agent uses, without a spider process around them.

The JOBDIR is made by **real Scrapy** when the bench venv (``bench/_scrapyd.py``'s, Scrapy 2.19 there)
exists: a ``Scheduler`` with ``JOBDIR`` (``ScrapyPriorityQueue`` — the default
``DownloaderAwarePriorityQueue`` needs a running engine — and the default ``PickleLifoDiskQueue``)
gets 10,000 requests enqueued and 90,000 more marked seen (crawled), then is closed as on a pause
(``requests.queue/0``, ``active.json``; ``requests.seen`` — in Scrapy ≥ 2.13 length-prefixed 20-byte
binary fingerprints, 22 bytes a request, before that 40 hex digits a line). Then a second run opens the
same JOBDIR and adds 1,000 requests (enqueued: seen and pending). Without the venv, a synthetic JOBDIR of
the same shape: 40-hex lines and pickled request dicts of Scrapy's size. The spider's snapshot
(``snapshots/N``) is a copy of the state dir, as the SDK/hook makes it.

Measured, per round (3 rounds, 1 quick; medians): for checkpoint 1 (everything new) and checkpoint 2
(after 1,000 more): the time from the submit to the manifest stored at the master, this process's CPU
(the agent's: pack, gzip, HTTP), the master's CPU, the HTTP bodies both ways (chunks and manifest up,
the answers down; for the restore, the chunks down) and their ratio to the JOBDIR's size; then the restore of checkpoint 2 into an empty state dir: time and CPU,
checked byte for byte. The spider's side — its pause (the reactor held for the persist, the copy, the
ack; target ≤ 50 ms) — is measured once in a running Scrapy crawl of the same size by the Scrapy hook's
own benchmark (bench/_scrapypause.py, :func:`spider_pause`; not with ``--no-scrapyd``); the copy of the
state dir made here is shown beside it.

Targets: a checkpoint shipped within one interval (``task.checkpoint_interval``, 60 s); the spider
paused ≤ 50 ms.

    .venv/bin/python -m bench.checkpoint [--quick]
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio

from bench._harness import DevMaster, markdown_table, module_main, work_directory
from bench._scrapyd import venv_python
from bench._scrapypause import measure_pause, pause_line
from ckagent.devmaster.client import zip_files
from ckagent.master.client import MasterClient
from ckagent.master.protocol import RegisterRequest, TaskResult, utc_now_iso
from ckagent.master.protocol.checkpoints import CheckpointRef
from ckagent.resume.restore import RestoreLimits, restore
from ckagent.resume.ship import CheckpointShipper
from ckagent.resume.snapshot import PackLimits

TARGET_SHIP_S = 60.0
"""One checkpoint interval (task.checkpoint_interval's default)."""
TARGET_PAUSE_MS = 50.0
FULL = (100_000, 10_000, 1_000)
"""Seen requests, pending among them, added for the second checkpoint."""
QUICK = (10_000, 1_000, 100)
MB = 1_000_000

_JOBDIR_SCRIPT = r"""
import sys, time
from scrapy import Request, Spider
from scrapy.core.scheduler import Scheduler
from scrapy.utils.test import get_crawler

jobdir, seen, pending, offset = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

class Shop(Spider):
    name = "shop"

crawler = get_crawler(Shop, {"JOBDIR": jobdir, "LOG_ENABLED": False,
                             "SCHEDULER_PRIORITY_QUEUE": "scrapy.pqueues.ScrapyPriorityQueue"})
spider = Shop()
crawler.spider = spider
scheduler = Scheduler.from_crawler(crawler)
scheduler.open(spider)
for i in range(offset, offset + seen):
    request = Request(f"https://shop.example/products/{i}?ref=list&page={i // 48}",
                      headers={"Referer": f"https://shop.example/list?page={i // 48}"}, meta={"depth": 3})
    if i - offset < pending:
        scheduler.enqueue_request(request)
    else:
        scheduler.df.request_seen(request)
scheduler.close("shutdown")
"""


def _scrapy_python() -> Path | None:
    python = venv_python()
    if not python.exists():
        return None
    done = subprocess.run([str(python), "-c", "import scrapy"], capture_output=True, check=False)
    return python if done.returncode == 0 else None


def make_jobdir(jobdir: Path, seen: int, pending: int, offset: int, scrapy: bool = True) -> str:
    """Add ``seen`` requests (``pending`` of them still queued) to the JOBDIR — with Scrapy when
    ``scrapy`` and the bench venv has it; returns how it was made. Blocking (a subprocess, seconds)."""
    python = _scrapy_python() if scrapy else None
    if python is not None:
        subprocess.run([str(python), "-c", _JOBDIR_SCRIPT, str(jobdir), str(seen), str(pending), str(offset)],
                       check=True, capture_output=True)
        return "Scrapy " + subprocess.run([str(python), "-c", "import scrapy; print(scrapy.__version__)"],
                                          capture_output=True, text=True, check=True).stdout.strip()
    queue = jobdir / "requests.queue"
    queue.mkdir(parents=True, exist_ok=True)
    with open(jobdir / "requests.seen", "a") as fingerprints, open(queue / "0", "ab") as records:
        for i in range(offset, offset + seen):
            fingerprints.write(hashlib.sha1(f"https://shop.example/products/{i}".encode()).hexdigest() + "\n")
            if i - offset < pending:
                record = pickle.dumps({"url": f"https://shop.example/products/{i}?ref=list&page={i // 48}",
                                       "headers": {b"Referer": [f"https://shop.example/list?page={i // 48}".encode()]},
                                       "meta": {"depth": 3}, "method": "GET", "priority": 0, "dont_filter": False,
                                       "callback": None, "errback": None, "flags": [], "cb_kwargs": {}}, 4)
                records.write(record + len(record).to_bytes(4, "big"))
    (queue / "active.json").write_text("[0]")
    return "synthetic (no Scrapy: --no-scrapyd, or none in the bench venv)"


def tree_size(top: Path) -> int:
    return sum(p.stat().st_size for p in top.rglob("*") if p.is_file())


def tree_bytes(top: Path) -> dict[str, bytes]:
    return {p.relative_to(top).as_posix(): p.read_bytes() for p in top.rglob("*") if p.is_file()}


class CountingTransport(httpx.AsyncHTTPTransport):
    """Counts the bodies sent and received (their Content-Length: bytes on the wire above HTTP's headers)."""

    sent = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += int(request.headers.get("content-length") or 0)
        response = await super().handle_async_request(request)
        self.sent += int(response.headers.get("content-length") or 0)
        return response


def cpu_of(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


@contextmanager
def measured(master_pid: int, transport: CountingTransport, into: dict[str, float]) -> Iterator[None]:
    me, master = psutil.Process(), psutil.Process(master_pid)
    cpu, mcpu, sent, began = cpu_of(me), cpu_of(master), transport.sent, time.perf_counter()
    yield
    into.update(seconds=time.perf_counter() - began, cpu=cpu_of(me) - cpu, master_cpu=cpu_of(master) - mcpu,
                sent=transport.sent - sent)


def copy_state(state_dir: Path, snapshot: Path) -> float:
    """The snapshot as the spider makes it (a copy of its state dir), in ms: a part of its pause."""
    began = time.perf_counter()
    shutil.copytree(state_dir, snapshot, symlinks=True)
    return (time.perf_counter() - began) * 1000


def spider_pause(scrapy: bool, directory: Path, seen: int, pending: int) -> dict[str, Any] | None:
    """The spider's pause at a checkpoint, measured in a running Scrapy crawl by the Scrapy hook's own
    benchmark (bench/_scrapypause.py: the reactor held for the persist + the copy + the ack; the "scrapy"
    part of issue 38): its figures, or None without Scrapy. Blocking (seconds)."""
    python = _scrapy_python() if scrapy else None
    if python is None:
        return None
    return measure_pause(python, directory, seen, pending, rounds=3 if seen < FULL[0] else 5)


async def one_round(directory: Path, master: DevMaster, counts: tuple[int, int, int], scrapy: bool) -> dict[str, Any]:
    seen, pending, more = counts
    admin = master.admin
    spider_id = await admin.create_spider(name=f"ckpt-{directory.name}", framework="python", command=["python", "-c", "pass"])
    await admin.upload_package(spider_id, zip_files({"main.py": "pass\n"}))
    task_id = await admin.create_task(spider_id)
    transport = CountingTransport()

    def register() -> RegisterRequest:
        return RegisterRequest(name=f"bench-{directory.name}", ip="127.0.0.1", port=9, version="bench", os="linux",
                               arch="x86_64", python="3", cpu_count=2, memory_total_bytes=1 << 30, max_workers=1)

    client = MasterClient(master.base_url, master.registration_token, register, transport=transport)
    out: dict[str, Any] = {}
    try:
        answer = await client.poll(1)
        assert [t.id for t in answer.tasks] == [task_id], answer
        await client.claim(task_id, TaskResult(status="RUNNING", started_at=utc_now_iso()))
        task_dir = directory / "node-a" / task_id
        state = task_dir / "state"
        made = await trio.to_thread.run_sync(make_jobdir, state / "jobdir", seen, pending, 0, scrapy)
        (task_dir / "snapshots").mkdir(parents=True)
        shipper = CheckpointShipper(client, task_id, task_dir, attempt=1, limits=PackLimits(max_bytes=1 << 34))
        async with trio.open_nursery() as nursery:
            await nursery.start(shipper.run)
            for n, added in ((1, 0), (2, more)):
                if added:
                    await trio.to_thread.run_sync(make_jobdir, state / "jobdir", added, added, seen, scrapy)
                copy_ms = await trio.to_thread.run_sync(copy_state, state, task_dir / "snapshots" / str(n))
                figures: dict[str, float] = {"copy_ms": copy_ms, "size": tree_size(state)}
                with measured(master.process.pid, transport, figures):  # type: ignore[union-attr]
                    await shipper.submit(n, item_seq=0, log_seq=0, reason="interval", created=datetime.now(timezone.utc))
                    with trio.fail_after(600):
                        assert await shipper.wait_idle() == f"1-{n}", shipper.failed
                out[f"ckpt{n}"] = figures
            nursery.cancel_scope.cancel()
        expected = await trio.to_thread.run_sync(tree_bytes, state)
        figures = {}
        ref = CheckpointRef(id="1-2", attempt=1, item_seq=0, log_seq=0)
        with measured(master.process.pid, transport, figures):  # type: ignore[union-attr]
            await restore(client, task_id, ref, directory / "node-b" / "state", RestoreLimits(max_bytes=1 << 34))
        restored = await trio.to_thread.run_sync(tree_bytes, directory / "node-b" / "state")
        assert restored == expected, "the restored JOBDIR differs"
        figures["size"] = tree_size(directory / "node-b" / "state")
        out["restore"] = figures
        out["made"] = made
        out["files"] = {p: len(b) for p, b in sorted(expected.items())}
    finally:
        await client.aclose()
    return out


async def measure(quick: bool, scrapy: bool) -> dict[str, Any]:
    counts = QUICK if quick else FULL
    rounds = []
    with work_directory("checkpoint") as directory:
        (directory / "node-a").mkdir()
        (directory / "node-b").mkdir()
        master = DevMaster(directory / "master")
        await master.start()
        try:
            for i in range(1 if quick else 3):
                here = directory / f"round{i}"
                (here / "node-b").mkdir(parents=True)
                rounds.append(await one_round(here, master, counts, scrapy))
        finally:
            await master.stop()
        pause = await trio.to_thread.run_sync(spider_pause, scrapy, directory / "pause", counts[0], counts[1])
    return {"counts": counts, "rounds": rounds, "pause": pause}


def _median(rounds: list[dict[str, Any]], part: str, key: str) -> float:
    return statistics.median(r[part][key] for r in rounds)


def run(quick: bool, scrapyd: bool = True) -> dict[str, Any]:
    """The benchmark; ``scrapyd`` False (``--no-scrapyd``): a synthetic JOBDIR, no Scrapy."""
    result = trio.run(measure, quick, scrapyd)
    rounds, (seen, pending, more) = result["rounds"], result["counts"]
    rows = []
    for part, what in (("ckpt1", f"checkpoint 1: {seen:,} seen, {pending:,} pending (all new)"),
                       ("ckpt2", f"checkpoint 2: +{more:,} seen and pending (incremental)"),
                       ("restore", "restore of checkpoint 2 on another node")):
        size = _median(rounds, part, "size")
        sent = _median(rounds, part, "sent")
        rows.append([what, f"{size / MB:.2f}", f"{_median(rounds, part, 'seconds') * 1000:.0f}",
                     f"{_median(rounds, part, 'cpu') * 1000:.0f}", f"{_median(rounds, part, 'master_cpu') * 1000:.0f}",
                     f"{sent / MB:.3f}", f"{sent / size:.3f}"])
    ship = max(_median(rounds, "ckpt1", "seconds"), _median(rounds, "ckpt2", "seconds"))
    pause = None if result["pause"] is None else float(result["pause"]["median_ms"])
    copy_ms = statistics.median(r[p]["copy_ms"] for r in rounds for p in ("ckpt1", "ckpt2"))
    table = markdown_table(["", "JOBDIR MB", "time ms", "agent CPU ms", "master CPU ms", "HTTP bodies MB", "bodies / size"], rows)
    files = ", ".join(f"{path} {size / MB:.2f} MB" for path, size in rounds[0]["files"].items())
    incremental = _median(rounds, "ckpt2", "sent") / _median(rounds, "ckpt1", "sent")
    notes = (f"\n\nJOBDIR made by {rounds[0]['made']}: {files}. Medians of {len(rounds)} round(s). "
             f"Checkpoint 2 sends {incremental:.2f} × checkpoint 1's bytes."
             + (" The spider's pause: not measured (no Scrapy: --no-scrapyd, or none in the bench venv)."
                if result["pause"] is None else " " + pause_line(result["pause"], seen, pending))
             + f" The copy of the state dir into the snapshot alone (as the spider makes it) took {copy_ms:.1f} ms "
             "(median).")
    target = f"shipped ≤ {TARGET_SHIP_S:g} s (one interval); spider pause ≤ {TARGET_PAUSE_MS:g} ms"
    met = ship <= TARGET_SHIP_S and (pause is None or pause <= TARGET_PAUSE_MS)
    return {"table": table + notes, "target": target, "target_met": met,
            "headline": f"shipped in {ship * 1000:.0f} ms, incremental {incremental:.2f}×"
                        + ("" if pause is None else f", pause {pause:.1f} ms"),
            "raw": json.loads(json.dumps(result, default=str))}


if __name__ == "__main__":
    raise SystemExit(module_main(run))
