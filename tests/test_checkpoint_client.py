"""The master client's checkpoint calls (ckagent.master.checkpointcalls) and MasterConflict.superseded_by:
what is sent, and how each answer is classified (httpx.MockTransport: pure logic of the boundary)."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Callable
from functools import partial
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


# ---------------------------------------------------------------------------- real HTTP on 127.0.0.1


async def test_over_real_http_a_chunk_goes_up_intact_and_an_endless_one_is_cut_at_the_bound() -> None:
    """A loopback server: registration, a chunk PUT (answered ``stored``), and a chunk GET answered with
    an endless chunked body — the client stops reading at MAX_CHUNK_DOWNLOAD_BYTES instead of holding it."""
    received: list[tuple[str, dict[str, str], bytes]] = []
    sent_of_endless: list[int] = [0]

    async def serve(stream: trio.SocketStream) -> None:
        buf = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                request_line, *lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
                size = int(headers.get("content-length", "0"))
                while len(buf) < size:
                    buf += await stream.receive_some(65536)
                body, buf = buf[:size], buf[size:]
                method, path = request_line.split()[:2]
                received.append((f"{method} {path}", headers, body))
                if method == "GET":  # endless: 64 KiB pieces until the client hangs up
                    await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/gzip\r\n"
                                          b"transfer-encoding: chunked\r\n\r\n")
                    piece = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
                    try:
                        while True:
                            await stream.send_all(piece)
                            sent_of_endless[0] += 65536
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return
                answer = {"nodeId": "n-1", "apiKey": "k-1"} if path.endswith("/register") else {"stored": True}
                payload = json.dumps(answer).encode()
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                      + str(len(payload)).encode() + b"\r\n\r\n" + payload)

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        master = MasterClient(f"http://127.0.0.1:{port}", "token", lambda: RegisterRequest(
            name="n", ip="127.0.0.1", port=1, version="t", os="linux", arch="x", python="3", cpu_count=1,
            memory_total_bytes=1, max_workers=1))
        try:
            with trio.fail_after(20):
                await master.put_checkpoint_chunk("t-1", SHA, GZ)
                with pytest.raises(MasterProtocolError, match="more than"):
                    await master.get_checkpoint_chunk("t-1", SHA)
        finally:
            await master.aclose()
        nursery.cancel_scope.cancel()
    put = received[1]
    assert put[0] == f"PUT /api/tasks/t-1/checkpoint-chunks/{SHA}"
    assert put[2] == GZ and put[1]["content-type"] == "application/gzip" and "content-encoding" not in put[1]
    assert received[2][0] == f"GET /api/tasks/t-1/checkpoint-chunks/{SHA}"
    # what the server got into its socket is bounded by the cut and the kernel's buffers, not endless
    assert MAX_CHUNK_DOWNLOAD_BYTES < sent_of_endless[0] < MAX_CHUNK_DOWNLOAD_BYTES + (32 << 20)
