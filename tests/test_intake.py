"""The intake gate: a node that cannot work takes no tasks and says so (disk floor; ckagent.node.intake).

Logic with Trio's autojump clock and a fake free-space reader; then a real in-process agent against the
dev master, whose work dir is "full" because its floor is set above the free space.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import trio
from harness import agent_settings, eventually, running_agent, submit

from ckagent.node.intake import DiskFloorWatch, IntakeGate

MIB = 1024**2


async def test_gate_opens_only_when_every_cause_is_withdrawn(autojump_clock: trio.abc.Clock) -> None:
    gate = IntakeGate()
    await gate.wait_open()  # open: returns at once
    gate.close("disk", "disk full")
    gate.close("version", "too old")
    assert gate.reason == "disk full; too old"
    opened_at: list[float] = []

    async def waiter() -> None:
        await gate.wait_open()
        opened_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(5)
        gate.open("disk")
        await trio.sleep(5)
        assert opened_at == [] and gate.reason == "too old"
        gate.open("version")
    assert opened_at == [10.0] and gate.reason is None


async def test_disk_floor_closes_the_gate_once_and_opens_it_when_space_returns(
    autojump_clock: trio.abc.Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    free = [900 * MIB]
    gate = IntakeGate()

    async def free_bytes(_: Path) -> int:
        return free[0]

    watch = DiskFloorWatch(gate, tmp_path, 512 * MIB, interval=5, free_bytes=free_bytes)
    caplog.set_level("INFO", "ckagent.node.intake")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await trio.sleep(1)
        assert gate.reason is None
        free[0] = 100 * MIB
        await trio.sleep(5)
        assert gate.reason is not None and "100 MiB, below task.min_free_disk_bytes (512 MiB)" in gate.reason
        await trio.sleep(20)  # still full: no new warning
        free[0] = 600 * MIB
        await trio.sleep(5)
        assert gate.reason is None
        nursery.cancel_scope.cancel()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("below task.min_free_disk_bytes" in m for m in messages) == 1
    assert sum("taking tasks again" in m for m in messages) == 1


async def test_an_idle_node_looks_at_its_disk_twice_a_minute_a_busy_one_every_interval(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """Issue 18 (idle cost): with no task running nothing of the agent's fills the disk, so the watch
    looks every idle_interval (30 s) instead of every interval (5 s); a task's start ends the idle wait."""
    looks: list[float] = []
    busy = trio.Event()

    async def free_bytes(_: Path) -> int:
        looks.append(trio.current_time())
        return 900 * MIB

    watch = DiskFloorWatch(IntakeGate(), tmp_path, 512 * MIB, interval=5, free_bytes=free_bytes,
                           idle=(lambda: not busy.is_set(), busy.wait), idle_interval=30)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await trio.sleep(101)
        assert [round(t - start) for t in looks] == [0, 30, 60, 90]  # idle: twice a minute
        busy.set()  # a task starts
        await trio.sleep(11)
        assert [round(t - start) for t in looks[4:]] == [106, 111]  # at the busy pace at once
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_node_below_its_disk_floor_takes_no_task_says_why_and_resumes(dev_master, tmp_path: Path) -> None:
    admin = dev_master.admin
    free = shutil.disk_usage(tmp_path).free
    settings = agent_settings(tmp_path / "work", dev_master.base_url, dev_master.registration_token,
                              AGENT_TASK_MIN_FREE_DISK_BYTES=str(free + 1024**4))  # 1 TiB more than there is
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery, running_agent(nursery, settings) as agent:
            reason = agent.intake.reason
            assert reason is not None and "below task.min_free_disk_bytes" in reason
            task_id = await submit(admin, "waits-for-disk", {"main.py": "print('ran')\n"})
            url = f"http://127.0.0.1:{agent.status_port}/readyz"
            async with httpx.AsyncClient(timeout=5) as client:
                async def paused_at_master() -> bool:
                    return any(n.get("pausedReason") for n in await admin.list_nodes())

                await eventually(paused_at_master)
                ready = await client.get(url)
                assert ready.status_code == 503 and "below task.min_free_disk_bytes" in ready.text
                await trio.sleep(2)  # polls would have claimed it by now
                assert (await admin.get_task(task_id))["status"] == "PENDING"
                agent.disk_watch.floor_bytes = 1  # space "returns"
                await agent.disk_watch.check()
                assert agent.intake.reason is None
                task = await admin.wait_task_final(task_id, 40)
                assert task["status"] == "SUCCESS", task
                async def ready_again() -> bool:
                    return (await client.get(url)).status_code == 200

                async def resumed_at_master() -> bool:  # the next heartbeat no longer carries the reason
                    return not await paused_at_master()

                await eventually(ready_again)
                await eventually(resumed_at_master)


def test_a_busy_cause_closes_the_gate_but_leaves_the_node_ready() -> None:
    """``busy`` (a spent --max-tasks budget): no poll, the heartbeat's reason says so, but not a reason for
    /readyz; another cause still is."""
    gate = IntakeGate()
    gate.close("max-tasks", "max-tasks: 1 of 1 claimed", busy=True)
    assert gate.reason == "max-tasks: 1 of 1 claimed" and gate.refusal == gate.reason
    assert gate.unready_reason is None
    gate.close("disk", "disk low")
    assert gate.unready_reason == "disk low"
    gate.open("disk")
    gate.close("max-tasks", "max-tasks: again")  # closed again without busy: unready
    assert gate.unready_reason == "max-tasks: again"
    gate.open("max-tasks")
    assert gate.reason is None and gate.unready_reason is None
