"""The tenant matrix's run (tests/test_tenants.py): a real agent process against the dev master, two victim
spiders (Python B, Node N: :mod:`harness.tenants`) kept running while spider A attacks them and the agent,
then the victims' ends and a later task of each — everything the test asserts on, in one
:class:`MatrixRun`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from ckagent.devmaster.client import AdminClient
from ckagent.master.ids import task_dir
from harness.agentproc import agent_process, wait_registered
from harness.core import AgentProcess, eventually, spider_zip
from harness.identities import spider_writable
from harness.npmregistry import npm_registry
from harness.recording import RecordingMaster
from harness.tenants import (
    ATTACKER,
    SECRET,
    VICTIM_DEP,
    attack_params,
    beacon_of,
    poisoned,
    read_report,
    victim_node_files,
    victim_py_files,
)

__all__ = ["MatrixRun", "run_matrix"]

BOUND = 420.0
"""Seconds the whole run may take (two environments built on a loaded machine, five tasks)."""


@dataclass
class MatrixRun:
    """What one run of the matrix saw. ``victims``: name (``B``, ``N``) → beacon; ``attacker_uid`` and
    ``report`` (action → result) from A's report; ``finals``/``items``/``logs`` per task id;
    ``tasks``: role (``A``, ``B``, ``N``, ``B2``, ``N2``) → task id; ``poisoned``: files a planted
    module left; ``planted``: files named ``*planted*`` anywhere under the work dir afterwards;
    ``agent_log``: the agent's own log."""

    work_dir: Path
    report_dir: Path
    victims: dict[str, dict[str, Any]] = field(default_factory=dict)
    attacker_uid: int = -1
    report: dict[str, dict[str, Any]] = field(default_factory=dict)
    tasks: dict[str, str] = field(default_factory=dict)
    finals: dict[str, dict[str, Any]] = field(default_factory=dict)
    items: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    logs: dict[str, list[str]] = field(default_factory=dict)
    poisoned: list[str] = field(default_factory=list)
    planted: list[str] = field(default_factory=list)
    agent_log: str = ""

    def summary(self) -> str:
        """One line per action A tried: done, or the error that refused it (for assertion messages); then
        the agent's lines on its levels."""
        lines = [f"{key}: {'DONE' if r['ok'] else r.get('error')}" for key, r in self.report.items()]
        lines += [line for line in self.agent_log.splitlines() if any(
            word in line for word in ("identity", "containment:", "private", "egress:"))][:8]
        return "\n".join(lines)

    def outcome(self, role: str) -> tuple[str, list[dict[str, Any]], str]:
        """``(status, items, log text)`` of the task in ``role``."""
        task_id = self.tasks[role]
        return self.finals[task_id]["status"], self.items[task_id], "\n".join(self.logs[task_id])


def _planted(work: Path) -> list[str]:
    found = []
    for top, dirs, files in os.walk(work):
        found += [os.path.join(top, name) for name in dirs + files if "planted" in name]
    return sorted(found)


async def run_matrix(master: RecordingMaster, tmp_path: Path, *, gentle: bool, agent: AgentProcess | None = None,
                     **settings: Any) -> MatrixRun:
    """Run the matrix on an agent process with ``settings`` (``section__key``, as :func:`agent_process`;
    or on ``agent``, made with ``agent__max_workers=3``), ``gentle`` as :data:`harness.tenants.ATTACKER`
    takes it; the report dir is beside the agent's directory. Bounded by :data:`BOUND`; the agent is
    killed at the end. Raises AssertionError when a victim never starts."""
    if agent is None:
        agent = agent_process(tmp_path, master.base_url, master.registration_token,
                              agent__max_workers=3, **settings)
    report_dir = await trio.to_thread.run_sync(spider_writable, agent.directory.parent / "report")
    work = agent.directory / "data"
    run = MatrixRun(work, report_dir)
    admin: AdminClient = master.admin
    with trio.fail_after(BOUND), npm_registry([VICTIM_DEP]) as registry:
        spiders = {
            "A": await admin.create_spider(name="tenant-a", framework="python"),
            "B": await admin.create_spider(name="tenant-b", framework="python"),
            "N": await admin.create_spider(name="tenant-n", framework="node"),
        }
        packages = {"A": {"main.py": ATTACKER}, "B": victim_py_files(), "N": victim_node_files()}
        for role, spider_id in spiders.items():
            await admin.upload_package(spider_id, spider_zip(packages[role]))
        env = {"DB_PASSWORD": SECRET, "NPM_CONFIG_REGISTRY": registry.url}
        params = {"report": str(report_dir), "wait": True}
        async with agent:
            # The token reaches the agent in its environment too: `ckagent run` moves it into a memory file.
            await agent.start({"AGENT_REGISTRATION_TOKEN": master.registration_token})
            await wait_registered(admin, agent)
            assert agent.process is not None
            proc = agent.process
            for role in ("B", "N"):
                run.tasks[role] = str(await admin.create_task(spiders[role], env=env, params=params))
            for role in ("B", "N"):
                async def started(task_id: str = run.tasks[role]) -> dict[str, Any] | None:
                    final = await admin.get_task(task_id)
                    assert final["status"] not in ("SUCCESS", "FAILED", "CANCELLED"), (
                        final, await admin.get_logs(task_id), agent.log_text()[-3000:])
                    return await trio.to_thread.run_sync(beacon_of, report_dir, task_id)

                run.victims[role] = await eventually(started, BOUND / 2, f"victim {role} started")
            attack = attack_params(report_dir, run.victims, agent_pid=proc.pid, work_dir=work,
                                   config=agent.config_path, gentle=gentle)
            run.tasks["A"] = str(await admin.create_task(spiders["A"], params=attack))
            await _finish(admin, run, "A")
            run.attacker_uid, run.report = await trio.to_thread.run_sync(read_report, report_dir)
            for role in ("B", "N"):
                await trio.to_thread.run_sync((task_dir(work, run.tasks[role]) / "go").touch)
            for role in ("B", "N"):
                await _finish(admin, run, role)
            for role in ("B", "N"):  # a later task of each victim, on the environment A attacked
                run.tasks[role + "2"] = str(await admin.create_task(
                    spiders[role], env=env, params={"report": str(report_dir), "wait": False}))
            for role in ("B2", "N2"):
                await _finish(admin, run, role)
            run.agent_log = agent.log_text()
    run.poisoned = await trio.to_thread.run_sync(poisoned, report_dir)
    run.planted = await trio.to_thread.run_sync(_planted, work)
    return run


async def _finish(admin: AdminClient, run: MatrixRun, role: str) -> None:
    task_id = run.tasks[role]
    run.finals[task_id] = await admin.wait_task_final(task_id, BOUND)
    run.items[task_id] = await admin.get_items(task_id)
    run.logs[task_id] = await admin.get_logs(task_id)
