"""A loopback origin server for :mod:`bench.proxy` that costs as little as a Python server can.

``python -m bench._origin HOST SMALL_BYTES BIG_BYTES`` listens on HOST (a 127.0.0.x address) and a
port the OS picks, prints ``{"port": N, "pid": P}`` as one JSON line and serves until stdin ends
(each stdin line ``cpu`` is answered with ``{"cpu": <this process's CPU seconds so far>}``):

- ``GET /small/<anything>``: 200 with a ``SMALL_BYTES`` HTML body;
- ``GET /big``: 200 with a ``BIG_BYTES`` body (Content-Length);
- anything else: 404.

Why not ``http.server``: it writes the head and the body in separate writes, and Nagle's algorithm
with the client's delayed ACK then holds each kept-alive answer ~40 ms — the server, not the proxy,
would set the pace. Here every answer is prepared in memory at start and sent with ONE ``sendall``
on a socket with ``TCP_NODELAY``; a thread per connection (blocking sockets, the GIL released while
the kernel copies), keep-alive, pipelining tolerated. The request head is found by its blank line and
only its request line is read (a benchmark's fixture, not an edge of the agent: the proxy in front
of it is what parses HTTP for real).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

HEAD = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"


def answers(small_bytes: int, big_bytes: int) -> tuple[bytes, bytes, bytes]:
    """The three answers (small page, big body, 404), each head and body in one bytes object."""
    prefix, suffix = b"<html><body><p>", b"</p></body></html>\n"
    page = prefix + b"x" * max(0, small_bytes - len(prefix) - len(suffix)) + suffix
    small = HEAD % (200, b"OK", b"text/html", len(page)) + page
    big = HEAD % (200, b"OK", b"application/octet-stream", big_bytes) + bytes(big_bytes)
    missing = HEAD % (404, b"Not Found", b"text/plain", 10) + b"not found\n"
    return small, big, missing


def serve_connection(conn: socket.socket, small: bytes, big: bytes, missing: bytes) -> None:
    """Answer the requests of one kept-alive connection until the client closes it."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = b""
    with conn:
        try:
            while True:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                    continue
                head, buffer = buffer[:end], buffer[end + 4:]
                line = head.split(b"\r\n", 1)[0].split(b" ")
                path = line[1] if len(line) == 3 else b""
                if path.startswith(b"/small/"):
                    conn.sendall(small)
                elif path == b"/big":
                    conn.sendall(memoryview(big))
                else:
                    conn.sendall(missing)
                if b"\r\nconnection: close" in head.lower():
                    return
        except OSError:
            return


def main(argv: list[str]) -> int:
    """Entry point (see the module docstring); returns the exit code."""
    host, small_bytes, big_bytes = argv[0], int(argv[1]), int(argv[2])
    if not host.startswith("127."):
        raise SystemExit("the origin listens on loopback only (127.0.0.x)")
    small, big, missing = answers(small_bytes, big_bytes)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(128)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve_connection, args=(conn, small, big, missing), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print(json.dumps({"port": listener.getsockname()[1], "pid": os.getpid()}), flush=True)
    for line in sys.stdin:  # until the benchmark closes our stdin
        if line.strip() == "cpu":
            print(json.dumps({"cpu": time.process_time()}), flush=True)
    listener.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
