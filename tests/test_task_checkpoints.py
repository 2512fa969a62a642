"""A task's checkpoints, the agent's side (ckagent.task.checkpoints) against a spider that answers by hand:
real control, ack, items and snapshot files in tmp_path, the autojump clock (no real sleep), the shipper
of ckagent.resume behind a master that has no checkpoint endpoints (what is queued is its ``N.json``).

- the interval is honoured: a request every interval, each answer queued as checkpoint ``<attempt>-<n>``
  with its items position (the items before its offset, in the task's numbering);
- a spider that never answers is said once, and asked again every interval;
- answers that are not the protocol's (garbage, wrong ids, a link for a snapshot, an error) are said and
  never queued;
- a re-adopted task numbers its requests after the previous agent's and skips the answers written before.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import task_json

from ckagent.master.client import MasterClient
from ckagent.master.protocol import RegisterRequest, Task
from ckagent.node.errors import DeployError
from ckagent.task.checkpoints import CheckpointReason, TaskCheckpoints, checkpointing
from ckagent.task.stop import TaskStop, Watchdog
from ckagent.task.taskenv import make_resume_files

pytestmark = pytest.mark.usefixtures("inline_threads")  # the autojump clock does not jump during a thread hop


def _master() -> MasterClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return httpx.Response(200, json={"nodeId": "n1", "apiKey": "k" * 20})
        return httpx.Response(404, json={"error": "no such endpoint"})

    def body() -> RegisterRequest:
        return RegisterRequest(name="n", ip="127.0.0.1", port=1, version="t", os="linux", arch="x", python="3",
                               cpu_count=1, memory_total_bytes=1, max_workers=1)

    return MasterClient("http://master.test", "token", body, transport=httpx.MockTransport(handler))


class Said(list[str]):
    def __call__(self, text: str) -> None:
        self.append(text)


def _checkpoints(task_dir: Path, said: Said, interval: float = 60.0, **task: Any) -> TaskCheckpoints:
    task_dir.mkdir(parents=True, exist_ok=True)
    make_resume_files(task_dir)
    return TaskCheckpoints(_master(), Task.from_json(task_json("t1", "s1", **task)), task_dir, interval=interval,
                           delivery=None, notice=said)


@asynccontextmanager
async def running(cp: TaskCheckpoints) -> AsyncIterator[trio.Nursery]:
    """``cp`` as the runner runs it while the spider runs: checkpointing() around a Watchdog's wait (what
    wakes the first interval's alarm). Yields a nursery for the fake spider; all is cancelled at the end."""
    async with checkpointing(cp), trio.open_nursery() as nursery:
        watchdog = Watchdog(TaskStop(cp.task.id), deadline_at=None, timeout_seconds=0, stall_timeout=0,
                            last_activity=None, alarm=cp)
        nursery.start_soon(watchdog.wait)
        yield nursery
        nursery.cancel_scope.cancel()


def _requests(task_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (task_dir / "control.jsonl").read_text().splitlines()]


async def fake_spider(task_dir: Path, *, items_per_answer: int = 3, answer: bool = True,
                      torn: bool = False, skip: int = 0) -> None:
    """Answer every request of the control file as the SDK does: items written, the state copied to
    ``snapshots/N``, then ``{"id", "itemsOffset", "snapshot", "pauseMs"}`` (``torn``: a half-written item
    line follows the offset)."""
    seen = skip  # requests answered before (by the same task's spider before an agent restart)
    n_item = 0
    while True:
        await trio.sleep(0.2)  # the SDK's look at the control file
        requests = _requests(task_dir)
        for request in requests[seen:]:
            if not answer:
                continue
            with (task_dir / "items.jsonl").open("a") as fh:
                for _ in range(items_per_answer):
                    fh.write(json.dumps({"n": n_item}) + "\n")
                    n_item += 1
            offset = (task_dir / "items.jsonl").stat().st_size
            if torn:
                with (task_dir / "items.jsonl").open("a") as fh:
                    fh.write('{"n": "half')
            (task_dir / "snapshots" / str(request["id"])).mkdir()
            (task_dir / "snapshots" / str(request["id"]) / "state.json").write_text(json.dumps({"n": n_item}))
            with (task_dir / "control-ack.jsonl").open("a") as fh:
                fh.write(json.dumps({"id": request["id"], "itemsOffset": offset, "snapshot": str(request["id"]),
                                     "pauseMs": 1.5}) + "\n")
            if torn:
                with (task_dir / "items.jsonl").open("a") as fh:
                    fh.write('"}\n')
                    n_item += 1
        seen = len(requests)


def _queued(task_dir: Path) -> list[dict[str, Any]]:
    metas = sorted((task_dir / "snapshots").glob("*.json"), key=lambda p: int(p.stem))
    return [json.loads(p.read_text()) for p in metas]


