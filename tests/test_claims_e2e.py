"""Claims, cancellation and shutdown end to end: the real agent (a process, or in-process), the real
reference master behind an ASGI gate that can hold claim answers or refuse final results.

- SIGTERM with claims on the wire: no task is left RUNNING at the master (each claim is answered
  and given back, or cut off and given back); the node's last heartbeat says STOPPED. The same with
  the claim in a poll answer (claim-in-poll) held on its way: the poll is cut off, and the master's
  reconciliation against the node's heartbeat makes the task PENDING again; it never runs here.
- A task cancelled during its dependency install, then ``kill -9`` of the agent before the result
  got through: the next start reports CANCELLED, not AGENT_LOST.
- After a cancel, the spider's next task starts within 1 s with the default poll settings.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import sqlite3
import textwrap
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    SLOW_BACKEND,
    agent_process,
    alive,
    eventually,
    marked_pids,
    no_strays,
    node_status,
    package_index,
    running_agent,
    spider_writable,
    submit,
    wait_exit,
    wait_for_log,
    wait_for_path,
    wait_registered,
)
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from ckagent.devmaster.app import Notifier, create_app
from ckagent.devmaster.client import AdminClient
from ckagent.devmaster.store import Store
from ckagent.node.config import load_settings

_RESULT_PATH = re.compile(r"^/api/tasks/([^/]+)/(result|release)$")
_POLL_PATH = re.compile(r"^/api/nodes/[^/]+/tasks/pending$")


@dataclass
class Gate:
    """ASGI wrapper of the dev master: ``claim_delay`` seconds between a claim's being applied and its
    answer (the claim is on the wire for the agent meanwhile); ``refuse_finals``: final results get
    503. Records the releases it passed on."""

    app: Any
    claim_delay: float = 0.0
    refuse_finals: bool = False
    releases: list[str] = field(default_factory=list)
    claimed_poll_delay: float = 0.0
    """Seconds between a poll answer that carries claimed tasks and its sending (claim-in-poll)."""
    claimed_polls: int = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and _POLL_PATH.match(scope.get("path", "")) and self.claimed_poll_delay:
            answer: list[dict[str, Any]] = []

            async def keep(message: dict[str, Any]) -> None:
                answer.append(message)

            await self.app(scope, receive, keep)  # the master has claimed what the answer carries
            if b'"claimed":true' in b"".join(m.get("body", b"") for m in answer):
                self.claimed_polls += 1
                await trio.sleep(self.claimed_poll_delay)
            for message in answer:
                await send(message)
            return
        match = _RESULT_PATH.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = b""
        messages: list[dict[str, Any]] = []
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status = json.loads(body or b"{}").get("status")
        if match.group(2) == "release":
            self.releases.append(match.group(1))
        elif status != "RUNNING" and self.refuse_finals:
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error": "refusing finals (test)"}'})
            return

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        held: list[dict[str, Any]] = []

        async def hold(message: dict[str, Any]) -> None:
            held.append(message)

        await self.app(scope, replay, hold)  # the master has applied the request
        if status == "RUNNING" and self.claim_delay:
            await trio.sleep(self.claim_delay)
        for message in held:
            await send(message)


@dataclass
class GatedMaster:
    base_url: str
    registration_token: str
    admin: AdminClient
    gate: Gate


@pytest.fixture
async def gated_master(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[GatedMaster]:
    """The gated dev master; ``claim_in_poll`` is its feature (parametrize indirectly with False to
    make the agent claim with POST .../result)."""
    claim_in_poll = getattr(request, "param", True)
    store = await trio.to_thread.run_sync(Store, tmp_path / "master.sqlite")
    registration_token, admin_token = uuid.uuid4().hex, uuid.uuid4().hex
    gate = Gate(create_app(store, Notifier(), registration_token=registration_token, admin_token=admin_token,
                           max_long_poll_seconds=30.0, claim_in_poll=claim_in_poll))
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.loglevel = "WARNING"
    config.graceful_timeout = 0.5
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(hypercorn_serve, gate, config))
            base_url = str(binds[0]).rstrip("/")
            async with AdminClient(base_url, admin_token) as admin:
                yield GatedMaster(base_url, registration_token, admin, gate)
            nursery.cancel_scope.cancel()
    finally:
        store.close()


SLEEPER = {"main.py": "import time\nprint('started', flush=True)\ntime.sleep(600)\n"}


@pytest.mark.parametrize("gated_master", [False], indirect=True, ids=["claim-by-result"])
@pytest.mark.parametrize("claim_delay", [3.0, 30.0], ids=["answered-while-draining", "cut-off"])
async def test_sigterm_with_claims_on_the_wire_leaves_no_task_running(
    gated_master: GatedMaster, tmp_path: Path, claim_delay: float
) -> None:
    admin = gated_master.admin
    # request_timeout 5 s: a claim held 3 s is answered while the agent drains; one held 30 s is cut
    # off 5 s after the drain began. Both tasks wait before the agent starts: its first poll gets both.
    agent = agent_process(tmp_path, gated_master.base_url, gated_master.registration_token,
                          server__request_timeout=5)
    gated_master.gate.claim_delay = claim_delay
    tasks = [await submit(admin, f"claimed-{i}", SLEEPER) for i in range(2)]
    await agent.start()
    async with agent:

        async def both_claimed() -> bool:
            return all([(await admin.get_task(t))["status"] == "RUNNING" for t in tasks])

        await eventually(both_claimed)  # applied at the master; the answers are held
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 20) == 0
    statuses = {t: (await admin.get_task(t))["status"] for t in tasks}
    assert statuses == dict.fromkeys(tasks, "PENDING"), agent.log_text()[-3000:]
    assert sorted(gated_master.gate.releases) == sorted(tasks)
    text = agent.log_text()
    reason = "claimed while the node started draining" if claim_delay < 10 else "claim cut off: the node is stopping"
    assert text.count(f"given back to the master ({reason})") == 2, text[-3000:]
    assert "started" not in "".join([line for t in tasks for line in await admin.get_logs(t)])
    assert await node_status(admin) == "STOPPED"


async def test_sigterm_with_a_claiming_poll_answer_on_the_wire_leaves_no_task_running(
    gated_master: GatedMaster, tmp_path: Path
) -> None:
    admin = gated_master.admin
    agent = agent_process(tmp_path, gated_master.base_url, gated_master.registration_token,
                          server__request_timeout=5)
    gated_master.gate.claimed_poll_delay = 30.0  # the answer carrying the claim never arrives in time
    await agent.start()
    async with agent:
        await wait_registered(admin, agent)
        task_id = await submit(admin, "claimed-in-poll", SLEEPER)

        async def claimed() -> bool:
            return gated_master.gate.claimed_polls == 1 and (await admin.get_task(task_id))["status"] == "RUNNING"

        await eventually(claimed)  # claimed at the master; the answer is held
        agent.signal(signal.SIGTERM)
        assert await wait_exit(agent, 20) == 0
    # The poll was cut off; the node's heartbeat showed it settled: PENDING again at once (no 60 s wait).
    assert (await admin.get_task(task_id))["status"] == "PENDING", agent.log_text()[-3000:]
    assert gated_master.gate.releases == []
    assert "started" not in "".join(await admin.get_logs(task_id))
    assert await node_status(admin) == "STOPPED"


def _stored_result(db: Path, task_id: str) -> dict[str, Any] | None:
    """The result the agent's state store holds for ``task_id`` (read-only, another process's file)."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            row = conn.execute("SELECT result_json FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
    except sqlite3.Error:
        return None
    return None if row is None or row[0] is None else dict(json.loads(row[0]))


