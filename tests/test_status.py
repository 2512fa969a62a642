"""The agent's own port, end to end: a real dev master, an in-process agent (status port 0), real spiders.

- /metrics scraped while a task runs shows it; afterwards every counter moved by the right amount.
- /healthz, /readyz, /status, 404 and 405; a busy port stops the agent with a clear message.
- /readyz flips to 503 when the master (a real process) goes away and back to 200 when it returns,
  and the outage is logged once, not once per retry.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import agent_settings, eventually, running_agent, spider_zip, submit
from prometheus_client.parser import text_string_to_metric_families

from ckagent import __version__
from ckagent.agent import Agent
from ckagent.master.protocol import CLAIM_IN_POLL
from ckagent.node.errors import StartupError
from ckagent.port.metrics import METRIC_NAMES, PHASES, STATES, AgentMetrics
from ckagent.port.status import AgentStatistics, AgentStatus, Readiness, StatusRoutes, serve_status

# Prints 25 lines and saves 7 items, then waits for the test to create "<task dir>/go".
BLOCKING_SPIDER = """\
import os, sys, time
import crawlerkeeper_sdk as ck
for i in range(25):
    print(f"line {i}", flush=True)
for i in range(7):
    ck.save_item({"n": i})
go = os.path.join(os.environ["CK_TASK_DIR"], "go")
while not os.path.exists(go):
    time.sleep(0.02)
print("released", flush=True)
"""
FAILING_SPIDER = "import sys\nprint('about to fail')\nprint('oops', file=sys.stderr)\nsys.exit(3)\n"


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a scrape: (sample name, labels) → value (prometheus-client's own parser)."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, metric: str, **labels: str) -> float:
    """The sample's value; 0 when absent (a labelled counter appears on its first increment)."""
    return samples.get((metric, frozenset(labels.items())), 0.0)


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    if shutil.which("promtool"):  # also tested (with a skip reason) in test_metrics
        checked = await trio.run_process(["promtool", "check", "metrics"], stdin=response.content,
                                         capture_stdout=True, capture_stderr=True, check=False)
        assert checked.returncode == 0 and not checked.stdout.strip(), checked.stdout + checked.stderr
    return parse(response.text)


@asynccontextmanager
async def status_client(agent: Agent) -> AsyncIterator[httpx.AsyncClient]:
    assert agent.status_port
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}", timeout=10) as client:
        yield client


