"""The egress proxy's connections towards destinations: one kept-alive connection carries a task's
requests to one destination, one closed by its server while idle is never used again, and a task's
connections are its own (issue 34, item 1: "an upstream connection pool per destination").
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from harness import IdentityOrigin

from ckagent.containment.egress import open_egress, parse_text
from ckagent.containment.egress.proxy import Limits
from ckagent.containment.egress.proxy.server import connection_budget
from ckagent.containment.egress.proxy.upstream import Pool, Upstream
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


async def test_a_task_whose_programs_ignore_the_proxy_is_told_so_at_its_end(nursery: trio.Nursery) -> None:
    egress = open_egress("proxy", None, "ckagent_pool_test", parse_text("metadata,link-local", ""))
    await nursery.start(egress.serve)
    rules = await trio.to_thread.run_sync(egress.attach, None, "bypassed")
    notes: list[str] = []
    egress.task_env(rules, {}, notes.append)
    await trio.to_thread.run_sync(egress.detach, rules)
    assert notes[-1].startswith("egress proxy: no request came through the proxy")


class _Idle:
    """A pooled connection's stream, for the pool's bookkeeping alone (never read or written)."""

    class socket:
        @staticmethod
        def is_readable() -> bool:
            return False


def test_the_pool_holds_a_bounded_number_of_idle_connections_least_recently_used_out() -> None:
    """A crawl across many hosts must not keep a descriptor per host it met: past ``max_total`` the
    least recently used idle connection goes, and an expired one goes whenever the pool is used."""
    pool = Pool(max_idle=2, idle_timeout=60.0, max_total=5)
    ups = [Upstream(_Idle(), ("direct", f"h{i}", 80)) for i in range(8)]  # type: ignore[arg-type]
    closed = [up for up in ups for up in pool.give(up)]
    assert len(pool) == 5 and closed == ups[:3]
    taken, stale = pool.take(("direct", "h7", 80))
    assert taken is ups[7] and taken.reused and not stale and len(pool) == 4
    assert pool.take(("direct", "h0", 80)) == (None, [])
    extra = [Upstream(_Idle(), ("direct", "h3", 80)) for _ in range(2)]  # type: ignore[arg-type]
    assert [pool.give(up) for up in extra] == [[], [extra[1]]]  # (h3 holds max_idle = 2)
    pool.idle_timeout = -1.0  # everything idle has expired
    assert sorted(id(up) for up in pool.give(ups[7])) == sorted(id(u) for u in [*ups[3:7], extra[0]])
    assert len(pool) == 1  # (the one just given back)


async def test_the_proxy_serves_no_more_connections_than_its_descriptors_allow(nursery: trio.Nursery) -> None:
    origin = IdentityOrigin("127.0.0.2")
    await nursery.start(origin.serve)
    egress = open_egress("proxy", None, "ckagent_pool_test", parse_text("metadata,link-local", ""))
    await nursery.start(egress.serve)
    assert egress.server is not None
    egress.server.budget = 4
    a = await trio.to_thread.run_sync(egress.attach, None, "budget-a")
    b = await trio.to_thread.run_sync(egress.attach, None, "budget-b")
    assert egress.server.task_cap == 16  # (at least 16, at most half the budget)
    with trio.fail_after(20):
        held = [await trio.open_tcp_stream("127.0.0.1", egress.proxy_port(a)) for _ in range(4)]
        await trio.testing.wait_all_tasks_blocked()
        extra = await trio.open_tcp_stream("127.0.0.1", egress.proxy_port(b))
        answer = await extra.receive_some(4096)
        await extra.aclose()
        for stream in held:
            await stream.aclose()
    assert answer.startswith(b"HTTP/1.1 503") and egress.proxy_outcomes(b) == {"busy": 1}


def test_the_budget_follows_the_open_files_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert connection_budget() == (1024 - 256) // 6
    monkeypatch.setattr(resource, "getrlimit", lambda _: (300, 300))
    assert connection_budget() == 32


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
async def test_another_uid_cannot_speak_for_a_task_through_its_port(nursery: trio.Nursery) -> None:
    """Where each spider runs under a uid of its own, a connection to a task's port from another uid
    is closed (403) without counting against the task, and it reaches nothing."""
    origin = IdentityOrigin("127.0.0.2")
    await nursery.start(origin.serve)
    egress = open_egress("proxy", None, "ckagent_pool_test", parse_text("metadata,link-local", ""))
    await nursery.start(egress.serve)
    rules = await trio.to_thread.run_sync(partial(egress.attach, None, "owned", uid=os.geteuid()))
    port = egress.proxy_port(rules)
    script = (f"import socket,sys; s=socket.create_connection(('127.0.0.1',{port})); "
              f"s.sendall(b'GET http://127.0.0.2:{origin.port}/ HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n'); "
              "sys.stdout.write(s.recv(4096).decode(errors='replace'))")
    with trio.fail_after(30):
        other = await trio.run_process(["/usr/bin/python3", "-c", script], capture_stdout=True, user=65534, group=65534)
        async with httpx.AsyncClient(proxy=egress.task_env(rules)["HTTP_PROXY"]) as client:
            own = await client.get(f"http://127.0.0.2:{origin.port}/")
    assert other.stdout.startswith(b"HTTP/1.1 403") and b"belongs to another task" in other.stdout
    assert own.status_code == 200 and len(origin.seen) == 1
    assert egress.proxy_outcomes(rules) == {"forwarded": 1}
    assert egress.server is not None and egress.server.outcomes["foreign"] == 1
