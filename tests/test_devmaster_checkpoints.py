"""The dev master's checkpoint endpoints over real HTTP on 127.0.0.1, with hostile bodies: chunks that are
not what their name says, gzip bombs, manifests that name chunks never sent or items never delivered,
huge manifests; and the store keeping only what each task's newest checkpoint needs."""

from __future__ import annotations

import gzip
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx
import pytest
import trio
from harness import (
    Node,
    checkpoint_files,
    gz,
    make_spider,
    manifest_body,
    post_checkpoint,
    post_items,
    put_chunk,
    register,
    sha256_of,
    ship_checkpoint,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckagent.devmaster.store.checkpoints import ChunkError, unpack_chunk
from ckagent.master.protocol import CHUNK_BYTES

if TYPE_CHECKING:
    from conftest import DevMaster

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture
async def http(dev_master: DevMaster) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=30) as client:
        yield client


@pytest.fixture
async def node(dev_master: DevMaster, http: httpx.AsyncClient) -> Node:
    return await register(http, dev_master.registration_token)


@pytest.fixture
async def task_id(dev_master: DevMaster, node: Node) -> str:
    """A task RUNNING on ``node`` at attempt 1."""
    task = await dev_master.admin.create_task(await make_spider(dev_master.admin))
    await node.poll()
    assert (await node.claim(task)).status_code == 200
    return task


async def test_a_chunk_is_stored_once_and_read_back(node: Node, task_id: str) -> None:
    with trio.fail_after(10):
        data = os.urandom(1000) * 3
        sha = sha256_of(data)
        for _ in range(2):  # idempotent
            r = await put_chunk(node, task_id, sha, gz(data))
            assert r.status_code == 200 and r.json() == {"stored": True}
        r = await node.http.get(f"/api/tasks/{task_id}/checkpoint-chunks/{sha}", headers=node.auth)
        assert r.status_code == 200 and gzip.decompress(r.content) == data
        missing = await node.http.get(f"/api/tasks/{task_id}/checkpoint-chunks/{'0' * 64}", headers=node.auth)
        assert missing.status_code == 404
        unauthorized = await node.http.get(f"/api/tasks/{task_id}/checkpoint-chunks/{sha}")
        assert unauthorized.status_code == 401


async def test_hostile_chunks_are_refused(node: Node, task_id: str, dev_master: DevMaster) -> None:
    with trio.fail_after(20):
        data = b"state" * 100
        sha = sha256_of(data)
        bomb = gzip.compress(bytes(64 * CHUNK_BYTES), compresslevel=9)  # 64 MiB of zeros in ~64 KiB
        for body, word in ((b"not gzip at all", "not gzip"), (gz(data)[:-9], "truncated"),
                           (gz(data) + gz(data), "after the gzip member"), (gz(b"other bytes"), "sha256"),
                           (bomb, "more than"), (gz(bytes(CHUNK_BYTES + 1)), "more than")):
            r = await put_chunk(node, task_id, sha if word != "more than" else sha256_of(bytes(CHUNK_BYTES + 1)), body)
            assert r.status_code == 422 and word in r.json()["error"], (word, r.text)
        assert (await put_chunk(node, task_id, sha, os.urandom(2 * 1024 * 1024 + 1))).status_code == 413
        for name in ("A" * 64, "abc", sha.upper()):
            assert (await put_chunk(node, task_id, name, gz(data))).status_code == 422
        # a full chunk of incompressible bytes is fine
        full = os.urandom(CHUNK_BYTES)
        assert (await put_chunk(node, task_id, sha256_of(full), gz(full))).status_code == 200
        # only the node that runs the task may upload
        other = await register(node.http, dev_master.registration_token, "node-b")
        r = await put_chunk(other, task_id, sha, gz(data))
        assert r.status_code == 409 and "supersededBy" not in r.json()


async def test_a_manifest_needs_its_chunks_and_its_items(node: Node, task_id: str) -> None:
    with trio.fail_after(20):
        files = {"jobdir/requests.seen": os.urandom(CHUNK_BYTES + 10), "state.json": b'{"page": 4}'}
        entries, chunks = checkpoint_files(files)
        body = manifest_body("1-1", 1, 2, [{"path": "jobdir", "type": "dir", "size": 0, "mode": 0o755, "chunks": []},
                                           *entries])
        r = await post_checkpoint(node, task_id, body)
        assert r.status_code == 409 and sorted(r.json()["missingChunks"]) == sorted(chunks)
        first = next(iter(chunks))
        await put_chunk(node, task_id, first, gz(chunks[first]))
        r = await post_checkpoint(node, task_id, body)
        assert r.status_code == 409 and first not in r.json()["missingChunks"]
        for sha, data in chunks.items():
            await put_chunk(node, task_id, sha, gz(data))
        r = await post_checkpoint(node, task_id, body)
        assert r.status_code == 409 and r.json()["storedItems"] == 0  # itemSeq 2, no item delivered yet
        await post_items(node, task_id, 0, [{"a": 1}, {"a": 2}], attempt=1)
        r = await post_checkpoint(node, task_id, body)
        assert r.status_code == 200 and r.json() == {"checkpointId": "1-1"}
        assert (await post_checkpoint(node, task_id, body)).json() == {"checkpointId": "1-1"}  # a repeat
        resent = {**body, "createdAt": "2026-12-05T18:00:09.000Z", "packedBytes": 7}  # rebuilt after a restart
        assert (await post_checkpoint(node, task_id, resent)).json() == {"checkpointId": "1-1"}
        changed = {**body, "itemSeq": 1}
        assert (await post_checkpoint(node, task_id, changed)).status_code == 409  # the id, another manifest
        got = await node.http.get(f"/api/tasks/{task_id}/checkpoints/1-1", headers=node.auth)
        assert got.status_code == 200 and got.json() == body
        # chunks that do not add up to the file's size
        small = sha256_of(b"12345")
        await put_chunk(node, task_id, small, gz(b"12345"))
        lying = manifest_body("1-2", 1, 2, [{"path": "f", "type": "file", "size": 9, "mode": 0o644, "chunks": [small]}])
        r = await post_checkpoint(node, task_id, lying)
        assert r.status_code == 422 and r.json()["field"] == "files[0].chunks"
        for bad, field in (({**body, "files": [{**entries[0], "path": "../escape"}]}, "files[0].path"),
                           ({**body, "attempt": 0}, "attempt"), ({**body, "reason": "whim"}, "reason")):
            r = await post_checkpoint(node, task_id, {**bad, "id": "1-9"})
            assert r.status_code == 422 and r.json()["field"] == field, r.text


