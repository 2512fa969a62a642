"""``ckagent demo``: the whole loop on this machine, with nothing but the package registries.

It starts the reference master on 127.0.0.1 (SQLite file in the demo dir), starts an agent
against it, uploads the example spiders from ``sdk/examples`` (a Scrapy project, a plain-Python
script, one that fails on purpose), schedules one task each, waits for them and prints a table.
The Scrapy example's dependencies are installed by the agent with uv into a per-spider
virtualenv under the demo dir — never into the agent's own environment.

Everything runs in one Trio process: the dev master and the agent are the same code that runs
in production, composed in one root nursery. The agent's own log goes to ``<dir>/agent.log``.
"""

from __future__ import annotations

import logging
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from ckagent.agent import Agent
from ckagent.devmaster.client import AdminClient, zip_directory
from ckagent.devmaster.server import DevMasterConfig, serve
from ckagent.master.ids import task_dir
from ckagent.node.config import load_settings
from ckagent.node.errors import StartupError
from ckagent.node.logs import setup_logging

EXAMPLES = Path(__file__).resolve().parents[2] / "sdk" / "examples"  # ckagent/cli/demo.py → the checkout
DEMO_TIMEOUT = 900.0
"""Seconds the demo waits for its tasks (the first Scrapy install downloads ~40 packages)."""


@dataclass(frozen=True)
class DemoSpider:
    """An example spider the demo uploads: directory under sdk/examples, name, framework."""

    directory: str
    name: str
    framework: str
    what: str


SPIDERS = (
    DemoSpider("scrapy_demo", "products", "scrapy", "Scrapy project: 5 pages, follows pagination"),
    DemoSpider("python_demo", "python_demo", "python", "plain Python + crawlerkeeper_sdk"),
    DemoSpider("fail_demo", "fail_demo", "python", "exits 3 on purpose"),
)


def _say(text: str = "") -> None:
    print(text, flush=True)


async def _demo(work_dir: Path, keep: bool) -> int:
    admin_token = secrets.token_urlsafe(16)
    registration_token = secrets.token_urlsafe(16)
    failure: list[StartupError] = []
    async with trio.open_nursery() as root:
        master_config = DevMasterConfig(
            db_path=work_dir / "master.sqlite", registration_token=registration_token,
            admin_token=admin_token, port=0,
        )
        base_url = await root.start(serve, master_config)
        _say(f"1. reference master listening on {base_url} (data: {master_config.db_path})")
        settings = load_settings(None, env={
            "AGENT_SERVER_URL": base_url,
            "AGENT_REGISTRATION_TOKEN": registration_token,
            "AGENT_WORK_DIR": str(work_dir / "agent"),
            "AGENT_NAME": "demo-node",
            "AGENT_IP": "127.0.0.1",
            "AGENT_PORT": "0",
            "AGENT_HEARTBEAT_INTERVAL": "2",
            "AGENT_TASK_LONG_POLL_WAIT": "10",
        })
        agent = Agent(settings)
        agent_done = trio.Event()

        async def run_agent() -> None:
            try:
                await agent.run()
            except StartupError as exc:  # the CLI reports it (and its exit code) once the demo is down
                failure.append(exc)
                root.cancel_scope.cancel()
            finally:
                agent_done.set()

        root.start_soon(run_agent)
        with trio.fail_after(30):
            await agent.started.wait()
        _say(f"2. agent registered as node {agent.master.node_id} "
             f"(max_workers {agent.max_workers}; work dir {settings.task.work_dir}; log {work_dir / 'agent.log'}; "
             f"status page http://127.0.0.1:{agent.status_port}/)")
        async with AdminClient(base_url, admin_token) as admin:
            tasks: list[tuple[DemoSpider, str]] = []
            for spider in SPIDERS:
                spider_id = await admin.create_spider(name=spider.name, framework=spider.framework)
                package = await trio.to_thread.run_sync(zip_directory, EXAMPLES / spider.directory)
                await admin.upload_package(spider_id, package)
                task_id = await admin.create_task(spider_id, params={"start_url": f"{base_url}/demo-site/"})
                tasks.append((spider, task_id))
            _say(f"3. uploaded {len(SPIDERS)} example spiders and scheduled one task each; waiting "
                 "(the first run installs Scrapy with uv into a per-spider virtualenv, ~10-60 s)...")
            results: list[tuple[DemoSpider, str, dict[str, Any]]] = []
            for spider, task_id in tasks:
                record = await admin.wait_task_final(task_id, DEMO_TIMEOUT)
                results.append((spider, task_id, record))
                _say(f"   - {spider.name}: {record['status']}")
            _print_table(results)
            spider, task_id, _ = results[0]
            for line in explore_lines(keep, base_url, admin_token, spider.name, task_id,
                                      task_dir(settings.task.work_dir, task_id)):
                _say(line)
        ok = all(r["status"] == expected for (s, _, r), expected in
                 zip(results, ("SUCCESS", "SUCCESS", "FAILED"), strict=True))
        if keep:
            _say(f"\n--keep: master and agent keep running at {base_url}; press Ctrl-C to stop.")
            await agent_done.wait()  # Ctrl-C reaches the agent's signal handler: it terminates
        agent.terminate()
        with trio.move_on_after(30):
            await agent_done.wait()
        root.cancel_scope.cancel()
    if failure:
        raise failure[0]
    _say("\nDemo " + ("finished as expected: two spiders succeeded, one failed on purpose."
                      if ok else "did NOT finish as expected: see the table and the agent log."))
    return 0 if ok else 1


