"""Shared parts of the benchmarks: a dev master and an agent as real processes, stamps, statistics.

Everything here runs on this machine: the dev master on 127.0.0.1 (port picked by the OS), the
agent as ``python -m ckagent run -c FILE`` (its own process, so psutil can measure it alone), and
spiders that write ``time.time()`` from their first line into a stamp file. Every clock read is
the same wall clock (``time.time()`` / the master's ``createdAt``), so times compare directly.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import trio
import yaml

from ckagent.devmaster.client import AdminClient

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
STAMP_DIR_VAR = "BENCH_STAMP_DIR"
STAMP_KEY_VARS = ("CK_TASK_ID", "BENCH_ID")
"""Environment variables naming the run whose stamp a process writes (agent task, bare run)."""

T = TypeVar("T")

STAMP_CODE = (
    "import time;t=time.time();import os;"
    f"k=next(os.environ[v] for v in {STAMP_KEY_VARS!r} if os.environ.get(v));"
    f"open(os.path.join(os.environ[{STAMP_DIR_VAR!r}],k),'w').write(repr(t))"
)
"""Python source whose first statement reads the clock and then writes it to the stamp file."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_iso(text: str) -> float:
    """A protocol timestamp ("2026-11-29T16:03:50.123Z") → epoch seconds."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def read_stamp(stamp_dir: Path, key: str) -> float | None:
    """The epoch seconds a process stamped under ``key``, or None if it has not (yet)."""
    try:
        text = (stamp_dir / key).read_text()
    except FileNotFoundError:
        return None
    return float(text) if text else None


def summary(values: Sequence[float]) -> dict[str, float]:
    """n, p50, p95 (nearest rank), max and mean of ``values`` (same unit as the values)."""
    if not values:
        return {"n": 0, "p50": math.nan, "p95": math.nan, "max": math.nan, "mean": math.nan}
    ordered = sorted(values)
    rank = max(0, math.ceil(0.95 * len(ordered)) - 1)
    return {
        "n": len(ordered),
        "p50": statistics.median(ordered),
        "p95": ordered[rank],
        "max": ordered[-1],
        "mean": statistics.fmean(ordered),
    }


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table; floats are printed with 3 significant decimals."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            if math.isnan(value):
                return "–"
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _admin_client(base_url: str, admin_token: str) -> AdminClient:
    """An AdminClient whose idle connections expire after 1 s.

    hypercorn closes a connection idle for 5 s and httpx keeps one for 5 s: a request sent on a
    connection idle for ~5 s (the benchmarks sleep up to 5 s at random) can meet the server's close
    and fail with "connection reset".
    """
    admin = AdminClient(base_url, admin_token)
    original = admin._http
    admin._http = httpx.AsyncClient(base_url=original.base_url, headers=original.headers, timeout=original.timeout,
                                    limits=httpx.Limits(keepalive_expiry=1.0))
    return admin


class DevMaster:
    """``python -m ckagent.devmaster`` on 127.0.0.1, port 0, SQLite under ``directory``.

    ``await start()`` returns the base URL; ``admin`` is an AdminClient for it; ``await stop()``
    ends the process (SIGTERM, then SIGKILL after 5 s).
    """

    def __init__(self, directory: Path, *, discard_logs: bool = False) -> None:
        self.directory = directory
        self.discard_logs = discard_logs  # --discard-logs: a master that keeps up (see devmaster.server)
        self.registration_token = secrets.token_urlsafe(16)
        self.admin_token = secrets.token_urlsafe(16)
        self.base_url = ""
        self.process: trio.Process | None = None
        self._admin: AdminClient | None = None

    async def start(self, timeout: float = 30.0) -> str:  # noqa: ASYNC109 - bounds a startup wait
        """Start the master and wait for its "listening on URL" line. Raises RuntimeError if it fails."""
        self.directory.mkdir(parents=True, exist_ok=True)
        stderr = (self.directory / "master.log").open("ab")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.process = await trio.lowlevel.open_process(
            [PYTHON, "-m", "ckagent.devmaster", "--db", str(self.directory / "master.sqlite"),
             "--host", "127.0.0.1", "--port", "0",
             # "--opt=value": a token may start with "-"
             f"--registration-token={self.registration_token}", f"--admin-token={self.admin_token}",
             *(["--discard-logs"] if self.discard_logs else [])],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=env,
        )
        stderr.close()
        assert self.process.stdout is not None
        line = b""
        with trio.move_on_after(timeout):
            while not line.endswith(b"\n"):
                chunk = await self.process.stdout.receive_some(1)
                if not chunk:
                    break
                line += chunk
        text = line.decode(errors="replace")
        if "listening on " not in text:
            await self.stop()
            raise RuntimeError(f"dev master did not start: {text!r}; see {self.directory / 'master.log'}")
        self.base_url = text.split("listening on ", 1)[1].split()[0]
        self._admin = _admin_client(self.base_url, self.admin_token)
        return self.base_url

    @property
    def admin(self) -> AdminClient:
        """The admin client (after start)."""
        assert self._admin is not None, "start() first"
        return self._admin

    async def stop(self) -> None:
        """Stop the master and close the admin client (idempotent)."""
        if self._admin is not None:
            await self._admin.aclose()
            self._admin = None
        await _end(self.process, signal.SIGTERM, 5.0)


class AgentProcess:
    """``python -m ckagent run -c <dir>/agent.yaml`` against a dev master; its log in ``<dir>/agent.log``.

    ``task`` overrides keys of the ``task`` section (``long_poll_wait``, ``poll_interval``, ...);
    other settings stay at their defaults except the node name, ip, a free status port and the work dir.
    """

    def __init__(self, directory: Path, master: DevMaster, *, max_workers: int, name: str,
                 extra_env: dict[str, str] | None = None, **task: Any) -> None:
        self.directory = directory
        self.master = master
        self.name = name
        self.config_path = directory / "agent.yaml"
        self.log_path = directory / "agent.log"
        self.extra_env = extra_env or {}
        self.config: dict[str, Any] = {
            "server": {"url": master.base_url},
            "agent": {"registration_token": master.registration_token, "name": name, "ip": "127.0.0.1",
                      "port": free_port(), "max_workers": max_workers},
            # (the bench's directory, where the spiders stamp, stays seen in each task's private /tmp)
            "task": {"work_dir": str(directory / "data"), "private_tmp_shared": str(directory.parent), **task},
        }
        self.process: trio.Process | None = None

    @property
    def pid(self) -> int:
        """The agent's process id (after start)."""
        assert self.process is not None
        return self.process.pid

    async def start(self, timeout: float = 60.0) -> None:  # noqa: ASYNC109 - bounds a startup wait
        """Start the agent and wait until the master lists the node. Raises RuntimeError if it exits."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config["server"]["url"] = self.master.base_url  # known once the master has started
        self.config_path.write_text(yaml.safe_dump(self.config))
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
        env.update(self.extra_env)
        with self.log_path.open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                [PYTHON, "-m", "ckagent", "run", "-c", str(self.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
            )
        with trio.fail_after(timeout):
            while not any(n.get("name") == self.name for n in await self.master.admin.list_nodes()):
                if self.process.returncode is not None:
                    raise RuntimeError(f"agent exited with {self.process.returncode}; see {self.log_path}")
                await trio.sleep(0.05)
            # Fully started: the status server (loaded after the first heartbeat) answers, so its
            # start-up work does not fall into what a benchmark measures next.
            status_url = f"http://127.0.0.1:{self.config['agent']['port']}/readyz"
            async with httpx.AsyncClient(timeout=5.0) as client:
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(status_url)).status_code == 200:
                            break
                    if self.process.returncode is not None:
                        raise RuntimeError(f"agent exited with {self.process.returncode}; see {self.log_path}")
                    await trio.sleep(0.05)

    async def stop(self) -> None:
        """SIGINT (terminate), then SIGKILL after 20 s (idempotent)."""
        await _end(self.process, signal.SIGINT, 20.0)


async def _end(process: trio.Process | None, signum: int, grace: float) -> None:
    if process is None:
        return
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.send_signal(signum)
            with trio.move_on_after(grace):
                await process.wait()
            if process.returncode is None:
                process.kill()
        await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()


async def wait_final(admin: AdminClient, task_ids: Sequence[str], timeout: float,  # noqa: ASYNC109
                     interval: float = 0.05) -> list[dict[str, Any]]:
    """Wait (polling every ``interval`` s) until every task is final; returns them. Raises TimeoutError.

    Polls only the PENDING and RUNNING lists (small), and reads the whole task list once at the end:
    the dev master shares the machine with what is being measured, so the waiting must cost it little.
    """
    wanted = set(task_ids)
    with trio.move_on_after(timeout):
        while True:
            active = await admin.list_tasks(status="PENDING") + await admin.list_tasks(status="RUNNING")
            if not any(task["id"] in wanted for task in active):
                done = {t["id"]: t for t in await admin.list_tasks() if t["id"] in wanted}
                if len(done) == len(wanted) and all(t["status"] in FINAL for t in done.values()):
                    return [done[t] for t in task_ids]
            await trio.sleep(interval)
    raise TimeoutError(f"task(s) not final after {timeout:g} s")


FINAL = ("SUCCESS", "FAILED", "CANCELLED")


async def gather(calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the calls concurrently; returns their results in order (the first error cancels the rest)."""
    results: list[Any] = [None] * len(calls)

    async def one(i: int) -> None:
        results[i] = await calls[i]()

    async with trio.open_nursery() as nursery:
        for i in range(len(calls)):
            nursery.start_soon(one, i)
    return results


