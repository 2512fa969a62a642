"""Checkpoints against the reference master over real HTTP on 127.0.0.1 (ckagent.resume with the agent's
real MasterClient and the in-process dev master): node A ships a JOBDIR (then only what grew), waits for
its items, hands the task over (MIGRATED); node B polls the next attempt, restores its checkpoint byte for
byte; node A's late checkpoint is superseded and its shipper stops. The logic's corners (every fault,
restarts): tests/test_resume_ship.py, tests/test_resume_restore.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio
from harness import make_spider, snapshot_tree

from ckagent.master.client import MasterClient
from ckagent.master.protocol import RegisterRequest, TaskResult, utc_now_iso
from ckagent.resume.restore import RestoreLimits, restore
from ckagent.resume.ship import CheckpointShipper
from ckagent.resume.snapshot import PackLimits

if TYPE_CHECKING:
    from conftest import DevMaster

CREATED = datetime(2026, 12, 5, 19, 0, tzinfo=timezone.utc)


def client_of(dev_master: DevMaster, name: str) -> MasterClient:
    def body() -> RegisterRequest:
        return RegisterRequest(name=name, ip="127.0.0.1", port=9, version="t", os="linux", arch="x86_64",
                               python="3", cpu_count=2, memory_total_bytes=1 << 30, max_workers=2)

    return MasterClient(dev_master.base_url, dev_master.registration_token, body, request_timeout=10)


@pytest.fixture
async def nodes(dev_master: DevMaster) -> AsyncIterator[tuple[MasterClient, MasterClient]]:
    a, b = client_of(dev_master, "node-a"), client_of(dev_master, "node-b")
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


def jobdir(seen: int) -> dict[str, bytes]:
    return {"jobdir/requests.seen": b"".join(hashlib.sha1(b"%d" % i).digest() + b"\r\n" for i in range(seen)),
            "jobdir/requests.queue/0": os.urandom(1500), "jobdir/requests.queue/active.json": b"[0]"}


async def test_a_checkpoint_travels_from_node_a_to_node_b_and_a_late_one_is_superseded(
        dev_master: DevMaster, nodes: tuple[MasterClient, MasterClient], tmp_path: Path) -> None:
    a, b = nodes
    with trio.fail_after(60):
        task_id = await dev_master.admin.create_task(await make_spider(dev_master.admin))
        [handed] = (await a.poll(5)).tasks
        assert handed.id == task_id and handed.attempt == 1
        await a.claim(task_id, TaskResult(status="RUNNING", started_at=utc_now_iso(), attempt=1))
        files = jobdir(100_000)  # 2.2 MB: three chunks of requests.seen
        task_dir = tmp_path / "node-a" / task_id
        snapshot_tree(task_dir, 1, files)
        ship = CheckpointShipper(a, task_id, task_dir, attempt=1, limits=PackLimits(1 << 30))
        async with trio.open_nursery() as nursery:
            await nursery.start(ship.run)
            await ship.submit(1, item_seq=0, log_seq=0, reason="interval", created=CREATED)
            assert await ship.wait_idle() == "1-1" and ship.sent_chunks == 5

            grown = {**files, "jobdir/requests.seen": files["jobdir/requests.seen"] + b"\x01" * 22 * 1000}
            snapshot_tree(task_dir, 2, grown)
            await ship.submit(2, item_seq=3, log_seq=0, reason="migrate", created=CREATED)
            with trio.move_on_after(2):  # the master holds no item yet: 409 storedItems, waited out
                await ship.wait_idle()
            assert ship.last is not None and ship.last.id == "1-1" and ship.pending == 1
            batch = json.dumps({"seq": 0, "items": [{"n": 0}, {"n": 1}, {"n": 2}], "attempt": 1}).encode()
            assert (await a.post_stream("items", task_id, batch)).accepted_seq == 3
            assert await ship.wait_idle() == "1-2" and ship.sent_chunks == 5 + 1  # only the grown chunk

            await a.report_result(task_id, TaskResult(status="FAILED", error_code="MIGRATED", attempt=1,
                                               checkpoint_id="1-2"))
            snapshot_tree(task_dir, 3, grown)  # attempt 1 keeps going on node A for a moment
            await ship.submit(3, item_seq=3, log_seq=0, reason="interval", created=CREATED)
            assert await ship.wait_idle() == "1-2"
            assert ship.superseded_by == 2
        # run() returned on its own: nothing more is shipped for attempt 1

        [next_attempt] = (await b.poll(5)).tasks
        assert next_attempt.id == task_id and next_attempt.attempt == 2
        assert next_attempt.checkpoint is not None and next_attempt.checkpoint.id == "1-2"
        assert next_attempt.item_seq_start == 3
        state = tmp_path / "node-b" / task_id / "state"
        state.parent.mkdir(parents=True)
        manifest = await restore(b, task_id, next_attempt.checkpoint, state, RestoreLimits(1 << 30))
        assert manifest.item_seq == 3 and manifest.reason == "migrate"
        assert {p.relative_to(state).as_posix(): p.read_bytes() for p in state.rglob("*") if p.is_file()} == grown
