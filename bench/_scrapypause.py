"""The pause a Scrapy crawl sees at a checkpoint (issue 38; crawlerkeeper_sdk._scrapy_state), measured in a
running crawl: the part of bench/checkpoint.py that is the spider's side.

A real Scrapy process (the bench venv's Scrapy, the SDK from this checkout, the hook's ``state`` mode as
an agent's task has it) opens a spider whose JOBDIR is ``$CK_STATE_DIR/jobdir`` with Scrapy's default
queues, marks ``seen - pending`` requests seen and schedules ``pending`` more, towards a server on
127.0.0.1 that accepts and never answers — so the downloader holds ``CONCURRENT_REQUESTS`` (16) in
flight for the whole measurement, the scheduler the rest. Then this process writes ``rounds`` persist
requests to the control file, one after the other, and reads each ack's ``pauseMs``: the time the
reactor was held (the close-time state of the queues and the dupefilter, the requests in flight, the
copy of the state dir into the snapshot, the ack). Median and max are reported, with the ratio to the
target of 50 ms.

    .venv/bin/python -m bench._scrapypause [--quick]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

TARGET_PAUSE_MS = 50.0
FULL = (100_000, 10_000, 5)
"""Seen requests, pending among them, persist requests."""
QUICK = (10_000, 1_000, 3)
SDK_SRC = Path(__file__).resolve().parents[1] / "sdk" / "python" / "src"

_SPIDER = r"""
import os, sys
import crawlerkeeper_sdk._scrapy_hook  # the agent's environments load it from a .pth (CK_SCRAPY_HOOK)
import scrapy
from scrapy import signals
from scrapy.crawler import CrawlerProcess

SEEN, PENDING, SITE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


class Shop(scrapy.Spider):
    name = "shop"

    async def start(self):
        return
        yield

    def start_requests(self):
        return []

    @classmethod
    def from_crawler(cls, crawler, *args, **kwargs):
        spider = super().from_crawler(crawler, *args, **kwargs)
        crawler.signals.connect(spider.opened, signal=signals.spider_opened)
        crawler.signals.connect(spider.idle, signal=signals.spider_idle)
        return spider

    def opened(self, spider):
        engine = self.crawler.engine
        scheduler = (getattr(engine, "_slot", None) or engine.slot).scheduler
        for i in range(SEEN):
            request = scrapy.Request(f"{SITE}/products/{i}?ref=list&page={i // 48}",
                                     headers={"Referer": f"{SITE}/list?page={i // 48}"}, meta={"depth": 3})
            if i < PENDING:
                scheduler.enqueue_request(request)
            else:
                scheduler.df.request_seen(request)
        print("ready", flush=True)

    def idle(self, spider):
        raise scrapy.exceptions.DontCloseSpider

    def parse(self, response):
        pass


process = CrawlerProcess({"LOG_LEVEL": "INFO", "TELNETCONSOLE_ENABLED": False, "CONCURRENT_REQUESTS": 16,
                          "DOWNLOAD_TIMEOUT": 600, "ROBOTSTXT_OBEY": False})
process.crawl(Shop)
process.start()
"""


def _silent_server() -> tuple[socket.socket, threading.Event]:
    """A listener on 127.0.0.1 that accepts connections and never answers (kept until ``done``)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    done = threading.Event()
    held: list[socket.socket] = []

    def accept() -> None:
        listener.settimeout(0.2)
        while not done.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue
        for conn in held:
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    return listener, done


def measure_pause(python: Path, directory: Path, seen: int, pending: int, rounds: int) -> dict[str, Any]:
    """Run the crawl (module docstring) with ``python`` (an interpreter with Scrapy) in ``directory``; returns
    ``{"pauses_ms": [...], "median_ms", "max_ms", "in_flight", "log"}``. Blocking (seconds; 120 s at most).
    Raises RuntimeError when the crawl does not get ready or does not answer."""
    task = directory / "task"
    (task / "state").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CK_", "PYTHON"))}
    env.update(PYTHONPATH=str(SDK_SRC), CK_SCRAPY_HOOK="stats,state", CK_STATE_DIR=str(task / "state"),
               CK_CONTROL_FILE=str(task / "control.jsonl"), CK_CONTROL_ACK_FILE=str(task / "control-ack.jsonl"),
               CK_SNAPSHOT_DIR=str(task / "snapshots"), CK_ITEMS_FILE=str(task / "items.jsonl"), CK_ATTEMPT="1")
    listener, done = _silent_server()
    site = f"http://127.0.0.1:{listener.getsockname()[1]}"
    log_path = task / "output.log"
    with log_path.open("wb") as log:
        crawl = subprocess.Popen([str(python), "-c", _SPIDER, str(seen), str(pending), site], env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while b"ready" not in log_path.read_bytes():
            if crawl.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the crawl did not get ready:\n" + log_path.read_text()[-3000:])
            time.sleep(0.1)
        time.sleep(1.0)  # the engine takes its 16 requests to the silent server
        pauses = []
        for number in range(1, rounds + 1):
            with (task / "control.jsonl").open("a") as control:
                control.write(json.dumps({"event": "persistState", "id": number, "reason": "interval"}) + "\n")
            ack = None
            while ack is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no ack of request {number}:\n" + log_path.read_text()[-3000:])
                time.sleep(0.05)
                lines = (task / "control-ack.jsonl").read_text().splitlines() if (task / "control-ack.jsonl").exists() else []
                ack = next((json.loads(x) for x in lines if json.loads(x)["id"] == number), None)
            if "error" in ack:
                raise RuntimeError(f"checkpoint {number} failed: {ack['error']}")
            pauses.append(float(ack["pauseMs"]))
    finally:
        crawl.kill()
        crawl.wait()
        done.set()
        listener.close()
    said = [line for line in log_path.read_text().splitlines() if "crawlerkeeper: checkpoint" in line]
    in_flight = said[-1].split(" pending, ", 1)[1].split(" in flight", 1)[0] if said else "?"
    return {"pauses_ms": pauses, "median_ms": statistics.median(pauses), "max_ms": max(pauses),
            "in_flight": in_flight, "log": said[-1] if said else ""}


def run(quick: bool, scrapyd: bool = True) -> dict[str, Any]:
    """The pause alone (``python -m bench._scrapypause``), with the bench venv's Scrapy (made if missing)."""
    import tempfile

    from bench._scrapyd import ensure_venv, venv_python

    ensure_venv()
    seen, pending, rounds = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="scrapypause") as directory:
        figures = measure_pause(venv_python(), Path(directory), seen, pending, rounds)
    return {"table": pause_line(figures, seen, pending), "target": f"spider pause ≤ {TARGET_PAUSE_MS:g} ms",
            "target_met": figures["median_ms"] <= TARGET_PAUSE_MS}


def pause_line(figures: dict[str, Any], seen: int, pending: int) -> str:
    """One sentence for a report."""
    return (f"The spider's pause at a checkpoint (a running Scrapy crawl, {seen:,} seen, {pending:,} pending, "
            f"{figures['in_flight']} in flight; {len(figures['pauses_ms'])} checkpoints): median "
            f"{figures['median_ms']:.1f} ms, max {figures['max_ms']:.1f} ms = {figures['median_ms'] / TARGET_PAUSE_MS:.2f} "
            f"× the {TARGET_PAUSE_MS:g} ms target.")


if __name__ == "__main__":
    from bench._harness import module_main

    sys.exit(module_main(run))
