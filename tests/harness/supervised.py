"""``ckagent supervise`` as PID 1 of a new pid namespace, as in a container, running a real agent.

The namespace comes from util-linux ``unshare --pid --fork --mount-proc --kill-child`` (a plain user
adds ``--user --map-current-user``: the same uid inside, no capability after the exec). ``unshare``
waits for its child, the namespace's PID 1, and exits with its code; when ``unshare`` is killed its
child is SIGKILLed, and the kernel then kills every process of the namespace — no crawl outlives the
test. The test sees the namespace's processes with their outer pids: PID 1's descendants (every
process of the namespace is one: orphans are re-parented to PID 1).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import trio
import yaml

from harness.core import AgentProcess
from harness.nodekill import kill_node
from harness.pyz import free_port

__all__ = ["SupervisedNode", "bare_supervisor", "in_pid_namespace", "process_table"]


def in_pid_namespace(argv: list[str]) -> list[str]:
    """``argv`` run as PID 1 of a new pid (and mount, for its own /proc) namespace (module docstring)."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-current-user"]
    return ["unshare", *user, "--pid", "--fork", "--mount-proc", "--kill-child", "--", *argv]


def process_table() -> dict[int, tuple[int, str]]:
    """{pid: (parent pid, state letter)} of every process (zombies included). Blocking (reads /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    state, parent = fh.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            found[int(entry)] = (int(parent), state)
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [part.decode(errors="replace") for part in fh.read().split(b"\0") if part]
    except OSError:
        return []


class SupervisedNode:
    """A node as a pod runs it: ``python -m ckagent supervise -c FILE`` as PID 1 of its own pid
    namespace, the token in the environment only (the config file has none), the tests' timings
    (harness.core.AgentProcess's config), the agent's status port and /livez on free ports."""

    def __init__(self, directory: Path, base_url: str, token: str, *, start_timeout: float = 120.0,
                 agent_args: tuple[str, ...] = (), **settings: Any) -> None:
        directory.mkdir(exist_ok=True)
        self.token = token
        self.directory = directory
        self.work_dir = directory / "data"
        self.live_port = free_port()
        self.agent_port = free_port()
        base = AgentProcess(directory, base_url, token, agent__port=self.agent_port, **settings)
        config = yaml.safe_load(base.config_path.read_text())
        del config["agent"]["registration_token"]
        base.config_path.write_text(yaml.safe_dump(config))
        self.config_path = base.config_path
        self.log_path = directory / "supervise.log"
        self.argv = [sys.executable, "-m", "ckagent", "supervise", "-c", str(self.config_path),
                     "--live-port", str(self.live_port), "--start-timeout", str(start_timeout)]
        if agent_args:
            self.argv += ["--", *agent_args]
        self.process: trio.Process | None = None

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
        env["AGENT_REGISTRATION_TOKEN"] = self.token
        return env

    async def start(self) -> None:
        """Start ``unshare … supervise`` (does not wait for the agent)."""
        with self.log_path.open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                in_pid_namespace(self.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self._env())

    def popen(self) -> subprocess.Popen[bytes]:
        """Start the supervisor as a plain child of this process (no namespace: it is then the child
        subreaper of what it starts), without Trio: for a module-scoped fixture. The caller stops it."""
        with self.log_path.open("ab") as log:
            return subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self._env())

    async def pid1(self) -> int:
        """The supervisor's (outer) pid, once ``unshare`` has forked it."""
        assert self.process is not None
        path = f"/proc/{self.process.pid}/task/{self.process.pid}/children"
        with trio.fail_after(10):
            while True:
                with contextlib.suppress(OSError):
                    children = (await trio.Path(path).read_text()).split()
                    if children:
                        return int(children[0])
                await trio.sleep(0.02)

    async def processes(self) -> dict[int, tuple[int, str]]:
        """{outer pid: (parent pid, state)} of the namespace's processes (PID 1 and its descendants)."""
        root = await self.pid1()
        table = await trio.to_thread.run_sync(process_table)
        found = {root: table[root]} if root in table else {}
        grown = True
        while grown:
            more = {pid: row for pid, row in table.items() if row[0] in found and pid not in found}
            found.update(more)
            grown = bool(more)
        return found

    async def agent_pid(self) -> int | None:
        """The running agent's outer pid (the supervisor's child running ``ckagent run``), or None."""
        root = await self.pid1()
        for pid, (parent, state) in (await self.processes()).items():
            if parent == root and state != "Z" and _cmdline(pid)[1:4] == ["-m", "ckagent", "run"]:
                return pid
        return None

    async def new_agent(self, *, other_than: int | None = None, timeout: float = 30) -> int:  # noqa: ASYNC109
        """Wait for a running agent whose pid is not ``other_than``; returns its pid."""
        with trio.fail_after(timeout):
            while True:
                pid = await self.agent_pid()
                if pid is not None and pid != other_than:
                    return pid
                await trio.sleep(0.05)

    async def livez(self, path: str = "/livez") -> tuple[int, str]:
        """(status, body) of one GET on the supervisor's /livez port (bounded: 10 s)."""
        with trio.fail_after(10):
            async with httpx.AsyncClient(timeout=8) as client:
                response = await client.get(f"http://127.0.0.1:{self.live_port}{path}")
        return response.status_code, response.text.strip()

    async def signal(self, signum: int) -> None:
        """Send ``signum`` to the supervisor (PID 1 of the namespace)."""
        os.kill(await self.pid1(), signum)

    async def wait(self, bound: float = 60) -> int:
        """The supervisor's exit code (``unshare`` passes it on); fails after ``bound`` seconds."""
        assert self.process is not None
        with trio.fail_after(bound):
            return await self.process.wait()

    def log_text(self) -> str:
        """The supervisor's and the agent's log (both write to stderr)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def __aenter__(self) -> SupervisedNode:
        """``async with node:`` — the namespace ends with the block."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """SIGKILL ``unshare`` (its child, PID 1, is killed with it, and with PID 1 the namespace), then
        remove what the node's task cgroups left (harness.nodekill); shielded, bounded."""
        with trio.move_on_after(20, shield=True):
            if self.process is not None and self.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.process.send_signal(signal.SIGKILL)
                await self.process.wait()
            await kill_node(None, self.work_dir, delete=False)


_BARE = """
import json, logging, os, sys
from ckagent.pod.livez import Health, Probe
from ckagent.pod.loop import Loop
from ckagent.pod.supervisor import AgentCommand, Backoff, Supervisor, set_child_subreaper
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
options = json.loads(sys.argv[1])
set_child_subreaper()
loop = Loop()
health = Health(loop, Probe(loop, ("127.0.0.1", 9)), 5.0)
backoff = Backoff(first=options["backoff"], cap=options["backoff"] * 4)
command = AgentCommand(options["agent"], dict(os.environ))
sys.exit(Supervisor(loop, command, health, backoff=backoff, children_timeout=options["children_timeout"]).run())
"""


def bare_supervisor(agent: list[str], *, backoff: float = 0.05, children_timeout: float = 1.0) -> list[str]:
    """A command line running ckagent.pod.supervisor.Supervisor (the real one, its rules and reaping; a
    child subreaper, not PID 1) over ``agent`` instead of ``ckagent run``, with a short backoff and
    children timeout: the exit-code rules in a second, with a shell script as the agent."""
    options = {"agent": agent, "backoff": backoff, "children_timeout": children_timeout}
    return [sys.executable, "-c", _BARE, json.dumps(options)]
