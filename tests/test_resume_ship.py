"""Shipping checkpoints (ckagent.resume.ship.CheckpointShipper), its logic against a master in memory
(harness.CheckpointMaster over ``httpx.MockTransport``, the real MasterClient) on Trio's autojump clock:
chunks once, the manifest once, incremental, every answer of the master (5xx, 429, garbage, timeouts,
409 missingChunks / storedItems / supersededBy, 404, 422), an agent restart mid-upload, a spider that
changes or plants things in its snapshots. Real HTTP against the reference master:
tests/test_resume_master.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import CheckpointMaster, checkpoint_client, snapshot_tree

from ckagent.resume.ship import UPLOADS, CheckpointShipper, MetaState
from ckagent.resume.snapshot import PackLimits

pytestmark = pytest.mark.usefixtures("inline_threads")

TASK = "t1"
CREATED = datetime(2026, 12, 5, 18, 0, tzinfo=timezone.utc)
LIMITS = PackLimits(max_bytes=1 << 30)


def seen(count: int, salt: str = "") -> bytes:
    return "".join(hashlib.sha1(f"{salt}{i}".encode()).hexdigest() + "\n" for i in range(count)).encode()


def jobdir(count: int, pending: int = 10) -> dict[str, bytes]:
    return {"jobdir/requests.seen": seen(count), "jobdir/requests.queue/p0": os.urandom(300) * pending,
            "jobdir/spider.state": b"\x80\x04}\x94."}


def shipper(master: CheckpointMaster, task_dir: Path, attempt: int = 1) -> CheckpointShipper:
    return CheckpointShipper(checkpoint_client(master), TASK, task_dir, attempt=attempt, limits=LIMITS)


def meta_of(task_dir: Path, n: int) -> Any:
    return json.loads((task_dir / "snapshots" / f"{n}.json").read_text())


def die(agent: trio.CancelScope, request: httpx.Request) -> Exception:
    """The agent is killed while this request is on its way (its answer never arrives)."""
    agent.cancel()
    return httpx.ConnectError("the agent was killed", request=request)


async def idle(ship: CheckpointShipper, seconds: float = 600) -> str | None:
    """The newest shipped checkpoint's id once nothing is pending, or after ``seconds`` (virtual)."""
    with trio.move_on_after(seconds):
        await ship.wait_idle()
    return ship.last.id if ship.last is not None else None


async def ship_one(ship: CheckpointShipper, n: int, item_seq: int = 0, reason: str = "interval") -> str | None:
    await ship.submit(n, item_seq=item_seq, log_seq=3, reason=reason, created=CREATED)
    return await idle(ship)


