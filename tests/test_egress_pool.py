"""The egress proxy's connections towards destinations: one kept-alive connection carries a task's
requests to one destination, one closed by its server while idle is never used again, and a task's
connections are its own (issue 34, item 1: "an upstream connection pool per destination").
"""

from __future__ import annotations

import httpx
import trio
from harness import IdentityOrigin

from ckagent.containment.egress import open_egress, parse_text


async def _proxy_url(nursery: trio.Nursery, task_id: str) -> str:
    egress = open_egress("proxy", None, "ckagent_pool_test", parse_text("metadata,link-local", ""))
    await nursery.start(egress.serve)
    rules = await trio.to_thread.run_sync(egress.attach, None, task_id)
    return egress.task_env(rules)["HTTP_PROXY"]


async def test_a_keep_alive_client_costs_one_connection_per_destination(nursery: trio.Nursery) -> None:
    a, b = IdentityOrigin("127.0.0.2"), IdentityOrigin("127.0.0.3")
    await nursery.start(a.serve)
    await nursery.start(b.serve)
    url = await _proxy_url(nursery, "pool-1")
    with trio.fail_after(20):
        async with httpx.AsyncClient(proxy=url) as client:
            for i in range(20):
                origin = a if i % 3 else b
                answer = await client.get(f"http://{origin.host}:{origin.port}/{i}")
                assert answer.json()["host"] == origin.host
    assert (a.connections, b.connections) == (1, 1)
    assert len(a.seen) + len(b.seen) == 20


async def test_a_connection_its_server_closed_while_idle_is_not_used_again(nursery: trio.Nursery) -> None:
    origin = IdentityOrigin("127.0.0.2", close_after_answer=True)
    await nursery.start(origin.serve)
    url = await _proxy_url(nursery, "pool-2")
    with trio.fail_after(20):
        async with httpx.AsyncClient(proxy=url) as client:
            answers = []
            for i in range(5):
                answers.append(await client.get(f"http://127.0.0.2:{origin.port}/{i}"))
    assert [a.status_code for a in answers] == [200] * 5
    assert [a.json()["connection"] for a in answers] == [1, 2, 3, 4, 5]


async def test_two_tasks_never_share_a_connection(nursery: trio.Nursery) -> None:
    origin = IdentityOrigin("127.0.0.2")
    await nursery.start(origin.serve)
    egress = open_egress("proxy", None, "ckagent_pool_test", parse_text("metadata,link-local", ""))
    await nursery.start(egress.serve)
    urls = []
    for task_id in ("pool-a", "pool-b"):
        rules = await trio.to_thread.run_sync(egress.attach, None, task_id)
        urls.append(egress.task_env(rules)["HTTP_PROXY"])
    for url in urls * 2:
        with trio.fail_after(20):
            async with httpx.AsyncClient(proxy=url) as client:
                await client.get(f"http://127.0.0.2:{origin.port}/")
    assert origin.connections == 2
