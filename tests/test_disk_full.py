"""A full disk fails the task that filled it, never the agent (issue: no full disk loses the node).

The agent's work dir is a small tmpfs the test mounts as root (and unmounts in a finally); a spider
writes into ``$CK_TASK_DIR`` until the disk is full, beside a well-behaved task. Checked at the real
dev master: the filler ends FAILED ``DISK_FULL`` with what it wrote so far (every line and item
once, in order), the other task goes on, the agent lives, and new tasks run once space is freed.

- a fast writer (≈100 MB/s) is stopped before the free space crosses the floor: the other task
  loses nothing;
- a burst that fills the disk between two looks (ENOSPC everywhere, the state store's writes fail):
  the agent releases its space reserve, stops the filler, keeps its state store, and ships what
  its tasks wrote; a task submitted while the disk is below the floor waits until space is freed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import agent_settings, items_of, output_lines, running_agent, submit

MIB = 1024 * 1024
DISK_BYTES = 128 * MIB
FLOOR_BYTES = 40 * MIB

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                                reason="mounting a tmpfs for the work dir needs root")


@contextlib.contextmanager
def small_disk(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted at ``path``; unmounted (lazily if busy) on the way out."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", str(path)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


FILLER = r"""
import os, sys, time
import crawlerkeeper_sdk as ck
for i in range(100):
    print(f"filler line {i:04d}", flush=True)
    ck.save_item({"filler": i})
time.sleep(float(sys.argv[1]))  # the other task is under way
size = int(sys.argv[2])
fd = os.open(os.path.join(os.environ["CK_TASK_DIR"], "blob.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
if sys.argv[3] == "burst":  # allocate pieces back to back: the disk is full (0 bytes free) within milliseconds
    offset = 0
    for piece in (8 << 20, 64 << 10, 4096):
        while True:
            try:
                os.posix_fallocate(fd, offset, piece)
                offset += piece
            except OSError:
                break
    chunk, pause = b"x" * 65536, 0.01
else:
    chunk, pause = b"x" * size, float(sys.argv[3])
while True:  # a writer that never gives up, even on ENOSPC
    try:
        os.write(fd, chunk)
    except OSError:
        time.sleep(0.05)
    time.sleep(pause)
"""

STEADY = r"""
import sys, time
import crawlerkeeper_sdk as ck
for i in range(int(sys.argv[1])):
    print(f"steady line {i:04d}", flush=True)
    if i % 3 == 0:
        ck.save_item({"steady": i})
    time.sleep(0.02)
"""


async def _run_filler_and_steady(dev_master: Any, nursery: trio.Nursery, work: Path,
                                 filler_args: list[str]) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    settings = agent_settings(work, dev_master.base_url, dev_master.registration_token,
                              AGENT_TASK_MIN_FREE_DISK_BYTES=str(FLOOR_BYTES), AGENT_MAX_WORKERS="3")
    admin = dev_master.admin
    async with running_agent(nursery, settings):
        steady = await submit(admin, "steady", {"main.py": STEADY}, args=["250"])
        filler = await submit(admin, "filler", {"main.py": FILLER}, args=filler_args)
        filled = await admin.wait_task_final(filler, 90)
        calm = await admin.wait_task_final(steady, 90)
        # The agent lives: with the filler's blob removed (the operator frees space), a new task runs.
        with contextlib.suppress(FileNotFoundError):
            (work / "tasks" / filler / "blob.bin").unlink()
        after = await submit(admin, "after", {"main.py": "print('after the full disk')\n"})
        later = await admin.wait_task_final(after, 90)
        assert later["status"] == "SUCCESS", later
        assert await admin.get_logs(after) == [] or "after the full disk" in await admin.get_logs(after)
    return filled, calm, filler, steady


async def _check_filler(dev_master: Any, work: Path, filled: dict[str, Any], filler: str) -> None:
    assert filled["status"] == "FAILED" and filled["errorCode"] == "DISK_FULL", filled
    assert "disk full" in filled["errorMessage"] and "MiB" in filled["errorMessage"], filled
    logs = await dev_master.admin.get_logs(filler)
    task_dir = work / "tasks" / filler
    assert logs == output_lines(task_dir)  # once, in order: the whole spool
    assert [line for line in logs if line.startswith("filler line")] == [f"filler line {i:04d}" for i in range(100)]
    assert any("task FAILED (DISK_FULL)" in line for line in logs), logs[-5:]
    assert await dev_master.admin.get_items(filler) == items_of(task_dir) == [{"filler": i} for i in range(100)]
    assert filled["logLines"] == len(logs) and filled["itemCount"] == 100


async def test_a_fast_writer_is_stopped_before_the_floor_and_the_other_task_loses_nothing(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    with small_disk(tmp_path / "disk", 2 * DISK_BYTES) as work:
        # 2 MiB every 40 ms: ~50 MB/s, the room above the floor in about four seconds.
        filled, calm, filler, steady = await _run_filler_and_steady(
            dev_master, nursery, work, ["1.0", str(2 * MIB), "0.04"])
        await _check_filler(dev_master, work, filled, filler)
        assert shutil.disk_usage(work).free > 0  # stopped before the disk was full
        assert calm["status"] == "SUCCESS" and calm.get("errorCode") is None, calm  # no LOG_BUDGET cut
        logs = await dev_master.admin.get_logs(steady)
        assert [line for line in logs if line.startswith("steady")] == [f"steady line {i:04d}" for i in range(250)]
        assert await dev_master.admin.get_items(steady) == [{"steady": i} for i in range(0, 250, 3)]


async def test_a_burst_that_fills_the_disk_fails_that_task_and_the_agent_goes_on(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    with small_disk(tmp_path / "disk", DISK_BYTES) as work:
        # The disk filled at once (ENOSPC for everyone), then 64 KiB tries every 10 ms.
        filled, calm, filler, steady = await _run_filler_and_steady(
            dev_master, nursery, work, ["1.0", "0", "burst"])
        await _check_filler(dev_master, work, filled, filler)
        # The other task ran to its end and was reported; whatever its output.log holds arrived once, in
        # order (lines written while the disk was full were dropped, and its log says so).
        # (Its SDK may meet ENOSPC too: whatever it reports, it is not blamed for the filler's disk.)
        assert calm["status"] in ("SUCCESS", "FAILED") and calm.get("errorCode") != "DISK_FULL", calm
        task_dir = work / "tasks" / steady
        logs = await dev_master.admin.get_logs(steady)
        assert logs == output_lines(task_dir)
        numbered = [line for line in logs if line.startswith("steady line")]
        assert numbered == sorted(set(numbered))
        if len(numbered) < 250 and calm["status"] == "SUCCESS":
            assert calm["errorCode"] == "LOG_BUDGET" and any("output truncated" in line for line in logs), calm
        assert await dev_master.admin.get_items(steady) == items_of(task_dir)
