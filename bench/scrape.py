"""/metrics scrape: how long the agent's event loop stalls while its /metrics is scraped.

Setup: the dev master as a subprocess; the agent in this process (``ckagent.agent.Agent`` on this
Trio loop) so the loop's lag can be measured where it happens: a probe task sleeps
``PROBE_INTERVAL`` seconds again and again and records how late each wake-up is. The outbox is
given work to count: ``TASKS`` running tasks, each of which printed ``LINES`` lines and saved
``ITEMS`` items and then goes on printing 1,000 lines a second (delivery and counting are in
progress while the scrapes run, and in the baseline window). A separate
process (``curl``-like, plain Python, so the scraper's own work does not share this loop or its
GIL) fetches /metrics ``SCRAPES`` times back to back.

Figures: the probe's lateness p50 / p99 / max over a window without scrapes (the baseline: the
machine's own noise) and over the window of scrapes; the scrape latency p50 / max.
Target: while scraping, the loop is never late by more than 1 ms beyond the baseline's max
(a scrape never blocks the event loop for more than 1 ms).

    .venv/bin/python -m bench.scrape [--quick]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import trio

from bench._harness import PYTHON, REPO, DevMaster, free_port, markdown_table, summary, work_directory
from ckagent.agent import Agent
from ckagent.config import load_settings
from ckagent.devmaster.client import zip_files

PROBE_INTERVAL = 0.002
TARGET_LAG_S = 0.001
SDK_DIR = REPO / "sdk" / "python" / "src"

SPIDER = r"""
import os, sys, time
sys.path.insert(0, os.environ["BENCH_SDK_DIR"])
from crawlerkeeper_sdk import save_items
lines = int(os.environ["BENCH_LINES"])
sys.stdout.write("".join("line %d of a spider that wrote a lot before it went quiet\n" % i for i in range(lines)))
sys.stdout.flush()
save_items({"n": i, "title": "item %d" % i} for i in range(int(os.environ["BENCH_ITEMS"])))
n = lines
while True:  # then 1,000 lines a second until stopped: every scrape has new bytes to count
    time.sleep(0.01)
    sys.stdout.write("".join("line %d written while the node is scraped\n" % (n + i) for i in range(10)))
    sys.stdout.flush()
    n += 10
"""

SCRAPER = r"""
import sys, time, urllib.request
url, count = sys.argv[1], int(sys.argv[2])
for _ in range(count):
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as answer:
        answer.read()
    print("%.6f" % (time.perf_counter() - started), flush=True)
