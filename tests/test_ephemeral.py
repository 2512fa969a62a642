"""Ephemeral and polite workers (issue 39): ``ckagent run --max-tasks N --exit-when-idle SECONDS`` as real
agent processes against the real reference master on 127.0.0.1 — one task claimed of three, a kill -9 and a
restart that does not reset the count, an idle agent that leaves, a long task that keeps it, a master down
at the end (exit 3, then delivered by the next start), bad values. The rules on the autojump clock:
tests/test_ephemeral_watch.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import trio
from harness import (
    agent_process,
    agent_settings,
    eventually,
    running_agent,
    submit,
    wait_exit,
    wait_for_log,
    wait_registered,
)

from ckagent.agent import Agent
from ckagent.node.ephemeral import EXIT_UNDELIVERED
from ckagent.node.taskbudget import BUDGET_FILE
from ckagent.port.status import AgentStatus

pytestmark = pytest.mark.slow

QUICK = {"main.py": "print('hello from an ephemeral task', flush=True)\n"}
LONG = {"main.py": textwrap.dedent("""
    import os, time
    print("started", flush=True)
    time.sleep(float(os.environ.get("WORK_SECONDS", "5")))
    print("done", flush=True)
""")}
SLACK = 6.0
"""Seconds on top of a bound: interpreter start and exit, the last heartbeat, the leaving call, a loaded machine."""


async def _statuses(admin, task_ids: list[str]) -> list[str]:  # type: ignore[no-untyped-def]
    return [(await admin.get_task(task_id))["status"] for task_id in task_ids]


async def _left(admin, name: str = "proc-node") -> bool:  # type: ignore[no-untyped-def]
    return any(n["name"] == name and n.get("leftAt") for n in await admin.list_nodes())


async def test_max_tasks_1_claims_one_of_three_delivers_it_and_exits_0(dev_master, tmp_path: Path) -> None:
    """Three tasks wait (three spiders, two slots): `--max-tasks 1` claims exactly one, delivers it, leaves
    the master (its name free) and exits 0; the other two stay PENDING for other nodes, none was given back."""
    admin = dev_master.admin
    tasks = [await submit(admin, f"spider-{i}", QUICK) for i in range(3)]
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token)
    await agent.start(args=["--max-tasks", "1"])
    async with agent:
        assert await wait_exit(agent, 60) == 0, agent.log_text()[-3000:]
    statuses = await _statuses(admin, tasks)
    assert sorted(statuses) == ["PENDING", "PENDING", "SUCCESS"], statuses
    done = tasks[statuses.index("SUCCESS")]
    assert "hello from an ephemeral task" in "\n".join(await admin.get_logs(done))
    log = agent.log_text()
    assert "max-tasks: 1 of 1 done: stopping (a drain), then leaving the master" in log, log[-3000:]
    assert "given back" not in log, log[-3000:]
    assert await _left(admin)
    assert not (agent.directory / "data" / BUDGET_FILE).exists()  # the life ended: the next start counts from 0


async def test_a_spent_budget_pauses_intake_but_the_busy_node_stays_ready(dev_master, tmp_path: Path) -> None:
    """`--max-tasks 1` with its task running: the intake is closed (the master sees `pausedReason`, a second
    task stays PENDING) but /readyz answers 200 — KEDA's ScaledJob (accurate, pendingPodConditions Ready)
    counts a Job whose pod is not Ready as one still waiting for a task, so a not-ready busy one-task pod
    would hold back a new Job per task queued (a new user found it)."""
    admin = dev_master.admin
    settings = agent_settings(tmp_path / "node", dev_master.base_url, dev_master.registration_token,
                              AGENT_MAX_TASKS="1")
    first = await submit(admin, "busy", LONG, env={"WORK_SECONDS": "30"})
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery, running_agent(nursery, settings) as agent:
            await wait_for_log(admin, first, "started", timeout=60)
            second = await submit(admin, "queued", QUICK)

            async def paused_at_master() -> bool:
                return any("max-tasks" in (n.get("pausedReason") or "") for n in await admin.list_nodes())

            await eventually(paused_at_master, timeout=30)
            async with httpx.AsyncClient(timeout=5) as client:
                ready = await client.get(f"http://127.0.0.1:{agent.status_port}/readyz")
            assert ready.status_code == 200 and ready.text == "ready\n", ready.text
            assert agent.intake.reason is not None and "max-tasks: 1 of 1" in agent.intake.reason
            assert (await admin.get_task(second))["status"] == "PENDING"
            await admin.cancel_task(first)  # (then the agent's exit terminates what is left)


async def test_a_restart_after_kill_9_does_not_reset_max_tasks(dev_master, tmp_path: Path) -> None:
    """`agent.max_tasks: 2`: the first task runs, the agent is killed (-9) while it runs and started again on
    the same work dir (as the pod's supervisor does): it re-adopts that task (already counted), claims only
    one more of the two then waiting, and exits 0 once both are delivered."""
    admin = dev_master.admin
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token, agent__max_tasks=2)
    first = await submit(admin, "first", LONG, env={"WORK_SECONDS": "4"})
    await agent.start()
    async with agent:
        await wait_for_log(admin, first, "started", timeout=60)
        await agent.kill()
        budget = agent.directory / "data" / BUDGET_FILE
        assert budget.exists() and first in budget.read_text()
        await trio.sleep(2.5)  # the dead agent's held poll (long_poll_wait 2 s) has ended at the master
        await agent.start()
        await wait_registered(admin, agent)
        later = [await submit(admin, f"later-{i}", QUICK) for i in range(2)]
        assert await wait_exit(agent, 90) == 0, agent.log_text()[-3000:]
    assert (await admin.get_task(first))["status"] == "SUCCESS"
    statuses = await _statuses(admin, later)
    assert sorted(statuses) == ["PENDING", "SUCCESS"], statuses
    log = agent.log_text()
    assert "max-tasks: 1 of 2 task(s) claimed before this start" in log, log[-3000:]
    assert "re-adopted 1 task(s)" in log and "max-tasks: 2 of 2 done" in log, log[-3000:]


async def test_exit_when_idle_with_no_task_exits_0_within_the_idle_seconds(dev_master, tmp_path: Path) -> None:
    """No task: `--exit-when-idle 2` stops 2 s after its start (no flush to wait for), leaves and exits 0."""
    admin = dev_master.admin
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token)
    await agent.start(args=["--exit-when-idle", "2"])
    async with agent:
        await wait_registered(admin, agent)
        registered = time.monotonic()
        assert await wait_exit(agent, 2 + SLACK) == 0, agent.log_text()[-3000:]
        seconds = time.monotonic() - registered
    assert seconds < 2 + 3, seconds  # (the timer starts at the registration; the stop: a last beat, the leaving)
    assert "exit-when-idle: idle 2 s: stopping (a drain)" in agent.log_text()
    assert await _left(admin)


async def test_exit_when_idle_waits_for_a_long_task_and_its_delivery(dev_master, tmp_path: Path) -> None:
    """A 6 s task and `agent.exit_when_idle: 2`: the agent is busy while it runs and while its results are
    delivered; it exits 0 only after the master holds the result, and not before 2 s of idleness."""
    admin = dev_master.admin
    agent = agent_process(tmp_path, dev_master.base_url, dev_master.registration_token, agent__exit_when_idle=2)
    task = await submit(admin, "long", LONG, env={"WORK_SECONDS": "6"})
    await agent.start()
    async with agent:
        assert await wait_exit(agent, 60) == 0, agent.log_text()[-3000:]
        exited = time.time()
    final = await admin.get_task(task)
    assert final["status"] == "SUCCESS", final
    assert "done" in "\n".join(await admin.get_logs(task))
    finished = datetime.fromisoformat(final["finishedAt"].replace("Z", "+00:00")).timestamp()
    assert exited - finished >= 2 - 0.5, (exited, finished)  # idle counted from the delivery on


async def test_a_master_down_at_the_end_exits_3_and_the_next_start_delivers(dev_master_process, tmp_path: Path) -> None:
    """`--max-tasks 1`, the master dies while the task runs: the agent stops after its bounded flush with
    the result undelivered and exits 3 (a pod's disk goes with it: the Job must not look done). Started
    again on the same work dir with the master back, it delivers the result and exits 0, claiming nothing."""
    master = dev_master_process
    url = await master.start()
    agent = agent_process(tmp_path, url, master.registration_token, task__flush_timeout=2)
    async with master.admin() as admin, agent:
        task = await submit(admin, "long", LONG, env={"WORK_SECONDS": "3"})
        await agent.start(args=["--max-tasks", "1"])
        await wait_for_log(admin, task, "started", timeout=60)
        other = await submit(admin, "other", QUICK)  # the budget is spent: never claimed
        await master.kill()
        code = await wait_exit(agent, 3 + 2 + 2 + 2 + SLACK)  # the task, the flush, the last beat, the leaving
        assert code == EXIT_UNDELIVERED, agent.log_text()[-3000:]
        assert (agent.directory / "data" / BUDGET_FILE).exists()  # the life goes on at the next start
    await master.start(same_port=True)
    async with master.admin() as admin, agent:
        await agent.start(args=["--max-tasks", "1"])
        assert await wait_exit(agent, 60) == 0, agent.log_text()[-3000:]
        assert (await admin.get_task(task))["status"] == "SUCCESS"
        assert "done" in "\n".join(await admin.get_logs(task))
        assert (await admin.get_task(other))["status"] == "PENDING"
    log = agent.log_text()
    assert "stopping with undelivered results" in log, log[-3000:]
    assert log.count("max-tasks: 1 of 1 done") == 2, log[-3000:]
    assert not (agent.directory / "data" / BUDGET_FILE).exists()


async def test_the_stop_reason_is_in_status(dev_master, tmp_path: Path) -> None:
    """An in-process agent with `AGENT_EXIT_WHEN_IDLE=1`: run() returns 0 by itself; /status says why."""
    settings = agent_settings(tmp_path / "node", dev_master.base_url, dev_master.registration_token,
                              AGENT_EXIT_WHEN_IDLE="1", AGENT_MAX_TASKS="3")
    agent = Agent(settings)
    with trio.fail_after(30):
        assert await agent.run() == 0
    status = await AgentStatus(agent.statistics, agent.metrics, agent.metrics.outbox).status()
    assert status["ephemeral"] == {"exitWhenIdleSeconds": 1.0, "maxTasks": 3, "tasksClaimed": 0,
                                   "stopReason": "exit-when-idle: idle 1 s"}
    assert status["state"] == "STOPPED"


async def test_tasks_arriving_as_the_idle_timer_fires_are_run_or_left_pending(dev_master, tmp_path: Path) -> None:
    """Rounds of an in-process agent with `AGENT_EXIT_WHEN_IDLE=1` and a task submitted around the moment its
    timer fires (0.7-1.3 s after its start, real time): every agent exits 0, and every task is either run to
    SUCCESS (claimed as the timer fired: the agent went on, then stopped idle) or PENDING with no node — never
    lost RUNNING for an agent that left, never run twice."""
    admin = dev_master.admin
    outcomes: list[str] = []
    for round_ in range(6):
        settings = agent_settings(tmp_path / f"node-{round_}" / "data", dev_master.base_url,
                                  dev_master.registration_token, AGENT_EXIT_WHEN_IDLE="1",
                                  AGENT_NAME=f"race-{round_}")
        agent = Agent(settings)
        codes: list[int] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                async def run(agent: Agent = agent, codes: list[int] = codes) -> None:
                    codes.append(await agent.run())

                nursery.start_soon(run)
                await agent.started.wait()
                await trio.sleep(0.7 + 0.12 * round_)
                task = await submit(admin, f"race-{round_}", QUICK)
        assert codes == [0]
        final = await admin.get_task(task)
        if final["status"] == "PENDING":
            assert final.get("nodeId") is None, final
            await admin.cancel_task(task)  # (the next round's agent must not take it)
        else:
            assert (final["status"], final["attempt"]) == ("SUCCESS", 1), final
        outcomes.append(final["status"])
    assert set(outcomes) <= {"SUCCESS", "PENDING"}, outcomes


@pytest.mark.parametrize(("argv", "said"), [
    (["--max-tasks", "0"], "--max-tasks '0': expected an integer >= 1"),
    (["--max-tasks", "-1"], "--max-tasks '-1': expected an integer >= 1"),
    (["--max-tasks", "two"], "--max-tasks 'two': expected an integer >= 1"),
    (["--max-tasks", "1.5"], "--max-tasks '1.5': expected an integer >= 1"),
    (["--exit-when-idle", "0"], "--exit-when-idle '0': expected a number of seconds > 0"),
    (["--exit-when-idle", "-5"], "--exit-when-idle '-5': expected a number of seconds > 0"),
    (["--exit-when-idle", "soon"], "--exit-when-idle 'soon': expected a number of seconds > 0"),
])
def test_bad_flag_values_are_a_usage_error(argv: list[str], said: str) -> None:
    """Each bad value: exit 2 and one line saying which flag, what it got and what it takes (no traceback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    done = subprocess.run([sys.executable, "-m", "ckagent", "run", *argv], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert done.returncode == 2, done
    assert done.stderr.strip().startswith(f"ckagent: run: {said}"), done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize(("name", "value"), [("AGENT_MAX_TASKS", "-1"), ("AGENT_MAX_TASKS", "x"),
                                             ("AGENT_EXIT_WHEN_IDLE", "-1")])
def test_bad_setting_values_are_a_config_error(name: str, value: str) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AGENT_")},
           "AGENT_REGISTRATION_TOKEN": "t" * 20, name: value}
    done = subprocess.run([sys.executable, "-m", "ckagent", "config", "check"], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert done.returncode == 2, done
    assert name in done.stderr + done.stdout, done
