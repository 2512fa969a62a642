"""Spiders are tenants (issue 35): spider A, running beside spiders B (Python) and N (Node) that keep
running and write items, with a secret in their task env, tries every cross-tenant action — write into
their working copies, task, data and home dirs; plant a ``.pth`` in B's venv and a module in N's
``node_modules``; append to their items, stats and output files; read their ``/proc/<pid>/environ``,
``cmdline``, ``fd``, ``mem``; signal and ptrace them — and reaches for the agent's secrets (its
``/proc`` entries, config file, state store, egress key) and work dir. A real agent process, the dev
master, loopback only (tests/harness/tenants.py, tests/harness/tenantmatrix.py).

At each identity level this machine gives (docs/operations.md, "Who a spider runs as"):

- ``spider-uids`` (root, the default): every attempt is refused; the victims end SUCCESS with exactly
  their own items; their later tasks run clean (nothing planted ran).
- ``one-user`` (``task.run_as_user``): one uid for every spider, so what is a spider's is every spider's
  (A reads B's environment, may write its items, may signal and trace it: asserted as the level's
  documented limit, A probing without harm); what still holds: sealed environments, the agent's files,
  memory and ``/proc`` entries (root's; hidepid).
- ``agent-user`` (a plain user's agent: as root, a throwaway user runs the pyz): the same, and the agent's files are
  the spiders' too; what still holds: sealed environments against writes, the non-dumpable agent's
  environ, fds, memory and ptrace.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    SECRET,
    MatrixRun,
    RecordingMaster,
    SystemUser,
    action_keys,
    no_strays,
    run_matrix,
    throwaway_user,
    unprivileged_user,
    user_agent_process,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("npm") is None, reason="the Node victim needs npm")]

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason=f"this level needs a root agent; the suite runs as uid "
                                                    f"{os.geteuid()}")


def _refused(run: MatrixRun, keys: list[str]) -> None:
    """Every one of ``keys`` was tried and refused."""
    missing = [k for k in keys if k not in run.report]
    assert not missing, f"A never tried {missing}: {run.report}"
    done = {k: run.report[k] for k in keys if run.report[k]["ok"]}
    assert not done, f"A did what it must not: {done}\n{run.summary()}"


def _done(run: MatrixRun, keys: list[str]) -> None:
    """Every one of ``keys`` was done (a level's documented limit)."""
    refused = {k: run.report[k] for k in keys if not run.report[k]["ok"]}
    assert not refused, f"the level's documented limit no longer holds (update the docs): {refused}\n{run.summary()}"


def _victims_whole(run: MatrixRun) -> None:
    """B and N ended SUCCESS with exactly their own items; their later tasks ran clean."""
    for role, mark in (("B", "B"), ("N", "N"), ("B2", "B"), ("N2", "N")):
        status, items, log = run.outcome(role)
        assert status == "SUCCESS", (role, run.finals[run.tasks[role]], log, run.agent_log[-3000:])
        task = run.tasks[role]
        assert items == [{"spider": mark, "task": task, "n": n} for n in (1, 2, 3, 4)], (role, items)
        assert "POISONED" not in log and "forged" not in log, (role, log)
    assert run.poisoned == [], f"a planted file ran: {run.poisoned}"


def _secrets_unseen(run: MatrixRun, token: str) -> None:
    text = repr(run.report)
    assert token not in text, "A read the agent's registration token"
    assert SECRET not in text, "A read B's task env"


@ROOT
async def test_at_spider_uids_no_spider_reaches_another_or_the_agent(
        recording_master: RecordingMaster, tmp_path: Path) -> None:
    run = await run_matrix(recording_master, tmp_path, gentle=False)
    _victims_whole(run)
    uids = {run.attacker_uid, run.victims["B"]["uid"], run.victims["N"]["uid"]}
    assert len(uids) == 3 and 0 not in uids, uids
    _refused(run, action_keys(run.victims))
    _secrets_unseen(run, recording_master.registration_token)
    assert run.planted == [], run.planted


@pytest.fixture
def spider_user() -> Iterator[SystemUser]:
    """The one user every spider runs as (a throwaway system user; conftest.py's SERIAL_GROUPS
    "system-users" by this name)."""
    with throwaway_user("cktenant") as user:
        yield user


@ROOT
async def test_at_one_user_spiders_share_everything_but_the_environments_and_the_agent(
        recording_master: RecordingMaster, tmp_path: Path, spider_user: SystemUser) -> None:
    run = await run_matrix(recording_master, tmp_path, gentle=True, task__run_as_user=spider_user.name)
    _victims_whole(run)
    assert {run.attacker_uid, run.victims["B"]["uid"], run.victims["N"]["uid"]} == {spider_user.uid}
    # What still holds: sealed environments; the agent's files, memory and /proc entries (root's, hidepid).
    _refused(run, [k for k in action_keys(run.victims) if k.startswith("agent:") or "plant" in k
                   or "node_modules" in k])
    assert recording_master.registration_token not in repr(run.report)
    # The level's documented limit (docs/operations.md): one uid, so A could do all this to B (probed
    # without harm: a write opened and closed, signal 0, a ptrace attach detached at once).
    for who in ("B", "N"):
        limit = [f"{who}:{a}" for a in ("write working copy", "write task dir", "write data dir", "append items",
                                         "append stats", "read environ", "read fd", "signal", "ptrace")]
        _done(run, limit)
    assert SECRET in run.report["B:read environ"]["got"]


@pytest.fixture
def agent_user() -> Iterator[SystemUser]:
    """The user the agent runs as: a throwaway system user as root (conftest.py's SERIAL_GROUPS
    "system-users"), the suite's own user otherwise."""
    with unprivileged_user("ckagentu") as user:
        yield user


async def test_at_agent_user_the_non_dumpable_agent_and_sealed_environments_hold(
        recording_master: RecordingMaster, tmp_path: Path, agent_user: SystemUser, pyz: Path) -> None:
    agent = await trio.to_thread.run_sync(lambda: user_agent_process(
        agent_user, pyz, recording_master.base_url, recording_master.registration_token, agent__max_workers=3))
    run = await run_matrix(recording_master, tmp_path, gentle=True, agent=agent)
    _victims_whole(run)
    assert "identity: agent-user" in run.agent_log or "agent-user" in run.agent_log, run.agent_log[-2000:]
    assert {run.attacker_uid, run.victims["B"]["uid"], run.victims["N"]["uid"]} == {agent_user.uid}
    # What still holds: the agent's memory, fds and environ (non-dumpable), sealed environments against
    # a write (the spider owns them: it could chmod them back, the docs say so).
    _refused(run, ["agent:read environ", "agent:read fd", "agent:read mem", "agent:ptrace",
                   *[k for k in action_keys(run.victims) if "plant" in k or "node_modules" in k]])
    assert recording_master.registration_token not in repr(
        {k: v for k, v in run.report.items() if k != "agent:read config" and k != "agent:read state.db"})
    # The level's documented limit: the agent's files and every spider's are the spiders'.
    # (Another task's environ, mem and ptrace were refused here too at the user-namespace private level —
    # each task's processes in a user namespace of their own — which the docs do not promise: not asserted.)
    limit = ["agent:read config", "agent:read state.db", "agent:list work dir", "agent:write work dir",
             "agent:signal", "B:read items", "B:append items", "B:write task dir", "B:write working copy",
             "B:signal", "N:append items"]
    _done(run, limit)
