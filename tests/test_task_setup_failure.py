"""A task whose directory cannot be created fails alone; the agent keeps running (never dies on bad input)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from harness import agent_settings, running_agent, submit


async def test_unpreparable_task_fails_alone_and_the_next_one_runs(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    work_dir = tmp_path / "agent"
    blocked = await submit(dev_master.admin, "blocked", {"main.py": "print('never')\n"})
    # A plain file where the task's directory must go: mkdir fails with an OSError, as on a full
    # or broken disk (root ignores permission bits, so a read-only dir would prove nothing here).
    (work_dir / "tasks").mkdir(parents=True)
    (work_dir / "tasks" / blocked).write_text("in the way")
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token)
    async with running_agent(nursery, settings) as agent:
        failed = await dev_master.admin.wait_task_final(blocked, 30)
        ok = await submit(dev_master.admin, "after", {"main.py": "print('still here')\n"})
        after = await dev_master.admin.wait_task_final(ok, 60)
        assert agent.state == "RUNNING"
    assert failed["status"] == "FAILED" and failed["errorCode"] == "DEPLOY_FAILED", failed
    assert "cannot prepare the task" in failed["errorMessage"]
    assert after["status"] == "SUCCESS", after
    assert "still here" in await dev_master.admin.get_logs(ok)
