"""The egress proxy's connections towards destinations: one kept-alive connection carries a task's
requests to one destination, one closed by its server while idle is never used again, and a task's
connections are its own (issue 34, item 1: "an upstream connection pool per destination").
"""

from __future__ import annotations

from pathlib import Path

import httpx
import trio
import trio.testing
from harness import IdentityOrigin

from ckagent.containment.egress import open_egress, parse_text
from ckagent.containment.egress.proxy import Limits
from ckagent.node.agentports import PortRegistry


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


async def test_a_task_holding_its_limit_of_connections_gets_503_for_one_more(nursery: trio.Nursery) -> None:
    """A spider that floods its proxy with connections gets 503 for those over its limit, not the
    agent's file descriptors; a connection freed is a connection it may open again."""
    origin = IdentityOrigin("127.0.0.2")
    await nursery.start(origin.serve)
    egress = open_egress("proxy", None, "ckagent_pool_test", parse_text("metadata,link-local", ""))
    await nursery.start(egress.serve)
    assert egress.server is not None
    egress.server.limits = Limits(max_connections=3)
    rules = await trio.to_thread.run_sync(egress.attach, None, "flood")
    port = egress.proxy_port(rules)
    with trio.fail_after(20):
        held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
        extra = await trio.open_tcp_stream("127.0.0.1", port)
        answer = b""
        while chunk := await extra.receive_some(4096):
            answer += chunk
        await extra.aclose()
        await held.pop().aclose()
        await trio.testing.wait_all_tasks_blocked()  # (the proxy has seen that close)
        async with httpx.AsyncClient(proxy=egress.task_env(rules)["HTTP_PROXY"]) as client:
            served = await client.get(f"http://127.0.0.2:{origin.port}/")
        for stream in held:
            await stream.aclose()
    assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
    assert served.status_code == 200
    assert egress.proxy_outcomes(rules) == {"busy": 1, "forwarded": 1}


async def test_a_tasks_proxy_port_is_an_agents_port_for_every_agent_on_the_host(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Another agent's task must not reach this agent's task listeners (it would be served as that
    task): each is in the host's registry of agents' ports while the task runs, and the `agent`
    group refuses it; it leaves the registry with the task."""
    origin = IdentityOrigin("127.0.0.2")
    await nursery.start(origin.serve)
    ours = open_egress("proxy", None, "ckagent_pool_a", parse_text("metadata,link-local,agent", ""),
                       registry=PortRegistry(tmp_path / "ports", work_dir=tmp_path / "a"))
    theirs = open_egress("proxy", None, "ckagent_pool_b", parse_text("metadata,link-local,agent", ""),
                         registry=PortRegistry(tmp_path / "ports", work_dir=tmp_path / "b", liveness_interval=0))
    await nursery.start(ours.serve)
    await nursery.start(theirs.serve)
    mine = await trio.to_thread.run_sync(ours.attach, None, "ours")
    other = await trio.to_thread.run_sync(theirs.attach, None, "theirs")
    port = ours.proxy_port(mine)
    with trio.fail_after(20):
        async with httpx.AsyncClient(proxy=theirs.task_env(other)["HTTP_PROXY"]) as client:
            refused = await client.get(f"http://127.0.0.1:{port}/")
            fine = await client.get(f"http://127.0.0.2:{origin.port}/")
    assert (refused.status_code, fine.status_code) == (403, 200)
    assert port in theirs.agent_ports()
    await trio.to_thread.run_sync(ours.detach, mine)
    assert port not in theirs.agent_ports()


async def test_the_task_log_says_at_its_end_what_the_proxy_answered_itself(nursery: trio.Nursery) -> None:
    origin = IdentityOrigin("127.0.0.2")
    await nursery.start(origin.serve)
    egress = open_egress("proxy", None, "ckagent_pool_test", parse_text("metadata,link-local", ""))
    await nursery.start(egress.serve)
    rules = await trio.to_thread.run_sync(egress.attach, None, "summary")
    notes: list[str] = []
    url = egress.task_env(rules, {}, notes.append)["HTTP_PROXY"]
    with trio.fail_after(20):
        async with httpx.AsyncClient(proxy=url) as client:
            for path in ("a", "b"):
                await client.get(f"http://127.0.0.2:{origin.port}/{path}")
            for _ in range(3):
                assert (await client.get("http://a..b/")).status_code == 400
    await trio.to_thread.run_sync(egress.detach, rules)
    assert len([n for n in notes if "a..b" in n]) == 1  # (said once while it runs)
    assert notes[-1] == "egress proxy: 2 requests forwarded; answered by the proxy: 400 bad-request ×3"
