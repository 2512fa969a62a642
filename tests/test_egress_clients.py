"""The real clients spiders use, through the egress proxy, with keep-alive (issue 34, Tests, first bullet).

Every client runs as a spider runs it — a subprocess with the task's environment (HTTP_PROXY… from
``Egress.task_env``) — and makes one plan of requests on ONE session/pool (harness.webclients): two
identity hosts interleaved (A, A, B, A, B, B…), plain HTTP and HTTPS (CONNECT), bodies up (Content-Length
and chunked where the client can) and down (a few hundred KB, also chunked), a redirect from one host to
the other, ``Authorization`` on host A's requests only, and a request to a host the policy denies in the
middle. Every answer must come from the host asked, with that request's headers and no other's, with
the body sent or asked, byte for byte, and no server may see the proxy's credentials.

A proxy that routes only the first request of a connection (the one before issue 34) fails these: the
second host's requests are answered by the first, with their Authorization and Proxy-Authorization.

Clients: requests.Session, urllib3's ProxyManager, httpx, aiohttp (trust_env), Scrapy, Chromium
(Debian's, through Playwright), Node's undici (EnvHttpProxyAgent, tunnelling and forwarding), got
(hpagent), axios, curl (every URL in one invocation). The Python clients' environment and the Node
packages are built once per session (uv's and npm's caches make that a second or two); a client whose
tool is missing here (node, npm, chromium, curl) is skipped, saying so.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from harness import (
    CLIENT_SCRIPTS,
    ClientUnavailable,
    WebHosts,
    check_answers,
    client_env,
    client_plan,
    client_python,
    clients_dir,
    node_clients,
    plan_document,
    proxied_task,
    run_client,
    run_curl,
    web_hosts,
)

DENY = "metadata,link-local,agent,127.0.0.4"
"""The node policy: the default groups, and host D (127.0.0.4), whose requests must get 403."""

TOKEN = "Bearer host-a-" + secrets.token_hex(8)
"""Host A's Authorization: no other host may see it."""

TEST_TIMEOUT = 180.0
"""Seconds for one test, a cold client start included."""


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebHosts]:
    """Identity hosts A (127.0.0.2), B (127.0.0.3) and D (127.0.0.4, denied), for the whole module."""
    with web_hosts(tmp_path_factory.mktemp("webhosts")) as running:
        yield running


@pytest.fixture(scope="session")
def python_clients(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of the session's client environment (Scrapy, requests, urllib3, httpx, aiohttp,
    Playwright)."""
    try:
        return client_python(clients_dir(tmp_path_factory))
    except ClientUnavailable as exc:
        pytest.skip(f"no Python client environment: {exc}")


@pytest.fixture(scope="session")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's directory of Node clients (undici, got + hpagent, axios + hpagent)."""
    try:
        return node_clients(clients_dir(tmp_path_factory))
    except ClientUnavailable as exc:
        pytest.skip(f"no Node clients: {exc}")


def _verdict(hosts: WebHosts, plan: list, records: list, scheme: str, task_secrets: list[str], *,
             strict_denied: bool = True) -> None:
    problems = check_answers(hosts, plan, records, scheme=scheme, token=TOKEN, secrets=task_secrets,
                             strict_denied=strict_denied)
    assert not problems, f"{len(problems)} wrong answer(s):\n" + "\n".join(problems)


def _refused_d(task_refusals: list) -> bool:
    return any(r.address == "127.0.0.4" for r in task_refusals)


SCHEMES = ["http", "https"]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("lib", ["urllib", "requests", "urllib3", "httpx", "aiohttp", "aiohttp-concurrent"])
async def test_python_clients_get_each_answer_from_the_host_asked(
        lib: str, scheme: str, hosts: WebHosts, python_clients: Path, tmp_path: Path) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with proxied_task(DENY) as task:
            plan = client_plan(hosts, scheme, TOKEN)
            records = await run_client([str(python_clients), str(CLIENT_SCRIPTS / "py_clients.py"), lib],
                                       plan_document(hosts, plan), tmp_path, client_env(task, hosts.ca_file))
            refused = task.egress.refusals(task.rules)
    _verdict(hosts, plan, records, scheme, task.secrets)
    assert _refused_d(refused), f"the denied request was not counted: {refused}"


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("mode", ["one-by-one", "concurrent"])
async def test_scrapy_gets_each_answer_from_the_host_asked(
        mode: str, scheme: str, hosts: WebHosts, python_clients: Path, tmp_path: Path) -> None:
    """One request after the other, and as a crawl runs (every request at once, eight at a time)."""
    argv = [str(python_clients), str(CLIENT_SCRIPTS / "scrapy_client.py")]
    if mode == "concurrent":
        argv.append("--concurrent")
    with trio.fail_after(TEST_TIMEOUT):
        async with proxied_task(DENY) as task:
            plan = client_plan(hosts, scheme, TOKEN, chunked=False)  # (Scrapy sends Content-Length only)
            records = await run_client(argv, plan_document(hosts, plan), tmp_path, client_env(task, hosts.ca_file))
    _verdict(hosts, plan, records, scheme, task.secrets)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
