"""The suite's support module: helpers for running the real agent against the real dev master.

The fixtures (``dev_master``, ``dev_master_process``) live in conftest.py; the fault-injecting proxy
in faultproxy.py. Everything else a test file would otherwise write for itself lives here:

- :func:`agent_settings` builds a Settings object the way `ckagent run` does (env overrides).
- :func:`running_agent` runs an in-process :class:`ckagent.agent.Agent` in a nursery and stops it.
- :func:`spider_zip` builds a code package from a dict of files; :func:`submit` makes spider + task.
- :class:`AgentProcess` runs `python -m ckagent run -c FILE` as a real process (signals, kill -9).
- :func:`eventually` waits for the state of another process (the master, a spider) to come true.
- :func:`output_lines` and :func:`items_of` read what a task wrote on the node, as the master must
  hold it.
- :class:`MemoryMaster` is the node protocol's seq rules in memory, for ``httpx.MockTransport``
  (put :class:`faultproxy.MockFaults` in front of it for the proxy's faults on the autojump clock).
- :class:`ExampleRuns` runs each sdk/examples spider once per session on each path (``ckagent
  exec``, an agent) for the tests that read that run (the session fixture ``example_runs``);
  :func:`recipe` reads the README's exec recipe.
- :class:`RecordingMaster` is the dev master behind a recorder of the final results it receives
  and the API keys it issues (conftest.py's ``recording_master`` serves one per test);
  :func:`settings_for` gives an in-process agent its settings for it (the containment level in
  ``LEVEL``, which test_supervision.py's ``containment_level`` sets).
- Processes: :func:`alive`, :func:`marked_pids` (a task's processes, read from /proc),
  :func:`pids_in`, and the ``no_strays`` fixture (import it: after each test, it kills the spiders
  a failed test left); spider building blocks :data:`ESCAPE` and :data:`SLOW_BACKEND`.
- :func:`package_index` serves wheels made by :func:`wheel` as a simple index on 127.0.0.1.
- An agent as a process: :func:`agent_process` (test timings), :func:`wait_registered`,
  :func:`wait_exit`, :func:`node_status`; :func:`wait_for_log` waits for a line in the master.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import uuid
import zipfile
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

import ckagent
from ckagent.agent import Agent
from ckagent.containment import available_levels
from ckagent.containment.process import find_marked
from ckagent.delivery import LineSplitter, Masker, decode_lines
from ckagent.devmaster.app import Notifier, create_app
from ckagent.devmaster.client import AdminClient, zip_directory, zip_files
from ckagent.devmaster.store import Store
from ckagent.node.config import Settings, load_settings


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with libyaml's parser when PyYAML has it (the same documents, ~10× less CPU:
    openapi.yaml takes 0.1 s in pure Python, and every pytest-xdist worker loads it at collection)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def agent_settings(work_dir: Path, base_url: str, registration_token: str, **env: str) -> Settings:
    """Settings for a test agent: fast heartbeat, short long poll, 2 workers; ``env`` overrides (AGENT_*)."""
    values = {
        "AGENT_SERVER_URL": base_url,
        "AGENT_REGISTRATION_TOKEN": registration_token,
        "AGENT_WORK_DIR": str(work_dir),
        "AGENT_HEARTBEAT_INTERVAL": "1",
        "AGENT_TASK_POLL_INTERVAL": "0.5",
        "AGENT_TASK_LONG_POLL_WAIT": "2",
        "AGENT_MAX_WORKERS": "2",
        "AGENT_TASK_KILL_GRACE": "2",
        "AGENT_NAME": "test-node",
        "AGENT_IP": "127.0.0.1",
        "AGENT_PORT": "0",  # the status server on a free port: tests (and engineers) run side by side
    }
    values.update(env)
    return load_settings(None, env=values, require_token=True)


@asynccontextmanager
async def running_agent(nursery: trio.Nursery, settings: Settings) -> AsyncIterator[Agent]:
    """Start an in-process agent; yields once it has registered. On exit: terminate and wait (≤ 30 s)."""
    agent = Agent(settings)
    done = trio.Event()
    exit_codes: list[int] = []

    async def run() -> None:
        exit_codes.append(await agent.run())
        done.set()

    nursery.start_soon(run)
    with trio.fail_after(20):
        async with trio.open_nursery() as waiting:
            async def early_exit() -> None:
                await done.wait()
                raise RuntimeError(f"agent exited early with {exit_codes}")
            waiting.start_soon(early_exit)
            await agent.started.wait()
            waiting.cancel_scope.cancel()
    try:
        yield agent
    finally:
        with trio.CancelScope(shield=True), trio.fail_after(30):
            agent.terminate()
            await done.wait()


spider_zip = zip_files
"""A deterministic zip of ``files`` (path → text or bytes); see ckagent.devmaster.client.zip_files."""


async def submit(admin: Any, name: str, files: dict[str, str | bytes], framework: str = "python",
                 **task: Any) -> str:
    """Create a spider with ``files`` as its package and one task; returns the task id."""
    spider_id = await admin.create_spider(name=name, framework=framework)
    await admin.upload_package(spider_id, spider_zip(files))
    return str(await admin.create_task(spider_id, **task))


class AgentProcess:
    """`python -m ckagent run -c <config>` as a real process; stderr goes to ``<dir>/agent.log``."""

    def __init__(self, directory: Path, base_url: str, registration_token: str, **settings: Any) -> None:
        self.directory = directory
        self.config_path = directory / "agent.yaml"
        self.log_path = directory / "agent.log"
        config: dict[str, Any] = {
            "server": {"url": base_url},
            "agent": {"registration_token": registration_token, "name": "proc-node", "ip": "127.0.0.1",
                      "port": 0,
                      "max_workers": 2},
            "heartbeat": {"interval": 1},
            "task": {"work_dir": str(directory / "data"), "poll_interval": 0.5, "long_poll_wait": 2,
                     "kill_grace": 2},
        }
        for dotted, value in settings.items():
            section, key = dotted.split("__", 1)
            config.setdefault(section, {})[key] = value
        self.config_path.write_text(yaml.safe_dump(config))
        self.process: trio.Process | None = None

    async def start(self, extra_env: dict[str, str] | None = None) -> None:
        """Launch the agent process (does not wait for registration)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
        env.update(extra_env or {})
        with self.log_path.open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "ckagent", "run", "-c", str(self.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
            )

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the agent process."""
        assert self.process is not None
        self.process.send_signal(signum)

    async def wait(self) -> int:
        """Wait for the exit (bound it with ``trio.fail_after`` at the call site)."""
        assert self.process is not None
        return await self.process.wait()

    async def kill(self) -> None:
        """SIGKILL and reap (idempotent)."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
            await self.process.wait()

    async def __aenter__(self) -> AgentProcess:
        """``async with agent:`` — the block owns the process (started in it, or before it)."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """At the block's end the agent is SIGKILLed and reaped if it still runs, also when the test
        failed or was cancelled (shielded, bounded to 10 s): no agent outlives its test."""
        with trio.move_on_after(10, shield=True):
            await self.kill()

    def log_text(self) -> str:
        """The agent's own log so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float = 20.0, what: str = "",  # noqa: ASYNC109
                     *, interval: float = 0.1) -> Any:
    """Call the async ``check()`` every ``interval`` seconds until it returns something truthy; return that.

    For the state of another process (the master's database, a spider, run.sh), which no Trio event
    announces: polling is the way. Raises AssertionError naming ``what`` and the last value after
    ``timeout`` seconds (real time: not for tests on the autojump clock).
    """
    last: Any = None
    with trio.move_on_after(timeout):
        while True:
            last = await check()
            if last:
                return last
            await trio.sleep(interval)
    raise AssertionError(f"not within {timeout} s: {what or getattr(check, '__name__', 'the check')} (last: {last!r})")