def check_success(tasks: Iterable[dict[str, Any]]) -> None:
    """Raise RuntimeError naming the first task that did not succeed (a benchmark must not time failures)."""
    for task in tasks:
        if task["status"] != "SUCCESS":
            raise RuntimeError(f"task {task['id']} ended {task['status']} {task.get('errorCode')}: "
                               f"{task.get('errorMessage')}")


@contextlib.contextmanager
def work_directory(prefix: str) -> Iterator[Path]:
    """A temp dir for one benchmark, removed afterwards — unless ``BENCH_KEEP_DIR`` is set: then a
    new dir under it is left (logs, databases) for a look afterwards."""
    keep = os.environ.get("BENCH_KEEP_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(tempfile.mkdtemp(prefix=prefix, dir=keep))
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def now() -> float:
    """Wall-clock seconds (the clock every stamp uses)."""
    return time.time()


STAMP_SPIDER = {"main.py": "# the benchmark runs its own command line\n"}
"""Files of the "python -c" spider (its command is :func:`stamp_command`)."""


def stamp_command() -> list[str]:
    """``python -c <STAMP_CODE>``: a process that stamps its start and exits (python -c pass + a stamp)."""
    return [PYTHON, "-c", STAMP_CODE]


async def create_spiders(admin: AdminClient, prefix: str, count: int, command: list[str], package: bytes,
                         stamp_dir: Path, framework: str = "python") -> list[str]:
    """Create ``count`` spiders named ``<prefix>-<i>`` running ``command`` from ``package``; returns their ids."""
    ids = []
    for i in range(count):
        spider_id = await admin.create_spider(name=f"{prefix}-{i}", framework=framework, command=command,
                                              env={STAMP_DIR_VAR: str(stamp_dir)})
        await admin.upload_package(spider_id, package)
        ids.append(spider_id)
    return ids


def module_main(run: Callable[[bool, bool], dict[str, Any]], argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.<name> [--quick] [--no-scrapyd]``: run, print the table and the target."""
    args = sys.argv[1:] if argv is None else argv
    result = run("--quick" in args, "--no-scrapyd" not in args)
    print(result["table"])
    print(f"target {result['target']}: {'met' if result['target_met'] else 'MISSED'}")
    return 0