async def test_chromium_gets_each_answer_from_the_host_asked(
        scheme: str, hosts: WebHosts, python_clients: Path, tmp_path: Path) -> None:
    """Chromium sends no proxy credentials (it ignores them in a proxy URL): the task's own proxy port
    says which task asks."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed")
    with trio.fail_after(TEST_TIMEOUT):
        async with proxied_task(DENY) as task:
            plan = client_plan(hosts, scheme, TOKEN, chunked=False)  # (fetch streams bodies over HTTP/2 only)
            document = plan_document(hosts, plan, page=hosts["a"].url(scheme, "/page"),
                                     spki=list(hosts.spki_hashes))
            records = await run_client([str(python_clients), str(CLIENT_SCRIPTS / "chromium_client.py")],
                                       document, tmp_path, client_env(task, hosts.ca_file, CHROMIUM=chromium))
    # A page's fetch sees the proxy's 403 (no CORS headers) or a refused tunnel as a network error.
    _verdict(hosts, plan, records, scheme, task.secrets, strict_denied=False)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("lib", ["undici", "undici-forward", "got", "axios"])
async def test_node_clients_get_each_answer_from_the_host_asked(
        lib: str, scheme: str, hosts: WebHosts, node_dir: Path, tmp_path: Path) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        async with proxied_task(DENY) as task:
            plan = client_plan(hosts, scheme, TOKEN)
            records = await run_client(["node", str(node_dir / "node_client.mjs"), lib],
                                       plan_document(hosts, plan), tmp_path, client_env(task, hosts.ca_file), cwd=node_dir)
    _verdict(hosts, plan, records, scheme, task.secrets)


def _need_curl() -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_curl_gets_each_answer_from_the_host_asked(scheme: str, hosts: WebHosts, tmp_path: Path) -> None:
    """Every URL in one invocation: plain HTTP goes over ONE proxy connection from the first request
    to the last (the 403 and the chunked bodies included); HTTPS reuses each host's tunnel."""
    _need_curl()
    with trio.fail_after(TEST_TIMEOUT):
        async with proxied_task(DENY) as task:
            plan = client_plan(hosts, scheme, TOKEN, expect_100=True)
            records = await run_curl(plan_document(hosts, plan), tmp_path, client_env(task, hosts.ca_file))
    _verdict(hosts, plan, records, scheme, task.secrets)
    if scheme == "http":
        connects = {r["id"]: r["num_connects"] for r in records}
        # curl's own rule: a final answer (the 403) that comes while it still sends a body makes it stop
        # sending and close ("HTTP error before end of send, stop sending"; this curl has no
        # --keep-sending-on-error). Whether the proxy's 403 overtakes the 100 kB upload is the
        # machine's timing: the request after a refused upload may open a new connection, none other.
        after_refused_upload = {plan[i + 1].id for i, r in enumerate(plan[:-1]) if r.expect == "denied" and r.body}
        again = {rid: n for rid, n in connects.items() if n and rid != plan[0].id and rid not in after_refused_upload}
        assert connects[plan[0].id] == 1 and not again, \
            f"curl's one proxy connection was not kept (new connections per request): {connects}"


async def test_a_denied_request_gets_403_and_its_connection_goes_on(hosts: WebHosts, tmp_path: Path) -> None:
    """A refused request on a kept-alive connection is answered 403 on that connection, and the
    connection serves the next requests (curl: no new connection after the 403)."""
    _need_curl()
    plan = [r for r in client_plan(hosts, "http", TOKEN, chunked=False) if r.id in ("a1", "d1", "b4", "a7")]
    with trio.fail_after(TEST_TIMEOUT):
        async with proxied_task(DENY) as task:
            records = await run_curl(plan_document(hosts, plan), tmp_path, client_env(task, hosts.ca_file))
            refused = task.egress.refusals(task.rules)
    assert [r["status"] for r in records] == [200, 403, 200, 200], records
    assert [r["num_connects"] for r in records] == [1, 0, 0, 0], \
        f"a new connection after the 403: {[(r['id'], r['num_connects'], r['local_port']) for r in records]}"
    _verdict(hosts, plan, records, "http", task.secrets)
    assert _refused_d(refused), f"the denied request was not counted: {refused}"


async def test_http_1_0_clients_get_each_answer_from_the_host_asked(hosts: WebHosts, tmp_path: Path) -> None:
    """curl --http1.0: HTTP/1.0 requests (no chunked bodies in 1.0) through the proxy, plain HTTP."""
    _need_curl()
    with trio.fail_after(TEST_TIMEOUT):
        async with proxied_task(DENY) as task:
            plan = client_plan(hosts, "http", TOKEN, chunked=False)
            records = await run_curl(plan_document(hosts, plan), tmp_path, client_env(task, hosts.ca_file),
                                     http10=True)
    _verdict(hosts, plan, records, "http", task.secrets)