def output_lines(task_dir: Path, secrets: list[str] | None = None) -> list[str]:
    """The log lines the capture rules make of a task's ``output.log`` (stdout and stderr only), with
    ``secrets`` masked: what the master must hold, once and in this order."""
    splitter = LineSplitter()
    data = (task_dir / "output.log").read_bytes()
    return decode_lines(splitter.feed(data)[0] + splitter.flush()[0], Masker(secrets or []))


def items_of(task_dir: Path) -> list[dict[str, Any]]:
    """The items of a task's ``items.jsonl`` (blank lines skipped); [] when it wrote none."""
    path = task_dir / "items.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MemoryMaster:
    """The node protocol in memory (docs/protocol.md), for ``httpx.MockTransport``: registration (a new
    API key each time), heartbeats (no cancels), an empty long poll, and per task the seq rules of the
    log and item streams (a batch at ``seq`` ≤ what is held is stored from where it overlaps; beyond
    it: 409 with ``expectedSeq``) and the result (each one kept, in order).

    ``logs[task]``, ``items[task]``, ``results[task]`` hold what arrived; ``requests`` lists
    (trio time, method, path) of every request. Not thread-safe: one Trio run.
    """

    def __init__(self) -> None:
        self.logs: dict[str, list[str]] = {}
        self.items: dict[str, list[Any]] = {}
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.registrations = 0
        self.requests: list[tuple[float, str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.requests.append((trio.current_time(), request.method, path))
        parts = path.strip("/").split("/")
        if path == "/api/nodes/register":
            self.registrations += 1
            return httpx.Response(200, json={"nodeId": "n-1", "apiKey": f"key-{self.registrations:04d}-0123456789"})
        if parts[:2] == ["api", "nodes"] and parts[-1] == "heartbeat":
            return httpx.Response(200, json={"cancelTaskIds": []})
        if parts[:2] == ["api", "nodes"] and parts[-2:] == ["tasks", "pending"]:
            return httpx.Response(200, json={"tasks": []})
        if parts[:2] == ["api", "tasks"] and len(parts) == 4 and parts[3] in ("logs", "items", "result"):
            task, kind, body = parts[2], parts[3], json.loads(request.content)
            if kind == "result":
                self.results.setdefault(task, []).append(body)
                return httpx.Response(200, json={})
            stored = (self.logs if kind == "logs" else self.items).setdefault(task, [])
            seq, batch = body["seq"], body["lines" if kind == "logs" else "items"]
            if seq > len(stored):
                return httpx.Response(409, json={"error": "gap", "expectedSeq": len(stored)})
            stored.extend(batch[len(stored) - seq:])
            return httpx.Response(200, json={"acceptedSeq": len(stored)})
        return httpx.Response(404, json={"error": f"no route {request.method} {path} in the memory master"})


# ------------------------------------------------------------- the sdk/examples spiders, run once each
#
# Each sdk/examples spider runs once per session on each path, and every test that asserts on that
# run reads the same one.
#
# Several test files ask the same example the same question on one path: the README's exec recipe runs
# every example with ``ckagent exec`` (tests/test_readme_exec.py), tests/test_exec.py runs seven of
# them with ``ckagent exec`` and through an agent and compares the two, tests/test_outputs_examples.py
# does the same for the two that deliver files, and tests/test_frameworks.py runs four through an
# agent. A real run costs seconds to a minute (an interpreter, a master, an agent, an install, a
# browser), so the session fixture ``example_runs`` (conftest.py) keeps what each run gave:
#
# - :meth:`ExampleRuns.exec` runs ``ckagent exec <words>`` as a real subprocess, the words exactly as
#   written after ``ckagent exec`` (``$URL`` for the demo site's address, as in the README's recipe),
#   plus only where the items, the artifacts and the work dir go. The same words give the same run:
#   the README line of an example and a test that asks for that line share it. Every exec run of the
#   session shares one work dir, as a user's runs share ``~/.cache/ckagent/exec``.
# - :meth:`ExampleRuns.agent` uploads the example to the test's dev master as a spider (framework,
#   name, outputs) and runs one task (params) on a fresh in-process agent; it keeps the final task,
#   its items, log lines, artifacts, the node's runtimes and the task's leftover processes. Its
#   work dir's ``envs/`` is the exec runs' (content-addressed: the same key is the same environment),
#   so each example's dependencies are installed once in the session, by whichever path runs it
#   first — the node's pipeline either way (crawlee's npm install alone is ~13 s of CPU).
#
# A run crawls the demo site of the dev master of the test that made it; :meth:`ExecRun.at` and
# :meth:`AgentRun.at` give the run as the demo site at another address would have given it (the
# demo site is the same everywhere; only its address is in the items and the log). The fixture is
# per process: under pytest-xdist, SERIAL_GROUPS (conftest.py) keeps the files that share runs in
# one worker, so each run happens once in the session (a test that finds no run makes it).

REPO = Path(ckagent.__file__).resolve().parent.parent
EXAMPLES = REPO / "sdk" / "examples"
RUN_TIMEOUT = 900.0
"""Seconds for one run, cold caches included (an npm install of crawlee, Playwright's ~40 MB)."""


@dataclass(frozen=True)
class RecipeLine:
    """One line of the README's exec recipe: the example, the words after ``ckagent exec`` (``$URL``
    as written) and the exit code its comment promises (``exit N``, else 0)."""

    example: str
    words: tuple[str, ...]
    expected: int


def recipe() -> list[RecipeLine]:
    """The README's exec recipe (between its ``exec-recipe`` markers), line by line."""
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- exec-recipe:start -->", 1)[1].split("<!-- exec-recipe:end -->", 1)[0]
    lines = []
    for line in block.splitlines():
        if not line.startswith(".venv/bin/ckagent exec "):
            continue
        comment = line.split("#", 1)[1] if "#" in line else ""
        words = tuple(shlex.split(line, comments=True)[2:])
        expected = int(m.group(1)) if (m := re.search(r"exit (\d+)", comment)) else 0
        lines.append(RecipeLine(Path(words[0]).name, words, expected))
    return lines


def recipe_words(example: str) -> tuple[str, ...]:
    """The README's words for ``example`` (KeyError if the recipe has no line for it)."""
    return {line.example: line.words for line in recipe()}[example]


def _relocated(value: Any, old: str, new: str) -> Any:
    return value if old == new else json.loads(json.dumps(value).replace(old, new))


@dataclass(frozen=True)
class ExecRun:
    """What one ``ckagent exec`` run gave: its exit code, stdout (the task's log) and stderr (the
    summary) as text, the items it wrote, the files it wrote to its artifacts folder (relative paths
    → bytes) and the base URL of the dev master whose demo site it crawled."""

    words: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    items: list[dict[str, Any]]
    artifacts: dict[str, bytes]
    base_url: str

    def at(self, base_url: str) -> ExecRun:
        """The run as if it had crawled the demo site at ``base_url``."""
        old = self.base_url
        return replace(self, stdout=self.stdout.replace(old, base_url), stderr=self.stderr.replace(old, base_url),
                       items=_relocated(self.items, old, base_url), base_url=base_url)


@dataclass(frozen=True)
class AgentRun:
    """What one task through the dev master and an agent gave: the final task record, its items and
    log lines as the master holds them, its artifacts' paths, the node's runtimes (as its heartbeat
    reported them), the task's processes left after it ended (ckagent.containment.process.find_marked)
    and the base URL of the dev master."""

    task: dict[str, Any]
    items: list[dict[str, Any]]
    logs: list[str]
    artifacts: list[str]
    runtimes: dict[str, Any]
    leftovers: list[Any]
    base_url: str

    def at(self, base_url: str) -> AgentRun:
        """The run as if it had gone through (and crawled) the dev master at ``base_url``."""
        old = self.base_url
        return replace(self, task=_relocated(self.task, old, base_url), items=_relocated(self.items, old, base_url),
                       logs=_relocated(self.logs, old, base_url), base_url=base_url)


def exec_env() -> dict[str, str]:
    """The environment of an exec run: this one without the agent's and the suite's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "CK_"))}
    env["AGENT_UV_SYNC_TIMEOUT"] = "600"
    return env


class ExampleRuns:
    """The session's runs (see the module docstring); ``root`` holds their files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._exec: dict[tuple[str, ...], ExecRun] = {}
        self._agent: dict[str, AgentRun] = {}
        self.made = {"exec": 0, "agent": 0}
        """How many runs this session made on each path (the rest were read)."""

    async def exec(self, words: Sequence[str], base_url: str) -> ExecRun:
        """``ckagent exec`` with ``words`` (``$URL`` → the demo site of ``base_url``), run once; the
        run as at ``base_url``."""
        key = tuple(words)
        run = self._exec.get(key)
        if run is None:
            run = await self._run_exec(key, base_url)
            self._exec[key] = run
            self.made["exec"] += 1
        return run.at(base_url)

    async def _run_exec(self, words: tuple[str, ...], base_url: str) -> ExecRun:
        n = len(self._exec)
        items, artifacts = self.root / f"exec-{n}.items.jsonl", self.root / f"exec-{n}.artifacts"
        url = f"{base_url}/demo-site/"
        source = words[0] if Path(words[0]).is_absolute() else str(REPO / words[0])
        argv = [sys.executable, "-m", "ckagent", "exec", source, *[w.replace("$URL", url) for w in words[1:]],
                "--items", str(items), "--artifacts", str(artifacts), "--work-dir", str(self.root / "exec-work")]
        done = await trio.to_thread.run_sync(lambda: subprocess.run(
            argv, capture_output=True, env=exec_env(), timeout=RUN_TIMEOUT, check=False, cwd=self.root))
        got = [json.loads(line) for line in items.read_text("utf-8").splitlines()] if items.exists() else []
        written = ({str(p.relative_to(artifacts)): p.read_bytes() for p in sorted(artifacts.rglob("*")) if p.is_file()}
                   if artifacts.exists() else {})
        return ExecRun(words, done.returncode, done.stdout.decode("utf-8", "replace"),
                       done.stderr.decode("utf-8", "replace"), got, written, base_url)

    async def agent(self, dev_master: Any, nursery: trio.Nursery, example: str, framework: str, *,
                    name: str | None = None, outputs: dict[str, Any] | None = None,
                    params: dict[str, Any] | None = None) -> AgentRun:
        """sdk/examples/``example`` as the spider ``name`` (default the example's) of ``framework``
        with ``outputs``, one task with ``params`` and ``start_url`` = the demo site, on a fresh agent
        against ``dev_master`` — run once; the run as at ``dev_master``."""
        key = json.dumps([example, framework, name, outputs, params], sort_keys=True)
        run = self._agent.get(key)
        if run is None:
            run = await self._run_agent(dev_master, nursery, example, framework, name, outputs, params)
            self._agent[key] = run
            self.made["agent"] += 1
        return run.at(dev_master.base_url)

    async def _run_agent(self, dev_master: Any, nursery: trio.Nursery, example: str, framework: str,
                         name: str | None, outputs: dict[str, Any] | None, params: dict[str, Any] | None) -> AgentRun:
        admin = dev_master.admin
        spider_id = await admin.create_spider(name=name or example, framework=framework, outputs=outputs)
        await admin.upload_package(spider_id, await trio.to_thread.run_sync(zip_directory, EXAMPLES / example))
        work_dir = self.root / f"agent-{len(self._agent)}"
        shared_envs = self.root / "exec-work" / "envs"  # where the exec runs keep theirs (module comment)
        shared_envs.mkdir(parents=True, exist_ok=True)
        work_dir.mkdir(parents=True)
        (work_dir / "envs").symlink_to(shared_envs, target_is_directory=True)
        settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                                  AGENT_UV_SYNC_TIMEOUT="600")
        async with running_agent(nursery, settings):
            task_id = await admin.create_task(
                spider_id, params={"start_url": f"{dev_master.base_url}/demo-site/", **(params or {})})
            with trio.fail_after(RUN_TIMEOUT):
                task = await admin.wait_task_final(task_id, RUN_TIMEOUT)
            # The runtime scan runs in the background at start and reaches the master with a heartbeat.
            for _ in range(100):
                nodes = await admin.list_nodes()
                if "python" in nodes[0]["runtimes"]:
                    break
                await trio.sleep(0.1)
        leftovers = await trio.to_thread.run_sync(find_marked, task_id)
        return AgentRun(task, await admin.get_items(task_id), await admin.get_logs(task_id),
                        [a["path"] for a in await admin.list_artifacts(task_id)], nodes[0]["runtimes"],
                        leftovers, dev_master.base_url)


# ------------------------------------------------------------------------------ a recording master


FINAL = ("SUCCESS", "FAILED", "CANCELLED")
_RESULT_PATH = re.compile(r"^/api/tasks/([^/]+)/result$")


class Recorder:
    """ASGI wrapper around the dev master app: final results received per task, API keys issued."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.final_posts: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
        self.api_keys: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        result = _RESULT_PATH.match(path) if scope["type"] == "http" and scope["method"] == "POST" else None
        register = scope["type"] == "http" and path == "/api/nodes/register"
        if result is None and not register:
            await self.app(scope, receive, send)
            return
        messages: list[dict[str, Any]] = []
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        status: list[int] = []
        answer = bytearray()

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                answer.extend(message.get("body", b""))
            await send(message)

        await self.app(scope, replay, capture)
        if result is not None:
            data = json.loads(body or b"{}")
            if data.get("status") in FINAL:
                self.final_posts[result.group(1)].append((status[0], data))
        elif status and status[0] == 200:
            self.api_keys.append(json.loads(bytes(answer))["apiKey"])


@dataclass
class RecordingMaster:
    """A running dev master (in this process) and what it recorded."""

    base_url: str
    registration_token: str
    admin_token: str
    admin: AdminClient
    recorder: Recorder = field(repr=False)

    def finals(self, task_id: str) -> list[tuple[int, dict[str, Any]]]:
        """Every final result (status code, body) the master received for ``task_id``."""
        return list(self.recorder.final_posts.get(task_id, []))


@asynccontextmanager
async def serve_recording_master(tmp_path: Path) -> AsyncIterator[RecordingMaster]:
    """The dev master app behind :class:`Recorder` (its SQLite file in ``tmp_path``), served by hypercorn
    on 127.0.0.1:0 until the block ends (the ``recording_master`` fixture of conftest.py)."""
    store = await trio.to_thread.run_sync(Store, tmp_path / "master.sqlite")
    registration_token, admin_token = uuid.uuid4().hex, uuid.uuid4().hex
    recorder = Recorder(create_app(store, Notifier(), registration_token=registration_token,
                                   admin_token=admin_token, max_long_poll_seconds=30.0))
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.loglevel = "WARNING"
    config.graceful_timeout = 0.5
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(hypercorn_serve, recorder, config))
            base_url = str(binds[0]).rstrip("/")
            async with AdminClient(base_url, admin_token) as admin:
                yield RecordingMaster(base_url, registration_token, admin_token, admin, recorder)
            nursery.cancel_scope.cancel()
    finally:
        store.close()


# ------------------------------------------------------------------------------ process helpers


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    state = _state(pid)
    return state is not None and state not in ("Z", "X")


def marked_pids(task_id: str) -> list[int]:
    """Live processes whose environment carries CK_TASK_ID=<task_id> (read straight from /proc)."""
    marker = f"CK_TASK_ID={task_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            continue
        if marker in environ.split(b"\0") and alive(int(entry)):
            found.append(int(entry))
    return found


LEVELS_HERE = available_levels(Path(tempfile.gettempdir()) / "ckagent-levels-probe")
"""Containment levels this machine can run; every test here runs at each (``task.containment``)."""
LEVEL = {"current": "auto"}




STRAY_ROOTS: list[Path] = []
"""Work dirs outside tmp_path whose spiders the ``no_strays`` fixture also cleans up."""


@pytest.fixture(autouse=True)
def no_strays(tmp_path: Path) -> Any:
    """After each test, SIGKILL spider processes it left alive (only a failing test does), so one
    failure does not leave 10-minute sleepers behind. Matched by CK_TASK_DIR under the test's dirs."""
    yield
    roots = [str(tmp_path), *map(str, STRAY_ROOTS)]
    STRAY_ROOTS.clear()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
        except OSError:
            continue
        task_dirs = [v[len(b"CK_TASK_DIR="):].decode(errors="replace") for v in environ
                     if v.startswith(b"CK_TASK_DIR=")]
        if any(d.startswith(root + os.sep) for d in task_dirs for root in roots):
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)