async def test_the_interval_is_honoured_and_each_answer_is_queued_with_its_items_position(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    said = Said()
    cp = _checkpoints(tmp_path / "t1", said, 60.0, attempt=2, itemSeqStart=450, logSeqStart=30)
    started = trio.current_time()
    async with running(cp) as nursery:
        nursery.start_soon(fake_spider, tmp_path / "t1")
        await trio.sleep(60 * 5 + 30)
    requests = _requests(tmp_path / "t1")
    assert [r["id"] for r in requests] == [1, 2, 3, 4, 5]
    assert {r["event"] for r in requests} == {"persistState"} and {r["reason"] for r in requests} == {"interval"}
    assert cp.answered == 5 and cp.taken is not None
    assert cp.taken.id == "2-5" and cp.taken.item_seq == 450 + 15 and cp.taken.log_seq == 30
    assert cp.taken.pause_ms == 1.5
    assert trio.current_time() - started >= 330
    assert not [line for line in said if "does not answer" in line]


async def test_a_migrate_request_says_the_seconds_left_and_a_torn_item_line_is_not_counted(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    said = Said()
    cp = _checkpoints(tmp_path / "t1", said, 0.0)  # no periodic checkpoints: only the one asked for
    async with running(cp) as nursery:
        nursery.start_soon(lambda: fake_spider(tmp_path / "t1", torn=True))
        assert await cp.take(CheckpointReason.MIGRATE, seconds_left=18.46, timeout=10), said
        assert await cp.take(CheckpointReason.MEMORY, timeout=10)
    assert _requests(tmp_path / "t1") == [
        {"event": "migrating", "id": 1, "reason": "migrate", "secondsLeft": 18.5},
        {"event": "persistState", "id": 2, "reason": "memory"}]
    assert cp.taken is not None and cp.taken.reason == "memory"
    assert cp.taken.item_seq == 7  # 3, the torn one completed after the first answer, 3 more


async def test_a_spider_that_never_answers_is_said_once_and_asked_every_interval(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    said = Said()
    cp = _checkpoints(tmp_path / "t1", said, 30.0, resume="restart-keep")
    async with running(cp):
        await trio.sleep(30 * 4 + 10)
    assert [r["id"] for r in _requests(tmp_path / "t1")] == [1, 2, 3, 4]
    silent = [line for line in said if "does not answer" in line]
    assert silent == ["the spider does not answer persist requests: a new attempt restarts it from scratch "
                      "(resume: restart-keep)"]
    assert cp.taken is None and _queued(tmp_path / "t1") == []


@pytest.mark.parametrize("answer, said_text", [
    (b"garbage\n", "not JSON"),
    (b'{"id": 1, "itemsOffset": 0, "snapshot": "../1"}\n', "snapshot"),
    (b'{"id": 1, "error": "state too large"}\n', "could not persist its state: state too large"),
    (b'{"id": 1, "itemsOffset": 0, "snapshot": "1"}\n', "not a directory"),  # a link made below
    (b"x" * 70000 + b"\n", "the most read is 4096"),
    (b"x" * 300000 + b"\n", "longer than 4096"),
])
async def test_bad_answers_are_said_and_never_queued(
    tmp_path: Path, autojump_clock: trio.abc.Clock, answer: bytes, said_text: str
) -> None:
    said = Said()
    task_dir = tmp_path / "t1"
    cp = _checkpoints(task_dir, said, 0.0)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", task_dir / "snapshots" / "1")
    (task_dir / "control-ack.jsonl").write_bytes(answer + b'{"id": 99, "itemsOffset": 0, "snapshot": "99"}\n')
    async with running(cp):
        assert not await cp.take(CheckpointReason.INTERVAL, timeout=5)
    assert any(said_text in line for line in said), said
    assert cp.taken is None and _queued(task_dir) == []


async def test_a_readopted_task_numbers_on_and_skips_the_answers_written_before(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    said = Said()
    task_dir = tmp_path / "t1"
    first = _checkpoints(task_dir, said, 0.0)
    async with running(first) as nursery:
        nursery.start_soon(fake_spider, task_dir)
        assert await first.take(CheckpointReason.INTERVAL, timeout=5)
        assert await first.take(CheckpointReason.INTERVAL, timeout=5)
    # The next agent: a new TaskCheckpoints of the same attempt.
    again = _checkpoints(task_dir, said, 0.0)
    await again.adopt()
    async with running(again) as nursery:
        nursery.start_soon(lambda: fake_spider(task_dir, skip=2))
        assert await again.take(CheckpointReason.INTERVAL, timeout=5)
    assert [r["id"] for r in _requests(task_dir)] == [1, 2, 3]
    assert again.taken is not None and again.taken.id == "1-3"


@pytest.mark.parametrize("resume, words", [("restart-replace", "earlier items replaced (resume: restart-replace)"),
                                           ("restart-keep", "earlier items kept (resume: restart-keep)")])
async def test_an_attempt_without_a_checkpoint_says_it_restarts_from_scratch(
    tmp_path: Path, resume: str, words: str
) -> None:
    said = Said()
    await _checkpoints(tmp_path / "t1", said, attempt=2, resume=resume).prepare()
    assert said == [f"attempt 2: no checkpoint; restarting from scratch, {words}"]
    first = Said()
    await _checkpoints(tmp_path / "t2", first).prepare()
    assert first == []  # a first attempt says nothing of the kind


async def test_a_checkpoint_that_cannot_be_restored_fails_the_deploy_saying_why(tmp_path: Path) -> None:
    said = Said()
    ref = {"id": "1-4", "attempt": 1, "itemSeq": 450, "logSeq": 30, "url": "/api/tasks/t1/checkpoints/1-4"}
    cp = _checkpoints(tmp_path / "t1", said, attempt=2, checkpoint=ref)
    with trio.fail_after(30), pytest.raises(DeployError, match=r"attempt 2: .*1-4") as raised:
        await cp.prepare()  # the master answers 404: no such checkpoint
    assert raised.value.error_code == "DEPLOY_FAILED"
    assert said == []
