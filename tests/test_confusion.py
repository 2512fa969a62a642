"""The smaller ways a master (or something in its place) can confuse the node (issue 36, item 5).

Real agents, the real reference master, a fault proxy between them on 127.0.0.1 (tests/faultproxy.py).

| what happens | expected |
| --- | --- |
| the final result is answered ``200 {}`` (a misrouted gateway) | not an acknowledgement: sent again until the master names the task's status |
| a task's args, env or params over the kernel's exec limits | FAILED/BAD_TASK naming the field and the limit (MAX_ARG_STRLEN, ARG_MAX) |
| every log and item batch answered 403 ``{"error"}`` (not an explicit drop) | after ``server.refusal_timeout`` the result says ``incomplete`` with the master's reason |
"""

from __future__ import annotations

import errno
import json
import re
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from faultproxy import FaultProxy
from harness import agent_settings, eventually, running_agent, spider_zip, submit
from hypothesis import given, settings
from hypothesis import strategies as st

from ckagent.agent import Agent
from ckagent.delivery.itemscan import scan_oversize
from ckagent.delivery.lines import encode_item
from ckagent.delivery.pending import Pending
from ckagent.delivery.readers import _FileReader
from ckagent.master.protocol import Task
from ckagent.task.execlimits import BadTaskError, arg_max, check_exec_size, max_arg_strlen

RUN_ONCE = "import os\nwith open(os.path.join(os.environ['CK_DATA_DIR'], 'runs.txt'), 'a') as f:\n    f.write('ran\\n')\n"


@asynccontextmanager
async def behind_proxy(dev_master: Any, nursery: trio.Nursery, tmp_path: Path,
                       **env: str) -> AsyncIterator[tuple[FaultProxy, Agent]]:
    """A fault proxy in front of the dev master and an agent talking through it."""
    proxy = FaultProxy(int(dev_master.base_url.rsplit(":", 1)[1]))
    port = await nursery.start(proxy.serve)
    settings = agent_settings(tmp_path / "agent", f"http://127.0.0.1:{port}", dev_master.registration_token, **env)
    async with running_agent(nursery, settings) as agent:
        yield proxy, agent


@pytest.mark.slow
async def test_a_200_empty_object_to_the_result_is_not_an_acknowledgement(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    admin = dev_master.admin
    with trio.fail_after(120):
        async with behind_proxy(dev_master, nursery, tmp_path) as (proxy, _agent):
            proxy.set("empty_object", ["result"])
            task_id = await submit(admin, "quick", {"main.py": RUN_ONCE})

            async def sent_again() -> bool:
                return proxy.faulted("result") >= 3

            await eventually(sent_again, 60, "the result sent again after a 200 {}")
            assert (await admin.get_task(task_id))["status"] == "RUNNING"  # the master never got it
            proxy.heal()
            task = await admin.wait_task_final(task_id, 60)
    assert task["status"] == "SUCCESS" and task["logLines"] >= 1, task
    # Taken for an acknowledgement, the result would end the task on the node: its next heartbeat
    # would not name it, the master would hand it out again and it would run again.
    runs = [p.read_text() for p in (tmp_path / "agent" / "spider-data").glob("*/runs.txt")]
    assert runs == ["ran\n"], runs


# ------------------------------------------------------------------- task params over the exec limits


def _task(**fields: Any) -> Task:
    return Task(id="t1", spider_id="s1", spider_name="shop", framework="python", **fields)


def _kernel_takes(argv: list[str], env: dict[str, str]) -> bool:
    """Whether the kernel execs ``argv`` with ``env`` (False: E2BIG) — /bin/true, for real."""
    try:
        subprocess.run(["/bin/true", *argv], env=env, check=True, timeout=10)
    except OSError as exc:
        if exc.errno == errno.E2BIG:
            return False
        raise
    return True


@settings(max_examples=40, deadline=None)
@given(arg_sizes=st.lists(st.integers(0, 200_000), max_size=24),
       env_sizes=st.lists(st.integers(0, 200_000), max_size=24), text=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=3))