async def test_huge_manifests_are_refused(node: Node, task_id: str) -> None:
    with trio.fail_after(60):
        entry = {"type": "file", "size": 0, "mode": 0o644, "chunks": []}
        many = manifest_body("1-1", 1, 0, [{**entry, "path": f"f{i}"} for i in range(100_001)])
        r = await post_checkpoint(node, task_id, many)
        assert r.status_code == 422 and r.json()["field"] == "files"
        huge = await node.http.post(f"/api/tasks/{task_id}/checkpoints", headers=node.auth,
                                    content=b'{"files": [' + b" " * (33 * 1024 * 1024) + b"]}")
        assert huge.status_code == 413


async def test_a_task_keeps_what_its_newest_checkpoint_needs(
        node: Node, task_id: str, dev_master: DevMaster) -> None:
    with trio.fail_after(20):
        shared = os.urandom(5000)
        assert (await ship_checkpoint(node, task_id, "1-1", 1, 0, {"a": shared, "b": b"old"})).status_code == 200
        stray = os.urandom(100)  # uploaded, never named
        await put_chunk(node, task_id, sha256_of(stray), gz(stray))
        assert (await ship_checkpoint(node, task_id, "1-2", 1, 0, {"a": shared, "b": b"new"})).status_code == 200

        async def status(path: str) -> int:
            return (await node.http.get(f"/api/tasks/{task_id}/{path}", headers=node.auth)).status_code

        assert await status(f"checkpoint-chunks/{sha256_of(shared)}") == 200  # named again: kept
        assert await status(f"checkpoint-chunks/{sha256_of(b'new')}") == 200
        assert await status(f"checkpoint-chunks/{sha256_of(b'old')}") == 404  # only the older one named it
        assert await status(f"checkpoint-chunks/{sha256_of(stray)}") == 404
        assert await status("checkpoints/1-1") == 404 and await status("checkpoints/1-2") == 200
        # a final task: its newest checkpoint stays, nothing else
        await put_chunk(node, task_id, sha256_of(stray), gz(stray))
        assert (await node.result(task_id, "SUCCESS", attempt=1)).status_code == 200
        assert await status(f"checkpoint-chunks/{sha256_of(stray)}") == 404
        assert await status(f"checkpoint-chunks/{sha256_of(b'new')}") == 200
        view = await dev_master.admin.get_task(task_id)
        assert view["checkpoint"]["id"] == "1-2" and view["checkpoint"]["fileCount"] == 2
        assert view["checkpoint"]["sizeBytes"] == 5003 and view["checkpoint"]["ageSeconds"] >= 0
        # a final task takes no more chunks
        assert (await put_chunk(node, task_id, sha256_of(stray), gz(stray))).status_code == 409


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_unpack_chunk_refuses_any_bytes_that_are_not_the_chunk(body: bytes) -> None:
    data = b"the chunk"
    try:
        size = unpack_chunk(body, sha256_of(data))
    except ChunkError:
        return
    assert size == len(data) and gzip.decompress(body) == data


async def test_a_task_holds_a_bounded_amount_of_chunks(
        node: Node, task_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckagent.devmaster.store import checkpoints

    with trio.fail_after(10):
        monkeypatch.setattr(checkpoints, "MAX_TASK_CHUNK_BYTES", 3000)
        pieces = [os.urandom(1000) for _ in range(4)]
        answers = [(await put_chunk(node, task_id, sha256_of(p), gz(p))).status_code for p in pieces]
        assert answers == [200, 200, 413, 413]  # ~1020 gzip bytes each
        # a manifest naming the first frees the other
        r = await post_checkpoint(node, task_id, manifest_body("1-1", 1, 0, checkpoint_files({"a": pieces[0]})[0]))
        assert r.status_code == 200
        assert (await put_chunk(node, task_id, sha256_of(pieces[2]), gz(pieces[2]))).status_code == 200
