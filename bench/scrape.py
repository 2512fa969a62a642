"""/metrics scrape: how long the agent's event loop stalls while its /metrics is scraped.

Setup: the dev master as a subprocess; the agent in this process (``ckagent.agent.Agent`` on this
Trio loop) so the loop's lag can be measured where it happens: a probe task sleeps
``PROBE_INTERVAL`` seconds again and again and records how late each wake-up is. The outbox is
given work to count: ``TASKS`` running tasks, each of which printed ``LINES`` lines and saved
``ITEMS`` items and then goes on printing 1,000 lines a second (delivery and counting are in
progress while the scrapes run, and in the baseline window). A separate
process (``curl``-like, plain Python, so the scraper's own work does not share this loop or its
GIL) fetches /metrics ``SCRAPES`` times back to back.

Figures: the probe's lateness p50 / p95 / p99 / max over a window without scrapes (the baseline:
the machine's own noise) and over the window of scrapes; the scrape latency p50 / max; and, from a
Trio instrument, the longest single loop step of the scrape's own tasks (hypercorn's, in which the
agent's handler runs) — by wall time and by the loop thread's CPU time — the number of its steps
over 1 ms, and the longest step of any other task while scraping.
Target (issue 18): a scrape never blocks the event loop for more than 1 ms. Judged by the longest
step of the scrape in CPU time: what the scrape itself holds the loop for. The lateness figures
are the loop's lag as a probe sees it; on a shared machine they also hold the time the OS gave the
process's thread to others (a baseline max of 50–150 ms was seen here under load 3), so their max
is reported beside the baseline's, not judged.

    .venv/bin/python -m bench.scrape [--quick]
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from typing import Any

import trio

from bench._harness import PYTHON, REPO, DevMaster, free_port, markdown_table, summary, work_directory
from ckagent.agent import Agent
from ckagent.devmaster.client import zip_files
from ckagent.node.config import load_settings

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
while True:  # then 100 lines a second until stopped: every scrape has new bytes to count
    time.sleep(0.05)
    sys.stdout.write("".join("line %d written while the node is scraped\n" % (n + i) for i in range(5)))
    sys.stdout.flush()
    n += 5
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


class StepTimes(trio.abc.Instrument):
    """The longest single step (run without yielding to the loop) of each Trio task, by task name, while
    ``on``: what holds the loop, and whether it is the scrape (hypercorn's handler tasks) or other work."""

    def __init__(self) -> None:
        self.on = False
        self.longest: dict[str, float] = {}
        self.longest_cpu: dict[str, float] = {}  # the same by the loop thread's CPU time (preemption excluded)
        self._started: float | None = None  # None: the step began before the instrument was added
        self._started_cpu = 0.0
        self.over: list[tuple[float, float, str]] = []  # (CPU s, wall s, task) of the scrape's steps over 1 ms CPU
        self.longest_cpu_no_gc = 0.0  # the scrape's longest step, CPU less the garbage collector's share
        self.gc_max = 0.0  # the longest collection of the garbage collector while on (CPU seconds)
        self._gc_in_step = 0.0
        self._gc_started = 0.0

    def gc_callback(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks`` hook: how much of the current step the garbage collector took."""
        if phase == "start":
            self._gc_started = time.thread_time()
        else:
            took = time.thread_time() - self._gc_started
            self._gc_in_step += took
            if self.on:
                self.gc_max = max(self.gc_max, took)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._started = time.perf_counter()
        self._started_cpu = time.thread_time()
        self._gc_in_step = 0.0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.on and self._started is not None:
            took = time.perf_counter() - self._started
            if took > self.longest.get(task.name, 0.0):
                self.longest[task.name] = took
            cpu = time.thread_time() - self._started_cpu
            if cpu > self.longest_cpu.get(task.name, 0.0):
                self.longest_cpu[task.name] = cpu
            if "hypercorn" in task.name or "serve_listeners" in task.name:
                if cpu > 0.001:
                    self.over.append((cpu, took, task.name))
                self.longest_cpu_no_gc = max(self.longest_cpu_no_gc, cpu - self._gc_in_step)

    def scrape_max(self, cpu: bool = False) -> float:
        """The longest step of a task serving HTTP on the status port (seconds of wall time, or of the
        loop thread's CPU time with ``cpu``: what the step itself cost, without the OS's preemption)."""
        steps = self.longest_cpu if cpu else self.longest
        return max((v for k, v in steps.items() if "hypercorn" in k or "serve_listeners" in k), default=0.0)

    def other_max(self) -> tuple[str, float]:
        """The longest step of any other task (its name, seconds)."""
        others = [(v, k) for k, v in self.longest.items()
                  if "hypercorn" not in k and "serve_listeners" not in k and not k.startswith("bench.")]
        value, name = max(others, default=(0.0, "–"))
        return name.rsplit(".", 1)[-1], value


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
                with trio.fail_after(300):  # the first burst delivered: the windows see a steady outbox
                    while True:
                        stored = {t["id"]: int(t.get("storedLogLines") or 0) for t in await master.admin.list_tasks()}
                        if all(stored.get(t, 0) >= lines for t in ids):
                            break
                        await trio.sleep(0.5)
                await trio.sleep(2.0)
                nursery.start_soon(probe.run)
                await trio.sleep(window)  # the baseline: no scrapes
                idle = list(probe.lags)
                probe.lags.clear()
                url = f"http://127.0.0.1:{port}/metrics"
                steps = StepTimes()
                trio.lowlevel.add_instrument(steps)
                gc.callbacks.append(steps.gc_callback)
                steps.on = True
                scraper = await trio.run_process([PYTHON, "-c", SCRAPER, url, str(scrapes)], capture_stdout=True)
                steps.on = False
                gc.callbacks.remove(steps.gc_callback)
                trio.lowlevel.remove_instrument(steps)
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
        "idle_p99_ms": _p99(idle) * 1000, "scrape_p99_ms": _p99(scraping) * 1000,
        "scrape_p50_ms": scraping_s["p50"] * 1000, "scrape_p95_ms": scraping_s["p95"] * 1000,
        "scrape_max_ms": scraping_s["max"] * 1000, "scrape_steps_over_1ms": len(steps.over),
        "latency_p50_ms": latency_s["p50"] * 1000, "latency_max_ms": latency_s["max"] * 1000,
        "scrape_step_max_ms": steps.scrape_max() * 1000,
        "scrape_step_cpu_max_ms": steps.scrape_max(cpu=True) * 1000,
        "scrape_step_cpu_no_gc_max_ms": steps.longest_cpu_no_gc * 1000, "gc_max_ms": steps.gc_max * 1000,
        "other_step": steps.other_max()[0], "other_step_max_ms": steps.other_max()[1] * 1000,
    }


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)] if ordered else math.nan


def run(quick: bool) -> dict[str, Any]:
    """Measure (see module docstring): quick = 4 tasks, 20 scrapes; full = 32 tasks, 200 scrapes."""
    shape = (4, 5_000, 1_000, 20, 2.0) if quick else (32, 20_000, 5_000, 200, 10.0)
    figures = trio.run(_run, *shape)
    figures["extra_max_ms"] = figures["scrape_max_ms"] - figures["idle_max_ms"]
    return {
        **figures,
        "target": f"a scrape never blocks the loop > {TARGET_LAG_S * 1000:g} ms (its longest loop step, CPU)",
        "target_met": figures["scrape_step_cpu_max_ms"] <= TARGET_LAG_S * 1000,
        "headline": f"longest scrape step {figures['scrape_step_cpu_max_ms']:.2f} ms CPU "
                    f"({figures['scrape_steps_over_1ms']} steps > 1 ms in {figures['scrapes']} scrapes); "
                    f"loop lateness p99 {figures['scrape_p99_ms']:.1f} ms (baseline {figures['idle_p99_ms']:.1f})",
    }


def report(figures: dict[str, Any]) -> str:
    """The figures as a Markdown table."""
    rows = [
        ("outbox", f"{figures['tasks']} running tasks, each {figures['lines']:,} lines + {figures['items']:,} items",
         "delivery in progress"),
        ("loop lateness, no scrapes (baseline)", f"p50 {figures['idle_p50_ms']:.2f} / p95 {figures['idle_p95_ms']:.2f} "
         f"/ p99 {figures['idle_p99_ms']:.2f} / max {figures['idle_max_ms']:.2f} ms",
         f"probe every {PROBE_INTERVAL * 1000:g} ms"),
        ("loop lateness while scraping", f"p50 {figures['scrape_p50_ms']:.2f} / p95 {figures['scrape_p95_ms']:.2f} "
         f"/ p99 {figures['scrape_p99_ms']:.2f} / max {figures['scrape_max_ms']:.2f} ms",
         f"max − baseline max = {figures['extra_max_ms']:.2f} ms (the OS's share included: not judged)"),
        ("scrape latency", f"p50 {figures['latency_p50_ms']:.1f} / max {figures['latency_max_ms']:.1f} ms",
         f"{figures['scrapes']} scrapes back to back"),
        ("longest loop step of the scrape", f"{figures['scrape_step_cpu_max_ms']:.2f} ms CPU / "
         f"{figures['scrape_step_max_ms']:.2f} ms wall",
         f"target ≤ {TARGET_LAG_S * 1000:g} ms CPU; hypercorn's tasks (the agent's handler runs in them), the "
         "loop thread's CPU time of one step (wall time also holds the OS's preemption)"),
        ("steps of the scrape over 1 ms CPU", f"{figures['scrape_steps_over_1ms']}",
         f"in {figures['scrapes']} scrapes"),
        ("longest step of the scrape less the GC's share", f"{figures['scrape_step_cpu_no_gc_max_ms']:.2f} ms CPU",
         f"the scrape's own work; the longest collection of the garbage collector (any task) while "
         f"scraping: {figures['gc_max_ms']:.2f} ms CPU"),
        ("longest loop step of anything else", f"{figures['other_step_max_ms']:.2f} ms",
         f"{figures['other_step']} (while scraping)"),
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
