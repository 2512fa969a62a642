"""A held poll follows the node's results (feature ``poll-follows-results``, docs/protocol.md "A held
poll follows the node's results").

- The reference master's rule (its store): a spider of ``runningSpiderIds`` stays excluded only while
  the node has a RUNNING task of it; the other excluded spiders stay excluded.
- Over HTTP: a held poll is answered with the spider's next task as soon as the node's final result
  of its running task arrives; a spider excluded without being running stays excluded; a master
  started without the feature does not offer it and ignores ``runningSpiderIds``.
- End to end (real agent, real master, a counting TCP relay between them): two tasks of one spider
  in a row run one after the other, the second handed out in the poll held while the first ran,
  with no poll abandoned (no connection closed by the agent); against a master without the feature
  the agent abandons the held poll as before and the second task still starts at once.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import (
    Node,
    agent_settings,
    eventually,
    make_spider,
    register,
    running_agent,
    spider_writable,
    store_node,
    store_spider,
    store_task,
)

from ckagent.devmaster.client import AdminClient, zip_files
from ckagent.devmaster.server import DevMasterConfig, serve
from ckagent.devmaster.store import Store
from ckagent.master.protocol import POLL_FOLLOWS_RESULTS, TaskResult, utc_now_iso

# --------------------------------------------------------------------------- the reference master's rule


def _finish(store: Store, task_id: str, node: str) -> None:
    store.report_result(task_id, node, TaskResult(status="SUCCESS", exit_code=0, finished_at=utc_now_iso()))


def test_a_running_spider_is_excluded_until_the_nodes_task_of_it_ends(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node = store_node(store)
        a, b = store_spider(store, "a"), store_spider(store, "b")
        a1, a2, b1 = store_task(store, a), store_task(store, a), store_task(store, b)
        [got], _ = store.claim_pending(node, poll_id=1, limit=1, exclude_spider_ids=[], base_url="")
        assert got["id"] == a1
        # a1 runs on the node: a stays excluded; b is excluded without running here (cannot run it).
        poll = {"exclude_spider_ids": [a, b], "running_spider_ids": [a], "base_url": ""}
        assert store.pending_tasks(limit=5, node_id=node, **poll) == []
        assert store.claim_pending(node, poll_id=2, limit=5, **poll) == ([], [])
        _finish(store, a1, node)  # its final result: a's exclusion lapses, b's does not
        assert [t["id"] for t in store.pending_tasks(limit=5, node_id=node, **poll)] == [a2]
        # Without runningSpiderIds (an agent that does not send them) every exclusion holds.
        assert store.pending_tasks(limit=5, node_id=node, exclude_spider_ids=[a, b], base_url="") == []
        claimed, _ = store.claim_pending(node, poll_id=3, limit=5, **poll)
        assert [t["id"] for t in claimed] == [a2]
        assert store.get_task(b1)["status"] == "PENDING"  # b is still excluded
    finally:
        store.close()


# --------------------------------------------------------------------------- over HTTP


async def _held_poll(node: Node, wait: float, exclude: list[str], running: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {"limit": 5, "waitSeconds": wait, "excludeSpiderIds": ",".join(exclude),
                              "runningSpiderIds": ",".join(running), "claim": 5, "pollId": 7}
    response = await node.http.get(f"/api/nodes/{node.node_id}/tasks/pending", params=params, headers=node.auth)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def _claim_first(node: Node, admin: AdminClient, spider: str) -> tuple[str, str]:
    """Two tasks of ``spider``; the node claims the first. Returns both ids."""
    first, second = await admin.create_task(spider), await admin.create_task(spider)
    claimed = await node.http.post(f"/api/tasks/{first}/result", json={"status": "RUNNING"}, headers=node.auth)
    assert claimed.status_code == 200, claimed.text
    return first, second


async def test_a_held_poll_hands_out_the_spiders_next_task_when_the_nodes_result_arrives(dev_master: Any) -> None:
    async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=30) as http:
        registered = await http.post("/api/nodes/register", json={"name": "n", "port": 1, "cpuCount": 1,
                                                                  "memoryTotalBytes": 1, "maxWorkers": 1},
                                     headers={"X-Registration-Token": dev_master.registration_token})
        assert POLL_FOLLOWS_RESULTS in registered.json()["features"]
        node = await register(http, dev_master.registration_token)
        with trio.fail_after(20):
            spider, cannot = await make_spider(dev_master.admin, "s1"), await make_spider(dev_master.admin, "s2")
            first, second = await _claim_first(node, dev_master.admin, spider)
            await dev_master.admin.create_task(cannot)  # excluded, not running here: never handed out
            answers: list[tuple[float, dict[str, Any]]] = []
            async with trio.open_nursery() as nursery:

                async def poll() -> None:
                    answer = await _held_poll(node, 10, [spider, cannot], [spider])
                    answers.append((trio.current_time(), answer))

                nursery.start_soon(poll)
                await trio.sleep(0.5)  # the poll is held: its spider's task still runs here
                assert answers == []
                reported = trio.current_time()
                done = await node.result(first, "SUCCESS", exitCode=0, finishedAt=utc_now_iso())
                assert done.status_code == 200, done.text
        [(answered, answer)] = answers
        assert answered - reported < 2  # at once, not after waitSeconds (10)
        assert [(t["id"], t["claimed"]) for t in answer["tasks"]] == [(second, True)]
        assert (await dev_master.admin.get_task(second))["status"] == "RUNNING"


@dataclass
class OldMaster:
    base_url: str
    registration_token: str
    admin: AdminClient


@pytest.fixture
async def master_without_the_feature(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[OldMaster]:
    config = DevMasterConfig(db_path=tmp_path / "old-master.sqlite", registration_token=secrets.token_urlsafe(16),
                             admin_token=secrets.token_urlsafe(16), port=0, poll_follows_results=False)
    base_url = await nursery.start(serve, config)
    async with AdminClient(base_url, config.admin_token) as admin:
        yield OldMaster(base_url, config.registration_token, admin)


async def test_a_master_without_the_feature_keeps_every_exclusion_for_the_whole_hold(
    master_without_the_feature: OldMaster,
) -> None:
    old = master_without_the_feature
    async with httpx.AsyncClient(base_url=old.base_url, timeout=30) as http:
        node = await register(http, old.registration_token)
        with trio.fail_after(20):
            spider = await make_spider(old.admin, "s1")
            first, _second = await _claim_first(node, old.admin, spider)
            async with trio.open_nursery() as nursery:
                answers: list[tuple[float, dict[str, Any]]] = []

                async def poll() -> None:
                    answer = await _held_poll(node, 1.5, [spider], [spider])
                    answers.append((trio.current_time(), answer))

                started = trio.current_time()
                nursery.start_soon(poll)
                await trio.sleep(0.3)
                done = await node.result(first, "SUCCESS", exitCode=0, finishedAt=utc_now_iso())
                assert done.status_code == 200, done.text
        [(answered, answer)] = answers
        assert answer["tasks"] == [] and answered - started >= 1.4  # held out: runningSpiderIds ignored


# --------------------------------------------------------------------------- end to end


class CountingRelay:
    """A TCP relay on 127.0.0.1 (port 0) to ``upstream_port`` that counts the connections the client
    closed first (an abandoned request: httpx closes its connection)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.closed_by_client = 0

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._relay, listeners)

    async def _relay(self, client: trio.SocketStream) -> None:
        first_eof: list[str] = []
        async with client, await trio.open_tcp_stream("127.0.0.1", self.upstream_port) as upstream:

            async def pipe(src: trio.SocketStream, dst: trio.SocketStream, side: str) -> None:
                try:
                    while data := await src.receive_some(65536):
                        await dst.send_all(data)
                except trio.BrokenResourceError:
                    pass
                first_eof.append(side)
                nursery.cancel_scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pipe, client, upstream, "client")
                nursery.start_soon(pipe, upstream, client, "master")
        if first_eof[:1] == ["client"]:
            self.closed_by_client += 1