"""


class LagProbe:
    """Sleeps PROBE_INTERVAL again and again; ``lags`` holds how late each wake-up was (seconds)."""

    def __init__(self) -> None:
        self.lags: list[float] = []

    async def run(self) -> None:
        while True:
            due = trio.current_time() + PROBE_INTERVAL
            await trio.sleep_until(due)
            self.lags.append(max(0.0, trio.current_time() - due))


async def _run(tasks: int, lines: int, items: int, scrapes: int, window: float) -> dict[str, Any]:
    with work_directory("ck-scrape-") as tmp:
        master = DevMaster(tmp / "master")
        await master.start()
        port = free_port()
        settings = load_settings(None, env={
            "AGENT_SERVER_URL": master.base_url, "AGENT_REGISTRATION_TOKEN": master.registration_token,
            "AGENT_WORK_DIR": str(tmp / "agent"), "AGENT_MAX_WORKERS": str(tasks), "AGENT_NAME": "scrape-node",
            "AGENT_IP": "127.0.0.1", "AGENT_PORT": str(port), "AGENT_TASK_LONG_POLL_WAIT": "5",
        })
        agent = Agent(settings)
        probe = LagProbe()
        stopped = trio.Event()

        async def run_agent() -> None:
            await agent.run()
            stopped.set()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_agent)
                with trio.fail_after(60):
                    await agent.started.wait()
                env = {"BENCH_SDK_DIR": str(SDK_DIR), "BENCH_LINES": str(lines), "BENCH_ITEMS": str(items)}
                ids = []
                for i in range(tasks):
                    spider = await master.admin.create_spider(name=f"quiet-{i}", framework="python",
                                                              command=[PYTHON, "-c", SPIDER])
                    await master.admin.upload_package(spider, zip_files({"main.py": "# runs its command\n"}))
                    ids.append(await master.admin.create_task(spider, env=env))
                with trio.fail_after(120):  # every task running and its output written
                    while True:
                        running = await master.admin.list_tasks(status="RUNNING")
                        if len(running) == tasks and all(
                                (tmp / "agent" / "tasks" / t / "output.log").exists() for t in ids):
                            break
                        await trio.sleep(0.2)
                await trio.sleep(2.0)
                nursery.start_soon(probe.run)
                await trio.sleep(window)  # the baseline: no scrapes
                idle = list(probe.lags)
                probe.lags.clear()
                url = f"http://127.0.0.1:{port}/metrics"
                scraper = await trio.run_process([PYTHON, "-c", SCRAPER, url, str(scrapes)], capture_stdout=True)
                scraping = list(probe.lags)
                latencies = [float(x) for x in scraper.stdout.decode().split()]
                for task_id in ids:
                    await master.admin.cancel_task(task_id)
                agent.terminate()
                with trio.fail_after(60):
                    await stopped.wait()
                nursery.cancel_scope.cancel()
        finally:
            await master.stop()
    idle_s, scraping_s, latency_s = summary(sorted(idle)), summary(sorted(scraping)), summary(sorted(latencies))
    return {
        "tasks": tasks, "lines": lines, "items": items, "scrapes": len(latencies),
        "idle_p50_ms": idle_s["p50"] * 1000, "idle_p95_ms": idle_s["p95"] * 1000, "idle_max_ms": idle_s["max"] * 1000,
        "scrape_p50_ms": scraping_s["p50"] * 1000, "scrape_p95_ms": scraping_s["p95"] * 1000,
        "scrape_max_ms": scraping_s["max"] * 1000,
        "latency_p50_ms": latency_s["p50"] * 1000, "latency_max_ms": latency_s["max"] * 1000,
    }


def run(quick: bool) -> dict[str, Any]:
    """Measure (see module docstring): quick = 4 tasks, 20 scrapes; full = 32 tasks, 200 scrapes."""
    if quick:
        figures = trio.run(_run, 4, 20_000, 2_000, 20, 2.0)
    else:
        figures = trio.run(_run, 32, 100_000, 10_000, 200, 10.0)
    extra = figures["scrape_max_ms"] - figures["idle_max_ms"]
    figures["extra_max_ms"] = extra
    return {
        **figures,
        "target": f"a scrape stalls the loop ≤ {TARGET_LAG_S * 1000:g} ms (max lateness beyond the baseline's)",
        "target_met": extra <= TARGET_LAG_S * 1000,
        "headline": f"loop late by ≤ {figures['scrape_max_ms']:.1f} ms while scraping "
                    f"(baseline max {figures['idle_max_ms']:.1f} ms), scrape p50 {figures['latency_p50_ms']:.1f} ms",
    }


def report(figures: dict[str, Any]) -> str:
    """The figures as a Markdown table."""
    rows = [
        ("outbox", f"{figures['tasks']} running tasks, each {figures['lines']:,} lines + {figures['items']:,} items",
         "delivery in progress"),
        ("loop lateness, no scrapes (baseline)", f"p50 {figures['idle_p50_ms']:.2f} / p95 {figures['idle_p95_ms']:.2f} "
         f"/ max {figures['idle_max_ms']:.2f} ms", f"probe every {PROBE_INTERVAL * 1000:g} ms"),
        ("loop lateness while scraping", f"p50 {figures['scrape_p50_ms']:.2f} / p95 {figures['scrape_p95_ms']:.2f} "
         f"/ max {figures['scrape_max_ms']:.2f} ms", f"max − baseline max = {figures['extra_max_ms']:.2f} ms "
         f"(≤ {TARGET_LAG_S * 1000:g})"),
        ("scrape latency", f"p50 {figures['latency_p50_ms']:.1f} / max {figures['latency_max_ms']:.1f} ms",
         f"{figures['scrapes']} scrapes back to back"),
    ]
    return markdown_table(["figure", "value", "target / note"], rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.scrape [--quick]``: print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="4 tasks, 20 scrapes")
    args = parser.parse_args(argv)
    figures = run(args.quick)
    print(report(figures))
    print(f"target {figures['target']}: {'met' if figures['target_met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
