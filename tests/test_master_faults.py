"""Every answer class of the master boundary, end to end: agent → FaultProxy (real sockets) → dev master.

For each class (tests/faultproxy.py modes: a captive portal's 200 text/html, truncated JSON, JSON of
the wrong shape, 429, 503, 401, another 4xx in the protocol's words, a 404 page of a misrouted
ingress, a reset connection, no answer at all), lasting some seconds:

1. at start-up, on registration: the agent waits, /readyz names the cause, then it registers;
2. while a task streams lines and items and ends, on every node call (heartbeat, poll, logs, items,
   result): the agent keeps running, logs the trouble once (one WARNING line of ckagent.master.client per
   episode), /readyz names it, and once the proxy behaves the task's lines, items and result reach
   the master complete, once, in order (the result's counts are the master's counts);
3. on the claim of the next task (in the poll, with claim-in-poll): the task still runs, once, when
   the proxy behaves.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from faultproxy import CALLS, FaultProxy
from harness import agent_settings, running_agent, submit

from ckagent.agent import Agent
from ckagent.delivery import LineSplitter, Masker, decode_lines
from ckagent.master.protocol import CLAIM_IN_POLL

FAULT_SECONDS = 5.0
"""How long each fault lasts: more than /readyz's limit (3 heartbeat intervals of 1 s)."""

SPIDER = r"""
import time
import crawlerkeeper_sdk as ck
for i in range(300):
    print(f"line {i:04d}", flush=True)
    if i % 10 == 0:
        ck.save_item({"n": i})
    time.sleep(0.02)
"""

CAUSES = {
    "html": "master answers 200 text/html to",
    "truncated": "truncated JSON",
    "wrong_shape": "wrong shape",
    "429": "master unavailable",
    "503": "answered 503 text/html",
    "401": "with 401 even after registering again",
    "403": "with 403 (blocked by the proxy)",  # then: "that request fails", or for task data "… sent again"
    "404_html": "master answers 404 text/html to",
    "reset": "master unreachable",
    "timeout": "master unreachable",
}
"""What /readyz (and the episode's log line) says for each mode while the agent runs."""
STARTUP_CAUSES = {**CAUSES, "401": "registration refused: 401, check AGENT_REGISTRATION_TOKEN"}
"""The same at registration (a 403 in the protocol's words refuses registration for good: not tried)."""


def output_lines(task_dir: Path) -> list[str]:
    splitter = LineSplitter()
    data = (task_dir / "output.log").read_bytes()
    return decode_lines(splitter.feed(data)[0] + splitter.flush()[0], Masker([]))


def items_of(task_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (task_dir / "items.jsonl").read_text().splitlines()]


async def eventually(check: Any, seconds: float, what: str) -> Any:
    """Poll ``check()`` (async, truthy when done) every 0.1 s for up to ``seconds``; returns its value."""
    with trio.move_on_after(seconds):
        while True:
            result = await check()
            if result:
                return result
            await trio.sleep(0.1)
    raise AssertionError(f"not within {seconds} s: {what}")


