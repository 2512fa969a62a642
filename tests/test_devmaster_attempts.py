"""The dev master's attempts over real HTTP on 127.0.0.1: the poll answer's attempt fields, a new attempt's
items cut back to its checkpoint, the 409 ``supersededBy`` answers, the retry policy and the node-lost
sweep (docs/protocol.md, "Attempts", "Causes and retries")."""

from __future__ import annotations

import sqlite3
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
from harness import (
    SPIDER_FILES,
    Node,
    eventually,
    heartbeat_of,
    make_spider,
    make_zip,
    post_checkpoint,
    post_items,
    post_logs,
    register,
    ship_checkpoint,
    short_grace_master,
    store_node,
    store_spider,
    store_task,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from ckagent.devmaster.client import AdminApiError
from ckagent.devmaster.store import Store
from ckagent.master.protocol import CheckpointManifest, PendingTasks, TaskResult

if TYPE_CHECKING:
    from conftest import DevMaster

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture
async def http(dev_master: DevMaster) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=10) as client:
        yield client


@pytest.fixture
async def node(dev_master: DevMaster, http: httpx.AsyncClient) -> Node:
    return await register(http, dev_master.registration_token)


def items(first: int, last: int) -> list[dict[str, Any]]:
    return [{"n": i} for i in range(first, last)]


async def claimed(node: Node, task_id: str, attempt: int | None = None) -> dict[str, Any]:
    """Poll until ``task_id`` is handed out, claim it (with ``attempt``); its wire JSON."""
    answer = await node.poll(limit=5)
    [task] = [t for t in answer["tasks"] if t["id"] == task_id]
    fields = {"attempt": attempt} if attempt is not None else {}
    r = await node.result(task_id, "RUNNING", startedAt="2026-12-05T18:00:00.000Z", **fields)
    assert r.status_code == 200, r.text
    return task


