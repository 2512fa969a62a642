"""Declared JSON Lines item files stream while the task runs, across a kill -9 of the agent.

Real agent process, real reference master (its SQLite file), real spider processes. The spider
writes its items to ``out.jsonl`` in its working directory (declared ``outputs.items``), never to
``CK_ITEMS_FILE``: its items must reach the master while it runs, and every one of them exactly once
and in order when the agent is killed mid-stream and started again (the task re-adopted).
"""

from __future__ import annotations

import json
import os
import random
import signal
import textwrap
import time
from pathlib import Path

import pytest
import trio
from harness import agent_process, eventually, spider_zip, wait_exit

from ckagent.code.workspace import Workspaces
from ckagent.delivery.journal import LogJournal
from ckagent.delivery.lines import encode_item
from ckagent.delivery.outputs import collect, itemfiles
from ckagent.delivery.outputs.live import LiveItemFiles
from ckagent.delivery.pending import Pending
from ckagent.delivery.readers import _ItemJournalReader
from ckagent.delivery.spool import ITEMS_FILE, ITEMS_JOURNAL
from ckagent.master.protocol import TaskOutputs

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


# ---------------------------------------------------------------------------------------------- logic


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    task_dir, work = tmp_path / "task", tmp_path / "work"
    task_dir.mkdir()
    work.mkdir()
    return task_dir, work


def _journal(task_dir: Path, notices: list[str]) -> LogJournal:
    journal = LogJournal(task_dir, ITEMS_JOURNAL, ITEMS_FILE, "item file")
    journal.open()
    journal.on_notice = notices.append
    return journal


def _sizes(task_dir: Path, live: LiveItemFiles) -> dict[str, int]:
    items = task_dir / ITEMS_FILE
    return {ITEMS_FILE: items.stat().st_size if items.exists() else 0, **live.scan()}


async def _stream(task_dir: Path, position: object = None) -> tuple[list[dict], _ItemJournalReader, Pending]:
    reader = _ItemJournalReader(task_dir, encode_item, 1 << 20)
    await reader.restore(position)
    pending = Pending()
    while not reader.done and await reader.read(pending):
        pass
    return [json.loads(e) for e in pending.encoded()], reader, pending


def _append(path: Path, *items: dict) -> None:
    with path.open("a") as out:
        out.write("".join(json.dumps(item) + "\n" for item in items))


async def test_the_items_stream_merges_items_jsonl_and_declared_files_and_resumes_exactly_once(tmp_path: Path) -> None:
    task_dir, work = _dirs(tmp_path)
    notices: list[str] = []
    journal = _journal(task_dir, notices)
    live = LiveItemFiles(task_dir, work, ["data/*.jsonl", "late.ndjson", "../outside.jsonl"])
    (work / "data").mkdir()
    _append(task_dir / ITEMS_FILE, {"sdk": 0})
    journal.note(_sizes(task_dir, live))
    _append(work / "data" / "a.jsonl", {"a": 0}, {"a": 1})
    journal.note(_sizes(task_dir, live))
    with (work / "data" / "a.jsonl").open("a") as out:
        out.write('{"a": 2}\n{"a": ')  # a line being written: not an item yet
    _append(task_dir / ITEMS_FILE, {"sdk": 1})
    journal.note(_sizes(task_dir, live))
    with (work / "data" / "a.jsonl").open("a") as out:
        out.write('3}\n')
    _append(work / "late.ndjson", {"late": 0})  # appears late
    journal.note(_sizes(task_dir, live))
    (tmp_path / "outside.jsonl").write_text('{"leak": 1}\n')
    assert [text.split(": ", 1)[1] for text in live.take_notices()] == [
        "streaming the items of data/a.jsonl while the task runs",
        "streaming the items of late.ndjson while the task runs"]
    journal.end(_sizes(task_dir, live))
    journal.close()
    everything, reader, _ = await _stream(task_dir)
    reader.close()
    # In the order the scans recorded growth (items.jsonl first within one scan), whole lines only.
    assert everything == [{"sdk": 0}, {"a": 0}, {"a": 1}, {"sdk": 1}, {"a": 2}, {"a": 3}, {"late": 0}]
    for k in range(1, len(everything)):  # resumed after any acknowledged item: the rest, once
        _, reader, pending = await _stream(task_dir)
        position = json.loads(json.dumps(reader.commit(pending.take(k))))  # as stored
        reader.close()
        rest, resumed, _ = await _stream(task_dir, position)
        resumed.close()
        assert rest == everything[k:], k


