"""An agent as a process with the tests' timings: start, registration, exit, its node's status."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
import yaml

from ckagent.devmaster.client import AdminClient
from harness.core import AgentProcess


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with libyaml's parser when PyYAML has it (the same documents, ~10× less CPU:
    openapi.yaml takes 0.1 s in pure Python, and every pytest-xdist worker loads it at collection)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


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