def pids_in(lines: list[str], label: str) -> list[int]:
    """Pids a spider printed as ``<label> <pid>``."""
    return [int(m.group(1)) for line in lines if (m := re.search(rf"\b{label} (\d+)\b", line))]


async def wait_for_log(admin: AdminClient, task_id: str, text: str, timeout: float = 20) -> list[str]:  # noqa: ASYNC109
    """Poll the master until the task's log holds ``text``; returns the lines."""
    with trio.fail_after(timeout):
        while True:
            lines = await admin.get_logs(task_id)
            if any(text in line for line in lines):
                return lines
            await trio.sleep(0.1)


async def wait_for_path(path: Path, timeout: float = 20) -> None:  # noqa: ASYNC109
    """Wait until ``path`` exists."""
    await eventually(trio.Path(path).exists, timeout)


def settings_for(tmp_path: Path, master: RecordingMaster, **env: str) -> Any:
    """Agent settings for these tests: 1 s kill grace, no index probing."""
    values = {"AGENT_TASK_KILL_GRACE": "1", "AGENT_UV_INDEX_URL": "http://127.0.0.1:9/simple",
              "AGENT_TASK_CONTAINMENT": LEVEL["current"]}
    values.update(env)
    return agent_settings(tmp_path / "agent", master.base_url, master.registration_token, **values)


