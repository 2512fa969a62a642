"""Scrapy runs a plan of requests through the proxy of its environment (HttpProxyMiddleware reads
HTTP_PROXY/HTTPS_PROXY and their credentials), one after the other on its one download pool (each
request is yielded by the previous one's callback, CONCURRENT_REQUESTS 1): ``python scrapy_client.py
PLAN RESULT``; with ``--concurrent`` as a crawl does, every request at once (CONCURRENT_REQUESTS 8:
plain-HTTP requests of both hosts share the pool's proxy connections). PLAN and RESULT as in
py_clients.py (the results in the plan's order). Scrapy cannot send a chunked request body: a plan for
it has none.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import scrapy
from scrapy.crawler import CrawlerProcess


def body_bytes(tag: str, size: int) -> bytes:
    unit = (tag + "-").encode()
    return (unit * (size // len(unit) + 1))[:size]


class PlanSpider(scrapy.Spider):
    name = "plan"

    def __init__(self, plan: dict[str, Any], out: list[dict[str, Any]], concurrent: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plan, self.out, self.concurrent = plan["requests"], out, concurrent

    def make(self, index: int) -> scrapy.Request | None:
        if index >= len(self.plan):
            return None
        spec = self.plan[index]
        body = body_bytes(spec["body"]["tag"], spec["body"]["size"]) if spec["body"] else None
        return scrapy.Request(spec["url"], method=spec["method"], headers=spec["headers"], body=body,
                              dont_filter=True, callback=self.answer, errback=self.failure,
                              cb_kwargs={"index": index},
                              meta={"handle_httpstatus_list": [304, *range(400, 600)]})  # (3xx: followed)

    async def start(self) -> Any:  # noqa: ASYNC900 (Scrapy ≥ 2.13 calls it; Twisted, not Trio)
        for request in self.start_requests():
            yield request

    def start_requests(self) -> Any:
        for index in range(len(self.plan) if self.concurrent else 1):
            request = self.make(index)
            if request is not None:
                yield request

    def after(self, index: int) -> Any:
        following = None if self.concurrent else self.make(index + 1)
        if following is not None:
            yield following

    def answer(self, response: scrapy.http.Response, index: int) -> Any:
        spec = self.plan[index]
        body = response.body
        parsed = None
        if b"json" in (response.headers.get("Content-Type") or b""):
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        identity = response.headers.get("X-Identity")
        self.out.append({"id": spec["id"], "status": response.status,
                         "identity": identity.decode() if identity else None, "length": len(body),
                         "sha256": hashlib.sha256(body).hexdigest(), "json": parsed, "error": None})
        yield from self.after(index)

    def failure(self, failure: Any) -> Any:
        index = failure.request.cb_kwargs["index"]
        spec = self.plan[index]
        self.out.append({"id": spec["id"], "status": None, "identity": None, "length": 0,
                         "sha256": hashlib.sha256(b"").hexdigest(), "json": None,
                         "error": f"{failure.type.__name__}: {failure.value}"})
        yield from self.after(index)


def main() -> None:
    concurrent = "--concurrent" in sys.argv
    plan_file, result_file = [arg for arg in sys.argv[1:] if arg != "--concurrent"]
    with open(plan_file) as fh:
        plan = json.load(fh)
    out: list[dict[str, Any]] = []
    process = CrawlerProcess(settings={
        "CONCURRENT_REQUESTS": 8 if concurrent else 1, "CONCURRENT_REQUESTS_PER_DOMAIN": 8,
        "RETRY_ENABLED": False, "ROBOTSTXT_OBEY": False, "LOG_LEVEL": "WARNING",
        "TELNETCONSOLE_ENABLED": False, "DOWNLOAD_TIMEOUT": 30, "COOKIES_ENABLED": False,
        "REQUEST_FINGERPRINTER_IMPLEMENTATION": "2.7",
    })
    process.crawl(PlanSpider, plan=plan, out=out, concurrent=concurrent)
    process.start()
    order = {spec["id"]: index for index, spec in enumerate(plan["requests"])}
    with open(result_file, "w") as fh:
        json.dump(sorted(out, key=lambda r: order[r["id"]]), fh)


if __name__ == "__main__":
    main()
