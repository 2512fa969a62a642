"""The agent in this process and as a process, a spider's package, waiting for another process, what a task wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
import yaml

from ckagent.agent import Agent
from ckagent.delivery import LineSplitter, Masker, decode_lines
from ckagent.devmaster.client import zip_files
from ckagent.node.config import Settings, load_settings
from harness.identities import spider_uid_env, uid_claims_dir


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with libyaml's parser when PyYAML has it (the same documents, ~10× less CPU:
    openapi.yaml takes 0.1 s in pure Python, and every pytest-xdist worker loads it at collection)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def agent_settings(work_dir: Path, base_url: str, registration_token: str, **env: str) -> Settings:
    """Settings for a test agent: fast heartbeat, short long poll, 2 workers; ``env`` overrides (AGENT_*).
    As root the agent gets the default identity level a node would, spider-uids (:func:`spider_uid_env`)."""
    values = {**spider_uid_env(work_dir),
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
        # The test's own registry of agents' ports (shared by the agents of one test), not the host's:
        # another test's agent port must not be refused to this test's tasks.
        "AGENT_PORTS_REGISTRY": str(work_dir.parent / "agent-ports"),
        "AGENT_TASK_UID_CLAIMS": str(uid_claims_dir(work_dir)),  # this agent's own record of claimed uids
        # The test's temp dir stays seen in each task's private /tmp: spiders report to the test there.
        "AGENT_TASK_PRIVATE_TMP_SHARED": str(work_dir.parent),
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
                      "port": 0, "ports_registry": str(directory.parent / "agent-ports"),
                      "max_workers": 2},
            "heartbeat": {"interval": 1},
            "task": {"work_dir": str(directory / "data"), "poll_interval": 0.5, "long_poll_wait": 2,
                     "kill_grace": 2, "private_tmp_shared": str(directory.parent),
                     "uid_claims": str(uid_claims_dir(directory / "data"))},
        }
        python = spider_uid_env(directory / "data").get("AGENT_DEPS_PYTHON")  # as root: spider-uids, as a node gets
        if python is not None:
            config["deps"] = {"python": python}
        for dotted, value in settings.items():
            section, key = dotted.split("__", 1)
            config.setdefault(section, {})[key] = value
        self.config_path.write_text(yaml.safe_dump(config))
        self.process: trio.Process | None = None

    async def start(self, extra_env: dict[str, str] | None = None, args: Sequence[str] = ()) -> None:
        """Launch the agent process (does not wait for registration); ``args`` follow ``run -c FILE``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
        env.update(extra_env or {})
        with self.log_path.open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "ckagent", "run", "-c", str(self.config_path), *args],
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
                return httpx.Response(200, json={"status": body["status"]})  # ResultAccepted
            stored = (self.logs if kind == "logs" else self.items).setdefault(task, [])
            seq, batch = body["seq"], body["lines" if kind == "logs" else "items"]
            if seq > len(stored):
                return httpx.Response(409, json={"error": "gap", "expectedSeq": len(stored)})
            stored.extend(batch[len(stored) - seq:])
            return httpx.Response(200, json={"acceptedSeq": len(stored)})
        return httpx.Response(404, json={"error": f"no route {request.method} {path} in the memory master"})
