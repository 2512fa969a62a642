"""The dev master over real HTTP on 127.0.0.1 with a real SQLite file: the protocol's contract."""

from __future__ import annotations

import contextlib
import hashlib
import re
import secrets
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
from harness import HEARTBEAT, SPIDER_FILES, Node, make_spider, make_zip, register, register_body

from ckagent.devmaster import demosite
from ckagent.devmaster.client import AdminApiError, AdminClient, zip_directory, zip_files
from ckagent.devmaster.errors import SchemaError
from ckagent.devmaster.store import SCHEMA_VERSION, Store
from ckagent.devmaster.store import database as store_database
from ckagent.master.protocol import SpiderFile, Task

if TYPE_CHECKING:
    from conftest import DevMaster, DevMasterProcess

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


# --------------------------------------------------------------------------- helpers


@pytest.fixture
async def http(dev_master: DevMaster) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=10) as client:
        yield client


@pytest.fixture
async def node(dev_master: DevMaster, http: httpx.AsyncClient) -> Node:
    return await register(http, dev_master.registration_token)


# --------------------------------------------------------------------------- registration and auth


async def test_register_needs_the_registration_token(dev_master: DevMaster, http: httpx.AsyncClient) -> None:
    with trio.fail_after(10):
        good = await register(http, dev_master.registration_token)
        assert good.node_id and len(good.api_key) >= 32
        for headers in ({"X-Registration-Token": "wrong"}, {}):
            r = await http.post("/api/nodes/register", json=register_body("x"), headers=headers)
            assert r.status_code == 401
            assert dev_master.registration_token not in r.text
        r = await http.post(
            "/api/nodes/register",
            json={**register_body("x"), "port": "nine"},
            headers={"X-Registration-Token": dev_master.registration_token},
        )
        assert r.status_code == 422
        assert r.json()["field"] == "port"


async def test_bad_key_is_401(dev_master: DevMaster, http: httpx.AsyncClient, node: Node) -> None:
    with trio.fail_after(10):
        assert (await node.heartbeat()).status_code == 200
        for headers in (
            {"Authorization": "Bearer " + secrets.token_urlsafe(32)},
            {"Authorization": f"Bearer {dev_master.admin_token}"},  # the admin token is not a node key
            {"Authorization": f"Basic {node.api_key}"},
            {},
        ):
            r = await http.post(f"/api/nodes/{node.node_id}/heartbeat", json=HEARTBEAT, headers=headers)
            assert r.status_code == 401, headers
            r = await http.get(f"/api/nodes/{node.node_id}/tasks/pending", headers=headers)
            assert r.status_code == 401
        other = await register(http, dev_master.registration_token, "node-b")
        r = await http.post(f"/api/nodes/{node.node_id}/heartbeat", json=HEARTBEAT, headers=other.auth)
        assert r.status_code == 403


async def test_reregister_keeps_id_and_revokes_old_key(
    dev_master: DevMaster, http: httpx.AsyncClient
) -> None:
    with trio.fail_after(10):
        first = await register(http, dev_master.registration_token, "same")
        second = await register(http, dev_master.registration_token, "same")
        assert second.node_id == first.node_id
        assert second.api_key != first.api_key
        assert (await first.heartbeat()).status_code == 401
        assert (await second.heartbeat()).status_code == 200
        assert [n["id"] for n in await dev_master.admin.list_nodes()] == [first.node_id]


async def test_heartbeat_figures_show_in_nodes(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(10):
        r = await node.heartbeat(cpuPercent=77.5, freeSlots=1)
        assert r.status_code == 200
        assert r.json() == {"cancelTaskIds": []}
        bad = await node.heartbeat(status="SLEEPING")
        assert bad.status_code == 422 and bad.json()["field"] == "status"
        [listed] = await dev_master.admin.list_nodes()
        assert listed["name"] == "node-a"
        assert listed["labels"] == {"zone": "test"}
        assert listed["maxWorkers"] == 2
        assert listed["lastHeartbeat"]["cpuPercent"] == 77.5
        assert listed["lastHeartbeat"]["freeSlots"] == 1
        assert listed["lastHeartbeatAt"].endswith("Z")


async def test_admin_api_needs_the_admin_token(
    dev_master: DevMaster, http: httpx.AsyncClient, node: Node
) -> None:
    with trio.fail_after(10):
        for headers in ({}, {"Authorization": "Bearer nope"}, node.auth):
            for method, path in (("GET", "/api/nodes"), ("GET", "/api/tasks"), ("POST", "/api/spiders")):
                r = await http.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path)
        async with AdminClient(dev_master.base_url, "wrong") as bad_admin:
            with pytest.raises(AdminApiError) as info:
                await bad_admin.list_nodes()
        assert info.value.status_code == 401


async def test_the_route_table_lists_what_is_served_by_side(
    dev_master: DevMaster, http: httpx.AsyncClient, node: Node, tmp_path: Path
) -> None:
    """route_table: every (method, path) it lists for a side is served and guarded as that side is
    (an admin route refuses a node key, a node route refuses the admin token); without artifacts the
    artifact routes are gone from the table too."""
    from ckagent.devmaster.app import Notifier, create_app, route_table

    store = Store(tmp_path / "table.db")
    try:
        app = create_app(store, Notifier(), registration_token="r", admin_token=dev_master.admin_token)
        node_side, admin_side = route_table(app, "node"), route_table(app, "admin")
        older = route_table(create_app(store, Notifier(), registration_token="r", admin_token="a", artifacts=False))
    finally:
        store.close()
    assert ("POST", "/api/nodes/register") in node_side and ("GET", "/api/nodes/{node_id}/tasks/pending") in node_side
    assert ("PATCH", "/api/spiders/{spider_id}") in admin_side and ("GET", "/api/tasks") in admin_side
    assert not set(node_side) & set(admin_side)
    assert set(route_table(app)) == {*node_side, *admin_side, *route_table(app, "page")}
    assert [p for p in route_table(app) if "artifacts" in p[1]] and not [p for p in older if "artifacts" in p[1]]
    with pytest.raises(ValueError, match="scope"):
        route_table(app, "nodes")
    admin_auth = {"Authorization": f"Bearer {dev_master.admin_token}"}
    with trio.fail_after(30):  # noqa: ASYNC912 (the route lists are non-empty: asserted above)
        for side, pairs, wrong in (("node", node_side, admin_auth), ("admin", admin_side, node.auth)):
            for method, template in pairs:
                if template == "/api/nodes/register":
                    continue
                path = re.sub(r"\{node_id\}", node.node_id, template)
                path = re.sub(r"\{(\w+)\}", "x", path)
                r = await http.request(method, path, headers=wrong, content=b"{}")
                assert r.status_code == 401, (side, method, path, r.status_code, r.text)

