"""One error tree for a task's setup: each failure keeps its own errorCode, its errno text and its path.

Against the real agent and the reference master: an installer that cannot be started is DEPS_FAILED
(not BAD_TASK, not "ExceptionGroup"), a working copy the file system refuses is DEPLOY_FAILED, a jail
the node cannot make and a bug of the agent are AGENT_ERROR; the agent goes on taking tasks.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import agent_settings, running_agent, submit

import ckagent.task.deploy
from ckagent.code.deps import Dependencies, DepsError, IndexChooser
from ckagent.containment import ContainmentError
from ckagent.node.errors import AGENT_ERROR, DeployError, TaskError, collapse, collapsed_groups

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

OK = {"main.py": "print('fine')\n"}


async def test_installer_that_cannot_start_is_deps_failed_with_the_errno_text(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    uv = tmp_path / "bin" / "uv"
    uv.parent.mkdir()
    uv.write_text("#!/nonexistent/interpreter\n")  # executable, but execve fails: ENOENT
    uv.chmod(0o755)
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_PATH=str(uv))
    async with running_agent(nursery, settings) as agent:
        task_id = await submit(dev_master.admin, "no-installer", {"requirements.txt": "x\n", **OK})
        final = await dev_master.admin.wait_task_final(task_id, 60)
        assert agent.state == "RUNNING"
    assert (final["status"], final["errorCode"]) == ("FAILED", "DEPS_FAILED"), final
    message = final["errorMessage"]
    # Spawned directly, execve's ENOENT; through a jail's launcher (a cgroup level), its shell's words.
    assert ("No such file or directory" in message or "not found" in message) and str(uv) in message, message
    assert "ExceptionGroup" not in message and "agent error" not in message


async def test_working_copy_refused_by_the_file_system_is_deploy_failed(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    async with running_agent(nursery, settings) as agent:
        assert agent.workspaces is not None
        runs = agent.workspaces.runs
        shutil.rmtree(runs)
        runs.write_text("not a directory")  # every working copy's parent is a file now
        task_id = await submit(dev_master.admin, "no-copy", OK)
        final = await dev_master.admin.wait_task_final(task_id, 60)
        runs.unlink()
        runs.mkdir()
        after = await submit(dev_master.admin, "after", OK)
        after_final = await dev_master.admin.wait_task_final(after, 60)
    assert (final["status"], final["errorCode"]) == ("FAILED", "DEPLOY_FAILED"), final
    assert "Not a directory" in final["errorMessage"] and str(runs) in final["errorMessage"], final
    assert after_final["status"] == "SUCCESS", after_final


async def test_jail_refused_and_agent_bug_are_agent_error_never_bad_task(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_copy = ckagent.task.deploy.make_working_copy

    def buggy_copy(code_dir: Path, work: Path) -> Any:
        if "bug" in str(code_dir.parent.name) or (code_dir / "bug.txt").exists():
            raise RuntimeError("a bug of the agent")
        return real_copy(code_dir, work)

    monkeypatch.setattr(ckagent.task.deploy, "make_working_copy", buggy_copy)
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    async with running_agent(nursery, settings) as agent:
        sup = agent.supervisor
        assert sup is not None
        bug = await submit(dev_master.admin, "bug", {"bug.txt": "", **OK})
        bug_final = await dev_master.admin.wait_task_final(bug, 60)

        containment = sup.config.containment

        def refuse(*args: Any) -> Any:
            raise ContainmentError("cannot create the task's cgroup /sys/fs/cgroup/x: Read-only file system")

        if containment is None:
            monkeypatch.setattr(ckagent.task.deploy, "ProcessGroupJail", refuse)
        else:
            monkeypatch.setattr(containment, "jail", refuse)
        jailless = await submit(dev_master.admin, "no-jail", OK)
        jail_final = await dev_master.admin.wait_task_final(jailless, 60)
        monkeypatch.undo()
        after = await submit(dev_master.admin, "after", OK)
        after_final = await dev_master.admin.wait_task_final(after, 60)
        assert agent.state == "RUNNING"
    assert (bug_final["status"], bug_final["errorCode"]) == ("FAILED", AGENT_ERROR), bug_final
    assert "RuntimeError: a bug of the agent" in bug_final["errorMessage"]
    assert (jail_final["status"], jail_final["errorCode"]) == ("FAILED", AGENT_ERROR), jail_final
    assert "Read-only file system" in jail_final["errorMessage"], jail_final
    assert after_final["status"] == "SUCCESS", after_final


async def test_installer_not_startable_raises_deps_error_not_a_group(tmp_path: Path) -> None:
    deps = Dependencies(tmp_path / "envs", uv_path=None, index=IndexChooser(None, "http://127.0.0.1:9/simple"),
                        uv_cache_dir=tmp_path / "cache", timeout=10.0, base_env={"PATH": "/usr/bin:/bin"})
    missing = tmp_path / "no-such-installer"
    with pytest.raises(DepsError) as caught, collapsed_groups():
        await deps.installers.run([str(missing), "install"], tmp_path, {"PATH": "/usr/bin:/bin"}, lambda _: None)
    assert "No such file or directory" in str(caught.value) and str(missing) in str(caught.value)
    assert isinstance(caught.value.__cause__, FileNotFoundError)


def test_collapse_keeps_cancellation_and_picks_the_task_error() -> None:
    deploy = DeployError("bad zip")
    assert collapse(ExceptionGroup("g", [deploy])) is deploy
    assert collapse(ExceptionGroup("g", [ValueError("x"), ExceptionGroup("h", [deploy])])) is deploy
    both = ExceptionGroup("g", [ValueError("x"), KeyError("y")])
    assert collapse(both) is both
    interrupted = BaseExceptionGroup("g", [deploy, KeyboardInterrupt()])
    assert collapse(interrupted) is interrupted
    assert issubclass(DeployError, TaskError) and DeployError.error_code == "DEPLOY_FAILED"