def test_the_exec_check_refuses_what_the_kernel_refuses(arg_sizes: list[int], env_sizes: list[int],
                                                        text: str) -> None:
    """Whatever the sizes: the check refuses everything the kernel refuses (E2BIG, tried for real),
    naming a task field, and lets through what is clear of the kernel's limits by its reserve."""
    args = [(text * (n // len(text.encode()) + 1))[:n] for n in arg_sizes]
    env = {f"V{i}": "v" * n for i, n in enumerate(env_sizes)}
    task = _task(args=args, env=env)
    full_env = {"PATH": "/usr/bin:/bin", **env}
    try:
        check_exec_size(task, ["/bin/true", *args], full_env)
    except BadTaskError as exc:
        assert re.search(r"(args\[\d+\]|env\.V\d+|args) ", str(exc)), str(exc)
        assert "MAX_ARG_STRLEN" in str(exc) or "ARG_MAX" in str(exc)
        return
    assert _kernel_takes(args, full_env)


def test_the_check_names_the_field_and_the_limit() -> None:
    strlen = max_arg_strlen()
    with pytest.raises(BadTaskError, match=rf"^args\[1\] is {strlen} bytes .*MAX_ARG_STRLEN = {strlen - 1} bytes"):
        check_exec_size(_task(args=["a", "x" * strlen]), ["scrapy", "a", "x" * strlen], {})
    with pytest.raises(BadTaskError, match=r"^env\.BIG is .*MAX_ARG_STRLEN"):
        check_exec_size(_task(env={"BIG": "x" * strlen}), ["scrapy"], {"BIG": "x" * strlen})
    big = {"P": "y" * (strlen - 10)}
    with pytest.raises(BadTaskError, match=r"^params is .*MAX_ARG_STRLEN"):
        check_exec_size(_task(params=big), ["scrapy"], {"CK_PARAMS": json.dumps(big)})
    many = {f"E{i}": "z" * 100_000 for i in range(30)}
    with pytest.raises(BadTaskError, match=rf"^env\.E\d+ makes .*ARG_MAX = {arg_max()} bytes"):
        check_exec_size(_task(env=many), ["scrapy"], many)
    check_exec_size(_task(args=["x" * (strlen - 1)]), ["scrapy", "x" * (strlen - 1)], {})  # just under: taken


async def test_params_over_the_kernels_limits_are_bad_task_naming_field_and_limit(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    admin = dev_master.admin
    strlen = max_arg_strlen()
    spider_id = await admin.create_spider(name="argv", framework="python")
    await admin.upload_package(spider_id, spider_zip({"main.py": "import sys\nprint(len(sys.argv))\n"}))
    settings_ = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    with trio.fail_after(120):
        async with running_agent(nursery, settings_):
            one = await admin.create_task(spider_id, args=["x" * strlen])
            first = await admin.wait_task_final(one, 60)
            total = await admin.create_task(spider_id, env={f"E{i:02d}": "z" * 100_000 for i in range(30)})
            second = await admin.wait_task_final(total, 60)
            fine = await admin.create_task(spider_id, args=["x" * (strlen - 1)])
            third = await admin.wait_task_final(fine, 60)
    assert (first["status"], first["errorCode"]) == ("FAILED", "BAD_TASK"), first
    assert first["errorMessage"].startswith("args[0] is ") and f"MAX_ARG_STRLEN = {strlen - 1} bytes" in first[
        "errorMessage"], first
    assert (second["status"], second["errorCode"]) == ("FAILED", "BAD_TASK"), second
    assert re.match(r"env\.E\d\d makes", second["errorMessage"]) and f"ARG_MAX = {arg_max()}" in second[
        "errorMessage"], second
    assert third["status"] == "SUCCESS", third  # just under the limit for one string: run


# --------------------------------------------------------- a batch the master keeps refusing


REFUSED_SPIDER = r"""
import time
import crawlerkeeper_sdk as ck
for i in range(200):
    print(f"line {i:04d}", flush=True)
    ck.save_item({"n": i})
    if i % 50 == 49:
        time.sleep(0.2)
"""


@pytest.mark.slow
async def test_a_batch_refused_past_the_refusal_timeout_ends_incomplete_with_the_masters_reason(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    """403 {"error": …} in the protocol's words on every log and item batch (not an explicit drop:
    no 409, no element named): after ``server.refusal_timeout`` the streams end, the result says
    ``incomplete`` with the master's reason; the spool stays on the node."""
    admin = dev_master.admin
    with trio.fail_after(120):
        async with behind_proxy(dev_master, nursery, tmp_path, AGENT_SERVER_REFUSAL_TIMEOUT="2") as (proxy, _agent):
            proxy.set("403", ["logs", "items"])  # the result itself passes
            task_id = await submit(admin, "refused", {"main.py": REFUSED_SPIDER})
            task = await admin.wait_task_final(task_id, 90)  # today: never (retried forever)
        assert proxy.faulted("logs") + proxy.faulted("items") >= 2
    assert task["status"] == "SUCCESS" and task["incomplete"] is True, task
    reason = task["incompleteReason"]
    assert "403" in reason and "blocked by the proxy" in reason, reason
    assert all(int(s) >= 2 for s in re.findall(r"for (\d+) s", reason)) and "for " in reason, reason  # ≥ the timeout
    assert task["logLines"] == 0 and task["itemCount"] == 0, task  # what the master holds
    task_dir = tmp_path / "agent" / "tasks" / task_id
    assert (task_dir / "items.jsonl").exists() and (task_dir / "output.log").exists()  # the spool stays


# ------------------------------------------------------------- an item over the size limit


OVERSIZE_SPIDER = r"""
import json, os, sys, time
import crawlerkeeper_sdk as ck
ck.save_item({"n": 0})
with open(os.environ["CK_ITEMS_FILE"], "a") as f:  # 17 MiB in one item: over the agent's 16 MiB
    f.write(json.dumps({"n": 1, "blob": "x" * (17 << 20)}) + "\n")
if sys.argv[1] == "live":
    time.sleep(3)  # the items reader reaches it while the task runs
ck.save_item({"n": 2})
print("done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("when", ["live", "at_the_end"])
async def test_an_item_over_the_size_limit_is_said_in_the_task_log(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path, when: str
) -> None:
    """Once, in the task's own log at the master (not only a placeholder among its items), whether the
    items reader met it while the task ran or the task ended first."""
    admin = dev_master.admin
    settings_ = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    with trio.fail_after(120):
        async with running_agent(nursery, settings_):
            task_id = await submit(admin, "oversize", {"main.py": OVERSIZE_SPIDER}, args=[when])
            task = await admin.wait_task_final(task_id, 90)
    assert task["status"] == "SUCCESS", task
    items = await admin.get_items(task_id)
    assert [item.get("n") for item in items] == [0, None, 2] and "_invalidItem" in items[1], items
    logs = await admin.get_logs(task_id)
    said = [line for line in logs if "over the limit of 16777216 bytes" in line and "items.jsonl" in line]
    assert len(said) == 1, said
    size = (17 << 20) + len(json.dumps({"n": 1, "blob": ""})) + 1  # with its line end
    assert "placeholder" in said[0] and f"an item of {size} bytes in items.jsonl" in said[0], said


@settings(max_examples=80, deadline=None)
@given(lines=st.lists(st.tuples(st.integers(0, 300), st.sampled_from([b"\n", b"\r\n", b""])), max_size=12),
       skip=st.integers(0, 12))
def test_the_end_scan_finds_the_oversize_items_the_reader_replaces(
    tmp_path_factory: pytest.TempPathFactory, lines: list[tuple[int, bytes]], skip: int
) -> None:
    """Whatever the items file holds (lines of any length, any line end, a last line without one),
    the end-of-task scan from a line's start finds exactly the items the reader turns into
    placeholders from there (so each is said once, whichever meets it first)."""
    limit = 64
    data = b"".join(b"{" + b"x" * n + b"}" + (end or b"\n") for n, end in lines[:-1])
    if lines:
        n, end = lines[-1]
        data += b"{" + b"x" * n + b"}" + end
    path = tmp_path_factory.mktemp("items") / "items.jsonl"
    path.write_bytes(data)
    starts = [0] + [i + 1 for i, byte in enumerate(data) if byte == 0x0A]
    start = starts[min(skip, len(starts) - 1)]
    if start >= len(data) and data:
        start = 0

    async def read_all() -> list[tuple[int, int]]:
        reader = _FileReader(path, encode_item, limit, cr_breaks=False)
        found: list[tuple[int, int]] = []
        reader.oversize_notes.say = lambda text: found.append(
            tuple(int(n) for n in re.findall(r"an item of (\d+) bytes .*\(ending at byte (\d+)\)", text)[0]))
        await reader.restore({"offset": start})
        reader.finished = True
        pending = Pending()
        while not reader.done:
            await reader.read(pending)
        reader.close()
        return found

    assert scan_oversize(path, start, limit)[0] == trio.run(read_all)