async def test_the_poll_answer_carries_the_attempt_and_the_settings_of_spider_and_task(
        dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(10):
        admin = dev_master.admin
        spider_id = await admin.create_spider(
            "s", "python", command=["python", "main.py"], resources={"memorySoftBytes": 5 << 20},
            retry={"maxAttempts": 3, "on": ["resource"]}, resume="restart-keep", checkpoint_interval_seconds=30)
        await admin.upload_package(spider_id, (await _zip()))
        spider = await admin.get_spider(spider_id)
        assert spider["retry"] == {"maxAttempts": 3, "backoffSeconds": 30.0, "factor": 2.0, "on": ["resource"],
                                   "exitCodes": []}
        assert (spider["resume"], spider["checkpointIntervalSeconds"]) == ("restart-keep", 30)
        inherited = await admin.create_task(spider_id)
        own = await admin.create_task(spider_id, retry={"maxAttempts": 1}, resume="restart-replace",
                                      checkpoint_interval_seconds=5, resources={"memorySoftBytes": 7 << 20})
        answer = await node.poll(limit=5)  # at most one task per spider in an answer
        [first] = answer["tasks"]
        assert first["id"] == inherited
        assert first["attempt"] == 1 and first["itemSeqStart"] == 0 and first["logSeqStart"] == 0
        assert first["checkpoint"] is None
        assert first["retry"]["maxAttempts"] == 3 and first["resume"] == "restart-keep"
        assert first["checkpointIntervalSeconds"] == 30 and first["resources"]["memorySoftBytes"] == 5 << 20
        parsed = PendingTasks.from_json(answer).tasks[0]
        assert parsed.attempt == 1 and parsed.retry is not None and parsed.retry.max_attempts == 3
        await admin.cancel_task(inherited)
        [second] = (await node.poll(limit=5))["tasks"]
        assert second["id"] == own
        assert second["retry"]["maxAttempts"] == 1 and second["resume"] == "restart-replace"
        assert second["checkpointIntervalSeconds"] == 5 and second["resources"]["memorySoftBytes"] == 7 << 20
        for bad, field in (({"retry": {"maxAttempts": 0}}, "retry.maxAttempts"), ({"resume": "later"}, "resume"),
                           ({"checkpointIntervalSeconds": 0}, "checkpointIntervalSeconds"),
                           ({"retry": {"on": ["weather"]}}, "retry.on[0]")):
            r = await node.http.post(f"/api/spiders/{spider_id}/tasks", json=bad,
                                     headers={"Authorization": f"Bearer {dev_master.admin_token}"})
            assert r.status_code == 422 and r.json()["field"] == field, r.text
        patched = await admin.update_spider(spider_id, retry=None, resume=None)
        assert patched["retry"] is None and patched["resume"] is None


async def _zip() -> bytes:
    return make_zip(SPIDER_FILES)


async def test_a_disruption_resumes_from_the_checkpoint_and_the_old_attempt_is_superseded(
        dev_master: DevMaster, node: Node, http: httpx.AsyncClient) -> None:
    with trio.fail_after(15):
        admin = dev_master.admin
        task_id = await admin.create_task(await make_spider(admin))
        await claimed(node, task_id)
        assert (await post_logs(node, task_id, 0, ["a", "b", "c", "d", "e"], attempt=1)).json() == {"acceptedSeq": 5}
        assert (await post_items(node, task_id, 0, items(0, 6), attempt=1)).json() == {"acceptedSeq": 6}
        # the master holds 6 items: a checkpoint at 8 must wait for them
        early = await ship_checkpoint(node, task_id, "1-1", 1, 8, {"jobdir/requests.seen": b"x" * 10})
        assert early.status_code == 409 and early.json()["storedItems"] == 6
        assert (await post_items(node, task_id, 6, items(6, 10))).json() == {"acceptedSeq": 10}  # attempt absent
        r = await ship_checkpoint(node, task_id, "1-1", 1, 8, {"jobdir/requests.seen": b"x" * 10})
        assert r.status_code == 200 and r.json() == {"checkpointId": "1-1"}
        r = await node.result(task_id, "FAILED", errorCode="MIGRATED", attempt=1, causeClass="disruption",
                              retryable=True, checkpointId="1-1")
        assert r.status_code == 200 and r.json()["status"] == "FAILED", r.text

        task = await admin.get_task(task_id)
        assert task["status"] == "PENDING" and task["attempt"] == 2
        assert [i["n"] for i in await admin.get_items(task_id)] == list(range(8))  # cut inside the 2nd chunk
        first, second = task["attempts"]
        assert (first["status"], first["errorCode"], first["causeClass"], first["counted"]) == (
            "FAILED", "MIGRATED", "disruption", False)
        assert first["nodeId"] == node.node_id and first["checkpointId"] == "1-1"
        assert (second["status"], second["resumedFrom"], second["itemsKept"], second["itemsDropped"]) == (
            "PENDING", "1-1", 8, 2)
        assert task["checkpoint"]["id"] == "1-1" and task["checkpoint"]["itemSeq"] == 8

        # the old attempt's late words: 409 supersededBy, on every stream
        moved = {"error": f"task {task_id} moved on to attempt 2", "supersededBy": 2}
        for late in (await post_items(node, task_id, 10, items(10, 11), attempt=1),
                     await post_logs(node, task_id, 5, ["late"], attempt=1),
                     await node.result(task_id, "SUCCESS", attempt=1),
                     await post_checkpoint(node, task_id, {"id": "1-2", "attempt": 1, "createdAt": "x",
                                                           "reason": "stop", "itemSeq": 8, "logSeq": 0,
                                                           "sizeBytes": 0, "packedBytes": 0, "files": []})):
            assert late.status_code == 409 and late.json() == moved, late.text
        batch = await http.post(f"/api/nodes/{node.node_id}/batches", headers=node.auth, json={"batches": [
            {"taskId": task_id, "stream": "items", "seq": 10, "items": items(10, 11), "attempt": 1}]})
        assert batch.json()["results"] == [{"status": 409, **moved}]
        # the same final result again (its answer was lost): acknowledged, nothing changes
        again = await node.result(task_id, "FAILED", errorCode="MIGRATED", attempt=1)
        assert again.status_code == 200 and again.json()["status"] == "FAILED"

        # attempt 2: handed out with where to start, and its items continue the numbering
        wire = await claimed(node, task_id, attempt=2)
        assert (wire["attempt"], wire["itemSeqStart"], wire["logSeqStart"]) == (2, 8, 5)
        assert wire["checkpoint"]["id"] == "1-1" and wire["checkpoint"]["itemSeq"] == 8
        assert wire["checkpoint"]["url"] == f"/api/tasks/{task_id}/checkpoints/1-1"
        numbered_from_0 = await post_items(node, task_id, 0, items(0, 3), attempt=2)  # not a repeat: refused
        assert numbered_from_0.status_code == 409 and "itemSeqStart" in numbered_from_0.json()["error"]
        assert "expectedSeq" not in numbered_from_0.json()
        assert (await post_logs(node, task_id, 4, ["e"], attempt=2)).status_code == 409
        assert (await post_items(node, task_id, 8, items(8, 12), attempt=2)).json() == {"acceptedSeq": 12}
        assert (await post_logs(node, task_id, 5, ["f"], attempt=2)).json() == {"acceptedSeq": 6}
        r = await node.result(task_id, "SUCCESS", attempt=2, itemCount=12)
        assert r.status_code == 200
        done = await admin.get_task(task_id)
        assert done["status"] == "SUCCESS" and [a["status"] for a in done["attempts"]] == ["FAILED", "SUCCESS"]
        assert [i["n"] for i in await admin.get_items(task_id)] == list(range(12))  # exactly once
        assert await admin.get_logs(task_id) == ["a", "b", "c", "d", "e", "f"]
        future = await post_items(node, task_id, 12, items(12, 13), attempt=3)
        assert future.status_code == 409 and "supersededBy" not in future.json()


@pytest.mark.parametrize(("resume", "kept"), [(None, 0), ("restart-keep", 4)])
async def test_without_a_checkpoint_resume_decides_what_is_kept(
        dev_master: DevMaster, node: Node, resume: str | None, kept: int) -> None:
    with trio.fail_after(10):
        admin = dev_master.admin
        task_id = await admin.create_task(await make_spider(admin), resume=resume)
        await claimed(node, task_id)
        await post_items(node, task_id, 0, items(0, 4), attempt=1)
        await post_logs(node, task_id, 0, ["x"], attempt=1)
        await node.result(task_id, "FAILED", errorCode="AGENT_LOST", attempt=1)
        assert len(await admin.get_items(task_id)) == kept
        wire = await claimed(node, task_id, attempt=2)
        assert (wire["attempt"], wire["itemSeqStart"], wire["logSeqStart"], wire["checkpoint"]) == (2, kept, 1, None)


async def test_a_retry_waits_its_backoff_and_max_attempts_ends_it(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(15):
        admin = dev_master.admin
        task_id = await admin.create_task(await make_spider(admin), retry={
            "maxAttempts": 2, "backoffSeconds": 0.6, "exitCodes": [3]})
        await claimed(node, task_id)
        await node.result(task_id, "FAILED", errorCode="EXIT_NONZERO", exitCode=3, attempt=1)
        task = await admin.get_task(task_id)
        assert task["status"] == "PENDING" and task["attempt"] == 2 and task["notBefore"]
        assert task["attempts"][0]["counted"] is True
        assert (await node.poll())["tasks"] == []  # not before its time
        start = trio.current_time()
        answer = await node.poll(wait=10)  # a held poll: woken when the retry comes due
        assert [t["id"] for t in answer["tasks"]] == [task_id]
        assert 0.3 < trio.current_time() - start < 5
        await node.result(task_id, "RUNNING", attempt=2)
        await node.result(task_id, "FAILED", errorCode="EXIT_NONZERO", exitCode=3, attempt=2)
        final = await admin.get_task(task_id)
        assert final["status"] == "FAILED" and final["errorCode"] == "EXIT_NONZERO" and final["attempt"] == 2
        assert "maxAttempts" in final["attempts"][1]["decision"]


async def test_final_results_that_are_not_retried(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(15):
        admin = dev_master.admin
        spider_id = await make_spider(admin)
        policy = {"maxAttempts": 5, "backoffSeconds": 0, "on": ["spider", "resource", "setup"]}
        for fields in ({"errorCode": "EXIT_NONZERO", "exitCode": 1, "retryable": False},
                       {"errorCode": "BAD_TASK"}):
            task_id = await admin.create_task(spider_id, retry=policy)
            await claimed(node, task_id)
            await node.result(task_id, "FAILED", attempt=1, **fields)
            task = await admin.get_task(task_id)
            assert task["status"] == "FAILED" and len(task["attempts"]) == 1, fields
        # MEMORY_LIMIT after a checkpoint of its own: again at once, not counted (maxAttempts 1)
        task_id = await admin.create_task(spider_id)
        await claimed(node, task_id)
        assert (await ship_checkpoint(node, task_id, "1-1", 1, 0, {"state.json": b"{}"})).status_code == 200
        await node.result(task_id, "FAILED", errorCode="MEMORY_LIMIT", attempt=1, checkpointId="1-1")
        task = await admin.get_task(task_id)
        assert task["status"] == "PENDING" and task["attempts"][0]["counted"] is False
        assert task["notBefore"] is None
        # a cancel while the next attempt waits: CANCELLED, and so is that attempt
        cancelled = await admin.cancel_task(task_id)
        assert cancelled["status"] == "CANCELLED"
        assert [a["status"] for a in (await admin.get_task(task_id))["attempts"]] == ["FAILED", "CANCELLED"]
        with pytest.raises(AdminApiError):
            await admin.cancel_task(task_id)


async def test_a_lost_node_s_task_moves_on_and_the_node_is_told_when_it_returns(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    with trio.fail_after(30):
        master = await short_grace_master(nursery, tmp_path, node_lost_after=0.5)
        async with httpx.AsyncClient(base_url=master.base_url, timeout=10) as http:
            node_a = await register(http, master.registration_token, "node-a")
            node_b = await register(http, master.registration_token, "node-b")
            task_id = await master.admin.create_task(await make_spider(master.admin))
            kept = await master.admin.create_task(await make_spider(master.admin, "kept"))
            await claimed(node_a, task_id)
            await post_items(node_a, task_id, 0, items(0, 5), attempt=1)
            assert (await ship_checkpoint(node_a, task_id, "1-1", 1, 3, {"s": b"1"})).status_code == 200
            await claimed(node_b, kept)
            # node B beats within its grace for longer than the grace: its task stays its own
            async with trio.open_nursery() as beats:
                async def beat() -> None:
                    while True:
                        await node_b.heartbeat(runningTaskIds=[kept])
                        await trio.sleep(0.1)
                beats.start_soon(beat)

                async def lost() -> bool:
                    return (await master.admin.get_task(task_id))["attempt"] == 2
                await eventually(lost, timeout=10, what="node A lost")
                beats.cancel_scope.cancel()
            assert (await master.admin.get_task(kept))["status"] == "RUNNING"
            task = await master.admin.get_task(task_id)
            assert task["status"] == "PENDING"
            ended = task["attempts"][0]
            assert (ended["errorCode"], ended["causeClass"], ended["counted"]) == ("NODE_LOST", "disruption", False)
            assert "lost" in ended["errorMessage"]
            assert [i["n"] for i in await master.admin.get_items(task_id)] == [0, 1, 2]
            # node A comes back: told to cancel the task it still runs, its late words refused
            r = await node_a.heartbeat(runningTaskIds=[task_id])
            assert task_id in r.json()["cancelTaskIds"]
            late = await post_items(node_a, task_id, 5, items(5, 6))  # attempt absent: it ran an older one
            assert late.status_code == 409 and late.json()["supersededBy"] == 2
            stats = await node_a.http.post(f"/api/tasks/{task_id}/stats", json={"seq": 9, "stats": {}},
                                           headers=node_a.auth)
            artifact = await node_a.http.put(f"/api/tasks/{task_id}/artifacts/a.txt", content=b"a", headers={
                **node_a.auth, "X-Content-SHA256": "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb"})
            for refused in (stats, artifact):
                assert refused.status_code == 409 and refused.json()["supersededBy"] == 2, refused.text
            # node B resumes it from the checkpoint
            wire = await claimed(node_b, task_id, attempt=2)
            assert wire["checkpoint"]["id"] == "1-1" and wire["itemSeqStart"] == 3
            r = await node_a.heartbeat(runningTaskIds=[task_id])
            assert task_id in r.json()["cancelTaskIds"]
            assert (await node_a.result(task_id, "SUCCESS", attempt=1)).status_code == 409


async def test_the_task_page_shows_attempts_and_the_checkpoint(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(15):
        admin = dev_master.admin
        task_id = await admin.create_task(await make_spider(admin))
        await claimed(node, task_id)
        await post_items(node, task_id, 0, items(0, 3), attempt=1)
        assert (await ship_checkpoint(node, task_id, "1-1", 1, 2, {"s": b"x" * 3000})).status_code == 200
        await node.result(task_id, "FAILED", errorCode="MIGRATED", attempt=1, checkpointId="1-1",
                          errorMessage="<script>alert(1)</script>")
        page = await node.http.get(f"/tasks/{task_id}", auth=("admin", dev_master.admin_token))
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        text = page.text
        for shown in ("MIGRATED", "disruption", "1-1", "node-a", "PENDING", "2 / 1", "2.9 KiB", "again at once"):
            assert shown in text, shown
        assert "<script>" not in text and "&lt;script&gt;" in text
        bearer = await node.http.get(f"/tasks/{task_id}", headers={"Authorization": f"Bearer {dev_master.admin_token}"})
        assert bearer.status_code == 200
        for headers in ({}, node.auth):
            refused = await node.http.get(f"/tasks/{task_id}", headers=headers)
            assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
        wrong = await node.http.get(f"/tasks/{task_id}", auth=("admin", "wrong"))
        assert wrong.status_code == 401
        assert (await node.http.get("/tasks/nope", auth=("admin", dev_master.admin_token))).status_code == 404


async def test_an_agent_that_names_no_attempt_claims_its_retried_task_again(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(10):
        admin = dev_master.admin
        task_id = await admin.create_task(await make_spider(admin), retry={"maxAttempts": 2, "backoffSeconds": 0,
                                                                           "on": ["spider"]})
        await claimed(node, task_id)
        await post_items(node, task_id, 0, items(0, 2))
        assert (await node.result(task_id, "FAILED", errorCode="EXIT_NONZERO", exitCode=1)).status_code == 200
        late = await post_items(node, task_id, 2, items(2, 3))  # attempt 1's, not claimed again yet
        assert late.status_code == 409 and late.json()["supersededBy"] == 2
        await claimed(node, task_id)  # the claim names no attempt: the task as handed out (attempt 2)
        assert (await post_items(node, task_id, 0, items(0, 1))).json() == {"acceptedSeq": 1}  # replaced: from 0
        assert (await node.result(task_id, "SUCCESS")).status_code == 200
        assert (await admin.get_task(task_id))["status"] == "SUCCESS"


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 7), max_size=6), st.data())
def test_a_new_attempt_keeps_exactly_the_items_before_its_checkpoint(batches: list[int], data: st.DataObject) -> None:
    """Items in batches of any sizes, a checkpoint at any position: the next attempt keeps exactly the items
    before it (the chunk spanning it rewritten), and itemSeqStart says so."""
    with tempfile.TemporaryDirectory() as folder:
        store = Store(Path(folder) / "m.sqlite")
        try:
            node_id = store_node(store)
            task_id = store_task(store, store_spider(store, "s"))
            store.claim_pending(node_id, poll_id=1, limit=1, exclude_spider_ids=[], base_url="")
            total = 0
            for size in batches:
                store.append_items(task_id, node_id, total, items(total, total + size), attempt=1)
                total += size
            keep = data.draw(st.integers(0, total))
            store.record_checkpoint(task_id, node_id, CheckpointManifest.from_json(
                {"id": "1-1", "attempt": 1, "createdAt": "t", "reason": "interval", "itemSeq": keep, "logSeq": 0,
                 "sizeBytes": 0, "packedBytes": 0, "files": []}))
            store.report_result(task_id, node_id, TaskResult.from_json(
                {"status": "FAILED", "errorCode": "AGENT_LOST", "attempt": 1}), 1)
            assert [i["n"] for i in store.task_items(task_id)] == list(range(keep))
            [wire], _ = store.claim_pending(node_id, poll_id=2, limit=1, exclude_spider_ids=[], base_url="")
            assert (wire["attempt"], wire["itemSeqStart"]) == (2, keep)
            assert store.append_items(task_id, node_id, keep, items(keep, keep + 2), attempt=2) == keep + 2
            assert [i["n"] for i in store.task_items(task_id)] == list(range(keep + 2))
            assert store.heartbeat(node_id, heartbeat_of(running=[task_id])) == []
        finally:
            store.close()


def test_a_task_whose_node_is_lost_25_times_in_a_row_is_final(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node_id = store_node(store)
        task_id = store_task(store, store_spider(store, "s"))
        for n in range(1, 26):
            [wire], _ = store.claim_pending(node_id, poll_id=n, limit=1, exclude_spider_ids=[], base_url="")
            assert wire["attempt"] == n
            assert store.lose_nodes(600, now=time.time() + 599) == []  # within the grace: its own
            assert store.lose_nodes(600, now=time.time() + 601) == [task_id]
        task = store.get_task(task_id)
        assert task["status"] == "FAILED" and task["errorCode"] == "NODE_LOST" and task["attempt"] == 25
        assert all(a["counted"] is False for a in task["attempts"]) and "25" in task["attempts"][-1]["decision"]
    finally:
        store.close()


@pytest.mark.parametrize("body", [b'{"seq":0,"attempt":1,"items":[{"a": 1}]}', b'{"seq": 0, "items": [{"a": 1}], "attempt": 1}',
                                  b'{"seq":0,"items":[{"a": 1}]}'])
async def test_an_items_batch_naming_its_attempt_is_kept_as_sent(
        dev_master: DevMaster, node: Node, body: bytes) -> None:
    """The agent's body forms with ``attempt`` keep the fast path: the items' JSON text stored as it came."""
    with trio.fail_after(10):
        task_id = await dev_master.admin.create_task(await make_spider(dev_master.admin))
        await claimed(node, task_id)
        r = await node.http.post(f"/api/tasks/{task_id}/items", content=body,
                                 headers={**node.auth, "Content-Type": "application/json"})
        assert r.json() == {"acceptedSeq": 1}
        with sqlite3.connect(dev_master.db_path) as db:
            [(data,)] = db.execute("SELECT data FROM task_item_chunks WHERE task_id = ?", (task_id,)).fetchall()
        assert data == '[{"a": 1}]'
        twice = b'{"seq":1,"attempt":1,"items":[{"b": 2}],"attempt":1}'
        r = await node.http.post(f"/api/tasks/{task_id}/items", content=twice,
                                 headers={**node.auth, "Content-Type": "application/json"})
        assert r.json() == {"acceptedSeq": 2}  # decoded the slow way


def test_a_claim_given_back_keeps_its_attempt_number(tmp_path: Path) -> None:
    """A release (or reconciliation) gives the current attempt back: PENDING again at the same number (it
    never ran), not a new attempt; a cancel asked meanwhile makes that attempt CANCELLED."""
    store = Store(tmp_path / "m.sqlite")
    try:
        node_id = store_node(store)
        task_id = store_task(store, store_spider(store, "s"))
        store.claim_pending(node_id, poll_id=1, limit=1, exclude_spider_ids=[], base_url="")
        store.report_result(task_id, node_id, TaskResult.from_json({"status": "FAILED", "errorCode": "MIGRATED"}), 1)
        store.claim_pending(node_id, poll_id=2, limit=1, exclude_spider_ids=[], base_url="")
        store.release_task(task_id, node_id, "draining")
        task = store.get_task(task_id)
        assert (task["status"], task["attempt"]) == ("PENDING", 2)
        assert [(a["attempt"], a["status"], a["nodeId"]) for a in task["attempts"]] == [
            (1, "FAILED", node_id), (2, "PENDING", None)]
        store.claim_pending(node_id, poll_id=3, limit=1, exclude_spider_ids=[], base_url="")
        store.cancel_task(task_id)  # RUNNING: asked; the node gives it back before it starts
        store.release_task(task_id, node_id, "not started")
        task = store.get_task(task_id)
        assert task["status"] == "CANCELLED" and task["attempts"][1]["status"] == "CANCELLED"
    finally:
        store.close()
