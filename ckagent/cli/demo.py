"""``ckagent demo``: the whole loop on this machine, with nothing but the package registries.

It starts the reference master on 127.0.0.1 (SQLite file in the demo dir), starts an agent
against it, uploads the example spiders from ``sdk/examples`` (a Scrapy project, a plain-Python
script, one that fails on purpose), schedules one task each, waits for them and prints a table.
The Scrapy example's dependencies are installed by the agent with uv into a per-spider
virtualenv under the demo dir — never into the agent's own environment.

Then it checks what it promises: each spider's items, as the master stored them, against the demo
shop the master serves (:func:`ckagent.devmaster.demosite.expected_products`: every product, in
order) and its status against what it was written to do (``fail_demo``: FAILED/EXIT_NONZERO, no
items). Any difference makes the exit code 1, and the last lines name the spider, the counts and the
first difference.

The agent is configured like any agent — ``AGENT_*`` variables over an optional ``-c`` file (for
instance ``AGENT_TASK_EGRESS=proxy``, ``AGENT_TASK_CONTAINMENT=process-group``) — except for what
makes it the demo's (:data:`DEMO_OWNED`: its master, token, work dir, name and address). The summary
says which containment and egress levels it ran at.

Everything runs in one Trio process: the dev master and the agent are the same code that runs
in production, composed in one root nursery. The agent's own log goes to ``<dir>/agent.log``.
"""

from __future__ import annotations

import logging
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio

from ckagent.agent import Agent
from ckagent.devmaster.client import AdminClient, zip_directory
from ckagent.devmaster.demosite import PAGES, PRODUCTS, expected_products
from ckagent.devmaster.server import DevMasterConfig, serve
from ckagent.master.ids import task_dir
from ckagent.node.config import Settings, load_settings
from ckagent.node.errors import StartupError
from ckagent.node.logs import setup_logging
from ckagent.node.secretenv import agent_environ

EXAMPLES = Path(__file__).resolve().parents[2] / "sdk" / "examples"  # ckagent/cli/demo.py → the checkout
DEMO_TIMEOUT = 900.0
"""Seconds the demo waits for its tasks, all together (the first Scrapy install downloads ~40 packages)."""

EXIT_INTERRUPTED = 130
"""Exit code when Ctrl-C ended the demo before its checks were done (as a shell reports SIGINT)."""

DEMO_OWNED = ("AGENT_SERVER_URL", "AGENT_REGISTRATION_TOKEN", "AGENT_WORK_DIR", "AGENT_NAME", "AGENT_IP",
              "AGENT_BIND", "AGENT_PORT", "AGENT_LOG_FILE")
"""The settings the demo sets for its agent whatever the environment says: its own master and token, its
work dir and log under ``--work-dir`` (never a real agent's), its name, and a free port on 127.0.0.1."""

DEMO_DEFAULTS = {"AGENT_HEARTBEAT_INTERVAL": "2", "AGENT_TASK_LONG_POLL_WAIT": "10"}
"""Settings the demo chooses unless the environment (or ``-c``) sets them."""


@dataclass(frozen=True)
class DemoSpider:
    """An example spider the demo uploads: directory under sdk/examples, name, framework, and what it
    must give: ``status`` (and ``error`` code), and the shop's products in order (``crawls_shop``) or
    no items at all."""

    directory: str
    name: str
    framework: str
    what: str
    status: str = "SUCCESS"
    error: str | None = None
    crawls_shop: bool = True


SPIDERS = (
    DemoSpider("scrapy_demo", "products", "scrapy", f"Scrapy project: {PAGES} pages, follows pagination"),
    DemoSpider("python_demo", "python_demo", "python", "plain Python + crawlerkeeper_sdk"),
    DemoSpider("fail_demo", "fail_demo", "python", "exits 3 on purpose", status="FAILED", error="EXIT_NONZERO",
               crawls_shop=False),
)


@dataclass(frozen=True)
class DemoResult:
    """One spider's task as the master holds it at the end: the final task record and its stored items."""

    spider: DemoSpider
    task_id: str
    record: dict[str, Any]
    items: list[Any]


def _say(text: str = "") -> None:
    print(text, flush=True)