async def test_a_replaced_or_truncated_item_file_is_said_and_its_new_content_streamed(tmp_path: Path) -> None:
    task_dir, work = _dirs(tmp_path)
    notices: list[str] = []
    journal = _journal(task_dir, notices)
    live = LiveItemFiles(task_dir, work, ["out.jsonl"])
    reader = _ItemJournalReader(task_dir, encode_item, 1 << 20)
    await reader.restore(None)
    pending = Pending()

    async def step() -> None:  # a scan of the outbox, then the shipper reads what was recorded
        journal.note(_sizes(task_dir, live))
        notices.extend(live.take_notices())
        while await reader.read(pending):
            pass

    _append(work / "out.jsonl", {"v": 1}, {"v": 2})
    await step()
    tmp = work / "out.jsonl.tmp"
    _append(tmp, {"v": 3, "pad": "x" * 40})
    os.replace(tmp, work / "out.jsonl")  # written anew and renamed over: another inode
    await step()
    (work / "out.jsonl").write_text(json.dumps({"v": 4}) + "\n")  # truncated, written again (shorter)
    await step()
    journal.end(_sizes(task_dir, live))
    journal.close()
    while not reader.done and await reader.read(pending):
        pass
    reader.close()
    assert [json.loads(e)["v"] for e in pending.encoded()] == [1, 2, 3, 4]
    assert reader.done
    assert any("out.jsonl was replaced by a new file" in text for text in notices), notices
    assert any("item file item-files/1-out.jsonl shrank from 60 to 9 bytes" in text for text in notices), notices


def test_links_are_found_again_by_inode_and_symlinked_folders_are_not_followed(tmp_path: Path) -> None:
    task_dir, work = _dirs(tmp_path)
    secret = tmp_path / "secret"
    secret.mkdir()
    _append(secret / "s.jsonl", {"secret": 1})
    (work / "elsewhere").symlink_to(secret)
    _append(work / "out.jsonl", {"n": 1})
    first = LiveItemFiles(task_dir, work, ["**/*.jsonl", "elsewhere/s.jsonl"])
    assert first.scan() == {"item-files/0-out.jsonl": 9}
    again = LiveItemFiles(task_dir, work, ["**/*.jsonl"])  # a restarted agent re-adopting the task
    assert again.scan() == {"item-files/0-out.jsonl": 9}
    assert again.take_notices() == []  # nothing new to say
    assert sorted(os.listdir(task_dir / "item-files")) == ["0-out.jsonl"]


def test_collect_counts_a_streamed_file_and_does_not_append_it_again(tmp_path: Path) -> None:
    task_dir, work = _dirs(tmp_path)
    code = tmp_path / "code"
    code.mkdir()
    _append(work / "out.jsonl", {"n": 1}, {"n": 2})
    (work / "rows.json").write_text(json.dumps([{"r": 1}]))
    live = LiveItemFiles(task_dir, work, ["out.jsonl", "rows.json"])
    collected = collect(work=work, code_dir=code, since=0.0, task_dir=task_dir,
                        outputs=TaskOutputs(items=["out.jsonl", "rows.json"]), budget_bytes=0,
                        master_takes_artifacts=True, keep_dir=tmp_path / "kept", streamed=live.link)
    assert collected.items == [("out.jsonl", 2), ("rows.json", 1)]
    assert (task_dir / ITEMS_FILE).read_text() == '{"r": 1}\n'  # only the file read at the end (as written)
    assert (task_dir / "item-files" / "0-out.jsonl").read_text().count("\n") == 2


@pytest.mark.parametrize("chunk_bytes", [1, 3, 7, 1 << 20])
def test_count_lines_counts_the_lines_the_items_reader_makes_items_of(tmp_path: Path, monkeypatch,
                                                                      chunk_bytes: int) -> None:
    monkeypatch.setattr(itemfiles, "CHUNK_BYTES", chunk_bytes)
    rng = random.Random(chunk_bytes)
    for trial in range(300):
        parts = [rng.choice([b"{}", b"", b"  ", b"\t\r", b'{"a": 1}', b" x "]) for _ in range(rng.randint(0, 8))]
        data = b"\n".join(parts) + rng.choice([b"", b"\n"])
        path = tmp_path / f"{trial}.jsonl"
        path.write_bytes(data)
        lines = data.split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        assert itemfiles.count_lines(path.parent, path.name) == sum(1 for line in lines if line.strip()), data


def test_the_working_copies_of_re_adopted_tasks_survive_the_agent_start(tmp_path: Path) -> None:
    root = tmp_path / "spiders"
    (root / ".runs" / "adopted").mkdir(parents=True)
    (root / ".runs" / "adopted" / "out.jsonl").write_text("{}\n")
    (root / ".runs" / "crashed").mkdir()
    workspaces = Workspaces(root, None)  # type: ignore[arg-type] # no download here
    assert sorted(p.name for p in workspaces.runs.iterdir()) == ["adopted", "crashed"]
    assert workspaces.prune_runs([root / ".runs" / "adopted"]) == 1
    assert [p.name for p in workspaces.runs.iterdir()] == ["adopted"]
    assert (root / ".runs" / "adopted" / "out.jsonl").read_text() == "{}\n"


# ---------------------------------------------------------------------------------------------- end to end


async def _registered(admin, agent) -> None:
    """The agent process registered and beat (two minutes at most: a loaded machine starts it slowly)."""
    with trio.fail_after(120):
        while not [n for n in await admin.list_nodes() if n["name"] == "proc-node" and n.get("lastHeartbeat")]:
            assert agent.process is not None and agent.process.returncode is None, agent.log_text()[-3000:]
            await trio.sleep(0.2)


async def _items(admin, task_id: str) -> list[int]:
    return [item["n"] for item in await admin.get_items(task_id)]


@pytest.mark.slow
async def test_a_declared_jsonl_file_streams_live_and_survives_a_kill_9(dev_master, tmp_path: Path) -> None:
    admin = dev_master.admin
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token)
    await agent.start()
    async with agent:
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