IDLE_PAUSE = 0.6
"""Seconds a client waits before each of host A's requests in the idle-close plan (A closes an idle
connection after 0.2 s)."""


@pytest.mark.parametrize("lib", ["requests", "undici-forward", "curl"])
async def test_a_connection_the_host_closed_while_idle_is_not_used_again(
        lib: str, hosts: WebHosts, python_clients: Path, tmp_path_factory: pytest.TempPathFactory,
        tmp_path: Path) -> None:
    """Servers close a kept-alive connection that stayed idle (their keep-alive timeout) without a
    word. The proxy must not send a client's next request — a GET, a POST, a PUT — on a pooled
    connection the host has closed meanwhile (that gets a 502, or loses the request)."""
    if lib == "curl":
        _need_curl()
    with trio.fail_after(TEST_TIMEOUT):
        async with proxied_task(DENY) as task:
            plan = client_plan(hosts, "http", TOKEN, idle_close=IDLE_PAUSE)
            document, env = plan_document(hosts, plan), client_env(task, hosts.ca_file)
            if lib == "curl":  # (curl cannot pause between URLs: at most 1.5 transfers a second does it)
                records = await run_curl(document, tmp_path, env, rate="90/m")
            elif lib == "requests":
                records = await run_client([str(python_clients), str(CLIENT_SCRIPTS / "py_clients.py"), lib],
                                           document, tmp_path, env)
            else:
                try:
                    node = node_clients(clients_dir(tmp_path_factory))
                except ClientUnavailable as exc:
                    pytest.skip(f"no Node clients: {exc}")
                records = await run_client(["node", str(node / "node_client.mjs"), lib], document, tmp_path, env,
                                           cwd=node)
    _verdict(hosts, plan, records, "http", task.secrets)
    fresh = {r["id"]: (r["json"] or {}).get("connection", {}).get("request") for r in records}
    assert fresh["i2"] == fresh["i3"] == fresh["i5"] == 1, \
        f"host A did not close its idle connections (the test proves nothing): requests per connection {fresh}"


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("lib", ["requests", "curl"])
async def test_a_tasks_own_proxy_is_chained_behind_the_agents(
        lib: str, scheme: str, hosts: WebHosts, python_clients: Path, tmp_path: Path) -> None:
    """A task whose own environment names a proxy (a team's) keeps it: the agent's proxy checks each
    request, then sends it on through the task's proxy with that proxy's credentials. The team's proxy
    here is another ckagent proxy that refuses host B: B's requests get its 403, which only a chained
    request can get; D's get the agent's 403 and never reach the team's proxy; A's are answered by A,
    which sees neither proxy's credentials."""
    if lib == "curl":
        _need_curl()
    keep = {"a1", "b1", "a3", "d1", "a4", "b4", "a7"}
    plan = [r if r.host != "b" else replace(r, expect="denied", status=403)
            for r in client_plan(hosts, scheme, TOKEN, chunked=False) if r.id in keep]
    with trio.fail_after(TEST_TIMEOUT):
        async with proxied_task("metadata,link-local,127.0.0.3", task_id="team") as team:
            own = {"HTTP_PROXY": team.url, "HTTPS_PROXY": team.url}
            async with proxied_task(DENY, task_env=own) as task:
                document, env = plan_document(hosts, plan), client_env(task, hosts.ca_file)
                if lib == "curl":
                    records = await run_curl(document, tmp_path, env)
                else:
                    records = await run_client([str(python_clients), str(CLIENT_SCRIPTS / "py_clients.py"), lib],
                                               document, tmp_path, env)
                refused = task.egress.refusals(task.rules)
                refused_by_team = team.egress.refusals(team.rules)
    # (A tunnel the team's proxy refuses reaches the client as the team's 403, as it would without the
    # agent; the team's count proves where it came from.)
    _verdict(hosts, plan, records, scheme, task.secrets + team.secrets)
    assert {r.address for r in refused} == {"127.0.0.4"}, f"the agent's proxy refused {refused}"
    assert {r.address for r in refused_by_team} == {"127.0.0.3"}, \
        f"the team's proxy refused {refused_by_team}: the task's requests did not go through it"


def test_the_client_scripts_are_the_ones_listed() -> None:
    """Each client script this file runs exists (a renamed script would make its tests error, not skip)."""
    assert sorted(p.name for p in CLIENT_SCRIPTS.iterdir() if p.suffix in (".py", ".mjs")) == [
        "chromium_client.py", "node_client.mjs", "py_clients.py", "scrapy_client.py"]
