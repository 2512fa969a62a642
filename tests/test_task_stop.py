"""How a task is stopped (ckagent.task.stop): the one request, what each reason becomes, the runner's watchdog.

The logic under Trio's autojump clock: the first reason wins, each StopReason's status/errorCode/
message, how an ended spider is judged against the stop, the deadline and stall limit of the
watchdog. Then real spiders behind their monitor, supervised by the runner: a task that runs past
its deadline, one that stays silent, one the master cancels — each ends with its outcome through
its TaskStop, and nothing of it is left running. Last, a real installer that traps SIGTERM is
stopped the same way, with the node's kill_grace.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from ckagent.code.builder import Builder
from ckagent.code.installer import Installers
from ckagent.containment.monitor import spawn_monitored
from ckagent.containment.process import MARKER_VAR
from ckagent.containment.process_group import ProcessGroupJail, find_marked
from ckagent.containment.stopping import ProcessOutcome
from ckagent.containment.tails import TailBuffer
from ckagent.delivery.activity import Activity
from ckagent.delivery.capture import LogSink
from ckagent.master.protocol import OUTCOME_STATUS, TIMEOUT_MESSAGE, Task
from ckagent.node.errors import DepsError
from ckagent.task.admission import Admission
from ckagent.task.outcome import TaskOutcome, judge_exit
from ckagent.task.runconfig import RunnerConfig
from ckagent.task.runner import TaskRunner
from ckagent.task.stop import StopReason, TaskStop, Watchdog, stopped_outcome


def _task(task_id: str = "t1") -> Task:
    return Task.from_json({"id": task_id, "spiderId": "s1", "framework": "python"})


# ------------------------------------------------------------------------------ the one request


async def test_the_first_reason_wins_and_a_later_one_is_ignored_with_a_debug_line(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    stop = TaskStop("t1")
    assert not stop.is_set() and stop.reason is None and stop.describe() == "not stopped"
    caplog.set_level(logging.DEBUG, logger="ckagent.task.stop")
    assert stop.request(StopReason.STALLED, "stalled: no output, items or stats for 61 s (stall timeout 60 s)")
    assert not stop.request(StopReason.CANCELLED)
    assert not stop.request(StopReason.TERMINATING)
    assert stop.reason is StopReason.STALLED
    assert stop.describe().startswith("stalled: no output")
    assert [r.getMessage() for r in caplog.records] == [
        "task t1: already stopping (STALLED); CANCELLED ignored", "task t1: already stopping (STALLED); TERMINATING ignored"]
    with trio.fail_after(1):
        await stop.wait()  # at once: it was requested


async def test_a_request_interrupts_the_preparation_at_once(autojump_clock: trio.testing.MockClock) -> None:
    stop = TaskStop("t1")
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _request_later(stop, 30))
        with stop.prepare_scope:
            await trio.sleep_forever()  # waiting for a slot, deploying, installing
    assert stop.prepare_scope.cancelled_caught
    assert trio.current_time() - started == 30
    assert stop.reason is StopReason.CANCELLED


async def _request_later(stop: TaskStop, seconds: float) -> None:
    await trio.sleep(seconds)
    stop.request(StopReason.CANCELLED)


@pytest.mark.parametrize(("reason", "detail", "expected"), [
    (StopReason.CANCELLED, None, ("CANCELLED", "CANCELLED", "cancelled by the master")),
    (StopReason.TERMINATING, None, ("CANCELLED", "CANCELLED", "agent terminating")),
    (StopReason.TIMEOUT, "timed out after 2 s", ("FAILED", "TIMEOUT", TIMEOUT_MESSAGE)),
    (StopReason.STALLED, "stalled: no output for 61 s", ("FAILED", "STALLED", "stalled: no output for 61 s")),
    (StopReason.DISK_FULL, "it wrote 1 GiB/s", ("FAILED", "DISK_FULL", "it wrote 1 GiB/s")),
    (StopReason.EGRESS_LOST, "egress: cannot apply", ("CANCELLED", "CANCELLED", "egress: cannot apply")),
])
def test_each_reason_becomes_its_status_error_code_and_message(
    reason: StopReason, detail: str | None, expected: tuple[str, str, str]
) -> None:
    stop = TaskStop("t1")
    stop.request(reason, detail)
    assert stopped_outcome(stop) == expected
    assert (reason.status, reason.error_code) == expected[:2]


def test_every_reason_has_an_outcome_of_the_protocol() -> None:
    for reason in StopReason:
        assert (reason.status, reason.error_code) in {
            ("CANCELLED", "CANCELLED"), ("FAILED", "TIMEOUT"), ("FAILED", "STALLED"), ("FAILED", "DISK_FULL"),
            ("FAILED", "MIGRATED"), ("FAILED", "MEMORY_LIMIT")}
        assert OUTCOME_STATUS[reason.error_code] == reason.status  # (the protocol's outcome table)


# ------------------------------------------------------------------------------ judging an ended spider


def _judge(stop_with: tuple[StopReason, str | None] | None, outcome: ProcessOutcome) -> tuple[TaskOutcome, list[str]]:
    admission = Admission(1)
    rt = admission.admit(_task())
    if stop_with is not None:
        admission.cancel("t1", *stop_with)
    notices: list[str] = []
    sink: Any = SimpleNamespace(truncated=None)  # read only for a clean exit 0
    return judge_exit(rt, outcome, notices.append, TailBuffer(100), sink, ()), notices


@pytest.mark.parametrize(("reason", "detail", "status", "code", "line"), [
    (StopReason.TIMEOUT, "timed out after 2 s", "FAILED", "TIMEOUT", "timed out after 2 s"),
    (StopReason.STALLED, "stalled: quiet", "FAILED", "STALLED", "stalled: quiet"),
    (StopReason.CANCELLED, None, "CANCELLED", "CANCELLED", "stopped (cancelled by the master)"),
    (StopReason.TERMINATING, None, "CANCELLED", "CANCELLED", "stopped (agent terminating)"),
    (StopReason.DISK_FULL, "fills the disk", "FAILED", "DISK_FULL", "fills the disk"),
])
def test_a_spider_the_agent_stopped_is_judged_by_its_stop_reason(
    reason: StopReason, detail: str | None, status: str, code: str, line: str
) -> None:
    judged, notices = _judge((reason, detail), ProcessOutcome(returncode=-15, stopped=True, term_sent_at=time.time()))
    assert (judged.status, judged.error_code, judged.exit_code) == (status, code, -15)
    [notice] = notices
    assert notice.startswith(line) and notice.endswith(f"task {status}" + (f" ({code})" if status == "FAILED" else ""))


def test_a_spider_that_ended_before_the_stop_reached_it_is_judged_by_its_exit() -> None:
    judged, _ = _judge((StopReason.CANCELLED, None), ProcessOutcome(returncode=0))
    assert (judged.status, judged.error_code) == ("SUCCESS", None)
    judged, _ = _judge((StopReason.STALLED, "quiet"), ProcessOutcome(returncode=3))
    assert (judged.status, judged.error_code) == ("FAILED", "EXIT_NONZERO")
    # A task filling the disk may die of it before the stop reaches it: DISK_FULL all the same.
    judged, _ = _judge((StopReason.DISK_FULL, "fills the disk"), ProcessOutcome(returncode=1))
    assert (judged.status, judged.error_code, judged.error_message) == ("FAILED", "DISK_FULL", "fills the disk")
    judged, _ = _judge(None, ProcessOutcome(returncode=-9))
    assert (judged.status, judged.error_code) == ("FAILED", "SIGNALED")


# ------------------------------------------------------------------------------ the watchdog


async def test_the_deadline_stops_the_task_as_timeout_when_it_comes(autojump_clock: trio.testing.MockClock) -> None:
    stop = TaskStop("t1")
    started = trio.current_time()
    dog = Watchdog(stop, deadline_at=time.time() + 90, timeout_seconds=90, stall_timeout=0, last_activity=None)
    await dog.wait()
    assert trio.current_time() - started == pytest.approx(90, abs=0.01)
    assert (stop.reason, stop.describe()) == (StopReason.TIMEOUT, "timed out after 90 s")


async def test_a_deadline_that_passed_while_no_agent_ran_stops_at_once(autojump_clock: trio.testing.MockClock) -> None:
    stop = TaskStop("t1")
    started = trio.current_time()
    await Watchdog(stop, deadline_at=time.time() - 5, timeout_seconds=60, stall_timeout=0, last_activity=None).wait()
    assert trio.current_time() == started and stop.reason is StopReason.TIMEOUT


async def test_the_stall_limit_fires_only_after_a_full_quiet_timeout(autojump_clock: trio.testing.MockClock) -> None:
    stop = TaskStop("t1")
    last = [trio.current_time()]
    start = trio.current_time()

    async def spider_activity() -> None:
        for _ in range(5):  # a sign of life every 50 s for 250 s, then silence
            await trio.sleep(50)
            last[0] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(spider_activity)
        await Watchdog(stop, deadline_at=None, timeout_seconds=0, stall_timeout=120,
                       last_activity=lambda: last[0]).wait()
    assert trio.current_time() - start == 250 + 120
    assert stop.reason is StopReason.STALLED
    assert stop.describe() == "stalled: no output, items or stats for 120 s (stall timeout 120 s)"


async def test_a_wait_in_the_stops_scope_ends_by_the_request_or_the_limit(autojump_clock: trio.testing.MockClock) -> None:
    # What a process supervisor waits in, in its own task (ckagent.containment.stopping.ScopedStop).
    stop = TaskStop("t1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_request_later, stop, 30)
        with stop.cancelling() as scope:
            await trio.sleep_forever()
    assert scope.cancelled_caught and trio.current_time() == 30 and stop.reason is StopReason.CANCELLED
    with stop.cancelling() as again:  # requested already: cancelled at once
        await trio.sleep(1)
    assert again.cancelled_caught and trio.current_time() == 30
    # The watchdog's scope also ends when a limit must be looked at; entered again, it requests the stop.
    timed = TaskStop("t2")
    dog = Watchdog(timed, deadline_at=time.time() + 90, timeout_seconds=90, stall_timeout=0, last_activity=None)
    with dog.cancelling(trio.current_time() + 1000):
        await trio.sleep_forever()
    assert trio.current_time() == pytest.approx(30 + 90, abs=0.01) and timed.reason is None
    with dog.cancelling() as last:
        await trio.sleep_forever()
    assert last.cancelled_caught and timed.reason is StopReason.TIMEOUT
    # Left, a scope is no longer the stop's to cancel.
    later = TaskStop("t3")
    with later.cancelling() as left:
        pass
    later.request(StopReason.CANCELLED)
    assert not left.cancel_called


async def test_the_watchdog_returns_on_anyone_elses_stop_and_requests_nothing(
    autojump_clock: trio.testing.MockClock
) -> None:
    stop = TaskStop("t1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_request_later, stop, 1000)
        await Watchdog(stop, deadline_at=time.time() + 3600, timeout_seconds=3600, stall_timeout=100,
                       last_activity=trio.current_time).wait()  # always active: never stalls
    assert stop.reason is StopReason.CANCELLED
    off = TaskStop("t2")  # no deadline, stall 0 = off: only a stop ends the wait
    with trio.move_on_after(10**6) as scope:
        await Watchdog(off, deadline_at=None, timeout_seconds=0, stall_timeout=0, last_activity=lambda: 0.0).wait()
    assert scope.cancelled_caught and off.reason is None


# ------------------------------------------------------------------------------ real spiders, through the runner

SILENT = "import time\nprint('started', flush=True)\ntime.sleep(300)\n"


async def _run_real(tmp_path: Path, *, limit: float = 0, stall: float = 0,
                    cancel_after: float | None = None) -> tuple[TaskOutcome, str, list[str]]:
    """A real silent spider behind its monitor, supervised by :meth:`TaskRunner.finish_run`."""
    task_id = f"stop-{os.getpid()}-{limit}-{stall}-{cancel_after}"
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    admission = Admission(1)
    rt = admission.admit(_task(task_id))
    config = RunnerConfig(tmp_path, execute_timeout=0, kill_grace=1.0)
    runner = TaskRunner(config, None, None, None, None, admission, None)  # type: ignore[arg-type]
    activity = Activity((task_dir / "items.jsonl",))
    rt.delivery = SimpleNamespace(activity=activity)  # what finish_run reads of the task's delivery
    sink = LogSink(task_dir / "output.log", on_write=activity.touch)
    notices: list[str] = []
    jail = ProcessGroupJail(task_id)
    env = {"PATH": os.environ["PATH"], MARKER_VAR: task_id}
    rt.started_at = time.time()
    mon = await trio.to_thread.run_sync(functools.partial(
        spawn_monitored, [sys.executable, "-c", SILENT], cwd=tmp_path, env=env, task_id=task_id, task_dir=task_dir,
        output_path=sink.path, jail=jail, run_as=None, deadline_at=rt.started_at + limit if limit else None,
        work=tmp_path, stall_timeout=stall))
    async with trio.open_nursery() as nursery:
        if cancel_after is not None:
            async def master_cancels() -> None:
                await trio.sleep(cancel_after)
                admission.master_cancelled([task_id, "not-ours"])
            nursery.start_soon(master_cancels)
        outcome = await runner.finish_run(rt, mon, jail, sink, notices.append, limit)
    sink.close()
    assert rt.stop.is_set()
    assert await trio.to_thread.run_sync(find_marked, task_id) == []  # nothing of the task is left
    return outcome, (task_dir / "output.log").read_text(), notices


@pytest.mark.parametrize(("case", "status", "code"), [
    ("timeout", "FAILED", "TIMEOUT"), ("stalled", "FAILED", "STALLED"), ("cancelled", "CANCELLED", "CANCELLED")])
async def test_a_real_spider_gets_the_outcome_of_its_stop(tmp_path: Path, case: str, status: str, code: str) -> None:
    options: dict[str, float] = {"timeout": {"limit": 1.5}, "stalled": {"stall": 1.0},
                                 "cancelled": {"cancel_after": 1.0}}[case]
    started = trio.current_time()
    with trio.fail_after(20):
        outcome, output, notices = await _run_real(tmp_path, **options)
    elapsed = trio.current_time() - started
    assert (outcome.status, outcome.error_code) == (status, code), (outcome, notices)
    assert outcome.exit_code == -15, outcome  # SIGTERM reached the spider (default handler): no kill needed
    assert "started" in output
    assert 1.0 <= elapsed < 6, elapsed  # the limit (1–1.5 s) and the TERM, well within the 1 s grace
    sent = [n for n in notices if "sent SIGTERM to the main process" in n]
    assert len(sent) == 1, notices
    assert sent[0].startswith({"timeout": "timed out after 1.5 s", "stalled": "stalled: no output",
                               "cancelled": "cancelled by the master"}[case]), sent
    assert notices[-1].endswith(f"task {status}" + (f" ({code})" if status == "FAILED" else "")), notices


# ------------------------------------------------------------------------------ installers: the same stop

STUBBORN_INSTALLER = r"""
import os, signal, time
# os.write, not print: the signal may come while the main line is inside print (a reentrant call raises)
signal.signal(signal.SIGTERM, lambda *_: os.write(1, b"SIGTERM" + b" trapped\n"))
os.write(1, b"install" + b"ing\n")
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_an_installer_is_stopped_with_the_nodes_kill_grace(tmp_path: Path, how: str) -> None:
    """A real installer that traps SIGTERM, in the task's jail (passed explicitly): stop signal, then
    the node's kill_grace (1.5 s here, not the old fixed 5 s), then every process of the jail killed."""
    task_id = f"installer-stop-{os.getpid()}-{how.replace(' ', '-')}"
    installers = Installers(timeout=1.0 if how == "timed out" else 60.0, base_env={"PATH": os.environ["PATH"]},
                            builder=Builder.of(None, tmp_path), kill_grace=1.5)
    jail = ProcessGroupJail(task_id)
    out = bytearray()
    installing = trio.Event()

    def output(chunk: bytes) -> None:
        out.extend(chunk)
        if b"\ninstalling\n" in out:  # its output, not its echoed command line
            installing.set()

    started = trio.current_time()
    with trio.fail_after(20):
        if how == "cancelled":  # the task is stopped while it installs (its prepare scope is cancelled)
            stop = TaskStop(task_id)
            async with trio.open_nursery() as nursery:
                async def stop_once_installing() -> None:
                    await installing.wait()
                    stop.request(StopReason.CANCELLED)
                nursery.start_soon(stop_once_installing)
                with stop.prepare_scope:
                    await installers.run([sys.executable, "-c", STUBBORN_INSTALLER], tmp_path,
                                         {"PATH": os.environ["PATH"], MARKER_VAR: task_id}, output, jail=jail)
            assert stop.prepare_scope.cancelled_caught
        else:
            with pytest.raises(DepsError, match=r"timed out after 1 s and was stopped"):
                await installers.run([sys.executable, "-c", STUBBORN_INSTALLER], tmp_path,
                                     {"PATH": os.environ["PATH"], MARKER_VAR: task_id}, output, jail=jail)
    elapsed = trio.current_time() - started
    text = out.decode()
    assert "\nSIGTERM trapped\n" in text, text  # what it says while it stops reaches the task's log
    begins = "installer stopped" if how == "cancelled" else "timeout after 1 s"
    assert f"[ckagent] {begins}: sent SIGTERM to the main process" in text, text
    assert "every process of the task is killed in 1.5 s" in text, text
    assert "main process still running 1.5 s after SIGTERM: killed every process of the task" in text, text
    assert 1.5 <= elapsed < 1.5 + (1.0 if how == "timed out" else 0) + 2.5, elapsed  # the grace, not 5 s
    assert await trio.to_thread.run_sync(find_marked, task_id) == []
