"""A real Python HTTP client runs a plan of requests on ONE session/pool, through the proxy of its
environment, as a spider would: ``python py_clients.py <urllib|requests|urllib3|httpx|aiohttp|
aiohttp-concurrent> PLAN RESULT``.

PLAN is JSON ``{"ca": <CA file>, "requests": [{"id", "method", "url", "headers": {}, "body": null |
{"tag", "size", "chunked"}}, …]}``; RESULT gets one record per request, in order: ``{"id", "status",
"identity" (the X-Identity header), "length", "sha256" (of the body received), "json" (the body when
it is JSON), "error" (a client error's text, else null)}``. A request's ``"pause"`` (seconds, optional)
is waited before it is sent. The proxy comes from the environment (HTTP_PROXY/HTTPS_PROXY), except for
urllib3, whose ProxyManager is given it (and its credentials) as its users do. ``urllib`` is the
standard library's urllib.request (an opener with its default handlers: one connection per request);
``aiohttp-concurrent`` sends every request at once over at most four connections.
Runs in the test's client environment (tests/harness/webclients.py), not the agent's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import ssl
import sys
import time
from typing import Any
from urllib.parse import unquote, urlsplit

TIMEOUT = 30.0


def body_bytes(tag: str, size: int) -> bytes:
    unit = (tag + "-").encode()
    return (unit * (size // len(unit) + 1))[:size]


def pieces(data: bytes) -> list[bytes]:
    third = max(1, len(data) // 3)
    return [data[:third], data[third:2 * third], data[2 * third:]]


def record(spec: dict[str, Any], status: int | None, identity: str | None, body: bytes,
           content_type: str | None, error: str | None = None) -> dict[str, Any]:
    parsed = None
    if content_type and "json" in content_type:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
    return {"id": spec["id"], "status": status, "identity": identity, "length": len(body),
            "sha256": hashlib.sha256(body).hexdigest(), "json": parsed, "error": error}


def failed(spec: dict[str, Any], exc: BaseException) -> dict[str, Any]:
    return record(spec, None, None, b"", None, f"{type(exc).__name__}: {exc}")


def run_urllib(plan: dict[str, Any]) -> list[dict[str, Any]]:
    import urllib.error
    import urllib.request

    context = ssl.create_default_context(cafile=plan["ca"])
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))  # ProxyHandler: env
    out = []
    for spec in plan["requests"]:
        time.sleep(spec.get("pause") or 0)
        data: Any = None
        if spec["body"]:
            data = body_bytes(spec["body"]["tag"], spec["body"]["size"])
            if spec["body"]["chunked"]:
                data = iter(pieces(data))  # an iterable without a length: chunked
        request = urllib.request.Request(spec["url"], data=data, headers=spec["headers"], method=spec["method"])
        try:
            try:
                response = opener.open(request, timeout=TIMEOUT)
            except urllib.error.HTTPError as answer:  # 4xx, 5xx, and a 304: an answer all the same
                response = answer
            with response:
                out.append(record(spec, response.status, response.headers.get("X-Identity"), response.read(),
                                  response.headers.get("Content-Type")))
        except Exception as exc:
            out.append(failed(spec, exc))
    return out


def run_requests(plan: dict[str, Any]) -> list[dict[str, Any]]:
    import requests

    out = []
    with requests.Session() as session:  # trust_env: HTTP_PROXY/HTTPS_PROXY, credentials from the URL
        session.verify = plan["ca"]
        for spec in plan["requests"]:
            time.sleep(spec.get("pause") or 0)
            data: Any = None
            if spec["body"]:
                data = body_bytes(spec["body"]["tag"], spec["body"]["size"])
                if spec["body"]["chunked"]:
                    data = iter(pieces(data))  # a generator: Transfer-Encoding: chunked
            try:
                r = session.request(spec["method"], spec["url"], headers=spec["headers"], data=data,
                                    timeout=TIMEOUT)
                out.append(record(spec, r.status_code, r.headers.get("X-Identity"), r.content,
                                  r.headers.get("Content-Type")))
            except Exception as exc:
                out.append(failed(spec, exc))
    return out


def run_urllib3(plan: dict[str, Any]) -> list[dict[str, Any]]:
    import urllib3

    proxy = urlsplit(os.environ["HTTP_PROXY"])
    auth = f"{unquote(proxy.username or '')}:{unquote(proxy.password or '')}"
    url = f"{proxy.scheme}://{proxy.hostname}:{proxy.port}"
    out = []
    with urllib3.ProxyManager(url, proxy_headers=urllib3.make_headers(proxy_basic_auth=auth),
                              ca_certs=plan["ca"], timeout=TIMEOUT, retries=False) as pool:
        for spec in plan["requests"]:
            time.sleep(spec.get("pause") or 0)
            body: Any = None
            chunked = False
            if spec["body"]:
                body = body_bytes(spec["body"]["tag"], spec["body"]["size"])
                if spec["body"]["chunked"]:
                    body, chunked = iter(pieces(body)), True
            try:
                r = pool.request(spec["method"], spec["url"], headers=spec["headers"], body=body,
                                 chunked=chunked, redirect=True, retries=urllib3.Retry(total=None, connect=0, read=0, redirect=5, status=0, other=0))
                out.append(record(spec, r.status, r.headers.get("X-Identity"), r.data, r.headers.get("Content-Type")))
            except Exception as exc:
                out.append(failed(spec, exc))
    return out


def run_httpx(plan: dict[str, Any]) -> list[dict[str, Any]]:
    import httpx

    out = []
    with httpx.Client(verify=plan["ca"], timeout=TIMEOUT, follow_redirects=True) as client:  # trust_env
        for spec in plan["requests"]:
            time.sleep(spec.get("pause") or 0)
            content: Any = None
            if spec["body"]:
                content = body_bytes(spec["body"]["tag"], spec["body"]["size"])
                if spec["body"]["chunked"]:
                    content = iter(pieces(content))  # an iterator: chunked
            try:
                r = client.request(spec["method"], spec["url"], headers=spec["headers"], content=content)
                out.append(record(spec, r.status_code, r.headers.get("X-Identity"), r.content,
                                  r.headers.get("Content-Type")))
            except Exception as exc:
                out.append(failed(spec, exc))
    return out


def run_aiohttp(plan: dict[str, Any], concurrent: bool = False) -> list[dict[str, Any]]:
    import aiohttp

    async def one(session: Any, spec: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(spec.get("pause") or 0)
        data: Any = None
        if spec["body"]:
            data = body_bytes(spec["body"]["tag"], spec["body"]["size"])
            if spec["body"]["chunked"]:
                parts = pieces(data)

                async def stream(parts: list[bytes] = parts) -> Any:  # noqa: ASYNC900 (asyncio, not Trio)
                    for part in parts:
                        yield part

                data = stream()  # an async generator: chunked
        try:
            async with session.request(spec["method"], spec["url"], headers=spec["headers"], data=data) as r:
                body = await r.read()
                return record(spec, r.status, r.headers.get("X-Identity"), body, r.headers.get("Content-Type"))
        except Exception as exc:
            return failed(spec, exc)

    async def main() -> list[dict[str, Any]]:
        context = ssl.create_default_context(cafile=plan["ca"])
        connector = aiohttp.TCPConnector(ssl=context, limit=4)
        async with aiohttp.ClientSession(connector=connector, trust_env=True,
                                         timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
            if concurrent:  # every request at once, over four connections at most
                return list(await asyncio.gather(*(one(session, spec) for spec in plan["requests"])))
            return [await one(session, spec) for spec in plan["requests"]]

    return asyncio.run(main())


def main() -> None:
    lib, plan_file, result_file = sys.argv[1:4]
    with open(plan_file) as fh:
        plan = json.load(fh)
    runners = {"urllib": run_urllib, "requests": run_requests, "urllib3": run_urllib3, "httpx": run_httpx,
               "aiohttp": run_aiohttp, "aiohttp-concurrent": lambda plan: run_aiohttp(plan, concurrent=True)}
    results = runners[lib](plan)
    with open(result_file, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main()