async def test_metrics_during_and_after_real_tasks(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    blocking_zip = spider_zip({"main.py": BLOCKING_SPIDER})
    failing_zip = spider_zip({"main.py": FAILING_SPIDER})
    with trio.fail_after(90):
        async with running_agent(nursery, settings) as agent, status_client(agent) as client:
            before = await scrape(client)
            assert value(before, "ckagent_tasks_started_total") == 0
            assert value(before, "ckagent_free_slots") == 2 and value(before, "ckagent_max_workers") == 2

            ok_id = await submit(dev_master.admin, "blocker", {"main.py": BLOCKING_SPIDER})

            async def running_in_status() -> dict[str, Any] | None:
                doc = (await client.get("/status")).json()
                tasks = [t for t in doc["runningTasks"] if t["id"] == ok_id and t["phase"] == "running"]
                return doc if tasks and tasks[0]["pid"] else None

            doc = await eventually(running_in_status, 30, "the task running in /status")
            (entry,) = doc["runningTasks"]
            assert entry["spiderName"] == "blocker" and entry["since"].endswith("Z")
            assert isinstance(entry["pid"], int) and entry["startedAt"].endswith("Z")
            assert doc["state"] == "RUNNING" and doc["nodeId"] == agent.master.node_id
            assert doc["versions"]["agent"] == __version__ and doc["freeSlots"] == 1

            during = await scrape(client)
            assert value(during, "ckagent_tasks_running", phase="running") == 1
            assert sum(value(during, "ckagent_tasks_running", phase=p) for p in PHASES) == 1
            assert value(during, "ckagent_free_slots") == 1
            assert value(during, "ckagent_tasks_started_total") == 1
            assert value(during, "ckagent_tasks_finished_total", status="SUCCESS", error_code="none") == 0
            assert value(during, "ckagent_task_queue_wait_seconds_count") == 1

            (settings.task.work_dir / "tasks" / ok_id / "go").touch()
            ok = await dev_master.admin.wait_task_final(ok_id, 30)
            bad_id = await submit(dev_master.admin, "failer", {"main.py": FAILING_SPIDER})
            bad = await dev_master.admin.wait_task_final(bad_id, 30)
            assert ok["status"] == "SUCCESS" and bad["errorCode"] == "EXIT_NONZERO", (ok, bad)
            lines = ok["logLines"] + bad["logLines"]
            assert ok["itemCount"] == 7 and lines >= 28

            async def settled() -> Samples | None:
                samples = await scrape(client)
                done = value(samples, "ckagent_log_lines_shipped_total") == lines and not any(
                    value(samples, "ckagent_tasks_running", phase=p) for p in PHASES)
                return samples if done else None

            after = await eventually(settled, 15, "the shipped counters to settle")

    assert value(after, "ckagent_tasks_started_total") == 2
    assert value(after, "ckagent_tasks_finished_total", status="SUCCESS", error_code="none") == 1
    assert value(after, "ckagent_tasks_finished_total", status="FAILED", error_code="EXIT_NONZERO") == 1
    assert value(after, "ckagent_task_duration_seconds_count", status="SUCCESS") == 1
    assert value(after, "ckagent_task_duration_seconds_count", status="FAILED") == 1
    assert value(after, "ckagent_task_queue_wait_seconds_count") == 2
    hits, misses = value(after, "ckagent_deps_cache_hits_total"), value(after, "ckagent_deps_cache_misses_total")
    assert hits + misses == 2
    assert value(after, "ckagent_deps_install_duration_seconds_count") == misses
    assert value(after, "ckagent_code_download_bytes_total") == len(blocking_zip) + len(failing_zip)
    assert value(after, "ckagent_items_shipped_total") == 7
    assert value(after, "ckagent_log_lines_shipped_total") == lines
    for gauge in ("ckagent_outbox_log_lines", "ckagent_outbox_items", "ckagent_outbox_results"):
        assert value(after, gauge) == 0, gauge
    assert value(after, "ckagent_free_slots") == 2
    claims = 0 if CLAIM_IN_POLL in agent.master.features else 2  # with claim-in-poll the poll answer claims
    assert value(after, "ckagent_master_requests_total", endpoint="claim", outcome="ok") == claims
    assert value(after, "ckagent_master_requests_total", endpoint="result", outcome="ok") == 2
    assert value(after, "ckagent_master_requests_total", endpoint="register", outcome="ok") == 1
    assert value(after, "ckagent_master_requests_total", endpoint="heartbeat", outcome="ok") >= 1
    assert value(after, "ckagent_master_request_duration_seconds_count", endpoint="claim") == claims
    assert claims or value(after, "ckagent_master_requests_total", endpoint="poll", outcome="ok") >= 2
    assert value(after, "ckagent_registered") == 1 and value(after, "ckagent_master_up") == 1
    assert value(after, "ckagent_heartbeat_age_seconds") < 3 * settings.heartbeat.interval
    for state in STATES:
        assert value(after, "ckagent_state", state=state) == (1 if state == "RUNNING" else 0), state
    build = [labels for (name, labels), v in after.items() if name == "ckagent_build_info" and v == 1]
    assert build and ("version", __version__) in build[0]
    assert value(after, "ckagent_node_info", name="test-node", node_id=agent.master.node_id or "") == 1
    # Bounded labels only: no task, spider or node id is a label value of a counter or histogram.
    for (name, labels), _ in after.items():
        if name != "ckagent_node_info":
            assert not {v for _, v in labels} & {ok_id, bad_id, agent.master.node_id}, name
    # Every documented metric is exported.
    exported = {name for name, _ in after}
    for name in METRIC_NAMES:
        assert name in exported or f"{name}_count" in exported, name


async def test_probes_status_and_unknown_paths(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    with trio.fail_after(40):
        async with running_agent(nursery, settings) as agent, status_client(agent) as client:
            health = await client.get("/healthz")
            assert (health.status_code, health.text) == (200, "ok\n")

            async def ready() -> bool:
                return (await client.get("/readyz")).status_code == 200

            await eventually(ready, 10, "/readyz 200")
            assert (await client.get("/readyz")).text == "ready\n"
            for path in ("/metrics/", "/status.json", "/admin", "/healthz/x", "/tasks/nope/log.txt",
                         "/tasks/../state.db/log.txt"):
                assert (await client.get(path)).status_code == 404, path
            page = await client.get("/")  # the status page (tests/test_statuspage.py)
            assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
            refused = await client.post("/metrics")
            assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD"
            head = await client.head("/metrics")
            assert head.status_code == 200 and head.content == b""
            om = await client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
            assert om.headers["content-type"].startswith("application/openmetrics-text")
            assert om.text.rstrip().endswith("# EOF")
            doc = (await client.get("/status")).json()
            assert doc["ready"] is True and doc["registered"] is True and doc["runningTasks"] == []
            assert doc["outbox"] == {"logLines": 0, "items": 0, "results": 0, "tasks": 0, "bytes": 0,
                                     "oldestSeconds": 0.0, "backlog": []}
            text = (await client.get("/status")).text + (await client.get("/metrics")).text
            assert dev_master.registration_token not in text
            assert agent.master._api_key and agent.master._api_key not in text
            # The master was told the real port (0 in the settings).
            (node,) = await dev_master.admin.list_nodes()
            assert node["port"] == agent.status_port
        # The port closes with the agent.
        assert agent.state == "STOPPED"
        async with httpx.AsyncClient() as fresh:
            with pytest.raises(httpx.ConnectError):
                await fresh.get(f"http://127.0.0.1:{agent.status_port}/healthz")


async def test_busy_port_stops_the_agent_with_a_clear_message(
    dev_master, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                                  AGENT_PORT=str(port))
        with trio.fail_after(20), pytest.raises(StartupError) as info:
            await Agent(settings).run()
    assert info.value.exit_code == 1
    message = str(info.value)
    assert f"cannot listen on 127.0.0.1:{port}" in message and "AGENT_PORT" in message
    assert await dev_master.admin.list_nodes() == []  # it stopped before registering


async def test_readyz_follows_the_master_away_and_back(
    dev_master_process, nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    base_url = await dev_master_process.start()
    settings = agent_settings(tmp_path / "agent", base_url, dev_master_process.registration_token)
    limit = 3 * settings.heartbeat.interval
    with trio.fail_after(90):
        async with running_agent(nursery, settings) as agent, status_client(agent) as client:

            async def readyz(code: int) -> httpx.Response | None:
                response = await client.get("/readyz")
                return response if response.status_code == code else None

            await eventually(lambda: readyz(200), 10, "/readyz 200")
            down_at = trio.current_time()  # (gone from the moment its stop begins: the stop waits for the exit)
            await dev_master_process.stop()
            answer = await eventually(lambda: readyz(503), limit + 10, "/readyz 503 with the master gone")
            assert trio.current_time() - down_at >= limit - settings.heartbeat.interval
            assert "heartbeat" in answer.text and "unreachable" in answer.text, answer.text
            samples = await scrape(client)
            assert value(samples, "ckagent_master_up") == 0
            assert value(samples, "ckagent_heartbeat_age_seconds") > limit
            assert value(samples, "ckagent_master_requests_total", endpoint="heartbeat", outcome="error") >= 1
            assert (await client.get("/healthz")).status_code == 200  # alive, just not ready
            assert (await client.get("/status")).json()["ready"] is False

            assert await dev_master_process.start(same_port=True) == base_url
            await eventually(lambda: readyz(200), 15, "/readyz 200 after the master returned")
            assert value(await scrape(client), "ckagent_master_up") == 1
    # The outage was logged once going down and once coming back, not once per failed attempt.
    messages = [r.getMessage() for r in caplog.records if r.name == "ckagent.master.client"]
    assert len([m for m in messages if m.startswith("master unreachable")]) == 1, messages
    back = [m for m in messages if m.startswith("master reachable again")]
    assert len(back) == 1 and "failed attempts" in back[0], messages


async def test_readiness_rules(autojump_clock: trio.abc.Clock) -> None:
    """The /readyz decision on its own (a statistics record stands in for the agent; the rules are
    pure logic over trio time)."""
    stats = AgentStatistics(state="STARTING", name="n", node_id=None, registered=False, master_up=True,
                            heartbeat_last_success=None, heartbeat_interval=10.0, max_workers=1, free_slots=1)
    status = AgentStatus(lambda: stats, AgentMetrics("0", "n"), None)

    def check(**changes: Any) -> tuple[bool, str]:
        nonlocal stats
        stats = dataclasses.replace(stats, **changes)
        answer = status.readiness()
        return answer.ready, answer.reason

    assert check() == (False, "not ready: the agent is STARTING")
    assert check(state="RUNNING") == (False, "not ready: not registered with the master yet")
    assert check(registered=True) == (False, "not ready: no heartbeat acknowledged by the master yet")
    beat = trio.current_time()
    await trio.sleep(30)
    assert check(heartbeat_last_success=beat) == (True, "ready")  # exactly 3 intervals: still ready
    await trio.sleep(0.5)
    ready, reason = check(master_up=False)
    assert not ready and "30.5 s ago (limit 30 s = 3 x heartbeat.interval)" in reason and "unreachable" in reason
    assert check(heartbeat_last_success=trio.current_time()) == (True, "ready")
    assert check(intake_reason="free disk below its floor") == (False, "not ready: free disk below its floor")
    assert check(intake_reason=None, master_problem="registration refused: 401") == (True, "ready")  # brief
    await trio.sleep(0.1)
    assert check(master_problem_age=30.1) == (False, "not ready: registration refused: 401")
    assert check(state="STARTING") == (False, "not ready: registration refused: 401")
    stats = dataclasses.replace(stats, master_problem=None)
    for state in ("DRAINING", "TERMINATING", "STOPPING", "STOPPED"):
        assert check(state=state) == (False, f"not ready: the agent is {state}")
    assert status.heartbeat_age() == pytest.approx(0.1)


async def test_the_port_listens_at_once_and_answers_when_serving_may_start() -> None:
    """serve_status reports its port as soon as it listens; with ``serve_after`` (the agent: its first
    heartbeat) a request made meanwhile waits in the backlog and is answered once serving starts."""
    go = trio.Event()
    routes = StatusRoutes(metrics=_unused_metrics, readiness=lambda: Readiness(True), status=_empty_status)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_status, routes, "127.0.0.1", 0, serve_after=go.wait))
            answers: list[httpx.Response] = []
            answered = trio.Event()

            async def ask() -> None:
                async with httpx.AsyncClient(timeout=10) as client:
                    answers.append(await client.get(f"http://127.0.0.1:{port}/healthz"))
                answered.set()

            nursery.start_soon(ask)
            await trio.sleep(0.3)
            assert answers == [], "nothing answers before serving starts"
            go.set()
            await answered.wait()
            assert (answers[0].status_code, answers[0].text) == (200, "ok\n")
            nursery.cancel_scope.cancel()
        # Cancelled before serving ever started: the socket is closed all the same.
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_status, routes, "127.0.0.1", 0, serve_after=trio.sleep_forever))
            nursery.cancel_scope.cancel()
        async with httpx.AsyncClient() as fresh:
            with pytest.raises(httpx.ConnectError):
                await fresh.get(f"http://127.0.0.1:{port}/healthz")


