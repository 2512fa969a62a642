"""The supervisor's /livez listener is an edge: hostile and unlucky clients end only their own connection.

One real supervisor for the module (a plain child of the test process: it works as any pid), its agent
pointed at a master that is not there (it keeps trying to register, so /livez says "starting"):
idle connections and slowloris heads are closed at the per-connection bound while other clients are
answered at once; garbage is a 400, a huge head a 431, other paths 404, other methods 405; a request
half-closed after its head is answered, one half-closed before is closed; a flood of connections
evicts the oldest; hypothesis sends arbitrary bytes — the supervisor answers or closes, never hangs,
and serves the next client.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
from harness import SupervisedNode, free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckagent.pod.livez import CONNECTION_TIMEOUT, MAX_CONNECTIONS

SLACK = 3.0
"""Seconds allowed beyond a bound the server keeps (a loaded machine)."""


@pytest.fixture(scope="module")
def live_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A running supervisor's /livez port (its agent's master unreachable); stopped after the module."""
    directory = tmp_path_factory.mktemp("livez")
    node = SupervisedNode(directory / "node", f"http://127.0.0.1:{free_port()}", "token-0123456789abcdef")
    process = node.popen()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if _ask(node.live_port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200"):
                    break
            except OSError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, node.log_text()[-3000:]
            time.sleep(0.1)
        yield node.live_port
        assert process.poll() is None, "the supervisor survived every client"
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=CONNECTION_TIMEOUT + SLACK)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _ask(port: int, request: bytes, *, half_close: bool = False) -> bytes:
    """Send ``request`` on a new connection; everything the server sent until it closed."""
    with _connect(port) as sock:
        sock.sendall(request)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return _read_all(sock)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def test_routes_methods_and_head(live_port: int) -> None:
    ok = _ask(live_port, b"GET /livez?verbose=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _status(ok) == 200 and b"Connection: close" in ok and ok.endswith(b"\n") and b"starting" in ok
    for path in (b"/", b"/healthz", b"/livez/x", b"/metrics"):
        assert _status(_ask(live_port, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")) == 404
    post = _ask(live_port, b"POST /livez HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi")
    assert _status(post) == 405 and b"Allow: GET, HEAD" in post
    head = _ask(live_port, b"HEAD /livez HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _status(head) == 200 and head.endswith(b"\r\n\r\n")  # no body
    # pipelined: one answer, then the connection closes (every response closes it)
    two = _ask(live_port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
    assert two.count(b"HTTP/1.1 ") == 1 and _status(two) == 200


def test_garbage_is_400_and_a_huge_head_431(live_port: int) -> None:
    assert _status(_ask(live_port, b"\x00\xff\x16\x03\x01 not http\r\n\r\n")) == 400
    assert _status(_ask(live_port, b"GET /livez HTTP/1.1\r\n\r\n")) == 400  # no Host
    huge = _ask(live_port, b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
    assert _status(huge) in (431, 0)  # (0: the server closed while 200 kB were still on their way: reset)
    assert _status(_ask(live_port, b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")) in (431, 0)


def test_half_close_after_the_head_is_answered_before_it_closed(live_port: int) -> None:
    assert _status(_ask(live_port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n", half_close=True)) == 200
    cut = _ask(live_port, b"GET /livez HTTP/1.1\r\nHo", half_close=True)
    assert cut == b"" or _status(cut) == 400, cut  # (h11: the peer closed in the middle of a head)


@pytest.mark.slow
def test_idle_and_slowloris_connections_end_at_the_bound_while_others_are_answered(live_port: int) -> None:
    started = time.monotonic()
    idle = _connect(live_port)
    slow = _connect(live_port)
    slow.sendall(b"GET /livez HTTP/1.1\r\n")
    closed_slow = None
    while closed_slow is None and time.monotonic() - started < CONNECTION_TIMEOUT + SLACK:
        try:
            slow.sendall(b"X")  # one byte of a header, every 0.2 s: never a whole head
        except OSError:
            closed_slow = time.monotonic() - started
            break
        asked = time.monotonic()
        assert _status(_ask(live_port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
        assert time.monotonic() - asked < 2.5, "another client waits behind the slow ones"
        time.sleep(0.2)
    with idle, slow:
        assert _read_all(idle) == b"" and time.monotonic() - started < CONNECTION_TIMEOUT + SLACK
        assert _read_all(slow) in (b"",) or closed_slow is not None
    assert time.monotonic() - started >= CONNECTION_TIMEOUT - 0.5, "not closed before the bound"


def test_a_flood_of_connections_evicts_the_oldest_and_the_next_client_is_answered(live_port: int) -> None:
    flood = [_connect(live_port) for _ in range(MAX_CONNECTIONS + 20)]
    try:
        asked = time.monotonic()
        assert _status(_ask(live_port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
        assert time.monotonic() - asked < 2.5
        flood[0].settimeout(SLACK)
        assert _read_all(flood[0]) == b"", "the oldest was closed for a new one"
    finally:
        for sock in flood:
            sock.close()


REQUESTS = st.one_of(
    st.binary(max_size=4096),
    st.builds(lambda line, tail: b"GET " + line + b" HTTP/1.1\r\n" + tail,
              st.binary(min_size=1, max_size=300), st.binary(max_size=600)),
    st.builds(lambda headers, body: b"GET /livez HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n" + body,
              st.binary(max_size=600), st.binary(max_size=600)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=REQUESTS)
def test_arbitrary_bytes_get_an_answer_or_a_close_never_a_hang(live_port: int, request: bytes) -> None:
    started = time.monotonic()
    try:
        answer = _ask(live_port, request, half_close=True)
    except (BrokenPipeError, ConnectionResetError):
        answer = b""
    assert time.monotonic() - started < CONNECTION_TIMEOUT + SLACK
    assert answer == b"" or _status(answer) in (200, 400, 404, 405, 431, 503), answer[:200]
    if answer:
        assert answer.count(b"HTTP/1.1 ") == 1


def test_after_everything_the_next_client_is_answered(live_port: int) -> None:
    assert _status(_ask(live_port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
