"""The smaller ways a master (or something in its place) can confuse the node (issue 36, item 5).

Real agents, the real reference master, a fault proxy between them on 127.0.0.1 (tests/faultproxy.py).

| what happens | expected |
| --- | --- |
| the final result is answered ``200 {}`` (a misrouted gateway) | not an acknowledgement: sent again until the master names the task's status |
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from faultproxy import FaultProxy
from harness import agent_settings, eventually, running_agent, submit

from ckagent.agent import Agent

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
