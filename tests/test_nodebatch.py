"""Node batches (issue 18): several tasks' log and item batches in one request when the master offers
``node-batches``; per-task posts with a master that does not (older masters keep working).

End to end with the in-process dev master and a real agent (real spiders); the result mapping of
one batch's answer is pure logic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from harness import BatchMaster, agent_settings, master_client, running_agent, submit

import ckagent.devmaster.node_api as devmaster_node_api
from ckagent.delivery.nodebatch import _settle, _Waiter
from ckagent.master.client import MasterConflict, MasterRejected, MasterUnavailable

SPIDER = """\
import crawlerkeeper_sdk as ck
for i in range(300):
    print("line", i, flush=i % 50 == 0)
    if i % 10 == 0:
        ck.save_item({"n": i // 10})
"""


async def _run_three(dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> tuple[Any, list[str]]:
    settings = agent_settings(tmp_path / "work", dev_master.base_url, dev_master.registration_token,
                              AGENT_MAX_WORKERS="3")
    async with running_agent(nursery, settings) as agent:
        ids = [await submit(dev_master.admin, f"batched-{i}", {"main.py": SPIDER}) for i in range(3)]
        for task_id in ids:
            task = await dev_master.admin.wait_task_final(task_id, 60)
            assert task["status"] == "SUCCESS", (task["errorCode"], task["errorMessage"])
        with trio.fail_after(30):
            await agent.outbox.wait_idle()
        batcher = agent.outbox.batcher
        figures = (batcher.requests, batcher.batches, agent.master.features)
    for task_id in ids:
        lines = [line for line in await dev_master.admin.get_logs(task_id) if not line.startswith("[ckagent")]
        assert lines == [f"line {i}" for i in range(300)]
        assert await dev_master.admin.get_items(task_id) == [{"n": n} for n in range(30)]
    return figures, ids


async def test_many_tasks_ship_through_node_batches(dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    with trio.fail_after(120):
        (requests, batches, features), _ = await _run_three(dev_master, nursery, tmp_path)
    assert "node-batches" in features
    assert requests >= 1 and batches >= 6  # every stream of every task went through them (≥ 1 batch each)


async def test_a_master_without_node_batches_gets_per_task_posts(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devmaster_node_api, "MASTER_FEATURES", ())  # an older master: no "features" offered
    with trio.fail_after(120):
        (requests, batches, features), _ = await _run_three(dev_master, nursery, tmp_path)
    assert "node-batches" not in features
    assert requests == batches == 0  # everything went per task, and arrived


@pytest.mark.parametrize(("result", "kind", "status"), [
    ({"acceptedSeq": 7}, None, None),
    ({"status": 409, "error": "gap", "expectedSeq": 3}, MasterConflict, 409),
    ({"status": 404, "error": "no such task"}, MasterRejected, 404),
    ({"status": 422, "error": "bad", "field": "items[0]"}, MasterRejected, 422),
    ({"status": 413, "error": "too many"}, MasterRejected, 413),
    ({"status": 503, "error": "busy"}, MasterUnavailable, None),
    ({"status": 429, "error": "slow down"}, MasterUnavailable, None),
    ({"acceptedSeq": -1}, MasterUnavailable, None),
    ({"status": 409}, MasterUnavailable, None),  # no error text: not the protocol's words
    ("ok", MasterUnavailable, None),
])
def test_a_batch_result_is_classified_as_its_own_endpoints_answer(result: Any, kind: Any, status: Any) -> None:
    waiter = _Waiter("t1", "logs", b'{"seq":0,"lines":[]}')
    _settle(waiter, result)
    if kind is None:
        assert waiter.value == 7 and waiter.error is None
        return
    assert type(waiter.error) is kind
    if status is not None:
        assert isinstance(waiter.error, MasterRejected) and waiter.error.status == status
        assert waiter.error.body == {k: v for k, v in result.items() if k != "status"}


def test_lines_wait_less_when_they_share_node_batches(tmp_path: Path) -> None:
    """A log batch waits NODE_LOG_BATCH_AGE (not LOG_BATCH_AGE) while node batches are on: the request
    is shared, so a shorter wait costs no extra request (lag p99, bench.manytasks). Items keep theirs."""

    from ckagent.delivery import Masker, StreamShipper
    from ckagent.delivery.nodebatch import NodeBatcher
    from ckagent.delivery.spool import BATCH_AGE, LOG_BATCH_AGE, NODE_LOG_BATCH_AGE
    from ckagent.node.state import AsyncStateStore, StateStore

    master = master_client(BatchMaster())
    store = AsyncStateStore(StateStore(tmp_path / "state.db"))
    logs = StreamShipper.logs(master, store, "t1", tmp_path, Masker([]))
    items = StreamShipper.items(master, store, "t1", tmp_path)
    assert (logs._age(), items._age()) == (LOG_BATCH_AGE, BATCH_AGE)  # no batcher
    batcher = NodeBatcher(master)
    logs.batcher = items.batcher = batcher
    assert (logs._age(), items._age()) == (LOG_BATCH_AGE, BATCH_AGE)  # the master does not offer them
    master.features = frozenset({"node-batches"})
    batcher._running = True
    assert (logs._age(), items._age()) == (NODE_LOG_BATCH_AGE, BATCH_AGE)
    assert NODE_LOG_BATCH_AGE < LOG_BATCH_AGE


async def test_the_batcher_joins_waiting_batches_and_passes_trouble_to_each(autojump_clock: trio.abc.Clock) -> None:
    """Batches posted while a request is on its way go together in the next one; a transport failure
    of the request reaches every waiter as MasterUnavailable; a master refusing the endpoint as a
    whole turns node batches off (the shippers post per task again)."""
    import json

    import httpx

    from ckagent.delivery.nodebatch import MAX_IN_FLIGHT, MIN_SEND_INTERVAL, NodeBatcher
    from ckagent.master.client import MasterClient
    from ckagent.master.protocol import RegisterRequest

    sizes: list[int] = []
    mode = {"answer": "ok"}
    release = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return httpx.Response(200, json={"nodeId": "n1", "apiKey": "k" * 20, "features": ["node-batches"]})
        assert request.url.path == "/api/nodes/n1/batches"
        batches = json.loads(request.content)["batches"]
        sizes.append(len(batches))
        if len(sizes) <= MAX_IN_FLIGHT:
            await release.wait()  # the first requests stay on their way while more batches queue
        if mode["answer"] == "reset":
            raise httpx.ConnectError("reset")
        if mode["answer"] == "refused":
            return httpx.Response(403, json={"error": "not here"})
        return httpx.Response(200, json={"results": [{"acceptedSeq": b["seq"] + len(b["lines"])} for b in batches]})

    def body() -> RegisterRequest:
        return RegisterRequest(name="n", ip="127.0.0.1", port=1, version="t", os="linux", arch="x", python="3",
                               cpu_count=1, memory_total_bytes=1, max_workers=1)

    master = MasterClient("http://master.test", "token", body, transport=httpx.MockTransport(handler))
    await master.register()
    batcher = NodeBatcher(master)
    accepted: dict[str, int] = {}

    async def post(task_id: str, seq: int) -> None:
        accepted[task_id] = await batcher.post(task_id, "logs", b'{"seq":%d,"lines":["a","b"]}' % seq)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.run)
            await trio.sleep(0.01)  # the sender runs
            assert batcher.enabled
            async with trio.open_nursery() as posts:
                for i in range(MAX_IN_FLIGHT + 10):
                    posts.start_soon(post, f"t{i}", i)
                    # one by one, a send interval apart: the first ones leave at once, alone
                    await trio.sleep(MIN_SEND_INTERVAL + 0.01 if i < MAX_IN_FLIGHT else 0.01)
                release.set()
            assert accepted == {f"t{i}": i + 2 for i in range(MAX_IN_FLIGHT + 10)}
            assert sizes[:MAX_IN_FLIGHT] == [1] * MAX_IN_FLIGHT and sizes[MAX_IN_FLIGHT:] == [10]  # queued: joined
            mode["answer"] = "reset"
            with pytest.raises(MasterUnavailable):
                await post("t-reset", 0)
            assert batcher.enabled
            mode["answer"] = "refused"
            with pytest.raises(MasterUnavailable):  # retried by the shipper, per task from now on
                await post("t-refused", 0)
            assert not batcher.enabled
            nursery.cancel_scope.cancel()
    await master.aclose()


async def test_a_steady_flow_goes_in_one_request_per_send_interval(autojump_clock: trio.abc.Clock) -> None:
    """20 streams each posting a batch every 50 ms (each at its own phase) to a master that answers at once: the batcher
    sends one request per MIN_SEND_INTERVAL carrying every batch that came meanwhile (not one per
    batch: 400 a second), and each batch still gets its own answer."""
    import json

    import httpx

    from ckagent.delivery.nodebatch import MIN_SEND_INTERVAL, NodeBatcher
    from ckagent.master.client import MasterClient
    from ckagent.master.protocol import RegisterRequest

    sizes: list[int] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/nodes/register":
            return httpx.Response(200, json={"nodeId": "n1", "apiKey": "k" * 20, "features": ["node-batches"]})
        batches = json.loads(request.content)["batches"]
        sizes.append(len(batches))
        return httpx.Response(200, json={"results": [{"acceptedSeq": b["seq"] + len(b["lines"])} for b in batches]})

    def body() -> RegisterRequest:
        return RegisterRequest(name="n", ip="127.0.0.1", port=1, version="t", os="linux", arch="x", python="3",
                               cpu_count=1, memory_total_bytes=1, max_workers=1)

    master = MasterClient("http://master.test", "token", body, transport=httpx.MockTransport(handler))
    await master.register()
    batcher = NodeBatcher(master)
    answers = 0

    async def stream(task_id: str, offset: float) -> None:
        nonlocal answers
        await trio.sleep(offset)  # the streams' batches age out spread over the interval, as in a real flow
        for seq in range(20):  # 1 s of batches
            assert await batcher.post(task_id, "logs", b'{"seq":%d,"lines":["a"]}' % seq) == seq + 1
            answers += 1
            await trio.sleep(0.05)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(batcher.run)
            async with trio.open_nursery() as streams:
                for i in range(20):
                    streams.start_soon(stream, f"t{i}", i * 0.0025)
            nursery.cancel_scope.cancel()
    await master.aclose()
    assert answers == 400 and sum(sizes) == 400
    assert len(sizes) <= 2.5 / MIN_SEND_INTERVAL, sizes  # about one per interval over the ~2 s the streams take
