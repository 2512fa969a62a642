"""A full disk is the writer's problem (issue 36, item 2), on real parts: the agent's work dir is a small
tmpfs the test mounts (root only; skipped with the reason otherwise) and always unmounts, the tasks
run at the real dev master.

- a burst writer takes the whole disk in milliseconds and exits 0 before any look of the disk watch
  (or keeps writing on the full disk), beside a quiet numbered neighbour: the writer is blamed at its
  end (FAILED DISK_FULL, not SUCCESS; or by the watch's next look, and stopped),
  its scratch is removed once its result is recorded, the neighbour loses nothing (every line once,
  in order, every item) and succeeds, and the next task succeeds with no hand on the node; the status
  page's culprit is the writer;
- a steady writer is stopped by the watch while it runs, before the disk is full, its neighbour
  untouched;
- a task over its own disk limit (``resources.diskBytes``) is stopped whatever the free space — on
  any disk, so at every level (plain user included).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import agent_settings, can_mount_tmpfs, items_of, output_lines, running_agent, small_disk, submit

MIB = 1024 * 1024
DISK_BYTES = 96 * MIB
BURST_DISK_BYTES = 300 * MIB  # the row: ~300 MB into a 300 MiB disk in under a second
FLOOR_BYTES = 16 * MIB

BURST = r"""
import os, sys, time
import crawlerkeeper_sdk as ck
print("burst starts", flush=True)
time.sleep(float(sys.argv[1]))  # the neighbour is under way
fd = os.open(os.path.join(os.environ["CK_TASK_DIR"], "blob.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
offset, started = 0, time.monotonic()
for piece in (8 << 20, 64 << 10, 4096):  # every free byte, in milliseconds
    while True:
        try:
            os.posix_fallocate(fd, offset, piece)
            offset += piece
        except OSError:
            break
with open(os.path.join(os.environ["CK_DATA_DIR"], "cache.bin"), "wb") as cache:
    pass
print(f"burst took {offset >> 20} MiB in {time.monotonic() - started:.3f} s", flush=True)
if len(sys.argv) > 2:  # a writer that never gives up, even on ENOSPC
    while True:
        try:
            os.write(fd, b"x" * int(sys.argv[2]))
        except OSError:
            pass
        time.sleep(0.02)
"""

QUIET = r"""
import sys, time
import crawlerkeeper_sdk as ck
for i in range(int(sys.argv[1])):
    print(f"quiet line {i:04d}", flush=True)
    if i % 3 == 0:
        ck.save_item({"quiet": i})
    time.sleep(0.02)
"""

AFTER = "print('after the full disk')\n"
NO_TMPFS = can_mount_tmpfs()
needs_tmpfs = pytest.mark.skipif(NO_TMPFS is not None, reason=f"a small disk of the test's own: {NO_TMPFS}")


async def _final(admin: Any, task_id: str) -> dict[str, Any]:
    return dict(await admin.wait_task_final(task_id, 90))


async def _neighbour_lost_nothing(dev_master: Any, work: Path, task_id: str, count: int) -> None:
    admin = dev_master.admin
    calm = await _final(admin, task_id)
    assert calm["status"] == "SUCCESS" and calm.get("errorCode") is None, calm  # no truncation, no blame
    logs = await admin.get_logs(task_id)
    assert logs == output_lines(work / "tasks" / task_id)  # what the node holds, once, in order
    assert [line for line in logs if line.startswith("quiet")] == [f"quiet line {i:04d}" for i in range(count)]
    assert await admin.get_items(task_id) == [{"quiet": i} for i in range(0, count, 3)]
    for name in ("output.log", "items.jsonl"):  # the blocks held beyond their ends are given back
        st = (work / "tasks" / task_id / name).stat()
        assert st.st_blocks * 512 - st.st_size < 64 * 1024, (name, st)


async def _next_task_succeeds(dev_master: Any) -> None:
    after = await submit(dev_master.admin, "after", {"main.py": AFTER})
    later = await _final(dev_master.admin, after)
    assert later["status"] == "SUCCESS", later
    assert "after the full disk" in await dev_master.admin.get_logs(after)


@needs_tmpfs
@pytest.mark.parametrize("stays", [False, True], ids=["exits-at-once", "keeps-writing"])
async def test_a_burst_is_blamed_and_its_neighbour_loses_nothing(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture, stays: bool
) -> None:
    """The burst exits 0 before any look (judged at its end), or keeps trying to write on the full disk
    (blamed by the watch's next look and stopped)."""
    caplog.set_level(logging.WARNING, logger="ckagent")
    with trio.fail_after(150), small_disk(tmp_path / "disk", BURST_DISK_BYTES) as work:
        settings = agent_settings(work, dev_master.base_url, dev_master.registration_token,
                                  AGENT_TASK_MIN_FREE_DISK_BYTES=str(FLOOR_BYTES), AGENT_MAX_WORKERS="3")
        admin = dev_master.admin
        async with running_agent(nursery, settings) as agent:
            quiet = await submit(admin, "quiet", {"main.py": QUIET}, args=["250"])
            burst = await submit(admin, "burst", {"main.py": BURST}, args=["2.0", "65536"] if stays else ["2.0"])
            filled = await _final(admin, burst)
            assert filled["status"] == "FAILED" and filled["errorCode"] == "DISK_FULL", filled
            assert "disk full" in filled["errorMessage"], filled
            assert ("when it ended" in filled["errorMessage"]) is not stays, filled
            logs = await admin.get_logs(burst)
            took = [line for line in logs if line.startswith("burst took")]
            assert len(took) == 1 and float(took[0].split(" in ")[1].split()[0]) < 1.0, logs  # under a second
            assert any("task FAILED (DISK_FULL)" in line for line in logs), logs[-5:]
            await _neighbour_lost_nothing(dev_master, work, quiet, 250)
            await _next_task_succeeds(dev_master)  # no hand on the node
            # Its scratch went once its result was recorded (with a line saying so); its spool stays.
            task_dir = work / "tasks" / burst
            assert not (task_dir / "blob.bin").exists() and (task_dir / "output.log").exists()
            assert output_lines(task_dir) == logs and items_of(task_dir) == []
            assert any("removed its scratch" in r.getMessage() and burst in r.getMessage() for r in caplog.records)
            culprit = agent.outbox.disk.last_culprit  # what the status page shows
            assert culprit is not None and culprit.task_id == burst and culprit.used_bytes > 250 * MIB
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}", timeout=10) as http:
                shown = (await http.get("/status")).json()["diskCulprit"]
            assert shown["taskId"] == burst and shown["usedBytes"] == culprit.used_bytes, shown
            assert shutil.disk_usage(work).free > FLOOR_BYTES


@needs_tmpfs
async def test_a_steady_writer_is_stopped_while_it_runs_and_its_neighbour_goes_on(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    with trio.fail_after(150), small_disk(tmp_path / "disk", DISK_BYTES) as work:
        settings = agent_settings(work, dev_master.base_url, dev_master.registration_token,
                                  AGENT_TASK_MIN_FREE_DISK_BYTES=str(FLOOR_BYTES), AGENT_MAX_WORKERS="3")
        admin = dev_master.admin
        async with running_agent(nursery, settings):
            quiet = await submit(admin, "quiet", {"main.py": QUIET}, args=["200"])
            steady = await submit(admin, "steady", {"main.py": STEADY}, args=["1.0", str(MIB), "0.02"])
            filled = await _final(admin, steady)
            assert filled["status"] == "FAILED" and filled["errorCode"] == "DISK_FULL", filled
            assert "disk full" in filled["errorMessage"] and "when it ended" not in filled["errorMessage"], filled
            await _neighbour_lost_nothing(dev_master, work, quiet, 200)
            await _next_task_succeeds(dev_master)
            assert not (work / "tasks" / steady / "blob.bin").exists()


STEADY = r"""
import os, sys, time
print("steady starts", flush=True)
time.sleep(float(sys.argv[1]))
fd = os.open(os.path.join(os.environ["CK_TASK_DIR"], "blob.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
chunk = b"x" * int(sys.argv[2])
while True:  # ~50 MB/s, never giving up
    try:
        os.write(fd, chunk)
    except OSError:
        time.sleep(0.05)
    time.sleep(float(sys.argv[3]))
"""

CAPPED = r"""
import os, sys, time
print("capped starts", flush=True)
with open(os.path.join(os.environ["CK_DATA_DIR"], "cache.bin"), "wb") as cache:
    for _ in range(int(sys.argv[1])):
        cache.write(b"c" * (1 << 20))
        cache.flush()
        time.sleep(0.05)
time.sleep(60)
"""


async def test_a_task_over_its_own_disk_limit_is_stopped_on_any_disk(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    with trio.fail_after(120):
        work = tmp_path / "work"
        settings = agent_settings(work, dev_master.base_url, dev_master.registration_token,
                                  AGENT_TASK_MIN_FREE_DISK_BYTES="0")
        admin = dev_master.admin
        async with running_agent(nursery, settings) as agent:
            capped = await submit(admin, "capped", {"main.py": CAPPED}, args=["24"],
                                  resources={"diskBytes": 8 * MIB})
            ended = await _final(admin, capped)
            assert ended["status"] == "FAILED" and ended["errorCode"] == "DISK_FULL", ended
            assert "over its disk limit of 8.0 MiB" in ended["errorMessage"], ended
            data = work / "spider-data"
            assert not any(path.name == "cache.bin" for path in data.rglob("*"))  # its scratch removed
            assert agent.outbox.disk.last_culprit is not None
            assert agent.outbox.disk.last_culprit.task_id == capped
            await _next_task_succeeds(dev_master)