def demo_agent_env(environ: Mapping[str, str], base_url: str, token: str, work_dir: Path) -> dict[str, str]:
    """The environment the demo's agent settings are loaded from: the ``AGENT_*`` variables of
    ``environ``, :data:`DEMO_DEFAULTS` where they set nothing, and :data:`DEMO_OWNED` from the demo."""
    env = {**DEMO_DEFAULTS, **{k: v for k, v in environ.items() if k.startswith("AGENT_") and v.strip()}}
    env.update({
        "AGENT_SERVER_URL": base_url,
        "AGENT_REGISTRATION_TOKEN": token,
        "AGENT_WORK_DIR": str(work_dir / "agent"),
        "AGENT_NAME": "demo-node",
        "AGENT_IP": "127.0.0.1",
        "AGENT_BIND": "127.0.0.1",
        "AGENT_PORT": "0",
        "AGENT_LOG_FILE": str(work_dir / "agent.log"),
    })
    return env


def _product(item: Any) -> dict[str, str] | None:
    """An item as the shop's terms (:func:`expected_products`): title, price as shown, sku, URL path;
    None when it is not shaped like a product at all."""
    if not isinstance(item, dict):
        return None
    raw: Any = item.get("price")
    try:
        price = f"{float(raw):.2f}"
    except (TypeError, ValueError):
        price = repr(raw)
    return {"title": str(item.get("title", "")).strip(), "price": price, "sku": str(item.get("sku", "")).strip(),
            "url": urlsplit(str(item.get("url", ""))).path}


def _describe(product: Mapping[str, Any]) -> str:
    return f"{product.get('title')!r} ({product.get('sku')})"


def first_difference(items: Sequence[Any], expected: Sequence[Mapping[str, str]]) -> str | None:
    """Where ``items`` (as the master stored them) first differ from ``expected`` (the shop's products,
    in order; [] = no items), in words; None when they agree. Prices compare as numbers shown with two
    decimals, URLs by path (the shop's address differs per run)."""
    for n in range(max(len(items), len(expected))):
        if n >= len(items):
            return f"item {n + 1} missing: expected {_describe(expected[n])}"
        got = _product(items[n])
        if n >= len(expected):
            return f"item {n + 1} is one too many: {_describe(got) if got else repr(items[n])[:120]}"
        want = expected[n]
        if got is None:
            return f"item {n + 1} is not a product: {repr(items[n])[:120]}"
        for field in ("title", "price", "sku", "url"):
            if got[field] != want[field]:
                return f"item {n + 1} {field} is {got[field]!r}, expected {want[field]!r} ({_describe(want)})"
    return None


def check_result(result: DemoResult, expected: Sequence[Mapping[str, str]]) -> str | None:
    """Why ``result`` is not what its spider promises (one line: status, counts, first difference),
    or None when it is. ``expected``: the shop's products (:func:`expected_products`)."""
    spider, record = result.spider, result.record
    status, error = record.get("status"), record.get("errorCode")
    if status != spider.status or (error or None) != spider.error:
        got = f"{status}" + (f"/{error}" if error else "")
        message = " ".join(str(record.get("errorMessage") or "").split())  # one line, however many it had
        message = f": {message[:200]}{'...' if len(message) > 200 else ''}" if message else ""
        return f"{got}{message}, expected {spider.status}" + (f"/{spider.error}" if spider.error else "")
    want = list(expected) if spider.crawls_shop else []
    difference = first_difference(result.items, want)
    if difference is None:
        return None
    count = f"{len(result.items)} item{'' if len(result.items) == 1 else 's'}"
    what = f"{count} of the shop's {len(want)}" if want else f"{count}, expected none"
    return f"{status} with {what} (first difference: {difference})"


def verdict_lines(results: Sequence[DemoResult], expected: Sequence[Mapping[str, str]],
                  containment: str, egress: str) -> tuple[list[str], list[str]]:
    """What differs from the spiders' promises (``"<spider>: <why>"``; [] = nothing), and the lines that
    say how each spider did, then the levels the agent ran at."""
    width = max(len(r.spider.name) for r in results)
    lines = ["", f"Checked against the demo shop ({len(expected)} products on {PAGES} pages, "
                 "ckagent/devmaster/demosite.py):"]
    problems = []
    for result in results:
        spider = result.spider
        problem = check_result(result, expected)
        if problem is not None:
            problems.append(f"{spider.name}: {problem}")
            lines.append(f"  {spider.name.ljust(width)}  NOT as expected: {problem}")
        elif spider.crawls_shop:
            lines.append(f"  {spider.name.ljust(width)}  ok: {spider.status}, all {len(expected)} products in order")
        else:
            lines.append(f"  {spider.name.ljust(width)}  ok: {spider.status}/{spider.error} as it should "
                         f"({spider.what}), no items")
    lines.append(f"The demo's agent ran at containment {containment} and egress {egress} "
                 "(AGENT_TASK_CONTAINMENT, AGENT_TASK_EGRESS choose).")
    return problems, lines


