"""Lifetimes and cancellation, as logic under the autojump clock (no real sleeping).

- Claims are atomic from the master's point of view: a claim answered after the drain began, and a
  claim cut off by a stop or a hard cancel, are given back (``POST /api/tasks/{id}/release``); a
  claim on the wire is listed in ``Supervisor.claiming`` (the heartbeat's ``claimingTaskIds``).
- The supervisor stores a CANCELLED result when a hard stop (a Cancelled from outside, arriving
  wrapped in an exception group from the installer's nursery) interrupts a task, before anything
  else can fail.
- ``process.run_supervised`` ends a real process when cancelled from outside.
- A slot freed for any reason (a cancel included) wakes the poller at once.
- The reference master's release and reconciliation rules (store level).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import HoldingSupervisor, PollMaster, heartbeat_of, register_request, store_node, task_json

from ckagent.code import workspace
from ckagent.code.deps import Prepared
from ckagent.containment.process import MARKER_VAR, find_marked, run_supervised
from ckagent.delivery import Outbox
from ckagent.devmaster.client import zip_files
from ckagent.devmaster.errors import ConflictError
from ckagent.devmaster.packages import read_package
from ckagent.devmaster.store import Store
from ckagent.master.client import MasterClient
from ckagent.master.protocol import CodePackage, RegisterRequest, Task, TaskResult
from ckagent.node.state import AsyncStateStore, StateStore
from ckagent.task.poller import Poller
from ckagent.task.stop import StopReason
from ckagent.task.supervisor import RunnerConfig, Supervisor

# ------------------------------------------------------------------------------ claims and releases


class ReleasingMaster(PollMaster):
    """PollMaster that also answers ``POST /api/tasks/{id}/release`` and records each release."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.released: list[tuple[float, str, str]] = []
        self.release_event = trio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.startswith("/api/tasks/") and path.endswith("/release"):
            self.released.append((trio.current_time(), path.split("/")[3], json.loads(request.content)["reason"]))
            self.release_event.set()
            return httpx.Response(200, json={"ok": True, "status": "PENDING"})
        return await super().__call__(request)


def make_poller(master: PollMaster, tmp_path: Path, max_workers: int = 2) -> tuple[Poller, HoldingSupervisor,
                                                                                 MasterClient]:
    client = MasterClient("http://master.test", "token", register_request, transport=httpx.MockTransport(master))
    supervisor = HoldingSupervisor(max_workers, tmp_path)
    poller = Poller(client, supervisor, poll_interval=5.0, long_poll_wait=20.0, request_timeout=10.0)
    return poller, supervisor, client


async def test_a_claim_answered_after_the_drain_began_is_given_back(autojump_clock: Any, tmp_path: Path) -> None:
    master = ReleasingMaster(answers=[{"tasks": [task_json("t1", "s1")], "cancelTaskIds": []}], claim_delay=3.0)
    poller, sup, client = make_poller(master, tmp_path)
    with trio.fail_after(600):
        async with trio.open_nursery() as work:
            returned = trio.Event()

            async def run() -> None:
                await poller.run(work)
                returned.set()

            work.start_soon(run)
            await master.wait_polls(1)
            await trio.sleep(1.0)  # the claim is on the wire (the master answers it after 3 s)
            assert sup.claiming == {"t1"}
            stopped_at = trio.current_time()
            poller.stop()  # the drain begins
            await returned.wait()
            # The poller waited for the claim's answer, then gave the task back: nothing runs here.
            assert trio.current_time() - stopped_at == pytest.approx(2.0)
            assert [(task, reason) for _, task, reason in master.released] == [
                ("t1", "claimed while the node started draining")]
            assert sup.started == [] and sup.running == {} and sup.claiming == set()
            assert len(master.polls) == 1  # no poll after the stop
    await client.aclose()


async def test_a_claim_without_an_answer_is_cut_off_and_given_back(autojump_clock: Any, tmp_path: Path) -> None:
    # The master takes longer than request_timeout to answer the claim: the stop cuts it off after
    # request_timeout (10 s) and releases the task (the agent cannot know whether the claim landed).
    master = ReleasingMaster(answers=[{"tasks": [task_json("t1", "s1")], "cancelTaskIds": []}], claim_delay=300.0)
    poller, sup, client = make_poller(master, tmp_path)
    with trio.fail_after(600):
        async with trio.open_nursery() as work:
            work.start_soon(poller.run, work)
            await master.wait_polls(1)
            await trio.sleep(1.0)
            stopped_at = trio.current_time()
            poller.stop()
            await master.release_event.wait()
            assert master.released[0][0] - stopped_at == pytest.approx(10.0)
            assert master.released[0][1:] == ("t1", "claim cut off: the node is stopping")
        assert sup.started == [] and sup.claiming == set()
    await client.aclose()


