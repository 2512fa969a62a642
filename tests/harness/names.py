"""A node's name held by one agent at a time (issue 39, "the pod's name"): a reference master whose
name-liveness window is short, and an agent process's status port read from its log.

:func:`short_live_master` serves a dev master in the test's nursery whose ``node_live_after`` (how long
a node that did not leave holds its name against another nodeUid after its last heartbeat; 90 s by
default) and ``node_lost_after`` are the test's, so that "the rescheduled pod waits until the earlier
one's heartbeats are old" takes seconds. :func:`status_port` finds an agent process's status port (it
listens on port 0 in the tests) in its log; :func:`readyz` reads ``/readyz`` there.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import httpx
import trio

from ckagent.devmaster.client import AdminClient
from ckagent.devmaster.server import DevMasterConfig, serve
from harness.core import AgentProcess

__all__ = ["ShortLiveMaster", "readyz", "short_live_master", "status_port", "wait_beating"]


@dataclass
class ShortLiveMaster:
    """A dev master started by :func:`short_live_master`."""

    base_url: str
    registration_token: str
    admin: AdminClient
    node_live_after: float


async def short_live_master(nursery: trio.Nursery, tmp_path: Path, node_live_after: float,
                            node_lost_after: float = 600.0) -> ShortLiveMaster:
    """An in-process dev master (port 0) whose node-name liveness window is ``node_live_after`` seconds
    and node-lost grace ``node_lost_after``; its admin client is closed when ``nursery`` ends."""
    config = DevMasterConfig(db_path=tmp_path / "names.sqlite", registration_token=secrets.token_urlsafe(16),
                             admin_token=secrets.token_urlsafe(16), port=0, node_live_after=node_live_after,
                             node_lost_after=node_lost_after)
    base_url = await nursery.start(serve, config)
    admin = AdminClient(base_url, config.admin_token)

    async def close_later() -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await admin.aclose()

    nursery.start_soon(close_later)
    return ShortLiveMaster(base_url, config.registration_token, admin, node_live_after)


_LISTENING = re.compile(r"status server on http://[^:/\s]+:(\d+)")


async def wait_beating(admin: AdminClient, agent: AgentProcess, name: str, bound: float = 120.0) -> None:
    """Wait until the node ``name`` registered and beat (≤ ``bound`` s: an agent's start on a machine
    under the whole suite's load takes tens of seconds); fails when ``agent`` exited meanwhile."""
    with trio.fail_after(bound):
        while True:
            assert agent.process is not None
            if agent.process.returncode is not None:
                raise AssertionError(f"agent exited with {agent.process.returncode}:\n{agent.log_text()[-3000:]}")
            if [n for n in await admin.list_nodes() if n["name"] == name and n.get("lastHeartbeat")]:
                return
            await trio.sleep(0.1)


async def status_port(agent: AgentProcess, bound: float = 120.0) -> int:
    """The status port the agent process logged it listens on (the newest such line; ≤ ``bound`` s)."""
    with trio.fail_after(bound):
        while True:
            found = _LISTENING.findall(agent.log_text())
            if found:
                return int(found[-1])
            assert agent.process is not None and agent.process.returncode is None, agent.log_text()[-3000:]
            await trio.sleep(0.05)


async def readyz(port: int) -> tuple[int, str]:
    """``GET /readyz`` of the agent on 127.0.0.1:``port``: (status code, body text)."""
    async with httpx.AsyncClient(timeout=5) as client:
        answer = await client.get(f"http://127.0.0.1:{port}/readyz")
    return answer.status_code, answer.text.strip()