async def test_a_checkpoint_is_shipped_chunks_then_manifest_once_and_only_what_grew_next(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    files = jobdir(100_000)
    snapshot_tree(tmp_path, 1, files)
    ship = shipper(master, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ship.run)
        assert await ship_one(ship, 1, item_seq=40) == "1-1"
        assert master.posts() == ["1-1"] and len(master.puts()) == 6  # 5 of requests.seen + the queue
        assert master.files_of(TASK, "1-1") == files
        body = master.manifests[f"{TASK}/1-1"]
        assert (body["attempt"], body["itemSeq"], body["logSeq"], body["reason"]) == (1, 40, 3, "interval")
        assert body["createdAt"] == "2026-12-05T18:00:00.000Z"
        assert ship.last is not None and (ship.last.id, ship.last.item_seq, ship.last.created) == ("1-1", 40, CREATED)
        assert meta_of(tmp_path, 1)["state"] == "shipped"
        assert not (tmp_path / "snapshots" / "1").exists()  # the state dir is the live copy

        files2 = {**files, "jobdir/requests.seen": files["jobdir/requests.seen"] + seen(1000, "more")}
        snapshot_tree(tmp_path, 2, files2)
        puts = len(master.puts())
        assert await ship_one(ship, 2, item_seq=90) == "1-2"
        assert len(master.puts()) - puts == 1  # only the grown last chunk of requests.seen
        assert master.files_of(TASK, "1-2") == files2
        assert master.manifests[f"{TASK}/1-2"]["packedBytes"] < 0.7 * (1 << 20)  # one chunk of hex, gzipped
        assert sorted(os.listdir(tmp_path / "snapshots")) == ["2.json", "chunks.known"]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("trouble", ["503", "429", "garbage", "timeout", "refused"])
async def test_a_master_blip_mid_upload_is_waited_out_and_the_manifest_posted_once(
        tmp_path: Path, autojump_clock: trio.abc.Clock, trouble: str) -> None:
    master = CheckpointMaster()
    snapshot_tree(tmp_path, 1, jobdir(100_000))
    failures = {"n": 0}

    def fault(kind: str, request: httpx.Request) -> httpx.Response | Exception | None:
        if kind not in ("put", "post") or len(master.puts()) < 3 or failures["n"] >= 4:
            return None
        failures["n"] += 1
        answers: dict[str, httpx.Response | Exception] = {
            "503": httpx.Response(503, text="upstream down"),
            "429": httpx.Response(429, headers={"Retry-After": "7"}, json={"error": "slow down"}),
            "garbage": httpx.Response(200, text="<html>captive portal</html>"),
            "timeout": httpx.ReadTimeout("no answer", request=request),
            "refused": httpx.ConnectError("connection refused", request=request)}
        return answers[trouble]

    master.fault = fault
    ship = shipper(master, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ship.run)
        started = trio.current_time()
        assert await ship_one(ship, 1) == "1-1"
        assert failures["n"] == 4
        if trouble == "429":
            assert trio.current_time() - started >= 7  # the master's Retry-After, waited in full
        assert master.posts() == ["1-1"]
        assert len(set(master.puts())) == 6
        nursery.cancel_scope.cancel()


async def test_missing_chunks_are_sent_again_then_the_manifest(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    snapshot_tree(tmp_path, 1, jobdir(1000))
    ship = shipper(master, tmp_path)
    ship.known = {"0" * 64}  # a chunk this agent believes the master holds: it never sent it
    forgotten: list[str] = []

    def fault(kind: str, request: httpx.Request) -> None:
        if kind == "post" and not forgotten:  # the master lost one of the chunks (a cleanup, a restore)
            forgotten.append(next(iter(master.chunks)))
            del master.chunks[forgotten[0]]

    master.fault = fault
    async with trio.open_nursery() as nursery:
        await nursery.start(ship.run)
        assert await ship_one(ship, 1) == "1-1"
        assert master.posts() == ["1-1", "1-1"]
        assert master.puts()[-1] == forgotten[0]
        nursery.cancel_scope.cancel()


async def test_a_manifest_waits_for_its_items_at_the_master(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster(stored_items={TASK: 10})
    snapshot_tree(tmp_path, 1, jobdir(10))
    ship = shipper(master, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ship.run)
        await ship.submit(1, item_seq=50, log_seq=0, reason="interval", created=CREATED)
        assert await idle(ship, 20) is None  # still waiting: the items are on their way
        assert len(master.posts()) >= 2 and not master.manifests
        master.stored_items[TASK] = 50
        assert await idle(ship, 120) == "1-1"
        nursery.cancel_scope.cancel()


async def test_a_superseded_attempt_ships_nothing_more(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster(superseded_by={TASK: 3})
    snapshot_tree(tmp_path, 1, jobdir(10))
    snapshot_tree(tmp_path, 2, jobdir(20))
    ship = shipper(master, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ship.run)
        assert await ship_one(ship, 1) is None
        assert ship.superseded_by == 3
        requests = len(master.requests)
        assert await ship_one(ship, 2) is None
        assert len(master.requests) == requests and not master.manifests
    # run() returned by itself: the nursery closed without a cancel


async def test_a_master_without_checkpoints_stops_the_shipper(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    master.fault = lambda kind, request: httpx.Response(404, json={"error": "no such endpoint"})
    snapshot_tree(tmp_path, 1, jobdir(10))
    ship = shipper(master, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ship.run)
        assert await ship_one(ship, 1) is None
        assert ship.unsupported and len(master.requests) <= UPLOADS  # those in flight at once, no more


async def test_a_refused_chunk_fails_that_checkpoint_and_the_next_one_ships(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    master.fault = lambda kind, request: (httpx.Response(422, json={"error": "not that sha256"})
                                          if kind == "put" and not master.manifests and len(master.puts()) == 1 else None)
    snapshot_tree(tmp_path, 1, jobdir(10))
    ship = shipper(master, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ship.run)
        assert await ship_one(ship, 1) is None
        assert ship.failed == 1 and not (tmp_path / "snapshots" / "1").exists()
        assert not (tmp_path / "snapshots" / "1.json").exists()
        snapshot_tree(tmp_path, 2, jobdir(10))
        assert await ship_one(ship, 2) == "1-2"
        nursery.cancel_scope.cancel()


async def test_an_agent_restart_mid_upload_finishes_it_and_posts_the_manifest_once(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    files = jobdir(100_000)
    snapshot_tree(tmp_path, 4, files)
    first = shipper(master, tmp_path, attempt=2)
    with trio.CancelScope() as agent:  # the first agent dies after three chunks
        master.fault = lambda kind, request: die(agent, request) if len(master.puts()) == 3 else None
        async with trio.open_nursery() as nursery:
            await nursery.start(first.run)
            await first.submit(4, item_seq=7, log_seq=9, reason="interval", created=CREATED)
            await trio.sleep_forever()
    assert meta_of(tmp_path, 4)["state"] == MetaState.PACKED.value and not master.posts()
    master.fault = lambda kind, request: None
    second = shipper(master, tmp_path, attempt=2)  # the next agent re-adopts the task
    async with trio.open_nursery() as nursery:
        await nursery.start(second.run)
        assert second.pending == 1
        assert await idle(second, 600) == "2-4"
        nursery.cancel_scope.cancel()
    assert master.posts() == ["2-4"]
    assert master.files_of(TASK, "2-4") == files
    body = master.manifests[f"{TASK}/2-4"]
    assert (body["itemSeq"], body["logSeq"]) == (7, 9)
    third = shipper(master, tmp_path, attempt=2)  # and one more restart: nothing to do, the last is known
    async with trio.open_nursery() as nursery:
        await nursery.start(third.run)
        assert third.pending == 0 and third.last is not None and third.last.id == "2-4"
        assert third.known == {sha for f in body["files"] for sha in f["chunks"]}
        nursery.cancel_scope.cancel()


async def test_an_older_attempts_leftovers_are_removed_not_shipped(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    snapshot_tree(tmp_path, 3, jobdir(10))
    old = shipper(master, tmp_path, attempt=1)
    await old.submit(3, item_seq=0, log_seq=0, reason="interval", created=CREATED)
    new = shipper(master, tmp_path, attempt=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(new.run)
        assert new.pending == 0 and not (tmp_path / "snapshots" / "3").exists()
        nursery.cancel_scope.cancel()
    assert not master.requests


async def test_a_newer_snapshot_abandons_an_older_one_still_uploading(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    big = os.urandom(12 << 20)  # 12 chunks: more than the uploads in flight
    snapshot_tree(tmp_path, 1, {"big": big})
    snapshot_tree(tmp_path, 2, {"big": big, "new": b"grown"})
    ship = shipper(master, tmp_path)
    submitted = trio.Event()

    def fault(kind: str, request: httpx.Request) -> httpx.Response | None:
        if kind == "put" and len(master.chunks) >= 2 and not submitted.is_set():
            return httpx.Response(503, text="busy")  # keeps checkpoint 1 waiting until 2 is submitted
        return None

    master.fault = fault
    async with trio.open_nursery() as nursery:
        await nursery.start(ship.run)
        await ship.submit(1, item_seq=0, log_seq=0, reason="interval", created=CREATED)
        await trio.sleep(5)
        await ship.submit(2, item_seq=5, log_seq=0, reason="migrate", created=CREATED)
        submitted.set()
        assert await idle(ship, 600) == "1-2"
        assert master.posts() == ["1-2"]
        assert len(master.stores) == len(set(master.stores)) == 13  # no chunk twice
        assert not (tmp_path / "snapshots" / "1").exists()
        nursery.cancel_scope.cancel()


async def test_a_snapshot_changed_after_it_was_packed_is_not_shipped(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    snap = snapshot_tree(tmp_path, 1, {"big": os.urandom(3 << 20)})
    first = shipper(master, tmp_path)
    with trio.CancelScope() as agent:
        master.fault = lambda kind, request: die(agent, request) if kind == "put" else None
        async with trio.open_nursery() as nursery:
            await nursery.start(first.run)
            await first.submit(1, item_seq=0, log_seq=0, reason="interval", created=CREATED)
            await trio.sleep_forever()
    master.fault = lambda kind, request: None
    data = bytearray((snap / "big").read_bytes())  # the spider changes it while no agent watches
    data[2 << 20: (2 << 20) + 7] = b"changed"
    (snap / "big").write_bytes(bytes(data))
    second = shipper(master, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(second.run)
        assert await idle(second, 600) is None
        assert second.failed == 1 and not master.posts()
        nursery.cancel_scope.cancel()


async def test_a_spider_that_links_its_snapshots_elsewhere_ships_nothing_of_it(
        tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    outside = tmp_path / "outside"
    snapshot_tree(outside, 1, {"secret": b"the node's secret\n"})
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    os.symlink(outside / "snapshots", task_dir / "snapshots")
    master = CheckpointMaster()
    ship = shipper(master, task_dir)
    async with trio.open_nursery() as nursery:
        await nursery.start(ship.run)
        with pytest.raises(OSError):
            await ship.submit(1, item_seq=0, log_seq=0, reason="interval", created=CREATED)
        nursery.cancel_scope.cancel()
    assert not master.requests


async def test_a_broken_record_is_dropped_at_recovery(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    snapshot_tree(tmp_path, 1, jobdir(10))
    (tmp_path / "snapshots" / "1.json").write_text('{"n": 1, "state": "packed", "files": [{"path": "../../etc"}]}')
    (tmp_path / "snapshots" / "2.json").write_bytes(b"\xff not json")
    ship = shipper(master, tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ship.run)
        assert ship.pending == 0
        nursery.cancel_scope.cancel()
    assert sorted(os.listdir(tmp_path / "snapshots")) == []
    assert not master.requests


async def test_the_restored_checkpoints_chunks_are_not_sent_again(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    master = CheckpointMaster()
    files = jobdir(100_000)
    snapshot_tree(tmp_path / "a", 1, files)
    first = shipper(master, tmp_path / "a")
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        await ship_one(first, 1)
        nursery.cancel_scope.cancel()
    manifest = await checkpoint_client(master).get_checkpoint(TASK, "1-1")
    snapshot_tree(tmp_path / "b", 1, files)  # attempt 2 on another node, from the restored state
    second = shipper(master, tmp_path / "b", attempt=2)
    second.seed(manifest)
    puts = len(master.puts())
    async with trio.open_nursery() as nursery:
        await nursery.start(second.run)
        assert await ship_one(second, 1) == "2-1"
        nursery.cancel_scope.cancel()
    assert len(master.puts()) == puts