async def test_a_hard_cancel_during_a_claim_still_gives_the_task_back(autojump_clock: Any, tmp_path: Path) -> None:
    master = ReleasingMaster(answers=[{"tasks": [task_json("t1", "s1"), task_json("t2", "s2")],
                                       "cancelTaskIds": []}], claim_delay=300.0)
    poller, sup, client = make_poller(master, tmp_path)
    with trio.fail_after(600):
        with trio.CancelScope() as hard:  # the agent's work scope reaching its deadline
            async with trio.open_nursery() as work:
                work.start_soon(poller.run, work)
                await master.wait_polls(1)
                await trio.sleep(1.0)
                assert sup.claiming == {"t1", "t2"}
                hard.cancel()
        assert sorted((task, reason) for _, task, reason in master.released) == [
            ("t1", "claim cut off: the agent is terminating"), ("t2", "claim cut off: the agent is terminating")]
        assert sup.claiming == set()
    await client.aclose()


async def test_a_claim_answered_before_the_stop_runs_the_task(autojump_clock: Any, tmp_path: Path) -> None:
    master = ReleasingMaster(answers=[{"tasks": [task_json("t1", "s1")], "cancelTaskIds": []}], claim_delay=1.0)
    poller, sup, client = make_poller(master, tmp_path)
    with trio.fail_after(600):
        async with trio.open_nursery() as work:
            work.start_soon(poller.run, work)
            await master.wait_polls(2)  # claimed, started, polled again
            poller.stop()
            assert sup.started == ["t1"] and master.released == []
            sup.release("t1")
    await client.aclose()


# ------------------------------------------------------------------------------ a slot frees: poll at once


async def test_a_slot_freed_by_a_cancel_from_the_heartbeat_is_polled_for_at_once(
    autojump_clock: Any, tmp_path: Path
) -> None:
    # One slot, taken by t1; the cancel arrives by the heartbeat (not by a poll answer): the poller
    # waits for the slot by an event, so the next poll goes out the moment t1 has ended.
    master = PollMaster(answers=[{"tasks": [task_json("t1", "s1")], "cancelTaskIds": []}], hold_empty=True)
    poller, sup, client = make_poller(master, tmp_path, max_workers=1)
    with trio.fail_after(600):
        async with trio.open_nursery() as work:
            work.start_soon(poller.run, work)
            await master.wait_polls(1)
            await trio.sleep(7.3)  # mid-way through a poll_interval, had there been one
            assert sup.started == ["t1"] and len(master.polls) == 1
            sup.cancel("t1", StopReason.CANCELLED)
            freed_at = trio.current_time()
            sup.release("t1")  # the task's processes have ended
            await master.wait_polls(2)
            assert master.polls[1].at == freed_at
            assert "excludeSpiderIds" not in master.polls[1].params
            work.cancel_scope.cancel()
    await client.aclose()


async def test_an_answer_with_only_stale_cancel_ids_pauses_until_their_results_are_delivered(
    autojump_clock: Any, tmp_path: Path
) -> None:
    # t0 was cancelled and has ended here; its CANCELLED result is on its way, so the master keeps
    # listing t0 and answers every poll at once. The pause after such an answer must end as soon as
    # t0's result is delivered (then a poll can be held again and hears the next cancel at once),
    # not after poll_interval: with default settings that was the ~8-10 s wait after a cancel.
    master = PollMaster(answers=[{"tasks": [task_json("t1", "s1")], "cancelTaskIds": []},
                                 {"tasks": [], "cancelTaskIds": ["t0"]}])
    delivered = trio.Event()

    async def reported(task_ids: set[str]) -> None:
        assert task_ids == {"t0"}
        await delivered.wait()

    client = MasterClient("http://master.test", "token", register_request, transport=httpx.MockTransport(master))
    sup = HoldingSupervisor(2, tmp_path)
    poller = Poller(client, sup, poll_interval=10.0, long_poll_wait=20.0, request_timeout=10.0,
                    reported=reported)
    with trio.fail_after(600):
        async with trio.open_nursery() as work:
            work.start_soon(poller.run, work)
            await master.wait_polls(2)  # the second answer: at once, only the stale t0
            await trio.sleep(2.5)
            assert len(master.polls) == 2  # pausing (t1 runs, so s1 is excluded: no spider freed)
            delivered_at = trio.current_time()
            delivered.set()
            await master.wait_polls(3)
            assert master.polls[2].at == delivered_at
            work.cancel_scope.cancel()
    await client.aclose()


# ------------------------------------------------------------------------------ the supervisor's hard stop


