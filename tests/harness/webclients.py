"""Real HTTP clients, run as spiders run them, through a task's egress proxy, against identity hosts
(:mod:`harness.webhosts`): the real-client matrix of tests/test_egress_clients.py.

- :func:`proxied_task` starts the agent's egress proxy at the ``proxy`` level in the test's Trio loop
  and attaches one task to it: the task's environment (HTTP_PROXY… as :meth:`Egress.task_env` gives
  them) and the proxy's credentials, which no server may ever see.
- :func:`client_plan` makes the sequence of requests every client runs on one session/pool: two
  hosts interleaved (A, A, B, A, B, B…), bodies up (``Content-Length`` and, where the client can,
  chunked) and down (a few hundred KB, also chunked), a redirect from one host to the other, a
  request to a denied host followed by more; ``Authorization`` on host A's requests only.
- :func:`run_client` runs a client script of ``webclients/`` (Python: requests, urllib3, httpx,
  aiohttp, Scrapy, Chromium through Playwright; Node: undici, got and axios with hpagent) as a subprocess with that
  environment; :func:`run_curl` runs curl, every request in one invocation (one connection cache).
- :func:`check_answers` says what is wrong with what the client got: an answer from another host,
  a header meant for another host, the proxy's credentials reaching a server, a body changed.
- :func:`client_python` and :func:`node_clients` build the clients' environments once per session
  for all pytest-xdist workers (uv with its cache; npm with its cache), under a file lock.
  :class:`ClientUnavailable` says why one cannot be had (no node, no npm, no registry): the test skips.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import pytest
import trio

from harness.webhosts import WebHost, WebHosts, body_bytes, page_bytes, sha256_hex

__all__ = [
    "CLIENT_SCRIPTS",
    "ClientUnavailable",
    "PlanRequest",
    "ProxiedTask",
    "check_answers",
    "client_env",
    "client_plan",
    "client_python",
    "clients_dir",
    "node_clients",
    "plan_document",
    "proxied_task",
    "run_client",
    "run_curl",
]

CLIENT_SCRIPTS = Path(__file__).resolve().parent / "webclients"
"""The client scripts (py_clients.py, scrapy_client.py, chromium_client.py, node_client.mjs)."""

PYTHON_CLIENT_PACKAGES = ("scrapy>=2.11,<3", "requests>=2.31,<3", "urllib3>=2,<3", "httpx>=0.27,<1",
                          "aiohttp>=3.9,<4", "playwright>=1.40,<2")
"""What :func:`client_python` installs (the clients spiders use)."""

NODE_CLIENT_PACKAGES = ("undici@^7", "got@^14", "hpagent@^1", "axios@^1")
"""What :func:`node_clients` installs."""

MIN_NODE = (20, 18, 1)
"""The oldest Node the packages of :data:`NODE_CLIENT_PACKAGES` run on."""

BUILD_TIMEOUT = 600.0
"""Seconds for one environment build, cold caches included."""

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
"""Proxy variables (either case) that the clients' environment takes from the task only."""


class ClientUnavailable(Exception):
    """A client cannot be run here (the message says why: a missing tool, an install that failed)."""


# ------------------------------------------------------------------------------------------ environments


def clients_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's client environments live: its base temp directory, or under pytest-xdist
    the one all workers share (the parent of theirs), so each is built once."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "egress-clients"


@contextlib.contextmanager
def _locked(directory: Path) -> Any:
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def client_python(base: Path) -> Path:
    """The interpreter of a virtualenv with :data:`PYTHON_CLIENT_PACKAGES`, in ``base``/python, made
    once (under a file lock; ~1 s from uv's cache, a minute cold). Blocking. Raises ClientUnavailable
    when uv cannot make it (its output says why)."""
    root = base / "python"
    python = root / "bin" / "python"
    done = root / ".complete"
    with _locked(base / "python-lock"):
        if done.exists():
            return python
        uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
        if uv is None:
            raise ClientUnavailable("uv is not installed (the dev extras install it)")
        shutil.rmtree(root, ignore_errors=True)
        env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
        for argv in ([uv, "venv", "--quiet", "--python", sys.executable, str(root)],
                     [uv, "pip", "install", "--quiet", "--python", str(python), *PYTHON_CLIENT_PACKAGES]):
            try:
                result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT,
                                        check=False)
            except subprocess.TimeoutExpired as exc:
                raise ClientUnavailable(f"{' '.join(argv[:3])} took over {BUILD_TIMEOUT:.0f} s") from exc
            if result.returncode != 0:
                raise ClientUnavailable(f"{' '.join(argv[:3])} failed ({result.returncode}): "
                                        f"{result.stderr.strip()[-2000:]}")
        done.touch()
    return python


