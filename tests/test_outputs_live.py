"""Declared JSON Lines item files stream while the task runs, across a kill -9 of the agent.

Real agent process, real reference master (its SQLite file), real spider processes. The spider
writes its items to ``out.jsonl`` in its working directory (declared ``outputs.items``), never to
``CK_ITEMS_FILE``: its items must reach the master while it runs, and every one of them exactly once
and in order when the agent is killed mid-stream and started again (the task re-adopted).
"""

from __future__ import annotations

import signal
import textwrap
import time
from pathlib import Path

import trio
from harness import spider_zip
from test_shutdown import agent_process, wait_exit
from test_supervision import eventually

ITEMS = 3000

# Writes 100 items, waits for "go" in its task dir (bounded), then writes the rest in small steps.
WRITER = textwrap.dedent(f"""
    import json, os, time
    go = os.path.join(os.environ["CK_TASK_DIR"], "go")
    with open("out.jsonl", "a") as out:
        for i in range({ITEMS}):
            out.write(json.dumps({{"n": i}}) + "\\n")
            out.flush()
            if i == 99:
                print("first hundred written", flush=True)
                for _ in range(1200):  # at most a minute
                    if os.path.exists(go):
                        break
                    time.sleep(0.05)
            elif i > 99 and i % 50 == 0:
                time.sleep(0.05)
    print("all written", flush=True)
""")


async def _registered(admin, agent) -> None:
    """The agent process registered and beat (two minutes at most: a loaded machine starts it slowly)."""
    with trio.fail_after(120):
        while not [n for n in await admin.list_nodes() if n["name"] == "proc-node" and n.get("lastHeartbeat")]:
            assert agent.process is not None and agent.process.returncode is None, agent.log_text()[-3000:]
            await trio.sleep(0.2)


async def _items(admin, task_id: str) -> list[int]:
    return [item["n"] for item in await admin.get_items(task_id)]


async def test_a_declared_jsonl_file_streams_live_and_survives_a_kill_9(dev_master, tmp_path: Path) -> None:
    admin = dev_master.admin
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token)
    await agent.start()
    try:
        await _registered(admin, agent)
        spider_id = await admin.create_spider(name="live-writer", framework="python",
                                              outputs={"items": ["*.jsonl"]})
        await admin.upload_package(spider_id, spider_zip({"main.py": WRITER}))
        task_id = str(await admin.create_task(spider_id))
        task_dir = tmp_path / "node" / "data" / "tasks" / task_id

        async def hundred_at_master() -> bool:
            return len(await _items(admin, task_id)) == 100

        await eventually(hundred_at_master, 60)  # while the spider waits: it has not ended
        assert (await admin.get_task(task_id))["status"] == "RUNNING"
        assert await _items(admin, task_id) == list(range(100))
        (task_dir / "go").touch()

        async def mid_stream() -> bool:
            link = next((task_dir / "item-files").glob("*out.jsonl"), None)
            return link is not None and link.stat().st_size > 20_000

        await eventually(mid_stream, 60)
        await agent.kill()  # kill -9 while the file grows and its items are on their way
        await trio.sleep(1.0)  # the spider writes on while no agent runs
        await agent.start()
        started = time.monotonic()
        final = await admin.wait_task_final(task_id, 120)
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 30) == 0
    finally:
        with trio.move_on_after(10, shield=True):
            await agent.kill()
    assert final["status"] == "SUCCESS", final
    assert await _items(admin, task_id) == list(range(ITEMS)), "every item once, in order"
    assert final["itemCount"] == ITEMS, final
    logs = await admin.get_logs(task_id)
    assert any("streaming the items of out.jsonl while the task runs" in line for line in logs), logs[-10:]
    assert any(f"outputs: out.jsonl → {ITEMS} items" in line for line in logs), logs[-10:]
    assert any("re-adopted after an agent restart" in line for line in logs), logs[-10:]
    assert time.monotonic() - started < 120
    journal = (task_dir / "items.journal").read_text().splitlines()
    assert journal[0] == "S 0 items.jsonl" and journal[-1] == "E", journal
