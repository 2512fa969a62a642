"""A real Python HTTP client runs a plan of requests on ONE session/pool, through the proxy of its
environment, as a spider would: ``python py_clients.py <requests|urllib3|httpx|aiohttp> PLAN RESULT``.

PLAN is JSON ``{"ca": <CA file>, "requests": [{"id", "method", "url", "headers": {}, "body": null |
{"tag", "size", "chunked"}}, …]}``; RESULT gets one record per request, in order: ``{"id", "status",
"identity" (the X-Identity header), "length", "sha256" (of the body received), "json" (the body when
it is JSON), "error" (a client error's text, else null)}``. The proxy comes from the environment
(HTTP_PROXY/HTTPS_PROXY), except for urllib3, whose ProxyManager is given it (and its credentials) as
its users do. Runs in the test's client environment (tests/harness/webclients.py), not the agent's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
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


def run_requests(plan: dict[str, Any]) -> list[dict[str, Any]]:
    import requests

    out = []
    with requests.Session() as session:  # trust_env: HTTP_PROXY/HTTPS_PROXY, credentials from the URL
        session.verify = plan["ca"]
        for spec in plan["requests"]:
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


def run_aiohttp(plan: dict[str, Any]) -> list[dict[str, Any]]:
    import ssl

    import aiohttp

    async def main() -> list[dict[str, Any]]:
        out = []
        context = ssl.create_default_context(cafile=plan["ca"])
        connector = aiohttp.TCPConnector(ssl=context, limit=10)
        async with aiohttp.ClientSession(connector=connector, trust_env=True,
                                         timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
            for spec in plan["requests"]:
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
                    async with session.request(spec["method"], spec["url"], headers=spec["headers"],
                                               data=data) as r:
                        body = await r.read()
                        out.append(record(spec, r.status, r.headers.get("X-Identity"), body,
                                          r.headers.get("Content-Type")))
                except Exception as exc:
                    out.append(failed(spec, exc))
        return out

    return asyncio.run(main())


def main() -> None:
    lib, plan_file, result_file = sys.argv[1:4]
    with open(plan_file) as fh:
        plan = json.load(fh)
    results = {"requests": run_requests, "urllib3": run_urllib3, "httpx": run_httpx, "aiohttp": run_aiohttp}[lib](plan)
    with open(result_file, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main()