SERIAL = ("import os, time\nwith open(os.environ['RUNS_FILE'], 'a') as f:\n"
          "    f.write('start ' + os.environ['CK_TASK_ID'] + '\\n')\n"
          "time.sleep(1.0)\nwith open(os.environ['RUNS_FILE'], 'a') as f:\n"
          "    f.write('end ' + os.environ['CK_TASK_ID'] + '\\n')\n")


async def _two_tasks_in_a_row(base_url: str, token: str, admin: AdminClient, nursery: trio.Nursery,
                              tmp_path: Path) -> tuple[int, list[dict[str, Any]], list[str], frozenset[str]]:
    """An agent (long poll 20 s) behind a counting relay runs two tasks of one spider, the second
    created while the first runs. Returns the connections the agent closed meanwhile, both tasks as the master has them, the
    spider's start/end lines and the master's features as the agent heard them."""
    relay = CountingRelay(int(base_url.rsplit(":", 1)[1]))
    port = await nursery.start(relay.serve)
    runs = spider_writable(tmp_path / "shared") / "runs.txt"  # (the spider may run under a uid of its own)
    settings = agent_settings(tmp_path / "agent", f"http://127.0.0.1:{port}", token,
                              AGENT_TASK_LONG_POLL_WAIT="20", AGENT_HEARTBEAT_INTERVAL="30")
    async with running_agent(nursery, settings) as agent:
        spider = await admin.create_spider(name="serial", framework="python")
        await admin.upload_package(spider, zip_files({"main.py": SERIAL}))
        env = {"RUNS_FILE": str(runs)}
        first = await admin.create_task(spider, env=env)

        async def first_runs() -> bool:
            return runs.exists()

        await eventually(first_runs, 30)
        closed_before = relay.closed_by_client
        second = await admin.create_task(spider, env=env)
        tasks = [await admin.wait_task_final(first, 60), await admin.wait_task_final(second, 60)]
        abandoned = relay.closed_by_client - closed_before
        features = agent.master.features
    return abandoned, tasks, runs.read_text().splitlines(), features


