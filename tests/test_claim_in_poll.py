"""Claims in the poll answer (feature ``claim-in-poll``, docs/protocol.md "Claims in the poll answer").

- The reference master's rules (its store): a claiming poll claims atomically, one task per spider,
  none of the excluded spiders, at most ``claim``; a poll sent again with the same ``pollId`` gets
  the tasks it claimed before; a heartbeat that shows the poll settled takes its unadmitted claims
  back at once, one that does not (still open, or sent after the snapshot) leaves them to the grace.
- Over HTTP: the registration answer offers the feature; an older agent (no ``claim``) gets today's
  answer; ``claim`` without ``pollId`` is refused; a master started without the feature ignores
  ``claim``; a long poll whose client went away claims nothing.
- End to end (real agent, real master, tests/faultproxy.py between them): the poll answer that
  carried the claim is lost on the way → the task runs exactly once; a new agent against a master
  without the feature claims with ``POST .../result`` as before, and with it sends no claim at all.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from faultproxy import FaultProxy, Request
from harness import (
    Node,
    agent_settings,
    eventually,
    heartbeat_of,
    make_spider,
    register,
    running_agent,
    spider_writable,
    store_node,
    store_spider,
    store_task,
    submit,
)

from ckagent.devmaster.client import AdminClient, zip_files
from ckagent.devmaster.server import DevMasterConfig, serve
from ckagent.devmaster.store import Store
from ckagent.master.protocol import CLAIM_IN_POLL, Heartbeat

# --------------------------------------------------------------------------- the reference master's rules


def _polls(beat: Heartbeat, *, open_ids: list[int], last: int | None) -> Heartbeat:
    return Heartbeat(**{**beat.__dict__, "claim_poll_ids": open_ids, "last_claim_poll_id": last})


def test_a_claiming_poll_claims_atomically_and_a_resent_poll_gets_its_claims_again(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node, other = store_node(store), store_node(store, "n2")
        a, b, c = (store_spider(store, name) for name in "abc")
        a1, a2, b1, c1 = store_task(store, a), store_task(store, a), store_task(store, b), store_task(store, c)
        tasks, cancel = store.claim_pending(node, poll_id=7, limit=2, exclude_spider_ids=[c], base_url="")
        assert [t["id"] for t in tasks] == [a1, b1] and cancel == []  # oldest first, one per spider
        assert all(t["claimed"] is True for t in tasks)
        assert tasks[0]["codePackage"]["url"].startswith("/api/packages/")
        for task_id in (a1, b1):
            row = store.get_task(task_id)
            assert (row["status"], row["nodeId"]) == ("RUNNING", node) and row["claimedAt"]
        # The same poll again (its answer was lost): the same tasks, nothing more claimed.
        again, _ = store.claim_pending(node, poll_id=7, limit=2, exclude_spider_ids=[c], base_url="")
        assert [t["id"] for t in again] == [a1, b1]
        # Another node's poll gets what is left; the claimed ones are not handed out any more.
        theirs, _ = store.claim_pending(other, poll_id=7, limit=5, exclude_spider_ids=[], base_url="")
        assert [t["id"] for t in theirs] == [a2, c1]
        assert store.pending_tasks(limit=5, exclude_spider_ids=[], base_url="") == []
        # Nothing left: a claiming poll answers empty (and claims nothing).
        assert store.claim_pending(node, poll_id=8, limit=5, exclude_spider_ids=[], base_url="") == ([], [])
    finally:
        store.close()


def test_a_settled_polls_unadmitted_claims_go_back_at_once_others_wait_for_the_grace(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.sqlite")
    try:
        node = store_node(store)
        spiders = [store_spider(store, f"s{i}") for i in range(3)]
        for spider_id in spiders:
            store_task(store, spider_id)
        [admitted] = [t["id"] for t in store.claim_pending(node, poll_id=10, limit=1, exclude_spider_ids=[],
                                                            base_url="")[0]]
        [lost] = [t["id"] for t in store.claim_pending(node, poll_id=11, limit=1, exclude_spider_ids=[],
                                                        base_url="")[0]]
        [later] = [t["id"] for t in store.claim_pending(node, poll_id=12, limit=1, exclude_spider_ids=[],
                                                         base_url="")[0]]
        assert store.claim_grace_seconds == 60.0  # all three were claimed just now: within the grace
        # An older agent (no claimingTaskIds) is left alone; so is a beat with poll 11 still open.
        assert store.reconcile(node, heartbeat_of(running=[admitted])) == []
        assert store.reconcile(node, _polls(heartbeat_of(running=[admitted], claiming=[]), open_ids=[11], last=11)) == []
        # Poll 11 settled without its task reaching the node (lost): back at once; poll 12 was sent
        # after the beat's snapshot (above lastClaimPollId): its claim may be on its way, left alone.
        beat = _polls(heartbeat_of(running=[admitted], claiming=[]), open_ids=[], last=11)
        assert store.reconcile(node, beat) == [lost]
        statuses = {t: store.get_task(t)["status"] for t in (admitted, lost, later)}
        assert statuses == {admitted: "RUNNING", lost: "PENDING", later: "RUNNING"}
        # Given back, the task is an ordinary PENDING one: the next poll claims it afresh.
        tasks, _ = store.claim_pending(node, poll_id=13, limit=5, exclude_spider_ids=[], base_url="")
        assert [t["id"] for t in tasks] == [lost]
    finally:
        store.close()


# --------------------------------------------------------------------------- over HTTP


async def _claiming_poll(node: Node, *, poll_id: int | None, claim: int = 5, wait: float = 0) -> httpx.Response:
    params: dict[str, Any] = {"limit": 5, "waitSeconds": wait, "claim": claim}
    if poll_id is not None:
        params["pollId"] = poll_id
    return await node.http.get(f"/api/nodes/{node.node_id}/tasks/pending", params=params, headers=node.auth)


async def test_the_master_offers_the_feature_and_older_agents_get_todays_answer(dev_master: Any) -> None:
    async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=10) as http:
        answer = await http.post("/api/nodes/register", json={"name": "n", "port": 1, "cpuCount": 1,
                                                              "memoryTotalBytes": 1, "maxWorkers": 1},
                                 headers={"X-Registration-Token": dev_master.registration_token})
        assert CLAIM_IN_POLL in answer.json()["features"]
        node = await register(http, dev_master.registration_token)
        with trio.fail_after(20):
            spider = await make_spider(dev_master.admin)
            task_id = await dev_master.admin.create_task(spider)
            old = (await node.poll())["tasks"]  # an older agent asks without claim: handed out, not assigned
            assert [t["id"] for t in old] == [task_id] and "claimed" not in old[0]
            assert (await dev_master.admin.get_task(task_id))["status"] == "PENDING"
            refused = await _claiming_poll(node, poll_id=None)
            assert refused.status_code == 400 and "pollId" in refused.json()["error"]
            claimed = await _claiming_poll(node, poll_id=1)
            assert claimed.status_code == 200
            assert [(t["id"], t["claimed"]) for t in claimed.json()["tasks"]] == [(task_id, True)]
            assert (await dev_master.admin.get_task(task_id))["status"] == "RUNNING"
            assert (await node.poll())["tasks"] == []


@pytest.fixture
async def master_without_the_feature(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Any]:
    config = DevMasterConfig(db_path=tmp_path / "old-master.sqlite", registration_token=secrets.token_urlsafe(16),
                             admin_token=secrets.token_urlsafe(16), port=0, claim_in_poll=False)
    base_url = await nursery.start(serve, config)
    async with AdminClient(base_url, config.admin_token) as admin:
        yield base_url, config.registration_token, admin


async def test_a_master_without_the_feature_ignores_claim(master_without_the_feature: Any) -> None:
    base_url, token, admin = master_without_the_feature
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        answer = await http.post("/api/nodes/register", json={"name": "n", "port": 1, "cpuCount": 1,
                                                              "memoryTotalBytes": 1, "maxWorkers": 1},
                                 headers={"X-Registration-Token": token})
        assert CLAIM_IN_POLL not in answer.json().get("features", [])
        node = await register(http, token, "n2")
        with trio.fail_after(20):
            task_id = await admin.create_task(await make_spider(admin))
            tasks = (await _claiming_poll(node, poll_id=3)).json()["tasks"]
            assert [t["id"] for t in tasks] == [task_id] and "claimed" not in tasks[0]
            assert (await admin.get_task(task_id))["status"] == "PENDING"


async def test_a_long_poll_whose_client_went_away_claims_nothing(dev_master: Any) -> None:
    async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=10) as http:
        node = await register(http, dev_master.registration_token)
        spider = await make_spider(dev_master.admin)
        with trio.fail_after(20):
            with trio.move_on_after(0.5):  # the poll is held at the master, then the client gives up
                await _claiming_poll(node, poll_id=5, wait=10)
            await trio.sleep(0.3)  # real time: the master sees the connection close
            task_id = await dev_master.admin.create_task(spider)
            await trio.sleep(0.5)
            assert (await dev_master.admin.get_task(task_id))["status"] == "PENDING"


# --------------------------------------------------------------------------- end to end

ONCE = "import os\nwith open(os.environ['RUNS_FILE'], 'a') as f:\n    f.write(os.environ['CK_TASK_ID'] + '\\n')\n" \
       "print('ran', flush=True)\n"


class DropOnePoll:
    """FaultProxy chooser: once armed, the next poll is forwarded and its answer dropped (``drop_answer``)."""

    def __init__(self) -> None:
        self.armed = False
        self.dropped: list[float] = []

    def __call__(self, request: Request) -> str:
        if self.armed and request.call == "poll":
            self.armed = False
            self.dropped.append(trio.current_time())
            return "drop_answer"
        return "pass"


async def test_a_lost_claiming_poll_answer_runs_the_task_exactly_once(
    dev_master: Any, nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "ckagent.devmaster")
    chooser = DropOnePoll()
    proxy = FaultProxy(int(dev_master.base_url.rsplit(":", 1)[1]), chooser=chooser)
    proxy_port = await nursery.start(proxy.serve)
    runs = spider_writable(tmp_path / "shared") / "runs.txt"  # (the spider may run under a uid of its own)
    settings = agent_settings(tmp_path / "agent", f"http://127.0.0.1:{proxy_port}", dev_master.registration_token)
    async with running_agent(nursery, settings) as agent:
        assert CLAIM_IN_POLL in agent.master.features
        spider = await dev_master.admin.create_spider(name="once", framework="python")
        await dev_master.admin.upload_package(spider, zip_files({"main.py": ONCE}))
        chooser.armed = True

        async def drop_is_waiting() -> bool:  # the next poll (held at the master) will lose its answer
            return bool(chooser.dropped)

        await eventually(drop_is_waiting, 10)
        await trio.sleep(0.2)  # real time: the poll reaches the master and is held there
        task_id = await dev_master.admin.create_task(spider, env={"RUNS_FILE": str(runs)})
        task = await dev_master.admin.wait_task_final(task_id, 60)
    assert task["status"] == "SUCCESS", task
    assert runs.read_text().splitlines() == [task_id]  # exactly once
    assert [mode for _, call, mode in proxy.seen if call == "poll"].count("drop_answer") == 1
    assert not any(call == "claim" for _, call, _ in proxy.seen)  # no claim round trip
    # The poll's retry (same pollId) got the task again: no reconciliation had to give it back.
    assert not [r for r in caplog.records if "PENDING again" in r.getMessage()]
    assert not any(call == "release" for _, call, _ in proxy.seen)


async def test_a_new_agent_claims_as_before_against_a_master_without_the_feature(
    master_without_the_feature: Any, nursery: trio.Nursery, tmp_path: Path
) -> None:
    base_url, token, admin = master_without_the_feature
    proxy = FaultProxy(int(base_url.rsplit(":", 1)[1]))
    proxy_port = await nursery.start(proxy.serve)
    settings = agent_settings(tmp_path / "agent", f"http://127.0.0.1:{proxy_port}", token)
    async with running_agent(nursery, settings) as agent:
        assert CLAIM_IN_POLL not in agent.master.features
        task_id = await submit(admin, "old-master", {"main.py": "print('ran')\n"})
        task = await admin.wait_task_final(task_id, 60)
    assert task["status"] == "SUCCESS", task
    assert sum(1 for _, call, _ in proxy.seen if call == "claim") == 1
