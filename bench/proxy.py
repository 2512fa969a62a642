"""Egress proxy speed: the same clients fetching the same pages directly and through the agent's proxy.

The ``proxy`` egress level puts the agent's forward proxy (:mod:`ckagent.containment.egress.proxy`)
between every request of a task and the network. What that costs, side by side in one run:

- **small pages**: 2,000 GETs (200 quick) of a 2 KiB page on ONE kept-alive connection, back to back;
  per-request latency (p50) and requests/s;
- **one 100 MB body** (5 MB quick): MB/s;
- **a Scrapy crawl of the demo shop** the reference master serves (``/demo-site/``): every listing
  and product page (35 a lap), 20 laps (1 quick), Scrapy's default concurrency: the crawl's wall time
  (process start to exit) and pages/s (Scrapy's own ``elapsed_time_seconds``). Skipped with
  ``--no-scrapyd`` (Scrapy is installed into the bench venv from the package index).

**Direct vs proxy, in pairs**: every workload runs directly and through the proxy one right after
the other (the order alternating from round to round), 5 rounds after a warm-up round (1 round, no
warm-up, quick), so a noisy minute hits both sides of a pair; each ratio is the median over rounds
of that round's ratio, each added latency the median of that round's difference of p50s.

**The proxy in its own process** (:mod:`bench._proxyrunner`): the agent's own ``open_egress("proxy")``
with the node's default policy, ``Egress.serve`` and ``attach`` of one task, as the agent runs it;
the client gets the task's ``HTTP_PROXY`` (its port, user name and secret password). Its CPU (user +
system, from ``/proc``) around each proxied run is the proxy's CPU per request / per 100 MB / per
page. It keeps running between runs, as in an agent (its pool of upstream connections warm).

**Server and clients chosen so they are not what is measured**:

- the origin (:mod:`bench._origin`) answers from memory, each answer in ONE write on a socket with
  ``TCP_NODELAY`` (Python's ``http.server`` writes head and body separately, and Nagle + delayed ACK
  then cost ~40 ms per kept-alive request), a thread per connection, on 127.0.0.2; its CPU per
  request is reported beside the proxy's;
- clients that spiders really use, each in a process of its own that times itself
  (:mod:`bench._proxyclients`): ``requests.Session`` (most Python spiders; the proxy from
  ``HTTP_PROXY`` as a spider takes it) and urllib3 (``PoolManager``/``ProxyManager``, what requests
  and many crawlers stand on) — from the bench venv; and **curl** (C; one process, the URLs of a
  config file on one connection, ``-w %{time_total}`` per transfer): the cheapest client, so its rows
  show the proxy's cost with the least client time around it (raw throughput). Without the bench
  venv (``--no-scrapyd``): curl and ``httpx.Client``. Scrapy for the crawl.

Targets (issue 34, item 7): through the proxy ≥ 0.9 × direct throughput for the small pages and for
the 100 MB body (every client), ≤ 0.5 ms added latency per request at p50 (every client), and the
Scrapy crawl within 1.1 × direct (wall time and pages/s); the proxy's CPU per request is reported.
After the timed rounds, a **profile** of the proxy (not timed): py-spy sampling the proxy process
when the bench venv has it (full mode installs it), else cProfile inside it — for the small pages
(the first Python client) and the big body (curl): the functions with the most CPU (self and
inclusive, % of the proxy's busy samples) and the CPU by package.

Only loopback addresses are used: the origin on 127.0.0.2, the proxy and the dev master on 127.0.0.1.
Run: ``python -m bench.proxy [--quick] [--no-scrapyd]`` or ``python -m bench --only proxy``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pstats
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from bench._harness import PYTHON, REPO, DevMaster, markdown_table, summary, work_directory

TARGET_THROUGHPUT_RATIO = 0.9
TARGET_ADDED_P50_SECONDS = 0.0005
TARGET_SCRAPY_RATIO = 1.1

ORIGIN_HOST = "127.0.0.2"
SMALL_BYTES = 2048
SHOP_PAGES_PER_LAP = 35
SHOP_ITEMS_PER_LAP = 30
CLIENT_REQUIREMENTS = ("requests>=2.31", "urllib3>=2", "py-spy>=0.3")
"""Installed into the bench venv (beside Scrapy) in full mode."""

HERE = Path(__file__).resolve().parent
CLIENTS_SCRIPT = HERE / "_proxyclients.py"
SHOP_SPIDER = HERE / "_shopcrawl.py"
START_SECONDS = 60.0
RUN_SECONDS = 600.0
STOP_SECONDS = 60.0
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


@dataclass(frozen=True)
class Sizes:
    """How much each run does (see the module docstring)."""

    pages: int
    big_bytes: int
    rounds: int
    warmup: int
    laps: int
    profile_repeat: int


FULL = Sizes(pages=2000, big_bytes=100_000_000, rounds=5, warmup=1, laps=20, profile_repeat=3)
QUICK = Sizes(pages=200, big_bytes=5_000_000, rounds=1, warmup=0, laps=1, profile_repeat=1)


@dataclass
class Measure:
    """One run of one side: wall seconds, per-request latencies (small pages), bytes, and the CPU
    seconds the proxy, the origin and the client used during it."""

    wall: float
    latencies: list[float] = field(default_factory=list)
    bytes: int = 0
    proxy_cpu: float = 0.0
    origin_cpu: float = 0.0
    client_cpu: float = 0.0
    count: int = 1


# ------------------------------------------------------------------------------ child processes


class _Child:
    """A helper process that prints one JSON line when ready and runs until its stdin closes."""

    def __init__(self, name: str, log: Path) -> None:
        self.name, self.log = name, log
        self.process: trio.Process | None = None
        self._buffer = b""

    async def start(self, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
        with self.log.open("ab") as log:
            self.process = await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                            stderr=log, env=env, cwd=str(REPO))
        return dict(json.loads(await self.line()))

    async def line(self) -> bytes:
        assert self.process is not None and self.process.stdout is not None
        with trio.fail_after(START_SECONDS):
            await trio.lowlevel.checkpoint()
            while b"\n" not in self._buffer:
                data = await self.process.stdout.receive_some(65536)
                if not data:
                    raise RuntimeError(f"the {self.name} exited ({self.process.returncode}); see {self.log}")
                self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    async def ask(self, text: str) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin is not None
        await self.process.stdin.send_all(text.encode() + b"\n")
        return dict(json.loads(await self.line()))

    async def cpu(self) -> float:
        """CPU seconds (user + system, every thread) the process used so far, as it reads them."""
        return float((await self.ask("cpu"))["cpu"])

    async def stop(self) -> None:
        """Close stdin (the child ends), SIGKILL after 20 s. Idempotent."""
        process = self.process
        if process is None:
            return
        with trio.CancelScope(shield=True):
            if process.stdin is not None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await process.stdin.aclose()
            with trio.move_on_after(20):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()


def _base_env() -> dict[str, str]:
    """This process's environment without proxy variables or AGENT_* settings, ckagent importable."""
    env = {k: v for k, v in os.environ.items()
           if k.upper() not in PROXY_VARIABLES and not k.startswith(("AGENT_", "SCRAPY_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def _proxied_env(env: dict[str, str], url: str | None) -> dict[str, str]:
    if url is None:
        return env
    return {**env, "HTTP_PROXY": url, "http_proxy": url, "HTTPS_PROXY": url, "https_proxy": url,
            "NO_PROXY": "", "no_proxy": ""}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def _run_client(argv: list[str], env: dict[str, str]) -> tuple[str, float]:
    """Run a client to its end; returns its stdout and CPU seconds. Raises RuntimeError when it fails."""
    before = _children_cpu()
    with trio.fail_after(RUN_SECONDS):
        done = await trio.run_process(argv, env=env, capture_stdout=True, capture_stderr=True, check=False,
                                      cwd=str(REPO))
    cpu = _children_cpu() - before
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} … failed ({done.returncode}): "
                           f"{(done.stdout + done.stderr).decode(errors='replace')[-2000:]}")
    return done.stdout.decode(), cpu


# ------------------------------------------------------------------------------------ the clients


@dataclass(frozen=True)
class Client:
    """One client: ``name`` as shown, and how it runs the two workloads."""

    name: str
    python: Path | None = None
    """The interpreter of a Python client (None: curl)."""
    lib: str = ""


def _write_curl_config(path: Path, prefix: str, count: int) -> None:
    path.write_text("".join(f'url = "{prefix}{i}"\noutput = "/dev/null"\n' for i in range(count)))


def _curl_argv(proxy: str | None) -> list[str]:
    argv = ["curl", "-q", "--silent", "--show-error", "--fail"]
    return argv + (["--proxy", proxy] if proxy else [])


def _parse_curl(text: str, count: int, what: str) -> tuple[list[float], int]:
    """curl's ``-w`` lines → (times, bytes). Raises RuntimeError unless every answer was 200 and the
    whole run used one connection."""
    latencies, received, connects = [], 0, 0
    for line in text.splitlines():
        seconds, status, size, new = line.split()
        if status != "200":
            raise RuntimeError(f"curl {what}: an answer was {status}")
        latencies.append(float(seconds))
        received += int(size)
        connects += int(new)
    if len(latencies) != count:
        raise RuntimeError(f"curl {what}: {len(latencies)} answers, expected {count}")
    if connects > 1:
        raise RuntimeError(f"curl {what}: {connects} connections for {count} requests (not kept alive)")
    return latencies, received


CURL_FORMAT = "%{time_total} %{http_code} %{size_download} %{num_connects}\\n"


async def small_pages(client: Client, origin: str, count: int, proxy: str | None, env: dict[str, str],
                      workdir: Path) -> Measure:
    """``count`` GETs of small pages on one kept-alive connection (directly when ``proxy`` is None)."""
    prefix = f"{origin}/small/"
    if client.python is None:
        config = workdir / f"curl-{count}.conf"
        if not config.exists():
            _write_curl_config(config, prefix, count)
        out, cpu = await _run_client([*_curl_argv(proxy), "-w", CURL_FORMAT, "--config", str(config)],
                                     _proxied_env(env, proxy))
        latencies, received = _parse_curl(out, count, "small pages")
        return Measure(wall=sum(latencies), latencies=latencies, bytes=received, client_cpu=cpu, count=count)
    out, _ = await _run_client([str(client.python), str(CLIENTS_SCRIPT), "small", client.lib, prefix, str(count)],
                                 _proxied_env(env, proxy))
    result = json.loads(out)
    if len(result["latencies"]) != count or result["bytes"] != count * SMALL_BYTES:
        raise RuntimeError(f"{client.name}: {len(result['latencies'])} pages, {result['bytes']} bytes")
    return Measure(wall=result["wall"], latencies=result["latencies"], bytes=result["bytes"],
                   client_cpu=result["cpu"], count=count)


async def big_body(client: Client, origin: str, size: int, proxy: str | None, env: dict[str, str]) -> Measure:
    """One GET of the big body, read and dropped (directly when ``proxy`` is None)."""
    url = f"{origin}/big"
    if client.python is None:
        out, cpu = await _run_client([*_curl_argv(proxy), "-w", CURL_FORMAT, "-o", "/dev/null", url],
                                     _proxied_env(env, proxy))
        latencies, received = _parse_curl(out, 1, "big body")
        wall = latencies[0]
    else:
        out, cpu = await _run_client([str(client.python), str(CLIENTS_SCRIPT), "big", client.lib, url],
                                     _proxied_env(env, proxy))
        result = json.loads(out)
        wall, received, cpu = result["wall"], result["bytes"], result["cpu"]
    if received != size:
        raise RuntimeError(f"{client.name}: the big body had {received} bytes, expected {size}")
    return Measure(wall=wall, bytes=received, client_cpu=cpu)


# ---------------------------------------------------------------------------------------- scrapy


def _read_stats(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


async def shop_crawl(python: Path, start_url: str, laps: int, proxy: str | None, env: dict[str, str],
                     workdir: Path) -> Measure:
    """One Scrapy crawl of the demo shop (see the module docstring); wall = process start → exit,
    ``latencies`` = [Scrapy's elapsed_time_seconds]."""
    stats_file = workdir / "shop-stats.json"
    stats_file.unlink(missing_ok=True)
    argv = [str(python), "-m", "scrapy", "runspider", str(SHOP_SPIDER), "-a", f"start_url={start_url}",
            "-a", f"laps={laps}", "-a", f"stats_file={stats_file}"]
    crawl_env = _proxied_env({k: v for k, v in env.items() if k != "PYTHONPATH"}, proxy)
    started = time.perf_counter()
    _, cpu = await _run_client(argv, crawl_env)
    wall = time.perf_counter() - started
    stats = _read_stats(stats_file)
    pages = SHOP_PAGES_PER_LAP * laps
    got = (stats.get("response_received_count"), stats.get("downloader/response_status_count/200"),
           stats.get("item_scraped_count"))
    if got != (pages, pages, SHOP_ITEMS_PER_LAP * laps) or stats.get("finish_reason") != "finished":
        raise RuntimeError(f"the shop crawl got (responses, 200s, items) {got}, expected "
                           f"{(pages, pages, SHOP_ITEMS_PER_LAP * laps)}; {stats}")
    return Measure(wall=wall, latencies=[float(stats["elapsed_time_seconds"])], client_cpu=cpu, count=pages)


# ---------------------------------------------------------------------------------------- the run


def run(quick: bool, scrapyd: bool = True) -> dict[str, Any]:
    """Run the benchmark; returns the report dict of bench/__main__.py. ``scrapyd`` False: no bench
    venv (no downloads): curl and httpx, no Scrapy crawl."""
    return trio.run(_run, QUICK if quick else FULL, scrapyd)


def _bench_python(full: bool) -> Path | None:
    if not full:
        return None
    from bench import _scrapyd

    python = _scrapyd.ensure_venv()
    uv = shutil.which("uv") or str(Path(PYTHON).parent / "uv")
    subprocess.run([uv, "pip", "install", "--quiet", "--python", str(python), *CLIENT_REQUIREMENTS],
                   check=True, capture_output=True)
    return python


def _versions(python: Path) -> str:
    code = ("import importlib.metadata as m\n"
            "print(' / '.join(f'{d} {m.version(d)}' for d in ('requests', 'urllib3', 'scrapy')))")
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip()


def _curl_version() -> str:
    done = subprocess.run(["curl", "--version"], capture_output=True, text=True, check=False)
    return " ".join(done.stdout.split()[:2])


async def _run(sizes: Sizes, full: bool) -> dict[str, Any]:
    python = await trio.to_thread.run_sync(_bench_python, full)
    clients: list[Client] = []
    if python is not None:
        clients += [Client("requests.Session", python, "requests"), Client("urllib3", python, "urllib3")]
    else:
        clients.append(Client("httpx.Client", Path(PYTHON), "httpx"))
    if shutil.which("curl"):
        clients.append(Client("curl"))
    loads = [os.getloadavg()[0]]
    env = _base_env()
    with work_directory("ckagent-bench-proxy-") as workdir:
        origin = _Child("origin", workdir / "origin.log")
        proxy = _Child("proxy", workdir / "proxy.log")
        master = DevMaster(workdir / "master") if python is not None else None
        try:
            found = await origin.start([PYTHON, "-m", "bench._origin", ORIGIN_HOST, str(SMALL_BYTES),
                                        str(sizes.big_bytes)], env)
            origin_url = f"http://{ORIGIN_HOST}:{found['port']}"
            ready = await proxy.start([PYTHON, "-m", "bench._proxyrunner", str(workdir / "proxy")], env)
            url = str(ready["url"])
            shop = f"{await master.start()}/demo-site/" if master is not None else ""
            runs: dict[tuple[str, str, str], list[Measure]] = collections.defaultdict(list)
            for round_no in range(sizes.warmup + sizes.rounds):
                order = ("direct", "proxy") if round_no % 2 == 0 else ("proxy", "direct")
                jobs: list[tuple[str, str, Callable[[str | None], Any]]] = []
                for client in clients:
                    jobs.append(("small", client.name, _bind(small_pages, client, origin_url, sizes.pages,
                                                             env=env, workdir=workdir)))
                for client in clients:
                    jobs.append(("big", client.name, _bind(big_body, client, origin_url, sizes.big_bytes, env=env)))
                if python is not None:
                    jobs.append(("scrapy", "Scrapy", _bind(shop_crawl, python, shop, sizes.laps, env=env,
                                                           workdir=workdir)))
                for workload, name, job in jobs:
                    for side in order:
                        measure = await _measured(job, url if side == "proxy" else None, proxy, origin)
                        if round_no >= sizes.warmup:
                            runs[(workload, name, side)].append(measure)
                loads.append(os.getloadavg()[0])
            profile_client = clients[0]
            profile = await _profile(profile_client, origin_url, sizes, env, workdir, python)
        finally:
            with trio.move_on_after(STOP_SECONDS, shield=True):
                await proxy.stop()
                await origin.stop()
                if master is not None:
                    await master.stop()
    versions = (_versions(python) if python is not None else "httpx (project venv)") + f" / {_curl_version()}"
    return _report(runs, clients, sizes, python is not None, loads, profile, versions)


async def _measured(job: Callable[[str | None], Any], url: str | None, proxy: _Child, origin: _Child) -> Measure:
    """Run ``job`` through the proxy at ``url`` (None: directly) with the proxy's and the origin's CPU
    around it. Raises RuntimeError when a proxied run did not go through the proxy, a direct one did,
    or the proxy counted an error, a refusal or a problem."""
    before, origin_before = await proxy.ask("stats"), await origin.cpu()
    measure: Measure = await job(url)
    after, origin_after = await proxy.ask("stats"), await origin.cpu()
    measure.proxy_cpu, measure.origin_cpu = after["cpu"] - before["cpu"], origin_after - origin_before
    new = after["connections"] - before["connections"]
    if (new > 0) != (url is not None):
        raise RuntimeError(f"a {'proxied' if url else 'direct'} run opened {new} connection(s) to the proxy")
    outcomes = collections.Counter(after["outcomes"])
    outcomes.subtract(before["outcomes"])
    forwarded = outcomes.pop("forwarded", 0)
    if after["errors"] != before["errors"] or any(outcomes.values()) or forwarded != (measure.count if url else 0):
        raise RuntimeError(f"the proxy forwarded {forwarded} of {measure.count} request(s); other outcomes "
                           f"{dict(outcomes)}, errors {after['errors']} (before: {before['errors']})")
    return measure


def _bind(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[[str | None], Any]:
    """``fn(*args, proxy, **kwargs)`` as a function of ``proxy`` alone (None: direct)."""

    async def call(proxy: str | None) -> Measure:
        measure: Measure = await fn(*args, proxy, **kwargs)
        return measure

    return call


# ----------------------------------------------------------------------------------- the profile


@dataclass
class Profile:
    """Where the proxy's CPU went in one workload: ``tool`` (py-spy or cProfile), ``rows`` of
    (function, self %, inclusive %), ``packages`` of (package, self %), ``samples``."""

    workload: str
    tool: str
    rows: list[tuple[str, float, float]]
    packages: list[tuple[str, float]]
    samples: int
    cpu_seconds: float


def _py_spy(python: Path | None) -> str | None:
    if python is not None and (python.parent / "py-spy").exists():
        return str(python.parent / "py-spy")
    return shutil.which("py-spy")


async def _profile(client: Client, origin: str, sizes: Sizes, env: dict[str, str], workdir: Path,
                   python: Path | None) -> list[Profile]:
    """One proxied run of the small pages (``client``) and one of the big body (curl, or ``client``),
    each through a fresh proxy process under a profiler (not timed)."""
    spy = _py_spy(python)
    big_client = Client("curl") if shutil.which("curl") else client
    out = []
    for workload, job, repeat in (
        (f"{sizes.pages:,} small pages, {client.name}",
         _bind(small_pages, client, origin, sizes.pages, env=env, workdir=workdir), sizes.profile_repeat),
        (f"{sizes.big_bytes / 1e6:g} MB body, {big_client.name}",
         _bind(big_body, big_client, origin, sizes.big_bytes, env=env), 3 * sizes.profile_repeat),
    ):
        if repeat > 1:
            workload += f", {repeat} times"
        proxy = _Child("profiled proxy", workdir / "proxy-profiled.log")
        stats_file = workdir / "proxy.prof"
        argv = [PYTHON, "-m", "bench._proxyrunner", str(workdir / "proxy")]
        if spy is None:
            argv += ["--cprofile", str(stats_file)]
        try:
            url = str((await proxy.start(argv, env))["url"])
            await job(url)  # (warm: imports, the pool's first connection)
            if spy is not None:
                raw = workdir / "py-spy.txt"
                assert proxy.process is not None
                recorder = await trio.lowlevel.open_process(
                    [spy, "record", "--pid", str(proxy.process.pid), "--rate", "997", "--format", "raw",
                     "--output", str(raw), "--nonblocking"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                await trio.sleep(1.0)  # py-spy attaches
                cpu = await proxy.cpu()
                for _ in range(repeat):
                    await job(url)
                cpu = await proxy.cpu() - cpu
                recorder.send_signal(signal.SIGINT)
                with trio.fail_after(30):
                    await recorder.wait()
                out.append(_parse_py_spy(workload, raw.read_text(), cpu))
            else:
                cpu = await proxy.cpu()
                for _ in range(repeat):
                    await job(url)
                cpu = await proxy.cpu() - cpu
        finally:
            with trio.move_on_after(STOP_SECONDS, shield=True):
                await proxy.stop()
        if spy is None:
            out.append(_parse_cprofile(workload, stats_file, cpu))
    return out


def _package(path: str) -> str:
    """A source file → what it belongs to: a ckagent module, h11, trio, the standard library..."""
    path = "/" + path.lstrip("/")
    if "/ckagent/" in path:
        return "ckagent " + path.split("/ckagent/", 1)[1].removesuffix(".py").replace("/", ".")
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0]
    for name in ("h11", "trio", "outcome", "sniffio", "idna", "sortedcontainers"):
        if f"/{name}/" in path:
            return name
    return "Python (stdlib, builtins)"


TOP_ROWS = 20
IDLE_FRAME = "EpollIOManager.get_events "
"""py-spy's name of the frame in which Trio's loop waits in epoll (samples there are idle time)."""


def _parse_py_spy(workload: str, text: str, cpu: float) -> Profile:
    """py-spy's raw (collapsed) stacks → self and inclusive % per function, self % per package."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    packages: collections.Counter[str] = collections.Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f]
        if not frames or frames[-1].startswith(IDLE_FRAME):
            continue  # the loop waiting for I/O: idle, not the proxy's work
        total += count
        names = [_frame_name(f) for f in frames]
        own[names[-1]] += count
        packages[_package(_frame_file(frames[-1]))] += count
        for name in set(names):
            inclusive[name] += count
    return _profile_rows(workload, "py-spy", own, inclusive, packages, total, cpu)


def _frame_file(frame: str) -> str:
    return frame.rsplit("(", 1)[-1].rstrip(")").rsplit(":", 1)[0]


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:12)`` → ``func (file.py)`` (lines of one function merged)."""
    function, _, where = frame.rpartition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{function} ({_short(path)})"


def _short(path: str) -> str:
    """A source path without the directories every frame shares."""
    if "/ckagent/" in path:
        return "ckagent/" + path.split("/ckagent/", 1)[1]
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    if "/lib/python3" in path:
        return path.split("/lib/python3", 1)[1].split("/", 1)[-1]
    return path


def _parse_cprofile(workload: str, stats_file: Path, cpu: float) -> Profile:
    """cProfile's stats → self (tottime) and inclusive (cumtime) % per function, of the time not spent
    waiting in epoll (the loop idle)."""
    stats = pstats.Stats(str(stats_file)).stats  # type: ignore[attr-defined]  # (documented, untyped)
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    packages: collections.Counter[str] = collections.Counter()
    for (path, _line, function), (_cc, _nc, tottime, cumtime, _callers) in stats.items():
        if "epoll" in function:
            continue  # idle
        name = f"{function} ({_short(path)})"
        units = int(tottime * 1e6)
        own[name] += units
        inclusive[name] = max(inclusive[name], int(cumtime * 1e6))
        packages[_package(path)] += units
    total = sum(own.values())
    return _profile_rows(workload, "cProfile", own, inclusive, packages, total, cpu)


def _profile_rows(workload: str, tool: str, own: collections.Counter[str], inclusive: collections.Counter[str],
                  packages: collections.Counter[str], total: int, cpu: float) -> Profile:
    scale = 100.0 / total if total else 0.0
    rows = [(name, count * scale, inclusive[name] * scale) for name, count in own.most_common(TOP_ROWS)]
    return Profile(workload, tool, rows, [(name, n * scale) for name, n in packages.most_common(12)], total, cpu)


# ------------------------------------------------------------------------------------- the report


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _pairs(runs: dict[tuple[str, str, str], list[Measure]], workload: str,
           name: str) -> Iterator[tuple[Measure, Measure]]:
    return zip(runs[(workload, name, "direct")], runs[(workload, name, "proxy")], strict=True)


def _report(runs: dict[tuple[str, str, str], list[Measure]], clients: list[Client], sizes: Sizes, scrapy: bool,
            loads: list[float], profile: list[Profile], versions: str) -> dict[str, Any]:
    figures: dict[str, Any] = {"small": {}, "big": {}, "scrapy": {}, "load": loads}
    misses: list[str] = []
    small_rows = []
    for client in clients:
        pairs = list(_pairs(runs, "small", client.name))
        p50 = {side: _median([summary(m.latencies)["p50"] for m in runs[("small", client.name, side)]])
               for side in ("direct", "proxy")}
        added = _median([summary(p.latencies)["p50"] - summary(d.latencies)["p50"] for d, p in pairs])
        rps = {side: _median([m.count / m.wall for m in runs[("small", client.name, side)]])
               for side in ("direct", "proxy")}
        ratio = _median([d.wall / p.wall for d, p in pairs])
        per = {what: _median([getattr(p, what) / p.count for _, p in pairs])
               for what in ("proxy_cpu", "origin_cpu", "client_cpu")}
        direct_client = _median([d.client_cpu / d.count for d, _ in pairs])
        met = ratio >= TARGET_THROUGHPUT_RATIO and added <= TARGET_ADDED_P50_SECONDS
        if not met:
            misses.append(f"small pages ({client.name})")
        figures["small"][client.name] = {"p50": p50, "added_p50": added, "rps": rps, "ratio": ratio,
                                         "proxy_cpu_per_request": per["proxy_cpu"],
                                         "origin_cpu_per_request": per["origin_cpu"],
                                         "client_cpu_per_request": {"direct": direct_client,
                                                                    "proxy": per["client_cpu"]}}
        small_rows.append([client.name, p50["direct"] * 1e3, p50["proxy"] * 1e3, added * 1e3,
                           f"{rps['direct']:,.0f}", f"{rps['proxy']:,.0f}", ratio, per["proxy_cpu"] * 1e6,
                           direct_client * 1e6, per["origin_cpu"] * 1e6, "met" if met else "MISSED"])
    big_rows = []
    for client in clients:
        pairs = list(_pairs(runs, "big", client.name))
        mbps = {side: _median([m.bytes / m.wall / 1e6 for m in runs[("big", client.name, side)]])
                for side in ("direct", "proxy")}
        ratio = _median([d.wall / p.wall for d, p in pairs])
        cpu_100 = _median([p.proxy_cpu / (p.bytes / 1e8) for _, p in pairs])
        client_100 = _median([d.client_cpu / (d.bytes / 1e8) for d, _ in pairs])
        met = ratio >= TARGET_THROUGHPUT_RATIO
        if not met:
            misses.append(f"big body ({client.name})")
        figures["big"][client.name] = {"mb_per_s": mbps, "ratio": ratio, "proxy_cpu_per_100mb": cpu_100}
        big_rows.append([client.name, f"{mbps['direct']:,.0f}", f"{mbps['proxy']:,.0f}", ratio, cpu_100,
                         client_100, "met" if met else "MISSED"])
    table = (f"Small pages: {sizes.pages:,} GETs of a {SMALL_BYTES:,}-byte page on one kept-alive connection, "
             f"back to back; {sizes.rounds} round(s) of direct/proxy pairs"
             f"{f' after {sizes.warmup} warm-up round' if sizes.warmup else ''}, medians over rounds "
             "(ratio: of each round's proxy/direct requests/s; added: of each round's p50 difference); "
             "CPU per request: the proxy's, the client's (direct run) and the origin's (proxied run).\n\n")
    table += markdown_table(["client", "direct p50 ms", "proxy p50 ms", "added p50 ms", "direct req/s",
                             "proxy req/s", "proxy / direct", "proxy CPU µs/req", "client CPU µs/req",
                             "origin CPU µs/req", "target"], small_rows)
    table += (f"\nOne {sizes.big_bytes / 1e6:g} MB body (Content-Length), read and dropped by the client; "
              "MB = 10^6 bytes; CPU seconds per 100 MB: the proxy's (proxied run) and the client's (direct run).\n\n")
    table += markdown_table(["client", "direct MB/s", "proxy MB/s", "proxy / direct", "proxy CPU s/100 MB",
                             "client CPU s/100 MB", "target"], big_rows)
    headline_scrapy = ""
    if scrapy:
        pairs = list(_pairs(runs, "scrapy", "Scrapy"))
        wall_ratio = _median([p.wall / d.wall for d, p in pairs])
        crawl_ratio = _median([p.latencies[0] / d.latencies[0] for d, p in pairs])
        pages = pairs[0][0].count
        pps = {side: _median([m.count / m.latencies[0] for m in runs[("scrapy", "Scrapy", side)]])
               for side in ("direct", "proxy")}
        walls = {side: _median([m.wall for m in runs[("scrapy", "Scrapy", side)]]) for side in ("direct", "proxy")}
        crawls = {side: _median([m.latencies[0] for m in runs[("scrapy", "Scrapy", side)]])
                  for side in ("direct", "proxy")}
        proxy_cpu = _median([p.proxy_cpu / p.count for _, p in pairs])
        met = wall_ratio <= TARGET_SCRAPY_RATIO and crawl_ratio <= TARGET_SCRAPY_RATIO
        if not met:
            misses.append("Scrapy crawl")
        figures["scrapy"] = {"wall": walls, "crawl": crawls, "pages_per_s": pps, "wall_ratio": wall_ratio,
                             "crawl_ratio": crawl_ratio, "proxy_cpu_per_page": proxy_cpu, "pages": pages}
        table += (f"\nScrapy crawl of the demo shop (dev master's /demo-site/): {pages:,} pages "
                  f"({sizes.laps} lap(s) of {SHOP_PAGES_PER_LAP}), Scrapy's default concurrency; wall = the "
                  "scrapy process from start to exit, crawl = Scrapy's elapsed_time_seconds (spider open → close); "
                  "ratios: medians of each round's proxy/direct time.\n\n")
        table += markdown_table(["Scrapy crawl", "direct", "proxy", "proxy / direct", "target"], [
            ["wall time s", walls["direct"], walls["proxy"], wall_ratio, f"≤ {TARGET_SCRAPY_RATIO:g}"],
            ["crawl time s", crawls["direct"], crawls["proxy"], crawl_ratio, f"≤ {TARGET_SCRAPY_RATIO:g}"],
            ["pages/s", pps["direct"], pps["proxy"], 1 / crawl_ratio if crawl_ratio else float("nan"),
             f"≥ {1 / TARGET_SCRAPY_RATIO:.3g}"],
            ["proxy CPU µs/page", "–", proxy_cpu * 1e6, "–", "–"],
        ])
        headline_scrapy = f"; Scrapy wall ×{wall_ratio:.2f}, crawl ×{crawl_ratio:.2f}"
    else:
        table += "\nScrapy crawl: not run (--no-scrapyd: no bench venv).\n"
    table += (f"\nLoad average (1 min) during the run: {min(loads):.2f}–{max(loads):.2f} (median "
              f"{statistics.median(loads):.2f}; read at the start and after each round). Clients: {versions}.\n")
    for prof in profile:
        table += (f"\nProfile of the proxy process, {prof.workload} ({prof.tool}, {prof.samples:,} "
                  f"{'samples' if prof.tool == 'py-spy' else 'µs profiled'}; proxy CPU {prof.cpu_seconds:.2f} s "
                  "in this run): % of the proxy's busy time (the loop's waits in epoll left out). A "
                  "function's self time includes the C it calls: the socket syscalls (send, recv) show as "
                  "trio's `_nonblocking_helper`.\n\n")
        table += markdown_table(["function (self time, top 20)", "self %", "inclusive %"], prof.rows)
        table += "\n" + markdown_table(["package or module (self time)", "%"], prof.packages)
    figures["profile"] = [prof.__dict__ for prof in profile]
    worst_small = min(figures["small"].values(), key=lambda f: f["ratio"])
    worst_big = min(figures["big"].values(), key=lambda f: f["ratio"])
    worst_added = max(f["added_p50"] for f in figures["small"].values())
    cpu_small = _median([f["proxy_cpu_per_request"] for f in figures["small"].values()])
    headline = (f"small pages: proxy/direct ≥ {worst_small['ratio']:.2f}, +{worst_added * 1e3:.2f} ms p50 at most, "
                f"proxy CPU {cpu_small * 1e6:.0f} µs/request; {sizes.big_bytes / 1e6:g} MB body: ≥ "
                f"{worst_big['ratio']:.2f}"
                f"{headline_scrapy}; load {min(loads):.1f}–{max(loads):.1f}")
    return {
        "name": "proxy",
        "table": table,
        "figures": figures,
        "target": f"through the proxy ≥ {TARGET_THROUGHPUT_RATIO:g} × direct throughput (small pages, "
                  f"{sizes.big_bytes / 1e6:g} MB body), ≤ +{TARGET_ADDED_P50_SECONDS * 1e3:g} ms p50 per request"
                  + (f", Scrapy crawl ≤ {TARGET_SCRAPY_RATIO:g} × direct" if scrapy else ""),
        "target_met": not misses,
        "headline": headline + (f" (missed: {', '.join(misses)})" if misses else ""),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.proxy [--quick] [--no-scrapyd]``: print the table and the target."""
    args = sys.argv[1:] if argv is None else argv
    report = run("--quick" in args, "--no-scrapyd" not in args)
    print(report["table"])
    print(f"target {report['target']}: {'met' if report['target_met'] else 'MISSED'} ({report['headline']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