async def test_cancel_during_the_install_then_kill_9_reports_cancelled_not_agent_lost(
    gated_master: GatedMaster, tmp_path: Path
) -> None:
    admin = gated_master.admin
    # A package whose build hangs, from a package index on 127.0.0.1 (a package of the project's own
    # tree is never built: installers run as the node's builder); its pid file where the builder's uid
    # may write it.
    pid_file = spider_writable(tmp_path / "shared") / "backend.pid"
    slowpkg = {
        "pyproject.toml": textwrap.dedent("""
            [build-system]
            requires = []
            build-backend = "slowbackend"
            backend-path = ["."]
            [project]
            name = "slowpkg"
            version = "0.1"
        """),
        "slowbackend.py": SLOW_BACKEND.format(pid_file=str(pid_file)),
    }
    files = {"main.py": "print('the spider must never start')\n", "requirements.txt": "slowpkg==0.1\n"}
    with package_index(tmp_path / "index", [], [("slowpkg", "0.1", slowpkg)]) as index:
        agent = agent_process(tmp_path, gated_master.base_url, gated_master.registration_token,
                              deps__uv_index_url=index.url)
        await agent.start()
        async with agent:
            await wait_registered(admin, agent)
            gated_master.gate.refuse_finals = True  # the CANCELLED result cannot get through
            task_id = await submit(admin, "slow-install", files)
            await wait_for_path(pid_file, timeout=60)
            backend = int(pid_file.read_text())
            await admin.cancel_task(task_id)
            db = tmp_path / "node" / "data" / "state.db"

            async def stored() -> dict[str, Any] | None:
                return await trio.to_thread.run_sync(_stored_result, db, task_id)

            result = await eventually(stored)
            assert (result["status"], result["errorCode"]) == ("CANCELLED", "CANCELLED")
            await agent.kill()  # kill -9 before the result reached the master
            assert (await admin.get_task(task_id))["status"] == "RUNNING"
            assert not alive(backend), "the installer was stopped before the result was stored"

            gated_master.gate.refuse_finals = False
            await agent.start()
            with trio.fail_after(30):
                task = await admin.wait_task_final(task_id, 30)
            agent.signal(signal.SIGTERM)
            assert await wait_exit(agent, 20) == 0
    assert (task["status"], task["errorCode"]) == ("CANCELLED", "CANCELLED"), task
    assert marked_pids(task_id) == []