def explore_lines(keep: bool, base_url: str, admin_token: str, spider_name: str, task_id: str,
                  task_dir: Path) -> list[str]:
    """What the demo prints to explore further. The curl commands only with ``keep``: otherwise the
    master stops with the demo and they would fail, so one line says how to keep it running."""
    lines = [""]
    if keep:
        lines += [
            f"Look further (admin API of the reference master; the {spider_name} task's logs and items):",
            f"  curl -H 'Authorization: Bearer {admin_token}' {base_url}/api/tasks/{task_id}/logs",
            f"  curl -H 'Authorization: Bearer {admin_token}' {base_url}/api/tasks/{task_id}/items",
            f"  curl -H 'Authorization: Bearer {admin_token}' {base_url}/api/tasks/{task_id}/stats",
            f"  curl -H 'Authorization: Bearer {admin_token}' {base_url}/api/nodes",
        ]
    else:
        lines.append("The master and agent stop with the demo; to explore their HTTP APIs afterwards, "
                     "re-run with --keep: `ckagent demo --keep`.")
    lines.append(f"  task files on the node: {task_dir}/ (output.log, items.jsonl)")
    if keep:
        lines.append("  (the admin token is a throwaway made for this demo run)")
    return lines


def _print_table(results: list[tuple[DemoSpider, str, dict[str, Any]]]) -> None:
    header = ("spider", "framework", "status", "error", "items", "requests", "finish", "log lines", "duration",
              "what")
    rows = [header]
    for spider, _, record in results:
        duration = record.get("durationMs")
        stats = (record.get("stats") or {}).get("stats") or {}  # the final stats the spider reported
        rows.append((
            spider.name, spider.framework, str(record["status"]), str(record.get("errorCode") or "-"),
            str(record.get("storedItems", record.get("itemCount"))), str(stats.get("requests", "-")),
            str(record.get("finishReason") or "-"),
            str(record.get("storedLogLines", record.get("logLines"))),
            f"{duration / 1000:.1f} s" if isinstance(duration, (int, float)) else "-", spider.what,
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    _say()
    for n, row in enumerate(rows):
        _say("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if n == 0:
            _say("  ".join("-" * width for width in widths))


def run_demo(work_dir: Path, keep: bool = False) -> int:
    """Entry point of ``ckagent demo``. Returns 0 when every example ended as expected."""
    if not (EXAMPLES / "scrapy_demo").is_dir():
        print(f"ckagent demo: the example spiders are not here ({EXAMPLES}); run the demo from a checkout",
              file=sys.stderr)
        return 2
    work_dir = work_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    setup_logging("INFO", work_dir / "agent.log", stderr=False)
    logging.getLogger("ckagent.devmaster").setLevel(logging.WARNING)
    try:
        return trio.run(_demo, work_dir, keep)
    except KeyboardInterrupt:
        return 0
