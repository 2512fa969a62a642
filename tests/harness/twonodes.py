"""Two real nodes on one real reference master, for the tests of crawls that survive their node (issue 38).

:func:`two_nodes` serves a reference master in the test's nursery (its ``--node-lost-after`` grace
short) and lays out two nodes, ``node-a`` and ``node-b``: each a real agent process
(:class:`harness.core.AgentProcess`, ``python -m ckagent run -c FILE``) with its own directory, work
dir, name and status port, at the containment and egress levels the test asks for. A node is started
by the test (:meth:`CrawlNode.start`), then leaves by the roads the issue names:

- :meth:`CrawlNode.migrate`: ``ckagent stop --migrate -c <its config>``, as an operator (or a pod's
  preStop) runs it, then its agent's exit;
- :meth:`CrawlNode.lose`: everything of the node SIGKILLed at once and its work dir deleted
  (harness.nodekill.kill_node).

:meth:`CrawlNode.occupy` keeps a started node busy with a task of its own (one that waits on the
site's ``/hold`` page) until :meth:`harness.crawlsite.CrawlSite.release`: with one slot, the node
claims nothing else until then — so the test decides which node a task starts on, and the other one
(its environment already built by the holding task when it is of the same spider) takes the next
attempt. :data:`LEVEL_PAIRS` (:data:`RESUME_LEVELS` as pytest params) are the levels these tests run at: a cgroup level with the kernel's
egress rules (nftables, as root) and the process-group level with the egress proxy.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from ckagent.devmaster.client import AdminClient
from ckagent.devmaster.server import DevMasterConfig, serve
from harness.agentproc import wait_exit, wait_registered
from harness.core import AgentProcess, eventually
from harness.nodekill import KilledNode, kill_node
from harness.procs import LEVELS_HERE

__all__ = ["LEVEL_PAIRS", "RESUME_LEVELS", "Cluster", "CrawlNode", "two_nodes"]

NODE_LOST_AFTER = 4.0
"""The test master's node-lost grace (seconds without a heartbeat; the agents beat every second)."""


def _level_pairs() -> list[tuple[str, str]]:
    cgroup = next((level for level in LEVELS_HERE if level != "process-group"), None)
    kernel = os.geteuid() == 0 and shutil.which("nft") is not None
    pairs = [] if cgroup is None else [(cgroup, "nftables" if kernel else "proxy")]
    return [*pairs, ("process-group", "proxy")]


LEVEL_PAIRS = _level_pairs()
"""``(task.containment, task.egress)`` pairs these tests run at: a cgroup level (with nftables when this
process is root and has ``nft``; the first pair) and the process-group level with the egress proxy (the last)."""
RESUME_LEVELS = [pytest.param(pair, id=pair[0]) for pair in LEVEL_PAIRS]
""":data:`LEVEL_PAIRS` as pytest params (id: the containment level)."""


@dataclass
class CrawlNode:
    """One node of :func:`two_nodes`: ``name``, its agent process, its master."""

    name: str
    agent: AgentProcess
    admin: AdminClient

    @property
    def work_dir(self) -> Path:
        """The agent's ``task.work_dir`` (what :meth:`lose` deletes)."""
        return self.agent.directory / "data"

    async def start(self) -> None:
        """Start the agent; return once it registered and beat (≤ 30 s)."""
        await self.agent.start()
        await wait_registered(self.admin, self.agent, self.name)

    async def node_id(self) -> str:
        """The master's id of this node (registered: :meth:`start` first)."""
        [node] = [n for n in await self.admin.list_nodes() if n["name"] == self.name]
        return str(node["id"])

    async def occupy(self, spider_id: str, **task: Any) -> str:
        """Queue a task of ``spider_id`` (``task``: create_task's arguments; the caller makes it wait on
        the site's ``/hold``) and wait until this node runs it (≤ 120 s: a first environment build
        included); returns the task id."""
        task_id = str(await self.admin.create_task(spider_id, **task))
        me = await self.node_id()

        async def running_here() -> bool:
            view = await self.admin.get_task(task_id)
            if view.get("status") in ("SUCCESS", "FAILED", "CANCELLED"):
                raise AssertionError(f"the holding task ended: {view}\n" +
                                     "\n".join(await self.admin.get_logs(task_id))[-3000:])
            return view.get("status") == "RUNNING" and view.get("nodeId") == me

        await eventually(running_here, 120, f"the holding task running on {self.name}")
        return task_id

    async def migrate(self, bound: float = 60.0) -> tuple[int, str, int]:
        """``ckagent stop --migrate -c <config>`` (the operator's command): returns its exit code, its
        output, and the agent's exit code (waited for, ≤ ``bound`` seconds)."""
        with trio.fail_after(bound):
            done = await trio.run_process(
                [sys.executable, "-m", "ckagent", "stop", "--migrate", "-c", str(self.agent.config_path)],
                stdin=subprocess.DEVNULL, capture_stdout=True, stderr=subprocess.STDOUT, check=False,
                env={k: v for k, v in os.environ.items() if not k.startswith("AGENT_")})
            exit_code = await wait_exit(self.agent, bound)
        return done.returncode, done.stdout.decode(errors="replace"), exit_code

    async def lose(self) -> KilledNode:
        """The node lost: agent, monitors, its tasks' processes and cgroups SIGKILLed, work dir deleted."""
        return await kill_node(self.agent.process, self.work_dir)

    async def close(self) -> None:
        """End whatever of the node still runs (its work dir kept, for the test's report)."""
        await kill_node(self.agent.process, self.work_dir, delete=False)


@dataclass
class Cluster:
    """:func:`two_nodes`'s master (``base_url``, ``admin``, ``node_lost_after``) and nodes ``a`` and ``b``."""

    base_url: str
    admin: AdminClient
    node_lost_after: float
    a: CrawlNode
    b: CrawlNode


def _master_config(tmp_path: Path, node_lost_after: float) -> DevMasterConfig:
    config = DevMasterConfig(db_path=tmp_path / "master.sqlite", registration_token=secrets.token_urlsafe(16),
                             admin_token=secrets.token_urlsafe(16), port=0)
    if "node_lost_after" in {f.name for f in dataclasses.fields(DevMasterConfig)}:
        config = dataclasses.replace(config, node_lost_after=node_lost_after)  # type: ignore[call-arg,unused-ignore]
    return config


@asynccontextmanager
async def two_nodes(nursery: trio.Nursery, tmp_path: Path, level: tuple[str, str], *,
                    node_lost_after: float = NODE_LOST_AFTER, **settings: Any) -> AsyncIterator[Cluster]:
    """A reference master (in ``nursery``) and two nodes at ``level`` = (containment, egress), not
    started; ``settings`` (``section__key``) go to both agents' config. At the block's end whatever of
    the nodes still runs is killed (bounded), also when the test failed."""
    config = _master_config(tmp_path, node_lost_after)
    base_url = await nursery.start(serve, config)
    containment, egress = level
    async with AdminClient(base_url, config.admin_token) as admin:
        nodes = []
        for name in ("node-a", "node-b"):
            directory = tmp_path / name
            directory.mkdir()
            values: dict[str, Any] = {"agent__name": name, "agent__max_workers": 1,
                                      "task__containment": containment, "task__egress": egress,
                                      "deps__uv_sync_timeout": 600, **settings}
            nodes.append(CrawlNode(name, AgentProcess(directory, base_url, config.registration_token, **values),
                                   admin))
        try:
            yield Cluster(base_url, admin, node_lost_after, nodes[0], nodes[1])
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(30):
                for node in nodes:
                    await node.close()
