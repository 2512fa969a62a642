"""One agent per work dir (ckagent.node.workdir), and start-up problems reported as configuration errors.

A second agent on a work dir in use must be refused before its crash recovery runs: recovery would
take the first agent's running tasks for leftovers of a crash, kill them and report AGENT_LOST.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import AgentProcess, submit

from ckagent.node.workdir import LOCK_FILE, WorkDirError, WorkDirInUse, WorkDirLock


def test_a_second_lock_on_the_same_work_dir_is_refused_until_the_first_is_released(tmp_path: Path) -> None:
    work_dir = tmp_path / "data"
    first = WorkDirLock.acquire(work_dir)
    with pytest.raises(WorkDirInUse) as refused:
        WorkDirLock.acquire(work_dir)
    message = str(refused.value)
    assert f"pid {os.getpid()}" in message and "AGENT_WORK_DIR" in message and str(work_dir) in message
    first.release()
    WorkDirLock.acquire(work_dir).release()  # free again: nothing stale is left behind
    assert (work_dir / LOCK_FILE).is_file()


def test_a_work_dir_below_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(WorkDirError) as failed:
        WorkDirLock.acquire(tmp_path / "afile" / "sub")
    assert "AGENT_WORK_DIR" in str(failed.value) and "Not a directory" in str(failed.value)


def test_the_lock_dies_with_its_process(tmp_path: Path) -> None:
    work_dir = tmp_path / "data"
    with subprocess.Popen(  # the with closes its stdout pipe
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from ckagent.node.workdir import WorkDirLock
            WorkDirLock.acquire(Path({str(work_dir)!r}))
            print("held", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
            with pytest.raises(WorkDirInUse, match=f"pid {holder.pid}"):
                WorkDirLock.acquire(work_dir)
        finally:
            holder.kill()
            holder.wait()
    WorkDirLock.acquire(work_dir).release()  # SIGKILL released it


def _cli(config: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    return subprocess.run([sys.executable, "-m", "ckagent", "run", "-c", str(config)], capture_output=True,
                          text=True, timeout=60, env={**clean, **env}, cwd=tmp_path)


@pytest.mark.parametrize(("key", "env_var"), [("work_dir", "AGENT_WORK_DIR"), ("log_file", "AGENT_LOG_FILE")])
def test_unusable_work_dir_or_log_file_exits_2_naming_the_setting(key: str, env_var: str, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    bad = str(tmp_path / "afile" / "sub")
    work_dir = bad if key == "work_dir" else str(tmp_path / "data")
    log_file = bad + "/agent.log" if key == "log_file" else None
    config = tmp_path / "agent.yaml"
    config.write_text(textwrap.dedent(f"""
        server: {{url: "http://127.0.0.1:9"}}
        agent: {{registration_token: "a-long-enough-registration-token", port: 0}}
        task: {{work_dir: {work_dir!r}}}
    """) + (f"logging: {{file: {log_file!r}}}\n" if log_file else ""))
    done = _cli(config, tmp_path)
    assert done.returncode == 2, done.stderr
    assert env_var in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_agent_makes_itself_non_dumpable(tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("prctl is Linux only")
    code = ("import ctypes; from ckagent.node.hardening import protect_agent_memory; "
            "ok = protect_agent_memory(); print(ok, ctypes.CDLL(None).prctl(3, 0, 0, 0, 0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "0"]  # PR_GET_DUMPABLE (3) answers 0 once protected
    assert ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 1  # a plain process is dumpable (the check can fail)


@pytest.mark.slow
async def test_a_second_agent_on_a_busy_work_dir_is_refused_and_the_first_ones_task_survives(
    dev_master: Any, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = AgentProcess(tmp_path / "a", dev_master.base_url, dev_master.registration_token)
    second = AgentProcess(tmp_path / "b", dev_master.base_url, dev_master.registration_token,
                          task__work_dir=str(tmp_path / "a" / "data"), agent__name="second-node")
    await first.start()
    async with first, second:
        sleeper = {"main.py": "import time\ntime.sleep(4)\nprint('done')\n"}
        task_id = await submit(dev_master.admin, "sleeper", sleeper)
        with trio.fail_after(60):
            while (await dev_master.admin.get_task(task_id))["status"] != "RUNNING":  # noqa: ASYNC110 - remote state
                await trio.sleep(0.05)
            await second.start()
            assert await second.wait() == 2
            assert "is in use by another agent" in second.log_text()
            assert f"pid {first.process.pid}" in second.log_text()  # type: ignore[union-attr]
            task = await dev_master.admin.wait_task_final(task_id, 30)
        assert task["status"] == "SUCCESS", task
        assert first.process is not None and first.process.returncode is None
