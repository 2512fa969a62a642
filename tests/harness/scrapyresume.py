"""A real Scrapy crawl under a fake agent, for the tests of checkpoints and resume (issue 38).

- :class:`PagedSite`: a site of ``pages`` pages on 127.0.0.1 (``/p/<n>`` links to ``/p/3n+1`` ..
  ``/p/3n+3`` below ``pages``, and back to its parent but for the first pages, whose parent is the start
  page), each answered after ``delay`` seconds (so requests are in flight), counting the fetches of
  every page.
- :func:`write_pages_project`: a Scrapy project whose spider ``pages`` (its start request ``dont_filter``,
  as Scrapy's ``start_urls``) yields one item per page and
  counts the pages it parsed in ``spider.state`` (said at close: ``pages spider closed: state=N, resumed=M``).
- :func:`scrapy_python`: a virtualenv with the given Scrapy (uv, from its cache) and the agent's
  ``.pth`` lines: the bundled SDK importable and the Scrapy hook attached, as in the agent's environments.
- :class:`FakeAgent`: one attempt's ``CK_*`` files, as the agent's side of issue 38 lays them out
  (``state/``, ``control.jsonl``, ``control-ack.jsonl``, ``snapshots/``, ``items.jsonl``).
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ckagent.code.deps import bundled_sdk_dir
from ckagent.code.deps_python import _SCRAPY_HOOK_LINE
from harness.webclients import BUILD_TIMEOUT, ClientUnavailable, _locked

__all__ = ["FakeAgent", "PagedSite", "scrapy_python", "write_pages_project"]


class PagedSite:
    """The site (module docstring); a context manager serving on 127.0.0.1 from a thread."""

    def __init__(self, pages: int, delay: float) -> None:
        self.pages = pages
        self.delay = delay
        self.hits: Counter[int] = Counter()
        self.lock = threading.Lock()
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                parts = self.path.split("/")
                if len(parts) != 3 or parts[1] != "p" or not parts[2].isdigit() or int(parts[2]) >= site.pages:
                    self.send_error(404)
                    return
                n = int(parts[2])
                with site.lock:
                    site.hits[n] += 1
                time.sleep(site.delay)
                family = (3 * n + 1, 3 * n + 2, 3 * n + 3, (n - 1) // 3 if n > 3 else site.pages)
                links = "".join(f'<a href="/p/{c}">{c}</a>' for c in family if c < site.pages)
                body = f"<html><body><h1>page {n}</h1>{links}</body></html>".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # (a crawl killed mid-request resets its connections)

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def fetched(self) -> int:
        """Fetches so far (every page, every time)."""
        with self.lock:
            return sum(self.hits.values())

    def __enter__(self) -> PagedSite:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


_SPIDER = '''\
import os

import scrapy


class Pages(scrapy.Spider):
    name = "pages"

    async def start(self):  # (Scrapy 2.13+; start_requests before)
        for request in self.start_requests():
            yield request

    def start_requests(self):
        # As Scrapy's own start_urls: dont_filter (a resumed crawl must not fetch it again).
        yield scrapy.Request(os.environ["START_URL"].rstrip("/") + "/p/0", dont_filter=True)

    def parse(self, response):
        if not hasattr(self, "state"):  # (no JOBDIR: no SpiderState extension)
            self.state = {}
        if not hasattr(self, "resumed"):
            self.resumed = self.state.get("pages", 0)
        self.state["pages"] = self.state.get("pages", 0) + 1
        yield {"url": response.url, "title": response.css("h1::text").get()}
        for href in response.css("a::attr(href)").getall():
            yield response.follow(href, callback=self.parse)

    def closed(self, reason):
        print(f"pages spider closed: state={getattr(self, 'state', {}).get('pages')}, "
              f"resumed={getattr(self, 'resumed', 0)}",
              flush=True)
'''


def write_pages_project(directory: Path) -> Path:
    """Write the project (module docstring) into ``directory`` (made if missing); returns it. Blocking."""
    package = directory / "pagesproj"
    (package / "spiders").mkdir(parents=True, exist_ok=True)
    (directory / "scrapy.cfg").write_text("[settings]\ndefault = pagesproj.settings\n")
    (package / "__init__.py").write_text("")
    (package / "settings.py").write_text('BOT_NAME = "pagesproj"\nSPIDER_MODULES = ["pagesproj.spiders"]\n'
                                         'ROBOTSTXT_OBEY = False\nTELNETCONSOLE_ENABLED = False\n'
                                         'LOG_LEVEL = "INFO"\n')
    (package / "spiders" / "__init__.py").write_text("")
    (package / "spiders" / "pages.py").write_text(_SPIDER)
    return directory


SCRAPY_SPECS = {"2.19": ("scrapy==2.19.0",), "2.11": ("scrapy==2.11.2", "twisted==23.10.0", "w3lib==2.1.2")}
"""The Scrapy releases the tests run on: the newest the suite's environments resolve, the oldest requirements allow."""