async def _wait_all(admin: AdminClient, tasks: list[tuple[DemoSpider, str]]) -> list[DemoResult]:
    """Each task's final record (or its record when :data:`DEMO_TIMEOUT` passed) and stored items."""
    results = []
    deadline = trio.current_time() + DEMO_TIMEOUT
    for spider, task_id in tasks:
        try:
            record = await admin.wait_task_final(task_id, max(deadline - trio.current_time(), 0.1))
        except TimeoutError:
            record = await admin.get_task(task_id)
        results.append(DemoResult(spider, task_id, record, await admin.get_items(task_id)))
        _say(f"   - {spider.name}: {record['status']}")
    return results


async def _demo(work_dir: Path, keep: bool, config: Path | None) -> int:
    admin_token = secrets.token_urlsafe(16)
    registration_token = secrets.token_urlsafe(16)
    failure: list[StartupError] = []
    problems = ["the demo stopped before its checks"]
    async with trio.open_nursery() as root:
        master_config = DevMasterConfig(
            db_path=work_dir / "master.sqlite", registration_token=registration_token,
            admin_token=admin_token, port=0,
        )
        base_url = await root.start(serve, master_config)
        _say(f"1. reference master listening on {base_url} (data: {master_config.db_path})")
        settings = load_settings(config, env=demo_agent_env(agent_environ(), base_url, registration_token, work_dir))
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
        containment = agent.containment.to_json()["level"] if agent.containment is not None else "-"
        egress = agent.egress.to_json()["level"] if agent.egress is not None else "-"
        _say(f"2. agent registered as node {agent.master.node_id} "
             f"(containment {containment}, egress {egress}; max_workers {agent.max_workers}; "
             f"work dir {settings.task.work_dir}; log {work_dir / 'agent.log'}; "
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
            results = await _wait_all(admin, tasks)
            _print_table(results)
            problems, lines = verdict_lines(results, expected_products(), containment, egress)
            for line in lines:
                _say(line)
            first = results[0]
            for line in explore_lines(keep, base_url, admin_token, first.spider.name, first.task_id,
                                      task_dir(settings.task.work_dir, first.task_id)):
                _say(line)
        if keep:
            _say(f"\n--keep: master and agent keep running at {base_url}; press Ctrl-C to stop.")
            await agent_done.wait()  # Ctrl-C reaches the agent's signal handler: it terminates
        agent.terminate()
        with trio.move_on_after(30):
            await agent_done.wait()
        root.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not problems:
        crawlers = sum(spider.crawls_shop for spider in SPIDERS)
        _say(f"\nDemo finished as expected: {crawlers} spiders delivered the shop's {PRODUCTS} products in order, "
             f"{len(SPIDERS) - crawlers} failed on purpose.")
        return 0
    _say(f"\nDemo did NOT finish as expected: {'; '.join(problems)}. The agent's log: {work_dir / 'agent.log'}")
    return 1


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


def _print_table(results: Sequence[DemoResult]) -> None:
    header = ("spider", "framework", "status", "error", "items", "requests", "finish", "log lines", "duration",
              "what")
    rows = [header]
    for result in results:
        spider, record = result.spider, result.record
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


def _checked_settings(work_dir: Path, config: Path | None) -> Settings:
    """The agent's settings as the demo will load them, with a placeholder master: a bad ``AGENT_*``
    value or ``-c`` file fails here, before anything starts (ConfigError, exit code 2)."""
    return load_settings(config, env=demo_agent_env(agent_environ(), "http://127.0.0.1:9", "placeholder", work_dir))


def run_demo(work_dir: Path, keep: bool = False, config: Path | None = None) -> int:
    """Entry point of ``ckagent demo``. Returns 0 when every example ended as it promises (status and
    items, :func:`check_result`), 1 otherwise, 2 when the examples are not there, 130 when Ctrl-C
    came before the checks (with ``--keep``, Ctrl-C stops the agent and the checks' code stands).
    Raises ConfigError for bad settings (``config``, ``AGENT_*``) and StartupError when the agent
    cannot start."""
    if not (EXAMPLES / "scrapy_demo").is_dir():
        print(f"ckagent demo: the example spiders are not here ({EXAMPLES}); run the demo from a checkout",
              file=sys.stderr)
        return 2
    work_dir = work_dir.resolve()
    settings = _checked_settings(work_dir, config)
    work_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(settings.logging.level, work_dir / "agent.log", stderr=False)
    logging.getLogger("ckagent.devmaster").setLevel(logging.WARNING)
    try:
        return trio.run(_demo, work_dir, keep, config)
    except KeyboardInterrupt:  # outside the agent's own handler (it turns Ctrl-C into a stop): not checked
        return EXIT_INTERRUPTED