def master_warnings(caplog: pytest.LogCaptureFixture, since: int) -> list[str]:
    return [r.getMessage() for r in caplog.records[since:] if r.name == "ckagent.master.client" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("mode", list(CAUSES))
async def test_the_agent_survives_every_answer_class_and_delivers_everything(
    mode: str, dev_master: Any, nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    proxy = FaultProxy(int(dev_master.base_url.rsplit(":", 1)[1]))
    proxy_port = await nursery.start(proxy.serve)
    settings = agent_settings(tmp_path / "agent", f"http://127.0.0.1:{proxy_port}", dev_master.registration_token,
                              AGENT_SERVER_REQUEST_TIMEOUT="2")
    agent = Agent(settings)
    exit_codes: list[int] = []
    stopped = trio.Event()

    async def run() -> None:
        exit_codes.append(await agent.run())
        stopped.set()

    # A protocol-worded refusal of registration is final (RegistrationRefused, exit 1): not a fault here.
    startup_calls = set() if mode == "403" else {"register"}
    proxy.set(mode, startup_calls)
    mark = len(caplog.records)
    nursery.start_soon(run)
    with trio.fail_after(120):
        while agent.status_port is None:  # noqa: ASYNC110 - set once the port listens; no event for it
            await trio.sleep(0.02)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}") as status:

            async def readyz_names(cause: str) -> str | None:
                answer = await status.get("/readyz")
                return answer.text if answer.status_code == 503 and cause in answer.text else None

            # 1. registration under the fault
            if startup_calls:
                cause = STARTUP_CAUSES[mode]
                text = await eventually(lambda: readyz_names(cause), FAULT_SECONDS, f"/readyz names {mode}")
                assert text.startswith("not ready: ")
                assert not stopped.is_set()
                warnings = master_warnings(caplog, mark)
                assert len(warnings) == 1 and cause in warnings[0], warnings
            proxy.heal()
            with trio.fail_after(30):
                await agent.started.wait()

            # 2. every node call under the fault while a task streams and ends
            task_id = await submit(dev_master.admin, "talker", {"main.py": SPIDER})

            async def streaming() -> bool:
                return (await dev_master.admin.get_task(task_id))["storedLogLines"] >= 40

            await eventually(streaming, 30, "the task streams")
            mark = len(caplog.records)
            faulted_at = trio.current_time()
            proxy.set(mode, CALLS - {"register", "claim", "download", "spider_files", "spider_file"})
            await eventually(lambda: readyz_names(CAUSES[mode]), FAULT_SECONDS + 2, f"/readyz names {mode}")
            await trio.sleep_until(faulted_at + FAULT_SECONDS)
            assert proxy.faulted("heartbeat", faulted_at) and proxy.faulted("logs", faulted_at), proxy.seen[-20:]
            proxy.heal()
            task = await dev_master.admin.wait_task_final(task_id, 60)
            await eventually(lambda: _ready(status), 15, "/readyz 200 again")
            warnings = master_warnings(caplog, mark)
            assert len(warnings) == 1 and CAUSES[mode] in warnings[0], warnings
            assert not stopped.is_set() and agent.state == "RUNNING"

            task_dir = tmp_path / "agent" / "tasks" / task_id
            logs = await dev_master.admin.get_logs(task_id)
            assert task["status"] == "SUCCESS", task
            assert logs == output_lines(task_dir)  # complete, once, in order
            assert [line for line in logs if line.startswith("line ")] == [f"line {i:04d}" for i in range(300)]
            items = await dev_master.admin.get_items(task_id)
            assert items == items_of(task_dir) == [{"n": n} for n in range(0, 300, 10)]
            assert task["logLines"] == len(logs) and task["itemCount"] == len(items)

            # 3. the claim of the next task under the fault (it travels in the poll with claim-in-poll)
            claim_call = "poll" if CLAIM_IN_POLL in agent.master.features else "claim"
            proxy.set(mode, {claim_call})
            claimed_at = trio.current_time()
            second = await submit(dev_master.admin, "second", {"main.py": "print('second')\n"})

            async def claim_faulted() -> bool:
                return proxy.faulted(claim_call, claimed_at) >= 2

            await eventually(claim_faulted, 20, "the claim meets the fault")
            proxy.heal()
            assert (await dev_master.admin.wait_task_final(second, 60))["status"] == "SUCCESS"
            assert not stopped.is_set()
    agent.terminate()
    with trio.fail_after(30):
        await stopped.wait()
    assert exit_codes == [0]
    tracebacks = [r for r in caplog.records if r.exc_info and r.name.startswith("ckagent")]
    assert not tracebacks, [r.getMessage() for r in tracebacks]


async def _ready(status: httpx.AsyncClient) -> bool:
    return (await status.get("/readyz")).status_code == 200


FLOOD = r"""
import sys, time
for i in range(40_000):
    sys.stdout.write(f"flood {i:05d}\n")
    if i % 2000 == 1999:
        sys.stdout.flush()
        time.sleep(0.05)
"""


async def test_a_portal_page_on_logs_alone_mid_task_loses_no_line(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's report: HTML on /logs alone for some seconds while a spider prints 40,000 lines
    used to kill the task's delivery (JSONDecodeError) and stop reading its output."""
    caplog.set_level(logging.INFO)
    proxy = FaultProxy(int(dev_master.base_url.rsplit(":", 1)[1]))
    proxy_port = await nursery.start(proxy.serve)
    settings = agent_settings(tmp_path / "agent", f"http://127.0.0.1:{proxy_port}", dev_master.registration_token)
    async with running_agent(nursery, settings) as agent:
        task_id = await submit(dev_master.admin, "flood", {"main.py": FLOOD})

        async def streaming() -> bool:
            return (await dev_master.admin.get_task(task_id))["storedLogLines"] >= 1000

        await eventually(streaming, 30, "the flood streams")
        mark = len(caplog.records)
        proxy.set("html", {"logs"})
        faulted_at = trio.current_time()
        await trio.sleep(FAULT_SECONDS)
        proxy.heal()
        assert proxy.faulted("logs", faulted_at) >= 2
        task = await dev_master.admin.wait_task_final(task_id, 90)
        assert agent.state == "RUNNING"
    logs = await dev_master.admin.get_logs(task_id)
    assert [line for line in logs if line.startswith("flood ")] == [f"flood {i:05d}" for i in range(40_000)]
    assert logs == output_lines(tmp_path / "agent" / "tasks" / task_id)
    assert task["status"] == "SUCCESS" and task["logLines"] == len(logs)
    warnings = master_warnings(caplog, mark)
    # Lines go in node batches when the master offers them (ckagent.delivery.nodebatch), else per task.
    assert len(warnings) == 1 and warnings[0].startswith(
        ("master answers 200 text/html to logs", "master answers 200 text/html to batches")), warnings