def _gap_seconds(tasks: list[dict[str, Any]]) -> float:
    """Seconds from the first task's end (as the node reported it) to the second's claim."""
    first_end = datetime.fromisoformat(tasks[0]["finishedAt"].replace("Z", "+00:00"))
    second_claim = datetime.fromisoformat(tasks[1]["startedAt"].replace("Z", "+00:00"))
    return (second_claim - first_end).total_seconds()


@pytest.mark.slow
async def test_the_agent_keeps_its_held_poll_across_a_spider_finishing(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    abandoned, tasks, runs, features = await _two_tasks_in_a_row(
        dev_master.base_url, dev_master.registration_token, dev_master.admin, nursery, tmp_path)
    assert POLL_FOLLOWS_RESULTS in features
    assert [t["status"] for t in tasks] == ["SUCCESS", "SUCCESS"], tasks
    ids = [t["id"] for t in tasks]
    assert runs == [f"start {ids[0]}", f"end {ids[0]}", f"start {ids[1]}", f"end {ids[1]}"]  # serial, once each
    assert _gap_seconds(tasks) < 5  # handed out by the held poll when the first result arrived, not after 20 s
    assert abandoned == 0  # no poll abandoned while the two tasks ran


@pytest.mark.slow
async def test_against_a_master_without_the_feature_the_agent_abandons_the_held_poll_as_before(
    master_without_the_feature: OldMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    old = master_without_the_feature
    abandoned, tasks, runs, features = await _two_tasks_in_a_row(old.base_url, old.registration_token, old.admin,
                                                             nursery, tmp_path)
    assert POLL_FOLLOWS_RESULTS not in features
    assert [t["status"] for t in tasks] == ["SUCCESS", "SUCCESS"], tasks
    ids = [t["id"] for t in tasks]
    assert runs == [f"start {ids[0]}", f"end {ids[0]}", f"start {ids[1]}", f"end {ids[1]}"]
    assert _gap_seconds(tasks) < 5  # the poll that excluded the spider was abandoned when it finished
    assert abandoned >= 1