class FakeWorkspaces:
    """Deploys nothing: the code dir is a fixed empty directory."""

    def __init__(self, code_dir: Path) -> None:
        self.code_dir = code_dir
        self.runs = code_dir.parent / "runs"
        self.downloaded_bytes = 0

    async def deploy_files(self, spider_id: str, notice: Any = None) -> Path:
        await trio.lowlevel.checkpoint()
        return self.code_dir

    def acquire(self, path: Path) -> None:
        pass

    def release(self, path: Path) -> None:
        pass


class HangingInstaller:
    """An installer whose work runs in a nursery of two children and never ends: a cancel from
    outside arrives at the supervisor wrapped in an exception group (as from the real installers)."""

    def __init__(self) -> None:
        self.entered = trio.Event()

    def check(self, framework: str, code_dir: Path, **_: Any) -> None:
        """The look the prepare hop makes: none (the install phase is where this installer hangs)."""
        return None

    async def prepare(self, framework: str, spider_id: str, code_dir: Path, output: Any, *,
                      marker: dict[str, str] | None = None, jail: Any = None, task_env: Any = None,
                      home: Any = None, checked: Any = None) -> Prepared:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(trio.sleep_forever)
            self.entered.set()
        raise AssertionError("unreachable")


async def test_a_hard_stop_during_the_install_stores_cancelled(mock_clock: Any, tmp_path: Path) -> None:
    # The state store and the task's files are real (worker threads): the clock jumps only after
    # 0.2 s of real idleness, so a thread's work never counts as minutes of virtual time.
    mock_clock.autojump_threshold = 0.2
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    (code_dir / "main.py").write_text("print('never runs')\n")

    async def master_away(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": "away"})

    def body() -> RegisterRequest:
        return register_request()

    client = MasterClient("http://master.test", "token", body, transport=httpx.MockTransport(master_away))
    store = AsyncStateStore(StateStore(tmp_path / "state.db"))
    outbox = Outbox(client, store, tmp_path)
    installer = HangingInstaller()
    sup = Supervisor(RunnerConfig(tmp_path, 60.0, 1.0), client, store, FakeWorkspaces(code_dir),  # type: ignore[arg-type]
                     installer, 2, outbox=outbox)  # type: ignore[arg-type]
    task = Task.from_json(task_json("t1", "s1"))
    try:
        with trio.fail_after(30):  # virtual seconds; each jump waits 0.2 s of real idleness
            async with trio.open_nursery() as root:
                await root.start(outbox.run)
                with trio.CancelScope() as work_scope:
                    async with trio.open_nursery() as work:
                        work.start_soon(sup.run_task, sup.admit(task))
                        await installer.entered.wait()
                        assert sup.running["t1"].phase == "installing"
                        work_scope.cancel()  # the hard stop: no stop request, a Cancelled from outside
                assert sup.running == {}
                record = await store.get("t1")
                assert record is not None and record.result is not None
                result = TaskResult.from_json(record.result)
                assert (result.status, result.error_code, result.error_message) == (
                    "CANCELLED", "CANCELLED", "agent terminating")
                root.cancel_scope.cancel()
    finally:
        await client.aclose()
        store.sync.close()


# ------------------------------------------------------------------------------ run_supervised, cancelled


async def test_run_supervised_cancelled_from_outside_ends_the_process(mock_clock: Any, tmp_path: Path) -> None:
    # A real process: the clock jumps after 0.2 s of real idleness (the process's start is real time);
    # the 2 s grace of a process that ignores SIGTERM then passes in virtual time.
    mock_clock.autojump_threshold = 0.2
    notices: list[str] = []
    output = bytearray()
    pids: list[int] = []
    up = trio.Event()

    def collect(chunk: bytes) -> None:
        output.extend(chunk)
        if b"up" in output:
            up.set()

    async def started(pid: int) -> None:
        pids.append(pid)

    env = {"PATH": "/usr/bin:/bin", MARKER_VAR: "task-x"}
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); " \
             "time.sleep(600)"
    with trio.fail_after(600):
        with trio.CancelScope() as outside:
            async with trio.open_nursery() as nursery:
                async def run() -> None:
                    await run_supervised([sys.executable, "-c", script], cwd=tmp_path, env=env, task_id="task-x",
                                         output=collect, deadline_seconds=None, grace=2.0,
                                         stop=trio.Event(), notice=notices.append, on_started=started)
                    raise AssertionError("run_supervised returned instead of letting the Cancelled through")

                nursery.start_soon(run)
                await up.wait()
                outside.cancel()
        assert outside.cancelled_caught
    (pid,) = pids
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # ended and reaped
    assert any("agent terminating: sent SIGTERM" in n for n in notices), notices
    assert any("killed every process of the task" in n for n in notices), notices  # it ignored SIGTERM: the grace ran out