# Spider building blocks (Python source).
ESCAPE = textwrap.dedent("""
    def escape(label):
        # Double fork + setsid: the grandchild leaves the spider's process group and session.
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            pid = os.fork()
            if pid == 0:
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                time.sleep(300)
                os._exit(0)
            os.write(w, str(pid).encode())
            os._exit(0)
        os.close(w)
        pid = int(os.read(r, 32))
        os.wait()
        print(label, pid, flush=True)
""")


SLOW_BACKEND = '''
import os, time

def get_requires_for_build_wheel(config_settings=None):
    with open({pid_file!r}, "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(300)
    return []

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("never reached")
'''
"""A PEP 517 build backend that writes its pid to ``{pid_file}`` and hangs: an install to cancel."""


# ------------------------------------------------------------------------------ a package index


def wheel(name: str, version: str, module_text: str) -> tuple[str, bytes]:
    """A minimal pure-Python wheel of the package ``name`` (its ``__init__.py`` is ``module_text``):
    (file name, bytes). The distribution's name is ``name`` with ``-`` for ``_``."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": module_text.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: ckagent-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return f"{name}-{version}-py3-none-any.whl", buf.getvalue()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@dataclass(frozen=True)
class PackageIndex:
    """A served simple index: ``url`` (``http://127.0.0.1:PORT/simple``) and, per (package, version),
    the wheel's direct URL with its hash (``…/files/NAME.whl#SHA256``), as a lock file names it."""

    url: str
    wheel_urls: dict[tuple[str, str], str]


@contextlib.contextmanager
def package_index(root: Path, packages: Sequence[tuple[str, str, str]]) -> Iterator[PackageIndex]:
    """Serve a PEP 503 simple index of ``packages`` ((package, version, module text), each built
    with :func:`wheel`) from ``root`` on 127.0.0.1 (a free port) until the block ends: for uv in tests
    that must not reach PyPI."""
    (root / "files").mkdir(parents=True, exist_ok=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    base = f"http://127.0.0.1:{server.server_address[1]}"
    projects: dict[str, list[str]] = {}
    urls: dict[tuple[str, str], str] = {}
    for name, version, text in packages:
        wheel_name, data = wheel(name, version, text)
        (root / "files" / wheel_name).write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        projects.setdefault(name.replace("_", "-"), []).append(
            f'<a href="/files/{wheel_name}#sha256={sha}">{wheel_name}</a>')
        urls[(name, version)] = f"{base}/files/{wheel_name}#{sha}"
    for project, links in projects.items():
        (root / "simple" / project).mkdir(parents=True)
        (root / "simple" / project / "index.html").write_text("<html><body>" + "".join(links) + "</body></html>\n")
    (root / "simple" / "index.html").write_text(
        "<html><body>" + "".join(f'<a href="{p}/">{p}</a>' for p in projects) + "</body></html>\n")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield PackageIndex(f"{base}/simple", urls)
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------ an agent as a process


async def wait_exit(agent: AgentProcess, bound: float) -> int:
    """The agent's exit code; fails the test when it is still running after ``bound`` seconds."""
    with trio.fail_after(bound):
        return await agent.wait()


async def wait_registered(admin: AdminClient, agent: AgentProcess, name: str = "proc-node") -> None:
    """Wait until the agent process has registered and sent a heartbeat."""
    with trio.fail_after(30):
        while True:
            assert agent.process is not None
            if agent.process.returncode is not None:
                raise AssertionError(f"agent exited with {agent.process.returncode}:\n{agent.log_text()[-3000:]}")
            nodes = [n for n in await admin.list_nodes() if n["name"] == name]
            if nodes and nodes[0].get("lastHeartbeat"):
                return
            await trio.sleep(0.1)


async def node_status(admin: AdminClient, name: str = "proc-node") -> str | None:
    """The status of the node's last heartbeat as the master saw it."""
    nodes = [n for n in await admin.list_nodes() if n["name"] == name]
    return (nodes[0].get("lastHeartbeat") or {}).get("status") if nodes else None


def agent_process(tmp_path: Path, base_url: str, token: str, **settings: Any) -> AgentProcess:
    """An AgentProcess with test timings (1 s heartbeat, 2 s grace) plus ``settings`` (section__key)."""
    directory = tmp_path / "node"
    directory.mkdir(exist_ok=True)
    values: dict[str, Any] = {"deps__uv_index_url": "http://127.0.0.1:9/simple"}
    values.update(settings)
    return AgentProcess(directory, base_url, token, **values)