# --------------------------------------------------------------------------- polling and claims


async def test_claim_twice_second_is_409(dev_master: DevMaster, http: httpx.AsyncClient, node: Node) -> None:
    with trio.fail_after(10):
        other = await register(http, dev_master.registration_token, "node-b")
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        # handing a task out does not assign it: both nodes see it
        assert [t["id"] for t in (await node.poll())["tasks"]] == [task_id]
        assert [t["id"] for t in (await other.poll())["tasks"]] == [task_id]
        assert (await node.claim(task_id)).status_code == 200
        second = await other.claim(task_id)
        assert second.status_code == 409
        assert "error" in second.json()
        assert (await node.claim(task_id)).status_code == 200  # the same node again is fine
        task = await dev_master.admin.get_task(task_id)
        assert task["status"] == "RUNNING"
        assert task["nodeId"] == node.node_id
        assert task["startedAt"] == "2026-11-29T16:03:50.123Z"
        assert task["claimedAt"]
        assert (await other.poll())["tasks"] == []


async def test_claim_of_cancelled_task_is_409(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(10):
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        cancelled = await dev_master.admin.cancel_task(task_id)
        assert cancelled["status"] == "CANCELLED"
        assert cancelled["errorCode"] == "CANCELLED"
        assert (await node.poll())["tasks"] == []
        assert (await node.claim(task_id)).status_code == 409
        with pytest.raises(AdminApiError) as info:
            await dev_master.admin.cancel_task(task_id)
        assert info.value.status_code == 409


async def test_long_poll_returns_within_100ms_of_task_creation(dev_master: DevMaster, node: Node) -> None:
    spider = await make_spider(dev_master.admin)
    answer: dict[str, Any] = {}

    async def poll() -> None:
        answer["body"] = await node.poll(wait=10)
        answer["at"] = trio.current_time()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await trio.sleep(0.3)  # real time: let the poll reach the master and wait there
            assert "body" not in answer, "the long poll answered before any task existed"
            task_id = await dev_master.admin.create_task(spider)
            created_at = trio.current_time()
    assert [t["id"] for t in answer["body"]["tasks"]] == [task_id]
    latency = answer["at"] - created_at
    print(f"long poll answered {latency * 1000:.1f} ms after the task was created")
    assert latency < 0.1


async def test_long_poll_times_out_empty(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(10):
        start = trio.current_time()
        body = await node.poll(wait=0.3)
        elapsed = trio.current_time() - start
    assert body == {"tasks": [], "cancelTaskIds": []}
    assert 0.3 <= elapsed < 2.0
    with trio.fail_after(10):
        start = trio.current_time()
        assert await node.poll(wait=0) == {"tasks": [], "cancelTaskIds": []}
        assert trio.current_time() - start < 1.0


async def test_a_spiders_egress_is_validated_copied_into_its_tasks_and_sent(
    dev_master: DevMaster, http: httpx.AsyncClient, node: Node
) -> None:
    """egress: {deny, allow} on POST/PATCH /api/spiders (422 naming the entry), copied into its tasks,
    replaced by a task's own, in the poll answer as the agent parses it."""
    admin = dev_master.admin
    auth = {"Authorization": f"Bearer {dev_master.admin_token}"}
    with trio.fail_after(20):
        for bad, field in (({"deny": ["10.0.0.0/33"]}, "egress.deny"), ({"allow": ["10.0.0.5:0"]}, "egress.allow"),
                           ({"block": []}, "egress"), ({"deny": "private"}, "egress.deny"), ("private", "egress")):
            r = await http.post("/api/spiders", headers=auth, json={"name": "e", "framework": "python", "egress": bad})
            assert (r.status_code, r.json()["field"]) == (422, field), (bad, r.text)
        spider_id = await admin.create_spider("e", "python", egress={"deny": ["private", "192.0.2.7"],
                                                                    "allow": ["10.0.0.5:3128"]})
        policy = {"deny": ["private", "192.0.2.7/32"], "allow": ["10.0.0.5:3128"]}  # as the agent writes it
        assert (await admin.get_spider(spider_id))["egress"] == policy
        r = await http.patch(f"/api/spiders/{spider_id}", headers=auth, json={"egress": {"deny": ["bogus"]}})
        assert (r.status_code, r.json()["field"]) == (422, "egress.deny") and "bogus" in r.json()["error"], r.text
        await admin.upload_package(spider_id, make_zip(SPIDER_FILES))
        copied = await admin.create_task(spider_id)
        own = await admin.create_task(spider_id, egress={"deny": [], "allow": []})
        assert (await admin.get_task(copied))["egress"] == policy
        assert (await admin.get_task(own))["egress"] == {"deny": [], "allow": []}
        [first] = (await node.poll())["tasks"]
        assert first["id"] == copied and first["egress"] == policy
        parsed = Task.from_json(first)
        assert parsed.egress is not None and parsed.egress.describe() == "deny private, 192.0.2.7/32; allow 10.0.0.5:3128"
        assert (await admin.update_spider(spider_id, egress={"deny": ["loopback"]}))["egress"] == \
            {"deny": ["loopback"], "allow": []}
        assert (await admin.get_task(copied))["egress"] == policy  # a task keeps what it was created with
        assert (await admin.update_spider(spider_id, egress=None))["egress"] is None
        plain = await admin.create_task(spider_id)
        assert (await admin.get_task(plain))["egress"] is None


async def test_artifact_uploads_small_in_the_database_large_as_synced_files(
    dev_master: DevMaster, http: httpx.AsyncClient, node: Node
) -> None:
    """PUT .../artifacts/{path}: a small artifact is kept in the SQLite file with its record (one
    transaction), a large one as a file beside it; resends are acknowledged once, another digest at a
    held path is 409, a cut body 400, another node's upload 409; GET gives the bytes back."""
    from ckagent.devmaster.artifacts import INLINE_MAX_BYTES, blob_dir, blob_path

    small, large = secrets.token_bytes(1024), secrets.token_bytes(INLINE_MAX_BYTES + 1)
    digest = {data: hashlib.sha256(data).hexdigest() for data in (small, large)}

    def put(path: str, data: bytes, sha: str, who: Node = node) -> Any:
        return http.put(f"/api/tasks/{task_id}/artifacts/{path}", content=data,
                        headers={**who.auth, "X-Content-SHA256": sha})

    with trio.fail_after(30):
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        assert (await node.claim(task_id)).status_code == 200
        for _ in range(2):  # the second time: a resend after a lost answer
            for path, data in (("out/small.bin", small), ("out/large.bin", large)):
                r = await put(path, data, digest[data])
                assert (r.status_code, r.json()) == (200, {"path": path, "sizeBytes": len(data),
                                                           "sha256": digest[data]}), r.text
        assert (await put("out/small.bin", large, digest[large])).status_code == 409  # another file there
        assert (await put("out/cut.bin", small[:-1], digest[small])).status_code == 400
        other = await register(http, dev_master.registration_token, "node-b")
        assert (await put("out/theirs.bin", small, digest[small], other)).status_code == 409
        listed = await dev_master.admin.list_artifacts(task_id)
        assert [(a["path"], a["sizeBytes"]) for a in listed] == [("out/large.bin", len(large)),
                                                                 ("out/small.bin", len(small))]
        assert await dev_master.admin.get_artifact(task_id, "out/small.bin") == small
        assert await dev_master.admin.get_artifact(task_id, "out/large.bin") == large
    files = [p for p in blob_dir(dev_master.db_path).rglob("*") if p.is_file()]
    assert files == [blob_path(dev_master.db_path, digest[large])]  # no temporary leftovers, no small file
    with contextlib.closing(sqlite3.connect(dev_master.db_path)) as db:
        assert db.execute("SELECT sha256 FROM artifact_blobs").fetchall() == [(digest[small],)]


async def test_poll_one_task_per_spider_and_exclusions(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(10):
        spider_a = await make_spider(dev_master.admin, "a")
        spider_b = await make_spider(dev_master.admin, "b")
        a1 = await dev_master.admin.create_task(spider_a, args=["-a", "x=1"], params={"p": 1})
        a2 = await dev_master.admin.create_task(spider_a)
        b1 = await dev_master.admin.create_task(spider_b, env={"TOKEN": "t"}, timeout_seconds=5)
        tasks = (await node.poll(limit=10))["tasks"]
        assert [t["id"] for t in tasks] == [a1, b1]  # oldest first, one per spider
        first = tasks[0]
        assert first["spiderId"] == spider_a and first["spiderName"] == "a"
        assert first["framework"] == "python" and first["command"] == ["python", "main.py"]
        assert first["args"] == ["-a", "x=1"] and first["params"] == {"p": 1}
        assert first["codePackage"]["url"].startswith("/api/packages/")  # relative to the agent's server.url
        assert tasks[1]["env"] == {"TOKEN": "t"} and tasks[1]["timeoutSeconds"] == 5
        assert [t["id"] for t in (await node.poll(limit=1))["tasks"]] == [a1]
        assert [t["id"] for t in (await node.poll(exclude=[spider_a]))["tasks"]] == [b1]
        assert (await node.poll(exclude=[spider_a, spider_b]))["tasks"] == []
        assert (await node.claim(a1)).status_code == 200
        assert [t["id"] for t in (await node.poll())["tasks"]] == [a2, b1]
        r = await node.http.get(f"/api/nodes/{node.node_id}/tasks/pending?limit=0", headers=node.auth)
        assert r.status_code == 422 and r.json()["field"] == "limit"


async def test_package_urls_come_from_the_public_url_setting(nursery: trio.Nursery, tmp_path: Path) -> None:
    from ckagent.devmaster.server import DevMasterConfig, serve

    config = DevMasterConfig(db_path=tmp_path / "m.sqlite", registration_token=secrets.token_urlsafe(16),
                             admin_token=secrets.token_urlsafe(16), port=0,
                             public_url="https://crawl.example/master/")
    with trio.fail_after(10):
        base_url = await nursery.start(serve, config)
        async with AdminClient(base_url, config.admin_token) as admin, \
                httpx.AsyncClient(base_url=base_url, timeout=10) as http:
            spider = await make_spider(admin, "public")
            await admin.create_task(spider)
            node = await register(http, config.registration_token)
            (task,) = (await node.poll())["tasks"]
    assert task["codePackage"]["url"].startswith("https://crawl.example/master/api/packages/")


# --------------------------------------------------------------------------- results


async def test_final_result_is_idempotent(dev_master: DevMaster, http: httpx.AsyncClient, node: Node) -> None:
    with trio.fail_after(10):
        other = await register(http, dev_master.registration_token, "node-b")
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        assert (await node.claim(task_id)).status_code == 200
        assert (await other.result(task_id, "SUCCESS", exitCode=0)).status_code == 409
        final = {
            "exitCode": 0,
            "startedAt": "2026-11-29T16:03:50.123Z",
            "finishedAt": "2026-11-29T16:03:52.623Z",
            "durationMs": 2500,
            "itemCount": 3,
            "logLines": 7,
        }
        assert (await node.result(task_id, "SUCCESS", **final)).status_code == 200
        assert (await node.result(task_id, "SUCCESS", **final)).status_code == 200  # the same again
        assert (await node.result(task_id, "FAILED", errorCode="EXIT_NONZERO", exitCode=1)).status_code == 409
        assert (await node.claim(task_id)).status_code == 409  # final: no claim
        assert (await other.result(task_id, "SUCCESS", **final)).status_code == 409
        task = await dev_master.admin.get_task(task_id)
        assert task["status"] == "SUCCESS"
        assert task["exitCode"] == 0 and task["errorCode"] is None
        assert task["finishedAt"] == final["finishedAt"]
        assert (task["durationMs"], task["itemCount"], task["logLines"]) == (2500, 3, 7)
        bad = await node.result(task_id, "FAILED")  # FAILED needs an errorCode
        assert bad.status_code == 422 and bad.json()["field"] == "errorCode"


async def test_unclaimed_final_is_409_except_bad_task(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(10):
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        assert (await node.result(task_id, "FAILED", errorCode="EXIT_NONZERO")).status_code == 409
        assert (await node.result(task_id, "CANCELLED", errorCode="CANCELLED")).status_code == 409
        assert (await node.result(task_id, "SUCCESS", exitCode=0)).status_code == 409
        assert (await dev_master.admin.get_task(task_id))["status"] == "PENDING"
        bad = {"errorCode": "BAD_TASK", "errorMessage": "tasks[0].env.1X: not a valid name"}
        assert (await node.result(task_id, "FAILED", **bad)).status_code == 200
        assert (await node.result(task_id, "FAILED", **bad)).status_code == 200
        task = await dev_master.admin.get_task(task_id)
        assert (task["status"], task["errorCode"], task["nodeId"]) == ("FAILED", "BAD_TASK", node.node_id)
        assert (
            await node.http.post("/api/tasks/nope/result", json={"status": "RUNNING"}, headers=node.auth)
        ).status_code == 404


async def test_cancel_flow(dev_master: DevMaster, node: Node) -> None:
    admin = dev_master.admin
    with trio.fail_after(10):
        spider = await make_spider(admin)
        task_id = await admin.create_task(spider)
        assert (await node.claim(task_id)).status_code == 200
        assert (await node.heartbeat()).json() == {"cancelTaskIds": []}

        # a waiting long poll wakes up for the cancel request
        answer: dict[str, Any] = {}

        async def poll() -> None:
            answer["body"] = await node.poll(wait=10)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll)
            await trio.sleep(0.2)
            task = await admin.cancel_task(task_id)
            requested_at = trio.current_time()
        assert trio.current_time() - requested_at < 1.0
        assert task["status"] == "RUNNING" and task["cancelRequested"] is True
        assert answer["body"] == {"tasks": [], "cancelTaskIds": [task_id]}
        assert (await node.heartbeat()).json() == {"cancelTaskIds": [task_id]}
        assert (await node.poll())["cancelTaskIds"] == [task_id]

        assert (
            await node.result(task_id, "CANCELLED", errorCode="CANCELLED", exitCode=-15)
        ).status_code == 200
        assert (await node.heartbeat()).json() == {"cancelTaskIds": []}
        final = await admin.get_task(task_id)
        assert (final["status"], final["errorCode"]) == ("CANCELLED", "CANCELLED")
        with pytest.raises(AdminApiError) as info:
            await admin.cancel_task(task_id)
        assert info.value.status_code == 409


async def test_heartbeat_stops_tasks_the_node_should_not_run(
    dev_master: DevMaster, http: httpx.AsyncClient, node: Node
) -> None:
    admin = dev_master.admin
    with trio.fail_after(10):
        other = await register(http, dev_master.registration_token, "node-b")
        mine, theirs, finished, pending = [
            await admin.create_task(await make_spider(admin, name)) for name in ("m", "t", "f", "p")
        ]
        assert (await node.claim(mine)).status_code == 200
        assert (await other.claim(theirs)).status_code == 200
        assert (await node.claim(finished)).status_code == 200
        assert (await node.result(finished, "SUCCESS", exitCode=0)).status_code == 200
        running = [mine, theirs, finished, pending, "unknown-task"]
        answer = await node.heartbeat(runningTaskIds=running)
        # final or someone else's: stop it; its own running task, a pending one (claim in flight) or an
        # unknown id: leave alone
        assert answer.json() == {"cancelTaskIds": [theirs, finished]}
        await admin.cancel_task(mine)
        answer = await node.heartbeat(runningTaskIds=running)
        assert answer.json() == {"cancelTaskIds": [mine, theirs, finished]}


# --------------------------------------------------------------------------- logs and items


async def test_logs_seq_rules(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(10):
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        assert (await node.logs(task_id, 0, ["a"])).status_code == 409  # not claimed yet
        assert (await node.claim(task_id)).status_code == 200
        first = await node.logs(task_id, 0, ["a", "b", "c"])
        assert (first.status_code, first.json()) == (200, {"acceptedSeq": 3})
        repeat = await node.logs(task_id, 0, ["a", "b", "c"])
        assert (repeat.status_code, repeat.json()) == (200, {"acceptedSeq": 3})
        overlap = await node.logs(task_id, 1, ["B?", "C?", "d", "e"])  # only the tail d, e is new
        assert (overlap.status_code, overlap.json()) == (200, {"acceptedSeq": 5})
        gap = await node.logs(task_id, 7, ["h"])
        assert gap.status_code == 409
        assert gap.json()["expectedSeq"] == 5
        assert (await node.logs(task_id, 5, [])).json() == {"acceptedSeq": 5}
        assert (await node.logs(task_id, 5, ["f", "✓ ünïcode"])).json() == {"acceptedSeq": 7}
        assert await dev_master.admin.get_logs(task_id) == ["a", "b", "c", "d", "e", "f", "✓ ünïcode"]
        assert (await dev_master.admin.get_task(task_id))["storedLogLines"] == 7
        bad = await node.http.post(
            f"/api/tasks/{task_id}/logs", json={"seq": -1, "lines": []}, headers=node.auth
        )
        assert bad.status_code == 422 and bad.json()["field"] == "seq"


async def test_items_seq_rules(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(10):
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        assert (await node.claim(task_id)).status_code == 200
        items = [{"n": i, "title": f"Product {i:02d}", "nested": {"ok": True}} for i in range(6)]
        assert (await node.items(task_id, 0, items[:4])).json() == {"acceptedSeq": 4}
        assert (await node.items(task_id, 0, items[:2])).json() == {"acceptedSeq": 4}
        assert (await node.items(task_id, 2, items[2:6])).json() == {"acceptedSeq": 6}
        gap = await node.items(task_id, 9, items[:1])
        assert (gap.status_code, gap.json()["expectedSeq"]) == (409, 6)
        assert await dev_master.admin.get_items(task_id) == items
        assert (await dev_master.admin.get_task(task_id))["storedItems"] == 6
        not_object = await node.http.post(
            f"/api/tasks/{task_id}/items", json={"seq": 6, "items": [1]}, headers=node.auth
        )
        assert not_object.status_code == 422 and not_object.json()["field"] == "items[0]"


async def test_items_bodies_in_the_agents_form_and_others(dev_master: DevMaster, node: Node) -> None:
    """A body of exactly {"seq", "items"} (what the agent sends: its items as the spider wrote them)
    is stored as its own text; overlaps, other key orders, extra keys and broken bodies still get
    the general path's answers."""
    async def post(body: bytes) -> httpx.Response:
        return await node.http.post(f"/api/tasks/{task_id}/items", content=body,
                                    headers={**node.auth, "content-type": "application/json"})

    with trio.fail_after(10):
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        assert (await node.claim(task_id)).status_code == 200
        # The SDK's spacing, non-ASCII text, a U+2028 escape, a nested object: kept as written.
        first = b'{"seq":0,"items":[{"n": 0, "title": "caf\xc3\xa9 \\u2028"},{"n": 1, "tags": [1, {"a": null}]}]}'
        assert (await post(first)).json() == {"acceptedSeq": 2}
        # Overlapping (item 1 again): only the new one is stored, encoded anew.
        assert (await post(b' { "seq" : 1 , "items" : [{"n": 1, "tags": []}, {"n": 2}] } ')).json() == {
            "acceptedSeq": 3}
        # Another key order and an extra key: the general path.
        assert (await post(b'{"items":[{"n": 3}],"seq":3}')).json() == {"acceptedSeq": 4}
        assert (await post(b'{"seq":4,"items":[{"n": 4}],"note":"x"}')).json() == {"acceptedSeq": 5}
        # A duplicated key: the general path too (the last one wins, as in json.loads).
        assert (await post(b'{"seq":5,"items":[{"n": "dropped"}],"items":[{"n": 5}]}')).json() == {"acceptedSeq": 6}
        broken = await post(b'{"seq":6,"items":[{"n": 6}')
        assert broken.status_code == 400
        not_object = await post(b'{"seq":6,"items":[{"n": 6}, 7]}')
        assert not_object.status_code == 422 and not_object.json()["field"] == "items[1]"
        assert await dev_master.admin.get_items(task_id) == [
            {"n": 0, "title": "caf\u00e9 \u2028"}, {"n": 1, "tags": [1, {"a": None}]}, {"n": 2}, {"n": 3},
            {"n": 4}, {"n": 5}]


async def test_node_batches_answer_each_batch_as_its_own_endpoint_would(
    dev_master: DevMaster, http: httpx.AsyncClient
) -> None:
    """POST /api/nodes/{id}/batches (issue 18, "node-batches"): several tasks' logs and items in one
    request, one result per batch in order, each what the per-task endpoint answers (409 expectedSeq,
    404, 422 field); a registration answer offers the feature."""
    with trio.fail_after(10):
        r = await http.post("/api/nodes/register", json=register_body("batcher"),
                            headers={"X-Registration-Token": dev_master.registration_token})
        assert "node-batches" in r.json()["features"]
        node = Node(http=http, node_id=r.json()["nodeId"], api_key=r.json()["apiKey"])
        spider = await make_spider(dev_master.admin)
        one, two = await dev_master.admin.create_task(spider), await dev_master.admin.create_task(spider)
        for task_id in (one, two):
            assert (await node.claim(task_id)).status_code == 200
        url = f"/api/nodes/{node.node_id}/batches"
        batches = [
            {"taskId": one, "stream": "logs", "seq": 0, "lines": ["a", "b"]},
            {"taskId": two, "stream": "items", "seq": 0, "items": [{"n": 0}, {"n": 1}]},
            {"taskId": one, "stream": "logs", "seq": 2, "lines": ["c"]},  # follows the first one
            {"taskId": two, "stream": "logs", "seq": 5, "lines": ["gap"]},
            {"taskId": "no-such-task", "stream": "logs", "seq": 0, "lines": ["x"]},
            {"taskId": one, "stream": "items", "seq": 0, "items": [1]},
            {"taskId": one, "stream": "stats", "seq": 0},
        ]
        answer = await http.post(url, json={"batches": batches}, headers=node.auth)
        assert answer.status_code == 200, answer.text
        results = answer.json()["results"]
        assert results[:3] == [{"acceptedSeq": 2}, {"acceptedSeq": 2}, {"acceptedSeq": 3}]
        assert results[3]["status"] == 409 and results[3]["expectedSeq"] == 0
        assert results[4]["status"] == 404 and "error" in results[4]
        assert results[5]["status"] == 422 and results[5]["field"] == "items[0]"
        assert results[6]["status"] == 400
        assert await dev_master.admin.get_logs(one) == ["a", "b", "c"]
        assert await dev_master.admin.get_items(two) == [{"n": 0}, {"n": 1}]
        other = await register(http, dev_master.registration_token, "node-b")  # another node's key
        assert (await http.post(url, json={"batches": []}, headers=other.auth)).status_code == 403
        assert (await http.post(url, json={"nope": []}, headers=node.auth)).status_code == 400
        too_many = {"batches": [{"taskId": one, "stream": "logs", "seq": 3, "lines": []}] * 257}
        assert (await http.post(url, json=too_many, headers=node.auth)).status_code == 413


async def test_only_the_claiming_node_may_post(
    dev_master: DevMaster, http: httpx.AsyncClient, node: Node
) -> None:
    with trio.fail_after(10):
        other = await register(http, dev_master.registration_token, "node-b")
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        assert (await node.claim(task_id)).status_code == 200
        assert (await other.logs(task_id, 0, ["x"])).status_code == 409
        assert (await other.items(task_id, 0, [{"x": 1}])).status_code == 409
        assert (await node.logs(task_id, 0, ["x"])).status_code == 200
        assert (await dev_master.admin.get_logs(task_id)) == ["x"]


async def test_batch_and_body_limits(dev_master: DevMaster, node: Node) -> None:
    with trio.fail_after(20):
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        assert (await node.claim(task_id)).status_code == 200
        assert (await node.logs(task_id, 0, ["x"] * 5000)).json() == {"acceptedSeq": 5000}
        assert (await node.logs(task_id, 5000, ["x"] * 5001)).status_code == 413
        assert (await node.items(task_id, 0, [{}] * 5001)).status_code == 413
        huge = await node.logs(task_id, 5000, ["y" * (1024 * 1024)] * 9)
        assert huge.status_code == 413
        assert (await dev_master.admin.get_task(task_id))["storedLogLines"] == 5000


def chunk_rows(db_path: Path, table: str, task_id: str) -> list[tuple[Any, ...]]:
    """``(first_seq, count, ...)`` of a task's stored chunks, read straight from the SQLite file."""
    columns = "first_seq, count, format" if table == "task_log_chunks" else "first_seq, count"
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        return db.execute(
            f"SELECT {columns} FROM {table} WHERE task_id = ? ORDER BY first_seq", (task_id,)
        ).fetchall()


async def test_each_batch_is_one_chunk_and_reads_join_them_in_order(
    dev_master: DevMaster, http: httpx.AsyncClient, node: Node
) -> None:
    with trio.fail_after(20):
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        assert (await node.claim(task_id)).status_code == 200
        lines = [f"line {n}" for n in range(5000)]
        assert (await node.logs(task_id, 0, lines[:3000])).json() == {"acceptedSeq": 3000}
        assert (await node.logs(task_id, 2000, lines[2000:5000])).json() == {"acceptedSeq": 5000}  # overlap
        assert (await node.logs(task_id, 0, lines[:10])).json() == {"acceptedSeq": 5000}  # repeat
        # lines an agent never sends but the protocol allows: newlines inside, empty, \r, non-ASCII
        odd = ["two\nlines", "", "cr\rinside", "\n", "✓ ünïcode \u2028"]
        assert (await node.logs(task_id, 5000, odd)).json() == {"acceptedSeq": 5005}
        assert (await node.logs(task_id, 5005, ["", "last"])).json() == {"acceptedSeq": 5007}
        rows = await trio.to_thread.run_sync(chunk_rows, dev_master.db_path, "task_log_chunks", task_id)
        assert rows == [(0, 3000, "lines"), (3000, 2000, "lines"), (5000, 5, "json"), (5005, 2, "lines")]
        expected = [*lines, *odd, "", "last"]
        admin = {"Authorization": f"Bearer {dev_master.admin_token}"}
        assert (await http.get(f"/api/tasks/{task_id}/logs", headers=admin)).text == "\n".join(expected)
        assert (await dev_master.admin.get_task(task_id))["storedLogLines"] == len(expected)

        items = [{"n": n, "title": f"Product {n}", "tags": ["a", "✓"]} for n in range(120)]
        assert (await node.items(task_id, 0, items[:50])).json() == {"acceptedSeq": 50}
        assert (await node.items(task_id, 40, items[40:120])).json() == {"acceptedSeq": 120}
        assert (await node.items(task_id, 100, items[100:110])).json() == {"acceptedSeq": 120}
        rows = await trio.to_thread.run_sync(chunk_rows, dev_master.db_path, "task_item_chunks", task_id)
        assert rows == [(0, 50), (50, 70)]
        assert await dev_master.admin.get_items(task_id) == items
        assert (await dev_master.admin.get_task(task_id))["storedItems"] == 120


async def test_a_task_without_logs_or_items_reads_empty(
    dev_master: DevMaster, http: httpx.AsyncClient, node: Node
) -> None:
    with trio.fail_after(10):
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        admin = {"Authorization": f"Bearer {dev_master.admin_token}"}
        logs = await http.get(f"/api/tasks/{task_id}/logs", headers=admin)
        assert (logs.text, logs.headers["content-type"]) == ("", "text/plain; charset=utf-8")
        items = await http.get(f"/api/tasks/{task_id}/items", headers=admin)
        assert (items.json(), items.headers["content-type"]) == ([], "application/json")
        assert (await node.claim(task_id)).status_code == 200
        assert (await node.logs(task_id, 0, [""])).json() == {"acceptedSeq": 1}  # one empty line
        assert await dev_master.admin.get_logs(task_id) == []  # the client cannot tell: the text is ""
        assert (await dev_master.admin.get_task(task_id))["storedLogLines"] == 1
        with pytest.raises(AdminApiError) as missing:
            await dev_master.admin.get_logs("no-such-task")
        assert missing.value.status_code == 404


def test_a_database_of_another_layout_is_refused_untouched(tmp_path: Path) -> None:
    old = tmp_path / "old.sqlite"
    with contextlib.closing(sqlite3.connect(old)) as db:  # what the per-line dev master wrote
        db.execute("CREATE TABLE task_logs (task_id TEXT, seq INTEGER, line TEXT, PRIMARY KEY (task_id, seq))")
        db.execute("INSERT INTO task_logs VALUES ('t', 0, 'kept')")
        db.commit()
    with pytest.raises(SchemaError, match=r"old\.sqlite .*schema version 2 \(it has version 0: an older"):
        Store(old)
    with contextlib.closing(sqlite3.connect(old)) as db:
        assert db.execute("SELECT line FROM task_logs").fetchall() == [("kept",)]
        assert db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall() == [("task_logs",)]

    newer = tmp_path / "newer.sqlite"
    with contextlib.closing(sqlite3.connect(newer)) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(SchemaError, match="it has version 99"):
        Store(newer)

    fresh = tmp_path / "fresh.sqlite"
    Store(fresh).close()
    Store(fresh).close()  # its own file opens again
    with contextlib.closing(sqlite3.connect(fresh)) as db:
        assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)


# --------------------------------------------------------------------------- code


async def test_spider_files_and_package_download(
    dev_master: DevMaster, http: httpx.AsyncClient, node: Node, tmp_path: Path
) -> None:
    admin = dev_master.admin
    with trio.fail_after(10):
        source = tmp_path / "spider"
        (source / "pkg").mkdir(parents=True)
        (source / "__pycache__").mkdir()
        (source / "main.py").write_text("print('hi')\n")
        (source / "pkg" / "util.py").write_text("X = 1\n")
        (source / "run.sh").write_text("#!/bin/sh\n")
        (source / "run.sh").chmod(0o755)
        (source / "__pycache__" / "main.cpython-311.pyc").write_bytes(b"junk")
        package = await trio.to_thread.run_sync(zip_directory, source)
        assert package == await trio.to_thread.run_sync(zip_directory, source)  # deterministic

        files_spider = await admin.create_spider("files", "python", code_mode="files")
        with pytest.raises(AdminApiError) as info:
            await admin.create_task(files_spider)  # no package yet
        assert info.value.status_code == 409
        assert (await http.get(f"/api/spider-files/spider/{files_spider}", headers=node.auth)).json() == []
        uploaded = await admin.upload_package(files_spider, package)
        assert uploaded["sha256"] == hashlib.sha256(package).hexdigest()
        assert uploaded["codeVersion"] == uploaded["sha256"][:12]

        r = await http.get(f"/api/spider-files/spider/{files_spider}", headers=node.auth)
        listing = SpiderFile.list_from_json(r.json())
        assert [f.path for f in listing] == ["main.py", "pkg/util.py", "run.sh"]
        for entry in listing:
            assert (await http.get(f"/api/spider-files/{entry.id}")).status_code == 401
            content = (await http.get(f"/api/spider-files/{entry.id}", headers=node.auth)).content
            assert hashlib.sha256(content).hexdigest() == entry.sha256
            assert len(content) == entry.size_bytes
            assert content == (source / entry.path).read_bytes()
        assert (await http.get("/api/spider-files/nope", headers=node.auth)).status_code == 404

        files_task = await admin.create_task(files_spider)
        [handed] = (await node.poll())["tasks"]
        assert handed["id"] == files_task
        assert handed["codePackage"] is None and handed["codeVersion"] == uploaded["codeVersion"]

        zip_spider = await admin.create_spider("zipped", "python")
        zipped = await admin.upload_package(zip_spider, package)
        await admin.create_task(zip_spider)
        [handed] = (await node.poll(exclude=[files_spider]))["tasks"]
        code = handed["codePackage"]
        assert code["sha256"] == zipped["sha256"] and code["sizeBytes"] == len(package)
        assert (await http.get(code["url"])).status_code == 401
        download = await http.get(code["url"], headers=node.auth)
        assert download.status_code == 200 and download.content == package
        missing = f"{dev_master.base_url}/api/packages/{zip_spider}/000000000000.zip"
        assert (await http.get(missing, headers=node.auth)).status_code == 404

        with pytest.raises(AdminApiError) as info:
            await admin.upload_package(zip_spider, b"not a zip")
        assert info.value.status_code == 400
        spiders = {s["id"]: s for s in await admin.list_spiders()}
        assert spiders[zip_spider]["codeVersion"] == zipped["codeVersion"]


# --------------------------------------------------------------------------- demo site


async def test_demo_site_pages(dev_master: DevMaster, http: httpx.AsyncClient) -> None:
    item = re.compile(
        r'<li class="product"><a class="title" href="(/demo-site/product/\d+/)">([^<]+)</a>'
        r' <span class="price">([^<]+)</span> <span class="sku">([^<]+)</span></li>'
    )
    with trio.fail_after(10):
        seen: list[dict[str, str]] = []
        url: str | None = "/demo-site/"
        pages = 0
        while url is not None:
            r = await http.get(url)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            pages += 1
            assert f"<title>Demo shop – page {pages}</title>" in r.text
            seen += [{"url": u, "title": t, "price": p, "sku": s} for u, t, p, s in item.findall(r.text)]
            found = re.search(r'<a class="next" href="([^"]+)">next</a>', r.text)
            url = found.group(1) if found else None
        assert pages == 5
        assert seen == demosite.expected_products()
        assert seen[0] == {
            "url": "/demo-site/product/1/",
            "title": "Product 01",
            "price": "3.99",
            "sku": "SKU-0001",
        }
        assert (await http.get("/demo-site/page/1/")).text == (await http.get("/demo-site/")).text
        detail = (await http.get("/demo-site/product/7/")).text
        assert '<h1 class="title">Product 07</h1>' in detail
        assert '<span class="price">21.99</span>' in detail and '<span class="sku">SKU-0007</span>' in detail
        assert '<p class="description">Description of product 07.</p>' in detail
        for missing in (
            "/demo-site/page/6/",
            "/demo-site/page/0/",
            "/demo-site/product/31/",
            "/demo-site/nope",
        ):
            assert (await http.get(missing)).status_code == 404, missing


# --------------------------------------------------------------------------- restarts


async def test_data_survives_a_restart(dev_master_process: DevMasterProcess) -> None:
    master = dev_master_process
    with trio.fail_after(60):
        base_url = await master.start()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", base_url)
        async with master.admin() as admin, httpx.AsyncClient(base_url=base_url) as http:
            node = await register(http, master.registration_token)
            spider = await make_spider(admin)
            task_id = await admin.create_task(spider)
            assert (await node.claim(task_id)).status_code == 200
            assert (await node.logs(task_id, 0, ["one", "two"])).status_code == 200
            assert (await node.items(task_id, 0, [{"a": 1}])).status_code == 200
        assert await master.stop() == 0  # SIGTERM: a clean exit

        expected_logs = ["one", "two"]
        for restart in ("after SIGTERM", "after SIGKILL"):
            base_url = await master.start()
            async with master.admin() as admin, httpx.AsyncClient(base_url=base_url) as http:
                task = await admin.get_task(task_id)
                assert (task["status"], task["nodeId"]) == ("RUNNING", node.node_id), restart
                assert await admin.get_logs(task_id) == expected_logs, restart
                assert await admin.get_items(task_id) == [{"a": 1}], restart
                assert [n["id"] for n in await admin.list_nodes()] == [node.node_id]
                node.http = http  # the api key survives too
                accepted = await node.logs(task_id, 0, [*expected_logs, restart])
                expected_logs.append(restart)
                assert accepted.json() == {"acceptedSeq": len(expected_logs)}
            await master.kill()  # a crash right after the write: it must survive too
        stderr = master.stderr_path.read_text()
        for secret in (master.registration_token, master.admin_token, node.api_key):
            assert secret not in stderr


async def test_database_is_one_sqlite_file_in_wal_mode(dev_master: DevMaster) -> None:
    def journal_mode() -> str:
        with contextlib.closing(sqlite3.connect(dev_master.db_path)) as db:
            return str(db.execute("PRAGMA journal_mode").fetchone()[0])

    assert await trio.to_thread.run_sync(journal_mode) == "wal"


async def test_wal_checkpoints_run_off_the_request_path_and_keep_the_wal_bounded(
    dev_master: DevMaster, node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's autocheckpoint is off (it would stall whichever batch crossed it): the checkpointer
    thread copies the WAL into the database file once CHECKPOINT_BYTES were written, and a write
    truncates it every WAL_LIMIT_BYTES."""
    monkeypatch.setattr(store_database, "WAL_LIMIT_BYTES", 9_000_000)
    with trio.fail_after(30):
        spider = await make_spider(dev_master.admin)
        task_id = await dev_master.admin.create_task(spider)
        assert (await node.claim(task_id)).status_code == 200
        line = "x" * 190

        async def post(batch: int) -> None:  # ~3.8 MB, in batches of 5000 lines
            lines = [f"{batch * 20000 + n:08d} {line}" for n in range(20000)]
            for start in range(0, 20000, 5000):
                seq = batch * 20000 + start
                answer = await node.logs(task_id, seq, lines[start : start + 5000])
                assert answer.json() == {"acceptedSeq": seq + 5000}

        await post(0)
        await post(1)  # 7.6 MB: under the WAL limit, so only the checkpointer moves pages into the database
        for _ in range(200):
            if dev_master.db_path.stat().st_size > 3_000_000:
                break
            await trio.sleep(0.05)
        assert dev_master.db_path.stat().st_size > 3_000_000
        await post(2)
        await post(3)
        wal = dev_master.db_path.with_name(dev_master.db_path.name + "-wal")
        assert wal.stat().st_size < 8_000_000  # truncated past 9 MB, not one ever-growing file
        assert (await dev_master.admin.get_task(task_id))["storedLogLines"] == 80000
        assert (await dev_master.admin.get_logs(task_id))[-1] == f"{79999:08d} {line}"


async def test_patch_spider_changes_what_later_tasks_run(dev_master: DevMaster, http: httpx.AsyncClient,
                                                        node: Node) -> None:
    admin = dev_master.admin
    with trio.fail_after(10):
        spider = await admin.create_spider("patched", "python", command="python old.py", env={"A": "1"})
        await admin.upload_package(spider, zip_files({"main.py": "", "new.py": ""}))
        before = await admin.create_task(spider)
        changed = await admin.update_spider(spider, command=["python", "new.py"], env={"B": "2"},
                                            timeoutSeconds=30, framework="scrapy")
        assert (changed["command"], changed["env"], changed["timeoutSeconds"], changed["framework"]) == (
            ["python", "new.py"], {"B": "2"}, 30.0, "scrapy")
        assert changed["name"] == "patched"  # fields not given are kept
        after = await admin.create_task(spider)
        tasks = {t: await admin.get_task(t) for t in (before, after)}
        assert tasks[before]["command"] == "python old.py" and tasks[before]["env"] == {"A": "1"}
        assert tasks[after]["command"] == ["python", "new.py"] and tasks[after]["env"] == {"B": "2"}
        assert tasks[after]["framework"] == "scrapy" and tasks[after]["timeoutSeconds"] == 30.0
        # null clears the command and the timeout: the framework's default applies again.
        cleared = await admin.update_spider(spider, command=None, timeoutSeconds=None)
        assert cleared["command"] is None and cleared["timeoutSeconds"] is None
        for bad in ({"codeMode": "files"}, {"framework": "cobol"}, {"command": []}, {"env": {"A": 1}}):
            with pytest.raises(AdminApiError) as info:
                await admin.update_spider(spider, **bad)
            assert info.value.status_code == 422, bad
        with pytest.raises(AdminApiError) as info:
            await admin.update_spider("no-such-spider", command="x")
        assert info.value.status_code == 404


async def test_spider_resources_and_stop_signal_are_task_defaults(dev_master: DevMaster, node: Node) -> None:
    admin = dev_master.admin
    with trio.fail_after(10):
        spider = await admin.create_spider("limited", "python", resources={"memoryBytes": 256 << 20, "pids": 64},
                                           stop_signal="SIGINT")
        await admin.upload_package(spider, zip_files({"main.py": ""}))
        first = await admin.create_task(spider, resources={"pids": 10})  # per key over the spider's
        changed = await admin.update_spider(spider, resources={"cpus": 0.5}, stopSignal=None)
        assert (changed["resources"], changed["stopSignal"]) == ({"cpus": 0.5}, None)
        second = await admin.create_task(spider)
        tasks = {t: await admin.get_task(t) for t in (first, second)}
        assert tasks[first]["resources"] == {"memoryBytes": 256 << 20, "pids": 10}
        assert tasks[first]["stopSignal"] == "SIGINT"
        assert (tasks[second]["resources"], tasks[second]["stopSignal"]) == ({"cpus": 0.5}, None)
        for bad in ({"stopSignal": "SIGKILL"}, {"resources": {"memoryBytes": 5}}, {"resources": {"pids": "x"}}):
            with pytest.raises(AdminApiError) as info:
                await admin.update_spider(spider, **bad)
            assert info.value.status_code == 422, bad


async def test_stop_grace_and_clean_start_reach_the_node_in_the_poll_answer(dev_master: DevMaster, node: Node) -> None:
    """A spider's stopGraceSeconds is its tasks' default (a task's own wins); a task's cleanStart is sent
    only when true; both as the node protocol says (docs/protocol.md, Task fields)."""
    admin = dev_master.admin
    with trio.fail_after(10):
        spider = await admin.create_spider("polite", "scrapy", stop_grace_seconds=240)
        await admin.upload_package(spider, zip_files({"scrapy.cfg": ""}))
        default = await admin.create_task(spider, clean_start=True)
        own = await admin.create_task(spider, stop_grace_seconds=30)
        assert (await admin.get_spider(spider))["stopGraceSeconds"] == 240
        assert [(await admin.get_task(t))["stopGraceSeconds"] for t in (default, own)] == [240, 30]
        assert [(await admin.get_task(t))["cleanStart"] for t in (default, own)] == [True, False]
        seen: dict[str, Any] = {}
        for _ in range(2):  # one task per spider per answer
            for wire in (await node.poll(limit=10))["tasks"]:
                seen[wire["id"]] = wire
                await node.claim(wire["id"])
        assert (seen[default]["stopGraceSeconds"], seen[default].get("cleanStart")) == (240, True)
        assert (seen[own]["stopGraceSeconds"], seen[own].get("cleanStart")) == (30, None)
        assert Task.from_json(seen[default]).clean_start and not Task.from_json(seen[own]).clean_start
        for bad in ({"stopGraceSeconds": -1}, {"cleanStart": "yes"}):
            with pytest.raises(AdminApiError) as info:
                await admin._call("POST", f"/api/spiders/{spider}/tasks", json=bad)
            assert info.value.status_code == 422, bad


async def test_a_misspelt_key_of_a_spider_or_task_is_refused_naming_it(
    dev_master: DevMaster, http: httpx.AsyncClient
) -> None:
    """A key the admin API does not know is a 422 naming it (with the closest known one), not a spider
    or task quietly made without what the caller meant (``timeout`` for ``timeoutSeconds``)."""
    auth = {"Authorization": f"Bearer {dev_master.admin_token}"}
    with trio.fail_after(20):
        r = await http.post("/api/spiders", headers=auth, json={"name": "t", "framework": "python", "timeout": 10})
        assert (r.status_code, r.json()["field"]) == (422, "timeout"), r.text
        assert "did you mean 'timeoutSeconds'?" in r.json()["error"], r.text
        r = await http.post("/api/spiders", headers=auth, json={"name": "t", "framework": "python", "output": {}})
        assert (r.status_code, r.json()["field"]) == (422, "output") and "'outputs'" in r.json()["error"], r.text
        spider_id = await dev_master.admin.create_spider("t", "python")  # the client's own keys are all known
        await dev_master.admin.upload_package(spider_id, make_zip(SPIDER_FILES))
        r = await http.post(f"/api/spiders/{spider_id}/tasks", headers=auth, json={"envv": {"A": "1"}})
        assert (r.status_code, r.json()["field"]) == (422, "envv") and "'env'" in r.json()["error"], r.text
        assert await dev_master.admin.create_task(spider_id)
        assert [t for t in await dev_master.admin.list_tasks() if t["spiderId"] == spider_id] != []
