"""The master client's checkpoint calls (ckagent.master.checkpointcalls) and MasterConflict.superseded_by:
what is sent, and how each answer is classified (httpx.MockTransport: pure logic of the boundary)."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from ckagent.master.checkpointcalls import MAX_CHUNK_DOWNLOAD_BYTES, checkpoint_id
from ckagent.master.client import (
    MasterClient,
    MasterConflict,
    MasterProtocolError,
    MasterRejected,
    MasterUnavailable,
)
from ckagent.master.protocol import (
    CHUNK_BYTES,
    CheckpointFile,
    CheckpointManifest,
    CheckpointRef,
    RegisterRequest,
)

BASE = "http://master.test"
DATA = b"requests seen\n" * 100
SHA = hashlib.sha256(DATA).hexdigest()
GZ = gzip.compress(DATA, compresslevel=1)
MANIFEST = CheckpointManifest(id="2-5", attempt=2, created_at="2026-12-05T18:00:00.000Z", reason="interval",
                              item_seq=450, log_seq=1210, size_bytes=len(DATA), packed_bytes=len(GZ),
                              files=[CheckpointFile("jobdir", "dir", 0, 0o755),
                                     CheckpointFile("jobdir/requests.seen", "file", len(DATA), 0o644, [SHA])])

Answer = Callable[[httpx.Request], httpx.Response]


def client(answer: Answer, seen: list[httpx.Request]) -> MasterClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return httpx.Response(200, json={"nodeId": "n1", "apiKey": "key-123456"})
        request.read()
        seen.append(request)
        return answer(request)

    def body() -> RegisterRequest:
        return RegisterRequest(name="n", ip="127.0.0.1", port=1, version="t", os="linux", arch="x", python="3",
                               cpu_count=1, memory_total_bytes=1, max_workers=1)

    return MasterClient(BASE, "token", body, transport=httpx.MockTransport(handler))


async def call(answer: Answer, what: Callable[[MasterClient], Any]) -> tuple[Any, list[httpx.Request]]:
    seen: list[httpx.Request] = []
    master = client(answer, seen)
    try:
        with trio.fail_after(5):
            return await what(master), seen
    finally:
        await master.aclose()


# ---------------------------------------------------------------------------- what is sent


async def test_a_chunk_is_put_as_gzip_bytes_under_its_sha() -> None:
    result, seen = await call(lambda r: httpx.Response(200, json={"stored": True}),
                              lambda m: m.put_checkpoint_chunk("task/7", SHA, GZ))
    assert result is None
    (request,) = seen
    assert (request.method, request.url.raw_path.decode()) == ("PUT", f"/api/tasks/task%2F7/checkpoint-chunks/{SHA}")
    assert request.content == GZ
    assert request.headers["content-type"] == "application/gzip"
    assert "content-encoding" not in request.headers
    assert request.headers["authorization"] == "Bearer key-123456"


async def test_a_manifest_is_posted_and_its_id_returned() -> None:
    result, seen = await call(lambda r: httpx.Response(200, json={"checkpointId": "2-5"}),
                              lambda m: m.post_checkpoint("t1", MANIFEST))
    assert result == "2-5"
    assert seen[0].url.path == "/api/tasks/t1/checkpoints"
    assert CheckpointManifest.from_json(json.loads(seen[0].content)) == MANIFEST


async def test_a_manifest_is_read_by_ref_id_or_url() -> None:
    ref = MANIFEST.ref("/api/tasks/t1/checkpoints/2-5")
    for given in (ref, "2-5", "/api/tasks/t1/checkpoints/2-5", "http://elsewhere.test/prefix/api/tasks/t1/checkpoints/2-5"):
        result, seen = await call(lambda r: httpx.Response(200, json=MANIFEST.to_json()),
                                  lambda m, given=given: m.get_checkpoint("t1", given))
        assert result == MANIFEST
        assert str(seen[0].url) == f"{BASE}/api/tasks/t1/checkpoints/2-5"  # always the master's own route


def test_a_url_of_another_task_or_route_is_refused() -> None:
    assert checkpoint_id("a/b", "/api/tasks/a%2Fb/checkpoints/1-1") == "1-1"
    for url in ("/api/tasks/t2/checkpoints/1-1", "/api/tasks/t1/artifacts/1-1", "/", "http://x.test/"):
        with pytest.raises(MasterRejected, match="not a checkpoint of task"):
            checkpoint_id("t1", url)
    assert checkpoint_id("t1", CheckpointRef("9-9", 9, 0, 0, url="/whatever")) == "9-9"


async def test_a_chunk_is_read_as_it_is() -> None:
    result, seen = await call(lambda r: httpx.Response(200, content=GZ, headers={"content-type": "application/gzip"}),
                              lambda m: m.get_checkpoint_chunk("t1", SHA))
    assert result == GZ and gzip.decompress(result) == DATA
    assert seen[0].url.path == f"/api/tasks/t1/checkpoint-chunks/{SHA}"


async def test_a_bad_sha_is_refused_before_anything_is_sent() -> None:
    for bad in (SHA.upper(), "../x", SHA[:-1], ""):
        with pytest.raises(ValueError, match="sha256"):
            await call(lambda r: httpx.Response(200, json={"stored": True}), lambda m, bad=bad: m.put_checkpoint_chunk("t", bad, GZ))
        with pytest.raises(ValueError, match="sha256"):
            await call(lambda r: httpx.Response(200, content=GZ), lambda m, bad=bad: m.get_checkpoint_chunk("t", bad))


# ---------------------------------------------------------------------------- answers classified


async def test_a_chunk_over_the_bound_is_a_protocol_error() -> None:
    big = b"x" * (MAX_CHUNK_DOWNLOAD_BYTES + 1)
    with pytest.raises(MasterProtocolError, match="more than"):
        await call(lambda r: httpx.Response(200, content=big), lambda m: m.get_checkpoint_chunk("t1", SHA))
    assert MAX_CHUNK_DOWNLOAD_BYTES >= 2 * CHUNK_BYTES
    exact = b"x" * MAX_CHUNK_DOWNLOAD_BYTES
    result, _ = await call(lambda r: httpx.Response(200, content=exact), lambda m: m.get_checkpoint_chunk("t1", SHA))
    assert len(result) == MAX_CHUNK_DOWNLOAD_BYTES


@pytest.mark.parametrize(("answer", "error"), [
    pytest.param(httpx.Response(200, json={"stored": False}), MasterProtocolError, id="stored-false"),
    pytest.param(httpx.Response(200, json={}), MasterProtocolError, id="empty-object"),
    pytest.param(httpx.Response(200, text="<html>portal</html>"), MasterProtocolError, id="html"),
    pytest.param(httpx.Response(422, json={"error": "not the bytes of that sha256"}), MasterRejected, id="422"),
    pytest.param(httpx.Response(503, json={"error": "busy"}), MasterUnavailable, id="503"),
    pytest.param(httpx.Response(409, json={"error": "moved on", "supersededBy": 3}), MasterConflict, id="409"),
])
async def test_chunk_answers_are_classified(answer: httpx.Response, error: type[Exception]) -> None:
    with pytest.raises(error) as caught:
        await call(lambda r: answer, lambda m: m.put_checkpoint_chunk("t1", SHA, GZ))
    assert type(caught.value) is error


@pytest.mark.parametrize("body", [{"checkpointId": "2-4"}, {"checkpointId": ""}, {"stored": True}, []])
async def test_a_manifest_answer_that_names_another_checkpoint_is_no_acknowledgement(body: Any) -> None:
    with pytest.raises(MasterProtocolError):
        await call(lambda r: httpx.Response(200, json=body), lambda m: m.post_checkpoint("t1", MANIFEST))


async def test_a_hostile_manifest_from_the_master_is_a_protocol_error() -> None:
    hostile = MANIFEST.to_json()
    hostile["files"][1]["path"] = "../../etc/cron.d/x"
    with pytest.raises(MasterProtocolError, match=r"files\[1\].path"):
        await call(lambda r: httpx.Response(200, json=hostile), lambda m: m.get_checkpoint("t1", "2-5"))
    other = {**MANIFEST.to_json(), "id": "1-1"}  # a valid manifest, but not the one asked for
    with pytest.raises(MasterProtocolError, match="answered checkpoint"):
        await call(lambda r: httpx.Response(200, json=other), lambda m: m.get_checkpoint("t1", "2-5"))


async def test_a_post_refused_for_missing_chunks_or_items_or_superseded() -> None:
    bodies = [({"error": "chunks missing", "missingChunks": [SHA]}, None),
              ({"error": "items not there", "storedItems": 400}, None),
              ({"error": "task 7 moved on to attempt 3", "supersededBy": 3}, 3)]
    for body, superseded in bodies:
        with pytest.raises(MasterConflict) as caught:
            await call(lambda r, body=body: httpx.Response(409, json=body), lambda m: m.post_checkpoint("t1", MANIFEST))
        assert caught.value.superseded_by == superseded
        assert caught.value.body == body


@pytest.mark.parametrize(("body", "expected"), [
    ({"error": "x", "supersededBy": 3}, 3),
    ({"error": "x", "supersededBy": 0}, None),
    ({"error": "x", "supersededBy": True}, None),
    ({"error": "x", "supersededBy": "3"}, None),
    ({"error": "x", "supersededBy": 2.5}, None),
    ({"error": "x"}, None),
    (None, None),
    ([3], None),
])
def test_superseded_by_is_read_strictly(body: Any, expected: int | None) -> None:
    assert MasterConflict("logs", 409, body).superseded_by == expected


async def test_a_superseded_batch_names_the_new_attempt() -> None:
    answer = httpx.Response(409, json={"error": "task 7 moved on to attempt 3", "supersededBy": 3})
    with pytest.raises(MasterConflict) as caught:
        await call(lambda r: answer, lambda m: m.post_stream("logs", "t1", b'{"seq":0,"attempt":2,"lines":[]}'))
    assert caught.value.superseded_by == 3
