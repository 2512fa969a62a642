"""What a task costs the agent while it runs: wake-ups, thread hops, work per element (issue 18).

- a task that writes nothing: its shippers sleep until notified (no 0.25 s retries);
- the items file's growth is seen by the outbox's once-a-second scan, which wakes the items shipper;
- shippers in backoff wait on the connectivity's event, not a 0.25 s check;
- stream positions of many streams are saved together (group commit: one thread hop per write);
- an acknowledged result does not wait for the lock a /metrics scrape holds in a worker thread;
- an item line the SDK wrote is sent as written (checked, not encoded again), anything else as before;
- small pipe writes gather for 50 ms before the next read, until the main process exits.

Logic against the in-memory master of test_delivery (httpx.MockTransport), real SQLite and spool
files in tmp_path, Trio's autojump clock.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import stamina.instrumentation
import trio
import trio.testing
from harness import BatchMaster, master_client

from ckagent.containment.process import _copy
from ckagent.delivery import Outbox
from ckagent.delivery.lines import encode_item, encode_json, item_object
from ckagent.delivery.readers import _FileReader
from ckagent.delivery.spool import EARLY_RETRY_AFTER, NOTIFY_FALLBACK
from ckagent.delivery.statistics import SpoolCounter
from ckagent.delivery.waiting import Backoff
from ckagent.master.client import MasterClient
from ckagent.master.connectivity import Trouble
from ckagent.master.protocol import Task, TaskResult
from ckagent.node.state import AsyncStateStore, StateStore


@pytest.fixture
def store(tmp_path: Path) -> AsyncStateStore:
    return AsyncStateStore(StateStore(tmp_path / "state.db"))


async def inline_run_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """trio.to_thread.run_sync, run inline: a real thread lets the autojump clock run ahead of its work."""
    await trio.lowlevel.checkpoint()
    return fn(*args)


class CountingReads:
    """Counts calls of ``_FileReader.read`` (the items shipper's looks at items.jsonl)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = _FileReader.read

        async def read(reader: _FileReader, pending: Any) -> bool:
            self.calls += 1
            return await original(reader, pending)

        monkeypatch.setattr(_FileReader, "read", read)


async def test_a_task_that_writes_nothing_costs_at_most_one_wake_up_a_second(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = CountingReads(monkeypatch)
    hops = {"n": 0}

    async def counting_run_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
        # Counted, and run inline: a real thread lets the autojump clock run ahead of its work.
        if fn is not shutil.disk_usage:  # the agent's free-space figure, not the task's
            hops["n"] += 1
        await trio.lowlevel.checkpoint()
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", counting_run_sync)

    fake = BatchMaster()
    outbox = Outbox(master_client(fake), store, tmp_path)
    task = Task.from_json({"id": "t1", "spiderId": "s1", "framework": "python"})
    task_dir = tmp_path / "tasks" / "t1"
    task_dir.mkdir(parents=True)
    await store.add_task("t1", "s1", {}, task_dir)
    with trio.fail_after(200):
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            delivery = await outbox.open_task(task, task_dir)
            await trio.sleep(5)  # settle: the streams started
            reads.calls = hops["n"] = 0
            await trio.sleep(60)  # a minute of a task that writes nothing
            idle_reads, idle_hops = reads.calls, hops["n"]
            # The spider starts writing items: the once-a-second scan sees the file grow.
            (task_dir / "items.jsonl").write_text("".join(json.dumps({"n": i}) + "\n" for i in range(10)))
            for _ in range(40):
                if len(fake.items) == 10:
                    break
                await trio.sleep(0.1)
            assert len(fake.items) == 10
            assert trio.current_time() - 65 < 3.5  # scan (≤ 1 s) + batch age (1 s) + slack
            await delivery.finish(TaskResult(status="SUCCESS", exit_code=0))
            await outbox.wait_idle()
            nursery.cancel_scope.cancel()
    assert fake.items == [{"n": i} for i in range(10)]
    assert idle_reads <= 60 // NOTIFY_FALLBACK + 1  # the safety net only (was 4 a second: 240)
    assert idle_hops <= 61  # the scan's one hop a second


async def test_backoff_waits_on_the_connectivity_event(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The delivery's backoff is stamina's (the master client's policy: exponential from 0.5 s to
    server.max_backoff_interval), cut short by the connectivity's event when the master comes back."""
    master = master_client(BatchMaster())
    sleeps: list[float] = []
    original_sleep = trio.sleep

    async def counting_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        await original_sleep(seconds)

    monkeypatch.setattr(trio, "sleep", counting_sleep)
    retries: list[float] = []  # what stamina's instrumentation sees: every retry of the delivery's
    hooks = stamina.instrumentation.get_on_retry_hooks()
    stamina.instrumentation.set_on_retry_hooks([lambda details: retries.append(details.wait_for)])
    try:
        await _backoff_waits(master, sleeps, original_sleep)
    finally:
        stamina.instrumentation.set_on_retry_hooks(hooks)
    assert len(retries) == 12 and retries[-1] == 7.0


async def _backoff_waits(master: MasterClient, sleeps: list[float], original_sleep: Any) -> None:
    connectivity = master.connectivity
    backoff = Backoff(master)
    for _ in range(9):  # the master reachable (another call got through): stamina's waits, in full
        await backoff.wait()
    assert sleeps[:3] == [pytest.approx(0.5, abs=1.0), pytest.approx(1.0, abs=1.0), pytest.approx(2.0, abs=1.0)]
    assert all(b >= a - 1.0 for a, b in itertools.pairwise(sleeps)) and max(sleeps) == master.max_backoff_interval
    sleeps.clear()
    connectivity.failed(Trouble("unreachable", "logs", "master unreachable", ("down",)))
    assert not connectivity.up
    start = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def come_back() -> None:
            await original_sleep(5)
            connectivity.succeeded("heartbeat")

        nursery.start_soon(come_back)
        await backoff.wait()  # a long backoff (30 s) cut short when the master is back
    assert trio.current_time() - start == pytest.approx(5, abs=0.01)
    assert sorted(sleeps) == [EARLY_RETRY_AFTER, master.max_backoff_interval]  # no 0.25 s checks
    # Back within the first EARLY_RETRY_AFTER seconds: retried right after them.
    connectivity.failed(Trouble("unreachable", "logs", "master unreachable", ("down",)))
    start = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def come_back_soon() -> None:
            await original_sleep(0.3)
            connectivity.succeeded("heartbeat")

        nursery.start_soon(come_back_soon)
        await backoff.wait()
    assert trio.current_time() - start == pytest.approx(EARLY_RETRY_AFTER)
    # A wait the master asked for (Retry-After) is waited in full, however the master is.
    connectivity.failed(Trouble("unreachable", "logs", "master unreachable", ("down",)))
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(come_back_soon)
        await backoff.wait(retry_after=7.0)
    assert trio.current_time() - start == pytest.approx(7.0)
    assert backoff.failed == 12


async def test_positions_of_many_streams_are_saved_together(
    store: AsyncStateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[int] = []
    original = store.sync.save_stream_positions

    def counting(positions: dict[tuple[str, str], tuple[int, Any]]) -> None:
        writes.append(len(positions))
        original(positions)

    monkeypatch.setattr(store.sync, "save_stream_positions", counting)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for i in range(50):
                for stream in ("log", "items"):
                    nursery.start_soon(store.save_stream_position, f"t{i}", stream, i + 1, {"offset": i})
    assert sum(writes) <= 100 and len(writes) <= 3  # one write on its way, the rest in the next one
    for i in range(50):
        assert await store.stream_position(f"t{i}", "items") == (i + 1, {"offset": i})
    # A later save of the same stream wins; a save returns only once it is in the database.
    await store.save_stream_position("t1", "log", 99, {"j": 1, "p": {}})
    assert store.sync.stream_position("t1", "log") == (99, {"j": 1, "p": {}})


async def test_a_failed_position_write_keeps_the_positions_for_the_next_one(
    store: AsyncStateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = store.sync.save_stream_positions
    calls = {"n": 0}

    def flaky(positions: dict[tuple[str, str], tuple[int, Any]]) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("disk I/O error")
        original(positions)

    monkeypatch.setattr(store.sync, "save_stream_positions", flaky)
    with trio.fail_after(10):
        with pytest.raises(OSError, match="disk I/O"):
            await store.save_stream_position("t1", "log", 5, {"offset": 5})
        await store.save_stream_position("t2", "log", 7, {"offset": 7})
    assert store.sync.stream_position("t1", "log") == (5, {"offset": 5})
    assert store.sync.stream_position("t2", "log") == (7, {"offset": 7})


def test_an_acknowledged_result_never_waits_for_a_scrape_in_progress(tmp_path: Path) -> None:
    """task_done runs on the event loop; a scrape's count holds the counter's lock across file reads
    in a worker thread: the loop must not wait for it (it only queues), and nothing is counted twice."""
    state = StateStore(tmp_path / "state.db")
    counter = SpoolCounter(state, started_at=0.0)
    task_dir = tmp_path / "t1"
    task_dir.mkdir()
    state.add_task("t1", "s1", {}, task_dir)
    (task_dir / "output.log").write_bytes(b"a\nb\nc\n")
    state.save_stream_position("t1", "log", 2, {"j": 0, "p": {}})
    assert counter.read().log_lines == 1
    with counter._lock:  # a read in progress in another thread
        counter.task_done("t1", log_lines=3, items=0, claimed_at=1.0)  # returns at once (a deadlock before)
    state.mark_result_acked("t1")
    assert (counter.shipped_log_lines, counter.shipped_items) == (3, 0)
    assert counter.read().tasks == 0
    assert counter.shipped_log_lines == 3


async def test_noted_positions_are_written_together_by_the_outbox_once_a_second(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[int] = []
    original = store.sync.save_stream_positions

    def counting(positions: dict[tuple[str, str], tuple[int, Any]]) -> None:
        writes.append(len(positions))
        original(positions)

    monkeypatch.setattr(store.sync, "save_stream_positions", counting)
    monkeypatch.setattr(trio.to_thread, "run_sync", inline_run_sync)  # no real thread under the autojump clock
    outbox = Outbox(master_client(BatchMaster()), store, tmp_path)
    task_dir = tmp_path / "tasks" / "t0"
    task_dir.mkdir(parents=True)
    await store.add_task("t0", "s1", {}, task_dir)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            # A running task's delivery: the outbox's once-a-second round runs while one is open.
            await outbox.open_task(Task.from_json({"id": "t0", "spiderId": "s1", "framework": "python"}), task_dir)
            await trio.sleep(0.5)
            writes.clear()
            for i in range(20):  # acknowledgements of many streams within one second: no write yet
                store.note_stream_position(f"t{i}", "log", i + 1, {"j": 0, "p": {}})
            assert writes == []
            assert await store.stream_position("t3", "log") == (4, {"j": 0, "p": {}})  # answered from memory
            await trio.sleep(1.5)
            assert writes == [20]  # one write for all of them
            assert store.sync.stream_position("t3", "log") == (4, {"j": 0, "p": {}})
            store.note_stream_position("t1", "items", 7, {"offset": 70})
            nursery.cancel_scope.cancel()  # the agent stops before the next round: written on the way out
    assert store.sync.stream_position("t1", "items") == (7, {"offset": 70})


@pytest.mark.parametrize("raw", [
    b'{"n": 1, "title": "\xe5\x95\x86\xe5\x93\x81", "price": 1.5, "tags": ["a", {"b": null}]}',
    b'  {"spaced": true}  ',
    b'{"escaped": "\\u00e9 \\n \\""}',
    b'{"big": 1e999}',
    b'{"nan": NaN}',
    b'{"bad utf-8": "\xff"}',
    b'[1, 2]',
    b'"a string"',
    b'not json',
    b'{"a": 1} {"b": 2}',
    b'   ',
    b'',
])
def test_an_item_line_is_sent_as_the_careful_path_would_send_it(raw: bytes) -> None:
    careful = item_object(raw)
    element = encode_item(raw)
    if careful is None:
        assert element is None
        return
    assert element is not None
    assert json.loads(element) == json.loads(encode_json(careful))
    plain = b"\xff" not in raw and b"1e999" not in raw and "_invalidItem" not in careful
    if plain:
        assert element == raw  # what the spider wrote, byte for byte


async def test_small_spider_writes_gather_and_the_exit_ends_the_wait(autojump_clock: trio.abc.Clock) -> None:
    """A spider printing a line every 10 ms costs one pipe read per 50 ms; after its main process
    exited nothing waits (the task's end is not delayed)."""
    send, receive = trio.testing.memory_stream_one_way_pair()
    got: list[bytes] = []
    exited = trio.Event()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_copy, receive, got.append, exited)
            for line in (b"a\n", b"b\n", b"c\n", b"d\n"):
                await send.send_all(line)
                await trio.sleep(0.01)
            await trio.sleep(0.1)
            assert got == [b"a\n", b"b\nc\nd\n"]  # the first read at once, the next three in one
            exited.set()
            await send.send_all(b"e\n")
            await trio.sleep(0.001)
            await send.send_all(b"f\n")
            await trio.sleep(0.001)
            assert got[2:] == [b"e\n", b"f\n"]
            await send.aclose()


class StepCounter(trio.abc.Instrument):
    """Counts task steps (each is one wake-up of a task) by task name."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name] = self.steps.get(task.name, 0) + 1


async def test_wake_ups_of_a_silent_task_and_of_an_idle_outbox(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 18: "a running task that writes nothing costs the agent at most one wake-up a second" —
    counted as Trio task steps over a silent minute. The task's delivery is one task (its journal,
    streams and stats driven by one loop), woken only for the streams' NOTIFY_FALLBACK safety net; the
    outbox's once-a-second round (shared by every task) is the rest. An outbox with no task open
    does not wake at all."""
    monkeypatch.setattr(trio.to_thread, "run_sync", inline_run_sync)
    outbox = Outbox(master_client(BatchMaster()), store, tmp_path)
    task_dir = tmp_path / "tasks" / "t1"
    task_dir.mkdir(parents=True)
    await store.add_task("t1", "s1", {}, task_dir)
    counter = StepCounter()
    with trio.fail_after(400):
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            await trio.sleep(1)
            trio.lowlevel.add_instrument(counter)
            await trio.sleep(120)  # two idle minutes
            idle = dict(counter.steps)
            delivery = await outbox.open_task(Task.from_json({"id": "t1", "spiderId": "s1", "framework": "python"}),
                                              task_dir)
            await trio.sleep(5)  # settle: the streams started
            counter.steps.clear()
            await trio.sleep(60)  # a minute of a task that writes nothing
            silent = dict(counter.steps)
            trio.lowlevel.remove_instrument(counter)
            await delivery.finish(TaskResult(status="SUCCESS", exit_code=0))
            await outbox.wait_idle()
            nursery.cancel_scope.cancel()
    main = trio.lowlevel.current_task().name
    rounds = {name: n for name, n in silent.items() if name.endswith("Outbox._disk_loop")}
    own = {name: n for name, n in silent.items() if name not in rounds and name != main}
    print(f"idle outbox, 120 s: {idle}; silent task, 60 s: outbox round {sum(rounds.values())} steps, "
          f"the task's own tasks {own}")
    assert {name: n for name, n in idle.items() if name != main} == {}, idle
    # The delivery's one task (journal, both streams, stats: one loop) wakes only for the streams'
    # NOTIFY_FALLBACK safety net, which logs and items share.
    loop = own.pop("deliver t1", 0)
    assert own == {}, own  # no other task of the task's delivery
    assert loop <= 60 // NOTIFY_FALLBACK + 1, loop
    assert sum(rounds.values()) <= 60 * 2 + 2, rounds  # a round a second: its wake-up and its one thread hop


async def test_an_acknowledged_result_is_marked_in_the_outbox_round_and_at_its_stop(
    tmp_path: Path, store: AsyncStateStore, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The result as sent is stored before it is sent, with the streams' last positions, in one write
    (what the status page shows of a finished task; where a crash resumes); the master's
    acknowledgement is marked in the outbox's next round, or on its way out when the agent stops
    first — no hop of its own. Before the mark the result stays pending (a crash then only makes the
    next start send it again)."""
    monkeypatch.setattr(trio.to_thread, "run_sync", inline_run_sync)  # no real thread under the autojump clock
    writes: list[int] = []
    original = store.sync.save_stream_positions

    def counting(positions: dict[tuple[str, str], tuple[int, Any]]) -> None:
        writes.append(len(positions))
        original(positions)

    monkeypatch.setattr(store.sync, "save_stream_positions", counting)
    fake = BatchMaster()
    outbox = Outbox(master_client(fake), store, tmp_path)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            for n, task_id in enumerate(("t1", "t2")):
                task_dir = tmp_path / "tasks" / task_id
                task_dir.mkdir(parents=True)
                delivery = await outbox.open_task(
                    Task.from_json({"id": task_id, "spiderId": "s1", "framework": "python"}), task_dir)
                assert delivery.sink is not None
                delivery.sink.write(b"one\ntwo\n")
                (task_dir / "items.jsonl").write_text('{"n": 1}\n')
                await delivery.finish(TaskResult(status="SUCCESS", exit_code=0))
                await outbox.wait_idle()
                assert fake.results[-1]["itemCount"] == 1 and fake.results[-1]["logLines"] == 2
                record = store.sync.get(task_id)
                assert record is not None and not record.result_acked  # acknowledged, marked later
                assert record.result is not None and record.result["itemCount"] == 1  # stored as sent
                assert store.sync.stream_position(task_id, "items") == (1, {"offset": 9})  # with it
                if n == 0:
                    await trio.sleep(1.5)  # the round after the last delivery: marked then
                    record = store.sync.get(task_id)
                    assert record is not None and record.result_acked
            assert writes == [2, 2]  # each task's last positions went with its result's write, no other
            nursery.cancel_scope.cancel()  # the agent stops before the next round: marked on the way out
    record = store.sync.get("t2")
    assert record is not None and record.result_acked and record.result is not None
    assert record.result["logLines"] == 2
    assert await store.pending_delivery() == []