async def test_run_supervised_cancelled_while_on_started_runs_still_ends_the_process(tmp_path: Path) -> None:
    """The supervision begins with the spawn: a cancel that comes while ``on_started`` is awaited stops
    the process (and its monitor) like any other (ckagent.containment.supervision.supervise)."""
    task_id = f"started-{os.getpid()}"
    pids: list[int] = []

    async def started(pid: int) -> None:
        pids.append(pid)
        await trio.sleep_forever()

    with trio.fail_after(30):
        with trio.move_on_after(0.5) as outside:
            await run_supervised(["sleep", "600"], cwd=tmp_path, env={"PATH": "/usr/bin:/bin", MARKER_VAR: task_id},
                                 task_id=task_id, output=lambda chunk: None, deadline_seconds=None, grace=2.0,
                                 stop=trio.Event(), notice=lambda text: None, on_started=started)
    assert outside.cancelled_caught and len(pids) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # ended and reaped
    assert await trio.to_thread.run_sync(find_marked, task_id) == []  # nothing of it left


# ------------------------------------------------------------------------------ the reference master


def _claimed_task(store: Store, node: str) -> str:
    spider_id = store.create_spider(name=f"sp-{len(store.list_spiders())}", framework="python", command=None,
                                    timeout_seconds=None, code_mode="files", env={})
    zipped = zip_files({"main.py": "print('hi')\n"})
    store.store_package(spider_id, read_package(zipped), zipped)
    task_id = store.create_task(spider_id, args=[], env={}, params={}, timeout_seconds=None)
    store.report_result(task_id, node, TaskResult(status="RUNNING"))
    return task_id


def test_reference_master_release_rules(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node, other = store_node(store), store_node(store, "n2")
        task_id = _claimed_task(store, node)
        with pytest.raises(ConflictError):
            store.release_task(task_id, other, "not mine")
        assert store.release_task(task_id, node, "claimed while draining")["status"] == "PENDING"
        assert store.release_task(task_id, node, "again")["status"] == "PENDING"  # the claim never landed: no-op
        store.report_result(task_id, other, TaskResult(status="RUNNING"))  # another node may claim it now
        assert store.get_task(task_id)["status"] == "RUNNING"
        # Cancel asked meanwhile: the released task is CANCELLED, not handed out again.
        second = _claimed_task(store, node)
        store.cancel_task(second)
        assert store.release_task(second, node, None)["status"] == "CANCELLED"
        with pytest.raises(ConflictError):
            store.release_task(second, node, None)  # final
    finally:
        store.close()


def test_reference_master_reconciles_against_running_claiming_and_reporting(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node = store_node(store)
        lost, running, claiming, reporting = (_claimed_task(store, node) for _ in range(4))
        store.claim_grace_seconds = 0.0
        # An older agent (no claimingTaskIds): left alone.
        assert store.reconcile(node, heartbeat_of(running=[running])) == []
        taken = store.reconcile(node, heartbeat_of(running=[running], claiming=[claiming], reporting=[reporting]))
        assert taken == [lost]
        statuses = {t: store.get_task(t)["status"] for t in (lost, running, claiming, reporting)}
        assert statuses == {lost: "PENDING", running: "RUNNING", claiming: "RUNNING", reporting: "RUNNING"}
        # Within the grace a claim may have been answered after the beat's snapshot: left alone.
        store.claim_grace_seconds = 60.0
        assert store.reconcile(node, heartbeat_of(claiming=[])) == []
    finally:
        store.close()


# ------------------------------------------------------------------------------ no fd left by a cancel


async def test_a_download_cancelled_mid_body_closes_its_file(
    mock_clock: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The download's finally closed the file with an unshielded await: a cancel skipped the close
    # and the descriptor stayed open for as long as anything referenced the file object.
    mock_clock.autojump_threshold = 0.2  # worker threads write the file: real time
    opened: list[Any] = []

    class Recorded(workspace._HashingFile):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            opened.append(self)

    monkeypatch.setattr(workspace, "_HashingFile", Recorded)
    first_chunk = trio.Event()

    class Hanging(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:  # noqa: ASYNC900 - httpx's stream interface is an async iterator
            yield b"x" * 1000
            first_chunk.set()
            await trio.sleep_forever()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return httpx.Response(200, json={"nodeId": "node-1", "apiKey": "key-1"})
        return httpx.Response(200, stream=Hanging())

    client = MasterClient("http://master.test", "token", register_request, transport=httpx.MockTransport(handler))
    ws = workspace.Workspaces(tmp_path / "spiders", client)
    package = CodePackage(url="http://master.test/api/packages/s1/v1.zip", sha256="0" * 64, size_bytes=10_000)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ws.deploy_package, "s1", "v1", package)
            await first_chunk.wait()
            nursery.cancel_scope.cancel()
    (download,) = opened
    assert download._fh.closed
    assert list(ws.staging.iterdir()) == []  # the temp dir went too
    await client.aclose()
