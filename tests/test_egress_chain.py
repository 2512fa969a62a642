"""A task's own proxies keep working behind the agent's egress proxy (issue 34, item 4).

The agent's proxy checks each destination, then forwards through the task's proxy: an HTTP proxy
(absolute-form requests and CONNECT, its credentials passed on, the agent's never), a SOCKS5 proxy
(user and password; ``socks5h`` names resolved by it), ``NO_PROXY`` hosts direct. Servers are on
loopback only (tests/harness/upstreams.py).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import trio
from harness import IdentityOrigin, RecordingProxy, Socks5Server

from ckagent.containment.egress import Egress, open_egress, parse_text
from ckagent.containment.egress.proxy.routes import DIRECT, Route, Unusable, bypassed, routes_from_env
from ckagent.containment.egress.proxy.target import Target

# ------------------------------------------------------------------------------ the variables, read


def test_lower_case_wins_and_all_proxy_fills_in() -> None:
    routes = routes_from_env({"HTTP_PROXY": "http://upper:1", "http_proxy": "http://lower.example:3128",
                              "ALL_PROXY": "socks5h://u:p%40ss@10.0.0.9:1080", "NO_PROXY": "Example.com, .internal ,"})
    assert isinstance(routes.http, Route) and routes.http.kind == "http"
    assert routes.http.proxy == Target("lower.example", 3128)
    assert isinstance(routes.https, Route) and routes.https.kind == "socks5" and routes.https.remote_dns
    assert routes.https.auth == b"u:p@ss" and routes.https.shown == "socks5h://u:***@10.0.0.9:1080"
    assert routes.no_proxy == ("example.com", ".internal")
    assert routes.chained == ["http://lower.example:3128", "socks5h://u:***@10.0.0.9:1080"]
    assert routes_from_env({}).http is DIRECT and routes_from_env({}).chained == []


@pytest.mark.parametrize(("value", "why"), [
    ("https://proxy.example:443", "HTTPS to the proxy itself is not supported"),
    ("socks4://proxy.example:1080", "the scheme socks4:// is not supported"),
    ("http://a..b:3128", "malformed label"),
    ("http://[::1:3128", "not a proxy URL"),
])
def test_a_setting_the_agent_cannot_follow_is_said_not_bypassed(value: str, why: str) -> None:
    routes = routes_from_env({"HTTPS_PROXY": value})
    assert isinstance(routes.https, Unusable) and why in routes.https.reason
    assert routes.problems and why in routes.problems[0]
    assert routes.http is DIRECT  # (only what the variable covers)


@pytest.mark.parametrize(("host", "port", "entries", "expected"), [
    ("example.com", 80, ("*",), True),
    ("example.com", 80, ("example.com",), True),
    ("api.example.com", 80, ("example.com",), True),
    ("api.example.com", 80, (".example.com",), True),
    ("notexample.com", 80, ("example.com",), False),
    ("example.com", 8080, ("example.com:80",), False),
    ("example.com", 80, ("example.com:80",), True),
    ("10.1.2.3", 80, ("10.0.0.0/8",), True),
    ("10.1.2.3", 80, ("10.1.2.3",), True),
    ("11.1.2.3", 80, ("10.0.0.0/8",), False),
    ("::1", 80, ("[::1]:80",), True),
])
def test_no_proxy_entries(host: str, port: int, entries: tuple[str, ...], expected: bool) -> None:
    assert bypassed(Target(host, port, ip=host[0].isdigit() or ":" in host), entries) is expected


# ------------------------------------------------------------------------------ through the proxy


@dataclass
class Chain:
    egress: Egress
    url: str
    notes: list[str]
    origin: IdentityOrigin
    direct: IdentityOrigin
    rules: Any


async def _chain(nursery: trio.Nursery, env: dict[str, str], deny: str = "metadata,link-local,agent,127.0.0.4") -> Chain:
    origin, direct = IdentityOrigin("127.0.0.2"), IdentityOrigin("127.0.0.3")
    await nursery.start(origin.serve)
    await nursery.start(direct.serve)
    egress = open_egress("proxy", None, "ckagent_chain_test", parse_text(deny, ""), agent_port=9)

    async def resolve(host: str, port: int) -> list[str]:  # (names of the tests, no DNS)
        await trio.lowlevel.checkpoint()
        known = {"origin.test": ["127.0.0.2"], "denied.test": ["127.0.0.4"]}
        if host not in known:
            raise OSError(f"{host}: unknown in this test")
        return known[host]

    egress.resolve = resolve
    await nursery.start(egress.serve)
    rules = await trio.to_thread.run_sync(egress.attach, None, "chained")
    notes: list[str] = []
    url = egress.task_env(rules, {k: v.replace("ORIGIN", str(origin.port)) for k, v in env.items()},
                          notes.append)["HTTP_PROXY"]
    return Chain(egress, url, notes, origin, direct, rules)


async def _connect_get(proxy_url: str, target: str, path: str = "/tunnelled") -> dict[str, Any]:
    """CONNECT ``target`` through ``proxy_url``, then one plain GET inside the tunnel (what HTTPS does,
    without the TLS)."""
    creds, _, address = proxy_url.split("//")[1].rpartition("@")
    host, _, port = address.rpartition(":")
    auth = base64.b64encode(creds.encode()).decode()
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}"
                              f"\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(4096)
        assert head.startswith(b"HTTP/1.1 200"), head
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: {target}\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
    return json.loads(answer.partition(b"\r\n\r\n")[2])


async def test_a_tasks_http_proxy_carries_its_requests_with_its_own_credentials(nursery: trio.Nursery) -> None:
    team = RecordingProxy("127.0.0.5", need_auth="Basic " + base64.b64encode(b"team:s3cret").decode())
    team_port = await nursery.start(team.serve)
    chain = await _chain(nursery, {"HTTP_PROXY": f"http://team:s3cret@127.0.0.5:{team_port}",
                                   "HTTPS_PROXY": f"http://team:s3cret@127.0.0.5:{team_port}",
                                   "NO_PROXY": "127.0.0.3"})
    with trio.fail_after(20):
        async with httpx.AsyncClient(proxy=chain.url) as client:
            answers = [(await client.get(f"http://{host}:{port}/page/{i}", headers={"Authorization": "for-origin"}))
                       for i, (host, port) in enumerate([("127.0.0.2", chain.origin.port)] * 3 +
                                                        [("127.0.0.3", chain.direct.port)] +
                                                        [("origin.test", chain.origin.port)])]
            denied = await client.get(f"http://127.0.0.4:{chain.origin.port}/")
            denied_name = await client.get(f"http://denied.test:{chain.origin.port}/")
        tunnelled = await _connect_get(chain.url, f"127.0.0.2:{chain.origin.port}")
    assert [a.status_code for a in answers] == [200] * 5
    assert [a.json()["host"] for a in answers] == ["127.0.0.2"] * 3 + ["127.0.0.3", "127.0.0.2"]
    assert [a.headers.get("via") for a in answers] == ["1.1 team-proxy"] * 3 + [None, "1.1 team-proxy"]
    assert denied.status_code == denied_name.status_code == 403
    # The team's proxy saw its own credentials on every request, absolute-form URLs, and never the agent's.
    plain = [s for s in team.seen if s.method == "GET"]
    assert [s.target for s in plain] == [f"http://127.0.0.2:{chain.origin.port}/page/{i}" for i in range(3)] + \
        [f"http://origin.test:{chain.origin.port}/page/4"]
    assert {s.headers["proxy-authorization"] for s in team.seen} == {"Basic " + base64.b64encode(b"team:s3cret").decode()}
    assert team.connections == 2  # one kept-alive connection for the plain requests, one for the tunnel
    assert [s.target for s in team.seen if s.method == "CONNECT"] == [f"127.0.0.2:{chain.origin.port}"]
    # The origin never saw a proxy header; the request NO_PROXY names went direct.
    assert all("proxy-authorization" not in s.headers for s in [*chain.origin.seen, *chain.direct.seen])
    assert chain.direct.seen[0].headers["authorization"] == "for-origin" and tunnelled["path"] == "/tunnelled"
    assert len(chain.notes) == 1 and "team:***@127.0.0.5" in chain.notes[0] and "s3cret" not in chain.notes[0]
    assert chain.egress.proxy_outcomes(chain.rules) == {"forwarded": 5, "refused": 2, "tunnel": 1}


async def test_a_tasks_socks5_proxy_with_a_password(nursery: trio.Nursery) -> None:
    socks = Socks5Server("127.0.0.6", auth=(b"crawler", b"pw"))
    port = await nursery.start(socks.serve)
    remote = Socks5Server("127.0.0.7")
    remote_port = await nursery.start(remote.serve)
    chain = await _chain(nursery, {"http_proxy": f"socks5://crawler:pw@127.0.0.6:{port}",
                                   "https_proxy": f"socks5h://127.0.0.7:{remote_port}"})
    with trio.fail_after(20):
        async with httpx.AsyncClient(proxy=chain.url) as client:
            first = await client.get(f"http://origin.test:{chain.origin.port}/a")
            second = await client.get(f"http://origin.test:{chain.origin.port}/b")
            denied = await client.get(f"http://denied.test:{chain.origin.port}/")
        by_name = await _connect_get(chain.url, f"origin.test:{chain.origin.port}")
    assert first.json()["host"] == second.json()["host"] == "127.0.0.2" and denied.status_code == 403
    # socks5: the agent resolved the name (and judged it), the proxy got the address; one kept connection.
    assert socks.asked == [("127.0.0.2", chain.origin.port)]
    # socks5h: the proxy got the name.
    assert remote.asked == [("origin.test", chain.origin.port)] and by_name["host"] == "127.0.0.2"


async def test_a_proxy_setting_the_agent_cannot_follow_fails_its_requests_with_502(nursery: trio.Nursery) -> None:
    chain = await _chain(nursery, {"HTTP_PROXY": "https://team.example:443"})
    with trio.fail_after(20):
        async with httpx.AsyncClient(proxy=chain.url) as client:
            answer = await client.get(f"http://127.0.0.2:{chain.origin.port}/")
    assert answer.status_code == 502 and "HTTP_PROXY" in answer.text and "not supported" in answer.text
    assert not chain.origin.seen  # never sent direct, around the task's proxy
    assert any("cannot be followed" in note for note in chain.notes)


async def test_the_task_proxys_own_address_is_judged(nursery: trio.Nursery) -> None:
    team = RecordingProxy("127.0.0.4")  # in a denied range: an allow entry would be needed
    team_port = await nursery.start(team.serve)
    chain = await _chain(nursery, {"HTTP_PROXY": f"http://127.0.0.4:{team_port}"})
    with trio.fail_after(20):
        async with httpx.AsyncClient(proxy=chain.url) as client:
            answer = await client.get(f"http://127.0.0.2:{chain.origin.port}/")
    assert answer.status_code == 403 and not team.seen


async def test_a_tasks_proxy_that_wants_other_credentials_is_a_502_that_says_so(nursery: trio.Nursery) -> None:
    """The team's proxy's 407 is about the team's credentials in the task's variable: passed on as
    it is, the client would take it for the agent's proxy refusing its own."""
    team = RecordingProxy("127.0.0.5", need_auth="Basic " + base64.b64encode(b"team:right").decode())
    team_port = await nursery.start(team.serve)
    chain = await _chain(nursery, {"HTTP_PROXY": f"http://team:wrong@127.0.0.5:{team_port}",
                                   "HTTPS_PROXY": f"http://team:wrong@127.0.0.5:{team_port}"})
    assert "http:// through http://team:***@127.0.0.5" in chain.notes[0]
    with trio.fail_after(20):
        async with httpx.AsyncClient(proxy=chain.url) as client:
            plain = await client.get(f"http://127.0.0.2:{chain.origin.port}/")
        creds, _, address = chain.url.split("//")[1].rpartition("@")
        host, _, port = address.rpartition(":")
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            auth = base64.b64encode(creds.encode()).decode()
            target = f"127.0.0.2:{chain.origin.port}"
            await stream.send_all(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nProxy-Authorization: Basic {auth}"
                                  "\r\n\r\n".encode())
            head = b""
            while b"check the user" not in head and (chunk := await stream.receive_some(4096)):
                head += chunk
    assert plain.status_code == 502 and "asks for credentials" in plain.text and "proxy-authenticate" not in plain.headers
    assert head.startswith(b"HTTP/1.1 502") and b"check the user and password" in head