def scrapy_python(base: Path, release: str) -> Path:
    """The interpreter of a virtualenv in ``base``/scrapy-<release> with :data:`SCRAPY_SPECS`'s packages and
    the agent's ``.pth`` (the SDK, the Scrapy hook), made once under a file lock (uv, its cache first).
    Blocking. Raises ClientUnavailable when uv cannot make it."""
    root = base / f"scrapy-{release}"
    python = root / "bin" / "python"
    done = root / ".complete"
    with _locked(base / f"scrapy-{release}-lock"):
        if done.exists():
            return python
        uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
        if uv is None:
            raise ClientUnavailable("uv is not installed (the dev extras install it)")
        shutil.rmtree(root, ignore_errors=True)
        env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
        for argv in ([uv, "venv", "--quiet", "--python", sys.executable, str(root)],
                     [uv, "pip", "install", "--quiet", "--python", str(python), *SCRAPY_SPECS[release]]):
            result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT,
                                    check=False)
            if result.returncode != 0:
                raise ClientUnavailable(f"{' '.join(argv[:3])} failed ({result.returncode}): "
                                        f"{result.stderr.strip()[-2000:]}")
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        (Path(site) / "_crawlerkeeper_sdk_fallback.pth").write_text(f"{bundled_sdk_dir()}\n{_SCRAPY_HOOK_LINE}")
        done.touch()
    return python


class FakeAgent:
    """One attempt's files in ``task_dir`` (made), laid out as the agent lays them out (module docstring)."""

    def __init__(self, task_dir: Path, attempt: int = 1) -> None:
        self.task_dir = task_dir
        self.state = task_dir / "state"
        self.control = task_dir / "control.jsonl"
        self.acks = task_dir / "control-ack.jsonl"
        self.snapshots = task_dir / "snapshots"
        self.items = task_dir / "items.jsonl"
        self.attempt = attempt
        self.state.mkdir(parents=True, exist_ok=True)
        self.next_id = 1

    def env(self, hook: str = "items,stats,state") -> dict[str, str]:
        """The ``CK_*`` variables of this attempt."""
        return {"CK_SCRAPY_HOOK": hook, "CK_STATE_DIR": str(self.state), "CK_CONTROL_FILE": str(self.control),
                "CK_CONTROL_ACK_FILE": str(self.acks), "CK_SNAPSHOT_DIR": str(self.snapshots),
                "CK_ITEMS_FILE": str(self.items), "CK_ATTEMPT": str(self.attempt),
                "CK_TASK_DIR": str(self.task_dir), "CK_STATS_FILE": str(self.task_dir / "stats.jsonl")}

    def request(self, event: str = "persistState", **extra: Any) -> int:
        """Append a persist request; returns its id."""
        number = self.next_id
        self.next_id += 1
        with self.control.open("a") as f:
            f.write(json.dumps({"event": event, "id": number, "reason": "interval", **extra}) + "\n")
        return number

    def ack(self, number: int) -> dict[str, Any] | None:
        """The spider's answer to request ``number``, or None while there is none."""
        if not self.acks.exists():
            return None
        for line in self.acks.read_text().splitlines():
            record = json.loads(line)
            if record.get("id") == number:
                return record  # type: ignore[no-any-return]
        return None

    def items_list(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The items file's items (its first ``limit`` bytes when given)."""
        data = self.items.read_bytes() if self.items.exists() else b""
        if limit is not None:
            data = data[:limit]
        return [json.loads(line) for line in data.splitlines()]

    def resume_from(self, previous: FakeAgent, snapshot: str) -> None:
        """This attempt's state dir := ``previous``'s snapshot (what restore does from the master's copy)."""
        shutil.rmtree(self.state)
        shutil.copytree(previous.snapshots / snapshot, self.state, symlinks=True)
