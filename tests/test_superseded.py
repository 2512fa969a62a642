"""A superseded attempt (issue 38): the master declared the node lost and moved the task on to a new
attempt while the node's spider still ran; when the node comes back, its next batch is answered 409
``supersededBy`` (and its heartbeat lists the task in ``cancelTaskIds``): the agent stops that attempt's
spider and nothing of it overwrites what the master decided (attempt 1 stays NODE_LOST); a newer attempt
offered to this very node meanwhile is given back and claimed again once the older one left. A real agent
process (frozen with SIGSTOP past the master's node-lost grace), a real spider, the reference master."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    agent_process,
    alive,
    eventually,
    no_strays,
    pids_in,
    submit,
    wait_for_log,
    wait_registered,
)
from harness.checkpointnode import short_grace_master

STEADY = textwrap.dedent("""
    import json, os, time
    print("spider", os.getpid(), flush=True)
    print("started", flush=True)
    n = 0
    while True:
        with open(os.environ["CK_ITEMS_FILE"], "a") as f:
            f.write(json.dumps({"n": n}) + "\\n")
        n += 1
        time.sleep(0.2)
""")

pytestmark = pytest.mark.slow


async def test_a_superseded_attempt_s_spider_is_stopped_and_its_end_is_not_the_task_s(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    master = await short_grace_master(nursery, tmp_path, node_lost_after=2.0)
    admin = master.admin
    agent = agent_process(tmp_path, master.base_url, master.registration_token)
    await agent.start()
    async with agent:
        with trio.fail_after(120):
            await wait_registered(admin, agent)
            task_id = await submit(admin, "steady", {"main.py": STEADY})
            [spider] = pids_in(await wait_for_log(admin, task_id, "started", timeout=60), "spider")
            agent.signal(signal.SIGSTOP)  # the node goes silent; its spider runs on
            try:
                async def moved_on() -> bool:
                    return int((await admin.get_task(task_id)).get("attempt") or 1) >= 2
                await eventually(moved_on, 30, "the master declares the node lost")
            finally:
                agent.signal(signal.SIGCONT)

            async def stopped() -> bool:
                return not alive(spider)
            await eventually(stopped, 30, "the superseded attempt's spider is stopped")

            async def attempt_2_runs() -> dict | None:  # (here: the node is back, its older attempt gone)
                task = await admin.get_task(task_id)
                return task if task["status"] == "RUNNING" and task["attempts"][-1]["attempt"] == 2 else None
            task = await eventually(attempt_2_runs, 30, "attempt 2 claimed again")
    first = task["attempts"][0]
    assert (first["attempt"], first["errorCode"]) == (1, "NODE_LOST"), task["attempts"]
    log = agent.log_text()
    # Whichever reached the node first: a stream's 409, the newer attempt handed to this very node in its
    # held poll's answer (given back until the older one has left), or the heartbeat's cancel.
    said = ("superseded by attempt 2: stopping this attempt's spider" in log
            or "the master moved this task on to attempt 2: this attempt's result" in log)
    assert said, log[-4000:]
