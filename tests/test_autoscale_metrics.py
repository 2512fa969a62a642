"""The agent's autoscaler signals: ``ckagent_slots_capacity``, ``ckagent_slots_busy``, ``ckagent_idle_seconds``
on /metrics and ``slotsCapacity``/``slotsBusy``/``idleSeconds`` in /status, with a real agent against the
real dev master.

- a task claimed and running holds a slot and stops the idle clock; once it ended and was delivered the
  clock starts again from that end (not from the agent's start);
- a task that ended but whose result the master has not acknowledged holds no slot (the node claims
  another in it) and the idle clock does not tick;
- a task re-adopted after ``kill -9`` of the agent holds a slot from the new agent's first answer.
"""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
from harness import (
    GO_SPIDER,
    Samples,
    agent_process,
    agent_settings,
    eventually,
    free_port,
    running_agent,
    sample_value,
    scrape_samples,
    serve_result_gate,
    submit,
    wait_exit,
    wait_for_log,
    wait_registered,
)

from ckagent.agent import Agent


@asynccontextmanager
async def port_client(port: int) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        yield client


async def figures(client: httpx.AsyncClient) -> tuple[Samples, dict[str, Any]]:
    """A scrape and a /status, one after the other."""
    samples = await scrape_samples(client)
    return samples, (await client.get("/status")).json()


def slots(samples: Samples) -> tuple[float, float, float]:
    return (sample_value(samples, "ckagent_slots_capacity"), sample_value(samples, "ckagent_slots_busy"),
            sample_value(samples, "ckagent_idle_seconds"))


def task_dir(agent: Agent, task_id: str) -> Path:
    return agent.settings.task.work_dir / "tasks" / task_id


async def test_a_running_task_holds_a_slot_and_stops_the_idle_clock(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    with trio.fail_after(180):
        async with running_agent(nursery, settings) as agent:
            assert agent.status_port
            async with port_client(agent.status_port) as client:
                samples, status = await figures(client)
                total, busy, idle = slots(samples)
                assert (total, busy) == (2, 0) and idle > 0  # never busy: since the start
                assert (status["slotsCapacity"], status["slotsBusy"]) == (2, 0) and status["idleSeconds"] >= idle

                ids = [await submit(dev_master.admin, name, {"main.py": GO_SPIDER}) for name in ("a", "b")]

                async def both_busy() -> tuple[Samples, dict[str, Any]] | None:
                    got = await figures(client)
                    return got if slots(got[0])[1] == 2 and got[1]["slotsBusy"] == 2 else None

                samples, status = await eventually(both_busy, 60, "two busy slots")
                assert slots(samples) == (2, 2, 0) and status["idleSeconds"] == 0
                assert sample_value(samples, "ckagent_free_slots") == 0

                (task_dir(agent, ids[0]) / "go").touch()
                await dev_master.admin.wait_task_final(ids[0], 30)

                async def one_busy() -> Samples | None:
                    got = await scrape_samples(client)
                    return got if slots(got)[1] == 1 else None

                samples = await eventually(one_busy, 15, "one busy slot")
                assert slots(samples) == (2, 1, 0)  # one slot busy: not idle

                (task_dir(agent, ids[1]) / "go").touch()
                ended = time.monotonic()
                await dev_master.admin.wait_task_final(ids[1], 30)

                async def idle_again() -> Samples | None:
                    got = await scrape_samples(client)
                    return got if slots(got)[1] == 0 and slots(got)[2] > 0 else None

                samples = await eventually(idle_again, 15, "idle again")
                _, _, idle = slots(samples)
                assert idle <= time.monotonic() - ended  # from the last end, not from the start
                await trio.sleep(0.3)
                later = slots(await scrape_samples(client))[2]
                assert later >= idle + 0.25  # and it ticks
                status = (await client.get("/status")).json()
                assert status["slotsBusy"] == 0 and status["idleSeconds"] >= later


async def test_a_task_whose_result_is_not_acknowledged_holds_no_slot_and_the_node_is_not_idle(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    async with serve_result_gate(tmp_path) as master:
        settings = agent_settings(tmp_path / "agent", master.base_url, master.registration_token)
        with trio.fail_after(180):
            async with running_agent(nursery, settings) as agent:
                assert agent.status_port
                async with port_client(agent.status_port) as client:
                    task_id = await submit(master.admin, "held", {"main.py": GO_SPIDER})
                    await wait_for_log(master.admin, task_id, "ready", 60)
                    (task_dir(agent, task_id) / "go").touch()

                    async def delivering() -> tuple[Samples, dict[str, Any]] | None:
                        got = await figures(client)
                        return got if master.gate.held and slots(got[0])[1] == 0 else None

                    samples, status = await eventually(delivering, 60, "the task ended, its result held")
                    assert slots(samples) == (2, 0, 0) and sample_value(samples, "ckagent_free_slots") == 2
                    assert sample_value(samples, "ckagent_outbox_results") == 1
                    assert (status["slotsBusy"], status["idleSeconds"], status["freeSlots"]) == (0, 0, 2)
                    await trio.sleep(0.5)
                    assert slots(await scrape_samples(client))[2] == 0  # the clock does not tick meanwhile

                    master.gate.open.set()
                    opened = time.monotonic()
                    final = await master.admin.wait_task_final(task_id, 30)
                    assert final["status"] == "SUCCESS", final

                    async def idle() -> Samples | None:
                        got = await scrape_samples(client)
                        return got if slots(got)[2] > 0 else None

                    samples = await eventually(idle, 15, "idle once delivered")
                    assert 0 < slots(samples)[2] <= time.monotonic() - opened


async def test_a_re_adopted_task_holds_a_slot(dev_master: Any, tmp_path: Path) -> None:
    port = free_port()
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token, agent__port=port)
    await agent.start()
    with trio.fail_after(180):
        async with agent, port_client(port) as client:
            await wait_registered(dev_master.admin, agent)
            task_id = await submit(dev_master.admin, "adopted", {"main.py": GO_SPIDER})
            await wait_for_log(dev_master.admin, task_id, "ready", 60)
            await agent.kill()
            await agent.start()

            async def answering() -> tuple[Samples, dict[str, Any]] | None:
                try:
                    got = await figures(client)
                except httpx.TransportError:
                    return None
                return got if got[1]["tasksAtStart"]["readopted"]["count"] == 1 else None

            samples, status = await eventually(answering, 60, "the new agent's port, the task re-adopted")
            assert slots(samples) == (2, 1, 0)
            assert (status["slotsBusy"], status["idleSeconds"]) == (1, 0)
            assert [t["id"] for t in status["runningTasks"]] == [task_id]

            (tmp_path / "node" / "data" / "tasks" / task_id / "go").touch()
            assert (await dev_master.admin.wait_task_final(task_id, 30))["status"] == "SUCCESS"

            async def idle() -> Samples | None:
                got = await scrape_samples(client)
                return got if slots(got)[1] == 0 and slots(got)[2] > 0 else None

            await eventually(idle, 15, "idle once the adopted task ended")
            agent.signal(signal.SIGTERM)
            assert await wait_exit(agent, 30) == 0