def node_clients(base: Path) -> Path:
    """A directory with :data:`NODE_CLIENT_PACKAGES` installed by npm and node_client.mjs beside them,
    in ``base``/node, made once (under a file lock; a few seconds from npm's cache). Blocking. Raises
    ClientUnavailable when node or npm is missing, node is older than :data:`MIN_NODE`, or npm cannot
    install."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        raise ClientUnavailable(f"{'node' if node is None else 'npm'} is not installed")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30,
                             check=False).stdout.strip()
    try:
        numbers = tuple(int(part) for part in version.lstrip("v").split(".")[:3])
    except ValueError:
        numbers = ()
    if numbers < MIN_NODE:
        raise ClientUnavailable(f"node {version or '(no version)'} is older than "
                                f"{'.'.join(map(str, MIN_NODE))}, which undici 7 and got 14 need")
    root = base / "node"
    done = root / ".complete"
    with _locked(base / "node-lock"):
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            (root / "package.json").write_text('{"private": true, "type": "module"}\n')
            argv = [npm, "install", "--no-audit", "--no-fund", "--no-update-notifier", "--loglevel=error",
                    *NODE_CLIENT_PACKAGES]
            try:
                result = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=BUILD_TIMEOUT,
                                        check=False)
            except subprocess.TimeoutExpired as exc:
                raise ClientUnavailable(f"npm install took over {BUILD_TIMEOUT:.0f} s") from exc
            if result.returncode != 0:
                raise ClientUnavailable(f"npm install failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
            done.touch()
        shutil.copyfile(CLIENT_SCRIPTS / "node_client.mjs", root / "node_client.mjs")  # (the current one)
    return root


# -------------------------------------------------------------------------------------------- the proxy


@dataclass
class ProxiedTask:
    """A task attached to the egress proxy: ``env`` its proxy variables (``task_env``), ``url`` the
    proxy URL they hold (with the task's credentials), ``secrets`` what of those credentials must never
    reach a server (the password, the ``Basic`` token), and the ``egress`` and ``rules`` themselves."""

    egress: Any
    rules: Any
    env: dict[str, str]
    url: str
    secrets: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def proxied_task(deny: str, task_id: str = "task-1",
                       task_env: dict[str, str] | None = None) -> AsyncIterator[ProxiedTask]:
    """The agent's egress proxy at the ``proxy`` level, serving in this Trio loop, with one task attached
    under the node policy ``deny`` (the settings' text: ``metadata,link-local,agent,127.0.0.4``).
    ``task_env`` is the task's own environment (its own proxies are chained). On leaving, the task is
    detached and the proxy stopped. Raises what ``open_egress``/``attach`` raise."""
    from ckagent.containment.egress import open_egress, parse_text

    egress = open_egress("proxy", None, "ckagent_test", parse_text(deny, ""), agent_port=9000)
    async with trio.open_nursery() as nursery:
        await nursery.start(egress.serve)
        rules = await trio.to_thread.run_sync(egress.attach, None, task_id, None)
        try:
            env = dict(egress.task_env(rules, dict(task_env or {})))
            url = env.get("HTTP_PROXY") or env.get("http_proxy") or ""
            parts = urlsplit(url)
            secrets = []
            if parts.password:
                credentials = f"{unquote(parts.username or '')}:{unquote(parts.password)}"
                secrets = [unquote(parts.password), base64.b64encode(credentials.encode()).decode()]
            yield ProxiedTask(egress, rules, env, url, secrets)
        finally:
            egress.detach(rules)
            nursery.cancel_scope.cancel()


CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")
"""The CA bundle variables the clients read (a machine's own would override a client's setting:
requests prefers REQUESTS_CA_BUNDLE to a session's ``verify``)."""


def client_env(task: ProxiedTask, ca_file: Path, **extra: str) -> dict[str, str]:
    """The environment a spider of ``task`` gets (ckagent's spider base environment, any proxy variable
    of this machine removed, the task's proxy variables added), the CA bundle variables naming
    ``ca_file`` (the identity hosts' CA), plus ``extra``."""
    from ckagent.code.deps import spider_base_env

    env = {k: v for k, v in spider_base_env().items() if k.upper() not in PROXY_VARIABLES}
    return {**env, **task.env, **dict.fromkeys(CA_VARIABLES, str(ca_file)), **extra}


# --------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanRequest:
    """One request of a plan, and what its answer must be.

    ``expect``: ``echo`` (a JSON echo from ``host`` at ``path``), ``bytes`` (``size`` bytes of
    :func:`page_bytes` from ``host``), ``status`` (``status`` and no body, from ``host``) or ``denied``
    (the proxy's own answer ``status``: 403 when the policy denies ``host``, 502 when nothing listens
    there). ``auth``:
    the request carries host A's ``Authorization`` (and only host A may see it); ``redirected``: the
    URL asked redirects to ``host`` and ``path``, where the answer comes from; ``pause``: seconds the
    client waits before sending it (the Python and Node clients; curl: see :func:`run_curl`)."""

    id: str
    method: str
    url: str
    headers: dict[str, str]
    body: dict[str, Any] | None
    expect: str
    host: str
    path: str
    size: int = 0
    auth: bool = False
    redirected: bool = False
    status: int = 200
    pause: float = 0.0

    def wire(self) -> dict[str, Any]:
        """What the client script reads."""
        return {"id": self.id, "method": self.method, "url": self.url, "headers": self.headers, "body": self.body,
                "pause": self.pause}


def client_plan(hosts: WebHosts, scheme: str, token: str, *, chunked: bool = True,
                expect_100: bool = False, idle_close: float = 0.0) -> list[PlanRequest]:
    """The requests every client makes, in order, on one session, all to ``scheme`` URLs of hosts
    ``a`` and ``b`` (``d`` is the denied one). ``token`` is host A's ``Authorization`` value;
    ``chunked`` adds chunked uploads (for clients that can send them); ``expect_100`` asks
    ``Expect: 100-continue`` on the first upload (curl waits for it).

    ``idle_close`` (seconds, > 0.2) makes another plan instead: host A closes each connection once it
    has been idle 0.2 s, without a word (as a server's keep-alive timeout does), and the client waits
    ``idle_close`` seconds before each of A's next requests (GET, POST, PUT): a kept-alive connection
    the server has closed meanwhile must not be used for them."""
    a, b, d = hosts["a"], hosts["b"], hosts["d"]
    plan: list[PlanRequest] = []

    def add(rid: str, host: Any, path: str, *, method: str = "GET", body: int = 0, chunk: bool = False,
            expect: str = "echo", size: int = 0, target: Any = None, target_path: str | None = None,
            headers: dict[str, str] | None = None, status: int = 0, pause: float = 0.0) -> None:
        status = status or (403 if expect == "denied" else 200)
        all_headers = {"X-Ck-Id": rid, **({"Authorization": token} if host is a else {}), **(headers or {})}
        plan.append(PlanRequest(
            rid, method, host.url(scheme, path), all_headers,
            {"tag": rid, "size": body, "chunked": chunk} if body else None, expect, (target or host).name,
            target_path or urlsplit(path).path, size, host is a, target is not None, status, pause))

    if idle_close:  # each of A's connections closed once idle 0.2 s; the client waits longer between
        add("i1", a, "/echo/i1?linger=0.2")
        add("i2", a, "/echo/i2?linger=0.2", pause=idle_close)
        add("i3", a, "/upload?linger=0.2", method="POST", body=2000, pause=idle_close)
        add("i4", b, "/echo/i4")
        add("i5", a, "/echo/i5", method="PUT", body=100, pause=idle_close)
        return plan

    add("a1", a, "/echo/a1")
    add("a2", a, "/echo/a2/%E2%82%AC%20x?q=x%20y&r=a+b")  # (sent as written: already in canonical form)
    add("b1", b, "/echo/b1")
    add("a9", a, "/bytes/5000", method="HEAD", expect="status")  # (a length, no body)
    add("b8", b, "/status/304", expect="status", status=304)  # (Content-Length: 1234, no body)
    add("a3", a, "/upload", method="POST", body=200_000,
        headers={"Expect": "100-continue"} if expect_100 else None)
    add("b2", b, "/upload", method="POST", body=150_000)
    add("b3", b, "/bytes/300000", expect="bytes", size=300_000)
    add("a4", a, "/bytes/250000", expect="bytes", size=250_000)
    add("d1", d, "/echo/d1", expect="denied")
    add("d2", d, "/upload", method="POST", body=100_000, expect="denied")  # (a body the proxy must skip)
    add("b4", b, "/echo/b4")
    if chunked:
        add("a5", a, "/upload", method="POST", body=100_000, chunk=True)
        add("b5", b, "/upload", method="POST", body=64_000, chunk=True)
        add("d3", d, "/upload", method="POST", body=50_000, chunk=True, expect="denied")
    add("a6", a, "/chunked/200000", expect="bytes", size=200_000)
    to = a.url(scheme, "/echo/b6-to-a")
    add("b6", b, "/redirect?to=" + quote(to, safe=""), target=a, target_path="/echo/b6-to-a")
    add("b11", b, "/redirect?to=" + quote(d.url(scheme, "/echo/b11-to-d"), safe=""), expect="denied",
        target=d, target_path="/echo/b11-to-d")  # (the followed request is checked too)
    add("a7", a, "/echo/a7")
    closed = WebHost("a", a.address, hosts.closed_port, hosts.closed_port)  # (A's address, nothing listening)
    add("u1", closed, "/echo/u1", expect="denied", status=502)
    add("b7", b, "/echo/b7")
    add("a10", a, "/status/204", expect="status", status=204)
    add("b9", b, "/echo/b9?close=1")  # (B closes that connection: the next goes on another)
    add("b10", b, "/echo/b10")
    add("a8", a, "/echo/a8", method="PUT", body=1000)
    return plan


def plan_document(hosts: WebHosts, plan: list[PlanRequest], **extra: Any) -> dict[str, Any]:
    """The plan file a client script reads: ``{"ca", "requests", **extra}``."""
    return {"ca": str(hosts.ca_file), "requests": [r.wire() for r in plan], **extra}


# ------------------------------------------------------------------------------------------ the clients


async def run_client(argv: list[str], document: dict[str, Any], directory: Path, env: dict[str, str], *,
                     cwd: Path | None = None) -> list[dict[str, Any]]:
    """Run ``argv + [PLAN, RESULT]`` (a client script) with ``env`` and return its records (see
    webclients/py_clients.py). Raises AssertionError with its output when it exits non-zero or writes
    no result. Cancellation (the caller's ``trio.fail_after``) kills the process."""
    plan_file, result_file = _write_plan(document, directory)
    done = await trio.run_process([*argv, str(plan_file), str(result_file)], env=env, cwd=cwd,
                                  capture_stdout=True, capture_stderr=True, check=False)
    output = (done.stdout + done.stderr).decode(errors="replace")[-6000:]
    records = _read_result(result_file)
    assert done.returncode == 0 and records is not None, f"{' '.join(argv)} exited {done.returncode}:\n{output}"
    return records


def _write_plan(document: dict[str, Any], directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    plan_file, result_file = directory / "plan.json", directory / "result.json"
    plan_file.write_text(json.dumps(document))
    result_file.unlink(missing_ok=True)
    return plan_file, result_file


def _read_result(result_file: Path) -> list[dict[str, Any]] | None:
    if not result_file.exists():
        return None
    records: list[dict[str, Any]] = json.loads(result_file.read_text())
    return records


async def run_curl(document: dict[str, Any], directory: Path, env: dict[str, str], *, http10: bool = False,
                   rate: str | None = None) -> list[dict[str, Any]]:
    """Every request of the plan in one curl invocation (``--next`` between them: one connection cache,
    so kept-alive connections are reused), the proxy from the environment as curl reads it. Records as
    run_client's, plus ``num_connects`` (new connections that transfer made) and ``local_port``.
    ``http10``: as HTTP/1.0 (``--http1.0``); ``rate``: curl's ``--rate`` (``2/s``: transfers start at
    least 0.5 s apart; a request's ``pause`` means nothing to curl). Cancellation (the caller's
    ``trio.fail_after``) kills curl."""
    argv = _curl_argv(document, directory, http10)
    if rate is not None:
        argv[1:1] = ["--rate", rate]  # (a global option)
    done = await trio.run_process(argv, env=env, capture_stdout=True, capture_stderr=True, check=False)
    lines = [line for line in done.stdout.decode(errors="replace").splitlines() if line.startswith("<")]
    assert len(lines) == len(document["requests"]), \
        f"curl wrote {len(lines)} transfer reports for {len(document['requests'])} URLs (exit " \
        f"{done.returncode}): {done.stderr.decode(errors='replace')[-3000:]}"
    return _curl_records(document, directory, lines)


def _curl_argv(document: dict[str, Any], directory: Path, http10: bool) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    argv = ["curl"]
    for index, spec in enumerate(document["requests"]):
        out = directory / f"body-{index}"
        out.unlink(missing_ok=True)
        # (each transfer reports "<its X-Identity>" and curl's JSON of it: status, connects, errors)
        section = ["--silent", "--show-error", "--location", "--cacert", document["ca"], "--max-time", "30",
                   "--output", str(out), "--write-out", "<%header{x-identity}>%{json}\\n"]
        if index:
            section.insert(0, "--next")
        if http10:
            section.append("--http1.0")
        if spec["method"] == "HEAD":
            section.append("--head")
        elif spec["method"] not in ("GET", "POST"):
            section += ["--request", spec["method"]]
        for name, value in spec["headers"].items():
            section += ["--header", f"{name}: {value}"]
        if spec["body"]:
            data = directory / f"upload-{index}"
            data.write_bytes(body_bytes(spec["body"]["tag"], spec["body"]["size"]))
            section += ["--data-binary", f"@{data}", "--header", "Content-Type: application/octet-stream"]
            if spec["body"]["chunked"]:
                section += ["--header", "Transfer-Encoding: chunked"]
        argv += [*section, spec["url"]]
    return argv


def _curl_records(document: dict[str, Any], directory: Path, lines: list[str]) -> list[dict[str, Any]]:
    records = []
    for index, (spec, line) in enumerate(zip(document["requests"], lines, strict=True)):
        identity, _, report = line[1:].partition(">")
        info = json.loads(report)
        body_file = directory / f"body-{index}"
        body = body_file.read_bytes() if body_file.exists() and spec["method"] != "HEAD" else b""  # (--head: headers)
        status = info.get("http_code") or info.get("http_connect") or None
        parsed = None
        if "json" in (info.get("content_type") or ""):
            with contextlib.suppress(ValueError):
                parsed = json.loads(body)
        records.append({"id": spec["id"], "status": status, "length": len(body),
                        "sha256": sha256_hex(body), "json": parsed, "identity": identity or None,
                        "error": info.get("errormsg") if info.get("exitcode") else None,
                        "num_connects": info.get("num_connects"), "local_port": info.get("local_port")})
    return records


# ------------------------------------------------------------------------------------------- the checks

HOP_BY_HOP = ("proxy-authorization", "proxy-connection", "proxy-authenticate")
"""Header names no server may receive from a client through the proxy."""


def check_answers(hosts: WebHosts, plan: list[PlanRequest], records: list[dict[str, Any]], *, scheme: str,
                  token: str, secrets: list[str], strict_denied: bool = True) -> list[str]:
    """What is wrong with a client's answers to ``plan`` (an empty list: nothing). Each answer must
    come from the host asked (its identity, path, method, ``Host``), carry this request's own headers
    and no other's (host A's ``token`` only at host A), no proxy header, none of the proxy's
    ``secrets``, and the body sent or the page asked, byte for byte. A ``denied`` request must get the
    proxy's 403 (``strict_denied``), or else at least no answer from the denied host (a browser's fetch
    reports a refused tunnel or a CORS-less 403 as an error). A refused tunnel (HTTPS, and plain HTTP
    in clients that tunnel it too: undici's default, hpagent) is an error in most clients: its text
    must name the 403."""
    problems: list[str] = []
    by_id = {r.get("id"): r for r in records}
    if [r.get("id") for r in records] != [p.id for p in plan]:
        problems.append(f"answers {[r.get('id') for r in records]} for requests {[p.id for p in plan]}")
    for request in plan:
        where = f"{request.id} ({request.method} {request.url})"
        record = by_id.get(request.id)
        if record is None:
            problems.append(f"{where}: no answer")
            continue
        host = hosts[request.host]
        origin = host.origin(scheme)
        if request.expect == "denied":
            status, error = record.get("status"), str(record.get("error") or "")
            if record.get("json") or (status or 0) // 100 == 2 or record.get("identity"):
                problems.append(f"{where}: a host answered: status {status}, identity {record.get('identity')}")
            elif strict_denied and status != request.status and str(request.status) not in error:
                problems.append(f"{where}: expected the proxy's {request.status} (as the status, or for a "
                                f"refused tunnel in the client's error), got status {status} error {error!r}")
            elif not strict_denied and status != request.status and not error:
                problems.append(f"{where}: expected the proxy's {request.status} or an error, got status {status}")
            continue
        if record.get("error") or record.get("status") != request.status:
            problems.append(f"{where}: status {record.get('status')} (not {request.status}), error "
                            f"{record.get('error')!r}")
            continue
        if request.expect == "status":
            if record.get("identity") != origin or record.get("length"):
                problems.append(f"{where}: answered by {record.get('identity')}, not {origin}, with "
                                f"{record.get('length')} bytes of body")
            continue
        if record.get("identity") not in (None, origin):
            problems.append(f"{where}: answered by {record.get('identity')}, not {origin}")
        if request.expect == "bytes":
            expected = page_bytes(origin, request.size)
            if (record.get("length"), record.get("sha256")) != (len(expected), sha256_hex(expected)):
                other = _page_origin(hosts, request.size, record.get("sha256"))
                problems.append(f"{where}: got {record.get('length')} bytes sha256 {record.get('sha256')}, not "
                                f"{len(expected)} bytes of {origin}" + (f" (they are {other}'s)" if other else ""))
            continue
        echo = record.get("json")
        if not isinstance(echo, dict):
            problems.append(f"{where}: no JSON echo (status {record.get('status')}, {record.get('length')} bytes)")
            continue
        problems += [f"{where}: {p}" for p in _check_echo(request, echo, host.authority(scheme), origin,
                                                         token, secrets)]
    return problems


def _page_origin(hosts: WebHosts, size: int, digest: Any) -> str | None:
    for host in hosts.hosts.values():
        for scheme in ("http", "https"):
            if sha256_hex(page_bytes(host.origin(scheme), size)) == digest:
                return host.origin(scheme)
    return None


def _check_echo(request: PlanRequest, echo: dict[str, Any], authority: str, origin: str, token: str,
                secrets: list[str]) -> list[str]:
    problems = []
    got_origin = echo.get("identity", {}).get("origin")
    if got_origin != origin:
        problems.append(f"answered by {got_origin}, not {origin}")
    if echo.get("path") != request.path:
        problems.append(f"the server saw path {echo.get('path')!r}, not {request.path!r}")
    target = str(echo.get("target", ""))
    if not target.startswith("/"):
        problems.append(f"the server saw the request target {target!r} (not origin-form)")
    elif not request.redirected:
        url = urlsplit(request.url)
        sent = url.path + (f"?{url.query}" if url.query else "")
        if target != sent:
            problems.append(f"the server saw the request target {target!r}, not {sent!r}")
    if not request.redirected and echo.get("method") != request.method:
        problems.append(f"the server saw method {echo.get('method')}")
    headers = [(str(n), str(v)) for n, v in echo.get("headers", [])]
    lower = [(n.lower(), v) for n, v in headers]
    hosts_seen = [v for n, v in lower if n == "host"]
    if hosts_seen != [authority]:
        problems.append(f"Host headers {hosts_seen}, expected [{authority!r}]")
    ids = [v for n, v in lower if n == "x-ck-id"]
    if ids != [request.id]:
        problems.append(f"X-Ck-Id {ids} (headers of another request?)")
    auths = [v for n, v in lower if n == "authorization"]
    if request.auth and auths != [token]:
        problems.append(f"Authorization {auths}, expected host A's own")
    if not request.auth and auths:
        problems.append(f"received Authorization {auths}, meant for another host")
    for name, value in headers:
        if name.lower() in HOP_BY_HOP:
            problems.append(f"received the proxy's header {name}: {value}")
        for secret in secrets:
            if secret and secret in value and name.lower() not in HOP_BY_HOP:
                problems.append(f"received the proxy's credentials in {name}: {value}")
        if not request.auth and token in value:
            problems.append(f"received host A's token in {name}")
    if request.body and not request.redirected:
        sent = body_bytes(request.body["tag"], request.body["size"])
        body = echo.get("body", {})
        if (body.get("length"), body.get("sha256")) != (len(sent), sha256_hex(sent)):
            problems.append(f"the server received a body of {body.get('length')} bytes sha256 "
                            f"{body.get('sha256')}, not the {len(sent)} sent")
    return problems