async def test_the_status_port_logs_its_address_not_hypercorns_chatter(caplog: pytest.LogCaptureFixture) -> None:
    """One INFO line of ours with the address; not hypercorn's "Running on ... (CTRL + C to quit)"."""
    caplog.set_level(logging.DEBUG)
    routes = StatusRoutes(metrics=_unused_metrics, readiness=lambda: Readiness(True), status=_empty_status)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_status, routes, "127.0.0.1", 0)
            async with httpx.AsyncClient(timeout=10) as client:
                assert (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
            nursery.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "Running on" in m or "CTRL" in m], messages
    ours = [r.getMessage() for r in caplog.records if r.name.startswith(("ckagent.port.status", "hypercorn"))]
    assert [m for m in ours if f"http://127.0.0.1:{port}" in m] == [
        f"status server on http://127.0.0.1:{port} (/metrics /healthz /readyz /status)"]
    # hypercorn's warnings and errors still reach the log.
    logging.getLogger("ckagent.port.status.hypercorn").warning("a real hypercorn warning")
    assert caplog.records[-1].getMessage() == "a real hypercorn warning"


async def _unused_metrics(accept: str) -> tuple[bytes, str]:
    raise AssertionError("not scraped in this test")


async def _empty_status() -> dict[str, Any]:
    return {}