async def test_after_a_cancel_the_next_task_starts_within_1_s_with_default_settings(
    gated_master: GatedMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    env = {
        "AGENT_SERVER_URL": gated_master.base_url,
        "AGENT_REGISTRATION_TOKEN": gated_master.registration_token,
        "AGENT_WORK_DIR": str(tmp_path / "agent"),
        "AGENT_NAME": "default-node",
        "AGENT_IP": "127.0.0.1",
        "AGENT_PORT": "0",
        "AGENT_UV_INDEX_URL": "http://127.0.0.1:9/simple",
    }
    settings = load_settings(None, env=env, require_token=True)  # poll, long poll, heartbeat: defaults
    assert (settings.task.poll_interval, settings.task.long_poll_wait) == (10.0, 20.0)
    admin = gated_master.admin
    delays = []
    async with running_agent(nursery, settings):
        spider_files = dict(SLEEPER)
        first = await submit(admin, "serial", spider_files)
        await wait_for_log(admin, first, "started")
        for _ in range(3):
            spider_id = (await admin.get_task(first))["spiderId"]
            following = await admin.create_task(spider_id)
            await trio.sleep(1.0)  # the poll is held, excluding the spider that runs
            assert (await admin.get_task(following))["status"] == "PENDING"
            cancelled_at = trio.current_time()
            await admin.cancel_task(first)

            async def claimed(task_id: str = following) -> bool:
                return (await admin.get_task(task_id))["status"] == "RUNNING"

            await eventually(claimed, timeout=15)
            delays.append(trio.current_time() - cancelled_at)
            await wait_for_log(admin, following, "started")
            first = following
        await admin.cancel_task(first)
    print(f"cancel → next task claimed: {', '.join(f'{d:.3f} s' for d in delays)}")
    assert max(delays) < 1.0, delays


# ------------------------------------------------------------------------------ exit codes, decided once


@pytest.mark.parametrize("log_to_file", [False, True], ids=["log-on-stderr", "log-in-a-file"])
async def test_an_agent_that_cannot_run_exits_1_and_says_why_once(
    gated_master: GatedMaster, tmp_path: Path, log_to_file: bool
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        extra = {"logging__file": str(tmp_path / "own.log")} if log_to_file else {}
        agent = agent_process(tmp_path, gated_master.base_url, gated_master.registration_token,
                              agent__port=port, **extra)
        await agent.start()
        async with agent:
            assert await wait_exit(agent, 30) == 1
    stderr = agent.log_text()  # the process's stderr
    reason = f"cannot listen on 127.0.0.1:{port}"
    if log_to_file:
        assert (tmp_path / "own.log").read_text().count(reason) == 1
        assert stderr.count(f"ckagent: cannot run: {reason}") == 1, stderr
    else:  # the log line on stderr says it; the CLI does not repeat it
        assert stderr.count(reason) == 1, stderr
    assert "Traceback" not in stderr
