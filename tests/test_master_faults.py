"""Every answer class of the master boundary: every fault as logic, one end-to-end case per class.

The faults are tests/faultproxy.py's modes: a captive portal's 200 text/html, truncated JSON, JSON of
the wrong shape, a 404 page of a misrouted ingress (the protocol-error class); 429, 503 (unavailable);
a reset connection, no answer at all (unreachable); 401 (unauthorized); another 4xx in the protocol's
words (rejected). Each lasts some seconds and is checked

1. at start-up, on registration: the agent waits, /readyz names the cause, then it registers;
2. while a task streams lines and items and ends, on every node call (heartbeat, poll, logs, items,
   result): the agent keeps running, logs the trouble once (one WARNING line of ckagent.master.client per
   episode), /readyz names it, and once the proxy behaves the task's lines, items and result reach
   the master complete, once, in order (the result's counts are the master's counts);
3. on the claim of the next task (in the poll, with claim-in-poll): the task still runs, once, when
   the proxy behaves.

As logic, every mode (:func:`test_every_fault_as_logic`): the real MasterClient, StreamShippers and
result sender on Trio's autojump clock against harness.MemoryMaster behind faultproxy.MockFaults,
which answers with the proxy's own bytes — (1) and (2), the cause /readyz shows being
``Connectivity.problem``. What the agent does with a fault depends only on what the client raises
for it (the exception and its cause), so :func:`test_each_fault_is_answered_as_its_class_is` holds
every mode to its class's representative, and the representatives (:data:`END_TO_END`) run end to
end (:func:`test_the_agent_survives_every_answer_class_and_delivers_everything`): the real agent →
FaultProxy (real sockets) → the reference master, with a spider, (1), (2) and (3).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from faultproxy import CALLS, FaultProxy, MockFaults
from harness import MemoryMaster, agent_settings, eventually, items_of, output_lines, running_agent, submit

from ckagent.agent import Agent
from ckagent.delivery import LogJournal, Masker, StreamShipper, send_result
from ckagent.master.client import MasterClient, MasterError, RegistrationRefused
from ckagent.master.endpoints import HEARTBEAT, LOGS
from ckagent.master.protocol import CLAIM_IN_POLL, HeartbeatResponse, RegisterRequest, TaskResult
from ckagent.node.state import AsyncStateStore, StateStore

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

CLASS_OF = {
    "html": "protocol", "truncated": "protocol", "wrong_shape": "protocol", "404_html": "protocol",
    "429": "unavailable", "503": "unavailable",
    "reset": "unreachable", "timeout": "unreachable",
    "401": "unauthorized",
    "403": "rejected",
}
"""The class of the boundary (ckagent/master/client.py's exception tree) each mode falls in."""
END_TO_END = {"protocol": "truncated", "unavailable": "503", "unreachable": "timeout", "unauthorized": "401",
              "rejected": "403"}
"""One mode per class runs end to end: truncated JSON (forwarded: the master stored what the agent
sends again), 503 text/html, no answer (held connections), 401, 403. The portal page has its own case
below (on logs alone, mid-flood)."""


def master_warnings(caplog: pytest.LogCaptureFixture, since: int) -> list[str]:
    return [r.getMessage() for r in caplog.records[since:] if r.name == "ckagent.master.client" and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------- every fault, as logic

TOKEN = "reg-token-SECRET-0123456789"
NODE_CALLS = CALLS - {"register", "claim", "download", "spider_files", "spider_file"}
"""The calls faulted while a task streams (the end-to-end case's set)."""
LINES = [f"line {i:05d}" for i in range(12_000)]  # three batches: the fault starts after the first
ITEMS = [{"n": n} for n in range(0, 12_000, 10)]


def register_body() -> RegisterRequest:
    return RegisterRequest(name="n1", ip="127.0.0.1", port=9000, version="0", os="linux", arch="x86_64",
                           python="3.11", cpu_count=2, memory_total_bytes=1 << 30, max_workers=2)


def memory_client(faults: MockFaults) -> MasterClient:
    """The agent's client as the end-to-end case configures it (2 s request timeout), on ``faults``."""
    return MasterClient("http://master.test", TOKEN, register_body, request_timeout=2.0,
                        transport=faults.transport())


async def heartbeat(master: MasterClient) -> HeartbeatResponse:
    return await master.call(HEARTBEAT, json={})


async def heartbeats(master: MasterClient) -> None:
    """Beat every second, as the heartbeat loop does: a classified failure is a missed beat."""
    while True:
        with contextlib.suppress(MasterError):
            await heartbeat(master)
        await trio.sleep(1)


def write_task(task_dir: Path) -> None:
    """A finished task's files: output.log with LINES, items.jsonl with ITEMS, the journal's end record."""
    task_dir.mkdir(parents=True)
    (task_dir / "output.log").write_text("".join(f"{line}\n" for line in LINES))
    (task_dir / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    journal = LogJournal(task_dir)
    journal.open()
    journal.end({"output.log": (task_dir / "output.log").stat().st_size})
    journal.close()


async def exception_of(mode: str) -> type[Exception]:
    """What the client raises for a log batch answered in ``mode`` (after registering). (A heartbeat
    answer may lack every field: the proxy's JSON of the wrong shape is a valid one.)"""
    faults = MockFaults(MemoryMaster())
    master = memory_client(faults)
    try:
        await master.register()
        faults.set(mode, {"logs"})
        with pytest.raises(MasterError) as info:
            await master.call(LOGS, {"task": "t1"}, json={"seq": 0, "lines": ["a"]})
        return type(info.value)
    finally:
        await master.aclose()


@pytest.mark.parametrize("mode", list(CAUSES))
async def test_each_fault_is_answered_as_its_class_is(mode: str, autojump_clock: trio.abc.Clock) -> None:
    """The agent's loops react to what the client raises: a mode that raises what its class's
    end-to-end representative raises meets, in the agent, what the representative met."""
    assert await exception_of(mode) is await exception_of(END_TO_END[CLASS_OF[mode]])


@pytest.mark.parametrize("mode", list(CAUSES))
@pytest.mark.usefixtures("inline_threads")  # virtual time must not pass while the state store writes
async def test_every_fault_as_logic(
    mode: str, autojump_clock: trio.abc.Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    memory = MemoryMaster()
    faulted_at: list[float] = []

    def master_then_fault(request: httpx.Request) -> httpx.Response:
        answer = memory(request)
        if request.url.path.endswith("/logs") and not faulted_at:  # mid-stream: after the first batch
            faulted_at.append(trio.current_time())
            faults.set(mode, NODE_CALLS)
        return answer

    faults = MockFaults(master_then_fault)
    master = memory_client(faults)

    # 1. registration under the fault: it waits, names the cause once, then registers
    mark = len(caplog.records)
    if mode == "403":  # in the protocol's words a refusal of registration is final (exit 1)
        faults.set(mode, {"register"})
        with pytest.raises(RegistrationRefused, match="blocked by the proxy"):
            await master.register()
        faults.heal()
        await master.register()
    else:
        faults.set(mode, {"register"})
        registered = trio.Event()

        async def register() -> None:
            await master.register()
            registered.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(register)
            await trio.sleep(FAULT_SECONDS)
            assert not registered.is_set()
            problem = master.connectivity.problem
            assert problem is not None and STARTUP_CAUSES[mode] in problem, problem
            warnings = master_warnings(caplog, mark)
            assert len(warnings) == 1 and STARTUP_CAUSES[mode] in warnings[0], warnings
            faults.heal()
            with trio.fail_after(60):
                await registered.wait()
    assert master.node_id == "n-1"

    # 2. every node call under the fault while a task's streams ship; then all of it, once, in order
    write_task(tmp_path / "t1")
    store = AsyncStateStore(StateStore(tmp_path / "state.db"))
    await store.add_task("t1", "s1", {}, tmp_path / "t1")
    logs = StreamShipper.logs(master, store, "t1", tmp_path / "t1", Masker([]))
    items = StreamShipper.items(master, store, "t1", tmp_path / "t1")
    items.finish()
    mark = len(caplog.records)
    async with trio.open_nursery() as beating:
        beating.start_soon(heartbeats, master)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(logs.run)
            nursery.start_soon(items.run)

            async def heal_after_the_fault() -> None:
                while not faulted_at:  # noqa: ASYNC110 - the fault starts inside the transport
                    await trio.sleep(0.01)
                await trio.sleep_until(faulted_at[0] + FAULT_SECONDS)
                problem = master.connectivity.problem
                assert problem is not None and CAUSES[mode] in problem, problem
                assert faults.faulted("heartbeat") and faults.faulted("logs"), faults.seen[-20:]
                assert memory.logs["t1"] != LINES  # the fault came mid-stream
                faults.heal()

            nursery.start_soon(heal_after_the_fault)
        assert memory.logs["t1"] == LINES and memory.items["t1"] == ITEMS  # complete, once, in order
        assert (logs.acked, items.acked) == (len(LINES), len(ITEMS))
        await trio.sleep(2)  # a heartbeat answers again
        beating.cancel_scope.cancel()
    assert master.connectivity.problem is None
    warnings = master_warnings(caplog, mark)
    assert len(warnings) == 1 and CAUSES[mode] in warnings[0], warnings

    # 3. the result under the fault: it waits, then reaches the master (JSON of the wrong shape too:
    # the answer to a final result names the task's status, ResultAccepted; any other object is none).
    faults.set(mode, {"result"})
    result = TaskResult(status="SUCCESS", exit_code=0, log_lines=len(LINES), item_count=len(ITEMS))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_result, master, store, "t1", result)
        await trio.sleep(FAULT_SECONDS)
        assert faults.faulted("result")
        assert ("t1" in memory.results) is (mode == "truncated")  # only a cut answer was forwarded
        faults.heal()
    assert memory.results["t1"] and all(r == result.to_json() for r in memory.results["t1"])
    assert await store.pending_delivery() == []
    await master.aclose()
    tracebacks = [r for r in caplog.records if r.exc_info and r.name.startswith("ckagent")]
    assert not tracebacks, [r.getMessage() for r in tracebacks]


OUTAGE_SECONDS = 60.0
"""Long enough for every backoff to reach its 30 s cap (virtual time: it costs nothing here)."""


@pytest.mark.usefixtures("inline_threads")  # see the fixture: a slow thread hop cost this test 55 s of virtual time
async def test_a_long_outage_ends_in_seconds_once_the_master_is_back(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """The logic of tests/test_delivery_faults.py's outage (a real 60 s there): the streams back off to
    the cap during a 60 s outage, and once the master answers again they finish within seconds, not
    after a whole capped backoff."""
    memory = MemoryMaster()
    faults = MockFaults(memory)
    master = memory_client(faults)
    await master.register()
    write_task(tmp_path / "t1")
    store = AsyncStateStore(StateStore(tmp_path / "state.db"))
    await store.add_task("t1", "s1", {}, tmp_path / "t1")
    logs = StreamShipper.logs(master, store, "t1", tmp_path / "t1", Masker([]))
    items = StreamShipper.items(master, store, "t1", tmp_path / "t1")
    items.finish()
    faults.set("reset", NODE_CALLS)
    async with trio.open_nursery() as beating:
        beating.start_soon(heartbeats, master)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(logs.run)
            nursery.start_soon(items.run)
            await trio.sleep(OUTAGE_SECONDS)
            assert "t1" not in memory.logs and faults.faulted("logs") >= 3
            faults.heal()
            back_at = trio.current_time()
        took = trio.current_time() - back_at
        beating.cancel_scope.cancel()
    assert memory.logs["t1"] == LINES and memory.items["t1"] == ITEMS
    assert took < 20, f"delivery resumed {took:.1f} s after the master came back"
    await master.aclose()


# --------------------------------------------------------------------------- one per class, end to end

@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(END_TO_END.values()))
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


@pytest.mark.slow
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
