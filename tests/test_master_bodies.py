"""Large request bodies (stream batches, artifacts) against a real HTTP server on 127.0.0.1: sent in one
piece with their length (not chunked), byte for byte, and not held once the master has answered."""

from __future__ import annotations

import gc
import json
import sys
from functools import partial
from typing import Any

import trio

from ckagent.master.client import SENT_ONCE_BYTES, MasterClient
from ckagent.master.protocol import RegisterRequest


def register_body() -> RegisterRequest:
    return RegisterRequest(name="n1", ip="127.0.0.1", port=9000, version="0", os="linux", arch="x86_64",
                           python="3.11", cpu_count=2, memory_total_bytes=1 << 30, max_workers=2)


class LoopbackMaster:
    """Answers registration and stream batches over real HTTP/1.1 (keep-alive); records each request's
    path, headers (lower-case) and body."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []

    async def serve(self, stream: trio.SocketStream) -> None:
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
                size = int(headers.get("content-length", "0"))  # a chunked body would leave this 0
                while len(buf) < size:
                    buf += await stream.receive_some(65536)
                body, buf = buf[:size], buf[size:]
                path = request_line.split()[1]
                self.requests.append((path, headers, body))
                answer: dict[str, Any] = ({"nodeId": "n-1", "apiKey": "k"} if path.endswith("/register")
                                          else {"acceptedSeq": len(json.loads(body)["items"])})
                payload = json.dumps(answer).encode()
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                                      + str(len(payload)).encode() + b"\r\n\r\n" + payload)


async def test_a_large_batch_goes_in_one_piece_and_is_not_held_after_the_answer() -> None:
    master = LoopbackMaster()
    items = [b'{"n":%d,"title":"item %d"}' % (i, i) for i in range(SENT_ONCE_BYTES // 10)]
    body = b'{"seq":0,"items":[%s]}' % b",".join(items)
    assert len(body) > SENT_ONCE_BYTES
    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(partial(trio.serve_tcp, master.serve, 0, host="127.0.0.1"))
        port = listener.socket.getsockname()[1]
        client = MasterClient(f"http://127.0.0.1:{port}", "token", register_body)
        gc.disable()  # what frees a request is its reference count, not a collection
        try:
            await client.register()
            before = sys.getrefcount(body)
            accepted = await client.post_stream("items", "t-1", body)
            after = sys.getrefcount(body)
        finally:
            gc.enable()
            await client.aclose()
        nursery.cancel_scope.cancel()
    assert accepted.accepted_seq == len(items)
    path, headers, received = master.requests[-1]
    assert path == "/api/tasks/t-1/items"
    assert received == body
    assert headers["content-length"] == str(len(body)) and "transfer-encoding" not in headers
    assert after == before  # httpx's answered request (a reference cycle) no longer holds the batch
