"""An attempt's streams (issue 38): they continue the task's numbering from ``itemSeqStart`` /
``logSeqStart`` while the spool counts from 0, carry their attempt, and end — shipping nothing more — when
the master answers 409 ``supersededBy`` (ckagent.delivery.shipper, ckagent.delivery.judging).

An in-memory master under the protocol's seq rules (harness.BatchMaster), real spool files and SQLite;
the autojump clock.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import BatchMaster, master_client

from ckagent.delivery import LogJournal, Masker, StreamShipper
from ckagent.node.state import AsyncStateStore, StateStore

KEPT = [{"n": i, "attempt": 1} for i in range(450)]
NEW = [{"n": i, "attempt": 2} for i in range(450, 1200)]
LINES = [f"attempt 2 line {i}" for i in range(300)]


@pytest.fixture
def store(tmp_path: Path) -> AsyncStateStore:
    return AsyncStateStore(StateStore(tmp_path / "state.db"))


def write_spool(task_dir: Path) -> None:
    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in NEW))
    (task_dir / "output.log").write_text("".join(f"{line}\n" for line in LINES))
    journal = LogJournal(task_dir)
    journal.open()
    journal.end({"output.log": (task_dir / "output.log").stat().st_size})
    journal.close()


async def shippers(fake: BatchMaster, store: AsyncStateStore, task_dir: Path) -> tuple[StreamShipper, StreamShipper]:
    master = master_client(fake)
    await master.register()  # once, before two streams post at the same instant
    logs = StreamShipper.logs(master, store, "t1", task_dir, Masker([]))
    items = StreamShipper.items(master, store, "t1", task_dir)
    items.seq_start, logs.seq_start = 450, 80
    items.attempt = logs.attempt = 2
    items.finish()
    return logs, items


async def run_both(logs: StreamShipper, items: StreamShipper) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(logs.run)
        nursery.start_soon(items.run)


async def test_an_attempts_streams_continue_the_tasks_numbering_and_say_their_attempt(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock
) -> None:
    fake = BatchMaster()
    fake.items = list(KEPT)  # the master kept attempt 1's items up to its checkpoint
    fake.logs = [f"attempt 1 line {i}" for i in range(80)]
    write_spool(tmp_path / "t1")
    logs, items = await shippers(fake, store, tmp_path / "t1")
    await run_both(logs, items)
    assert fake.items == KEPT + NEW
    assert fake.logs[80:] == LINES
    assert {seq for _, kind, seq, _ in fake.requests if kind == "items"} >= {450}
    assert min(seq for _, kind, seq, _ in fake.requests if kind == "logs") == 80
    assert set(fake.attempts) == {2}
    # The spool counts from 0: the stored positions are the attempt's own.
    assert (items.acked, logs.acked) == (len(NEW), len(LINES))
    assert (await store.stream_position("t1", "items"))[0] == len(NEW)


async def test_the_masters_expected_seq_is_read_in_the_tasks_numbering(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock
) -> None:
    fake = BatchMaster()
    fake.items = KEPT + NEW[:300]  # the master holds more than the spool's position says (a crash)
    fake.logs = [f"attempt 1 line {i}" for i in range(80)]
    write_spool(tmp_path / "t1")
    logs, items = await shippers(fake, store, tmp_path / "t1")
    await run_both(logs, items)
    assert fake.items == KEPT + NEW  # told 750: skipped the 300 it had, nothing twice
    assert items.acked == len(NEW)


async def test_a_superseded_attempt_ships_nothing_more(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock
) -> None:
    fake = BatchMaster()
    fake.items = list(KEPT)
    fake.logs = [f"attempt 1 line {i}" for i in range(80)]
    told: list[int] = []

    def fault(kind: str, seq: int, batch: list[Any]) -> httpx.Response | None:
        if kind == "items":
            return httpx.Response(409, json={"error": "task t1 moved on to attempt 3", "supersededBy": 3})
        return None

    fake.fault = fault
    write_spool(tmp_path / "t1")
    logs, items = await shippers(fake, store, tmp_path / "t1")
    items.on_superseded = told.append
    await run_both(logs, items)  # (no fail_after: the autojump clock would jump past it during a thread hop)
    assert items.superseded == 3 and told == [3] and not items.refused
    assert [seq for _, kind, seq, _ in fake.requests if kind == "items"] == [450]  # no retry after the 409
    assert fake.items == KEPT
