"""The Python HTTP clients of :mod:`bench.proxy`, each timed inside its own process.

``python _proxyclients.py small LIB URL_PREFIX N``: N GETs of ``URL_PREFIX<i>`` on ONE kept-alive
session/pool, back to back; prints ``{"latencies": [s, ...], "wall": s, "bytes": n, "cpu": s}``.
``python _proxyclients.py big LIB URL``: one GET whose body is read in 1 MiB pieces and dropped;
prints ``{"wall": s, "bytes": n, "cpu": s}``. ``cpu``: this process's CPU seconds in the timed part.

LIB is ``requests`` (a ``requests.Session``: what most Python spiders use; it takes the proxy from
``HTTP_PROXY`` like a spider does), ``urllib3`` (a ``PoolManager``, or a ``ProxyManager`` for
``HTTP_PROXY`` with its credentials as ``Proxy-Authorization``, as urllib3 users write it) or
``httpx`` (an ``httpx.Client``, proxy from the environment; the one a machine without the bench
venv has). Every answer must be 200 with a body, else the script exits 1 (a benchmark must not time
failures). Only this file's standard-library imports run before the clock starts; the library's
import and the session's creation are outside the timed part.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

PIECE_BYTES = 1 << 20


def _requests() -> tuple[Callable[[str], bytes], Callable[[str], int]]:
    import requests

    session = requests.Session()

    def small(url: str) -> bytes:
        response = session.get(url)
        if response.status_code != 200:
            raise SystemExit(f"{url}: {response.status_code}")
        return response.content

    def big(url: str) -> int:
        with session.get(url, stream=True) as response:
            if response.status_code != 200:
                raise SystemExit(f"{url}: {response.status_code}")
            return sum(len(piece) for piece in response.iter_content(PIECE_BYTES))

    return small, big


def _urllib3() -> tuple[Callable[[str], bytes], Callable[[str], int]]:
    import urllib3

    proxy = os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy")
    pool: Any
    if proxy:
        parts = urlsplit(proxy)
        headers = {}
        if parts.username is not None:
            token = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            headers["Proxy-Authorization"] = "Basic " + base64.b64encode(token).decode()
        pool = urllib3.ProxyManager(f"{parts.scheme}://{parts.hostname}:{parts.port}", proxy_headers=headers)
    else:
        pool = urllib3.PoolManager()

    def small(url: str) -> bytes:
        response = pool.request("GET", url)
        if response.status != 200:
            raise SystemExit(f"{url}: {response.status}")
        return bytes(response.data)

    def big(url: str) -> int:
        response = pool.request("GET", url, preload_content=False)
        if response.status != 200:
            raise SystemExit(f"{url}: {response.status}")
        count = sum(len(piece) for piece in response.stream(PIECE_BYTES))
        response.release_conn()
        return count

    return small, big


def _httpx() -> tuple[Callable[[str], bytes], Callable[[str], int]]:
    import httpx

    client = httpx.Client(timeout=60.0)

    def small(url: str) -> bytes:
        response = client.get(url)
        if response.status_code != 200:
            raise SystemExit(f"{url}: {response.status_code}")
        return response.content

    def big(url: str) -> int:
        with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise SystemExit(f"{url}: {response.status_code}")
            return sum(len(piece) for piece in response.iter_raw(PIECE_BYTES))

    return small, big


LIBS = {"requests": _requests, "urllib3": _urllib3, "httpx": _httpx}


def main(argv: list[str]) -> int:
    """Entry point (see the module docstring); returns the exit code."""
    mode, lib = argv[0], argv[1]
    small, big = LIBS[lib]()
    if mode == "small":
        prefix, count = argv[2], int(argv[3])
        latencies = []
        received = 0
        cpu = time.process_time()
        started = time.perf_counter()
        for i in range(count):
            before = time.perf_counter()
            body = small(f"{prefix}{i}")
            latencies.append(time.perf_counter() - before)
            if not body:
                raise SystemExit(f"{prefix}{i}: empty body")
            received += len(body)
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu
        print(json.dumps({"latencies": latencies, "wall": wall, "bytes": received, "cpu": cpu}))
        return 0
    cpu = time.process_time()
    started = time.perf_counter()
    received = big(argv[2])
    wall = time.perf_counter() - started
    print(json.dumps({"wall": wall, "bytes": received, "cpu": time.process_time() - cpu}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
