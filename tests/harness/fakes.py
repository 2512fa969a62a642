"""Fake masters in memory (``httpx.MockTransport``) for the poller and the delivery, and a supervisor that only admits."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
import yaml

from ckagent.delivery import MAX_BATCH_BYTES
from ckagent.master.client import MasterClient
from ckagent.master.protocol import RegisterRequest
from ckagent.task.supervisor import RunnerConfig, RunningTask, Supervisor


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with libyaml's parser when PyYAML has it (the same documents, ~10× less CPU:
    openapi.yaml takes 0.1 s in pure Python, and every pytest-xdist worker loads it at collection)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


PENDING = "/api/nodes/node-1/tasks/pending"
"""The poll's path for the node :class:`PollMaster` registers (node-1)."""


def task_json(task_id: str, spider_id: str, **extra: Any) -> dict[str, Any]:
    """A task as the master hands it out (JSON), python, no code package; ``extra`` overrides."""
    return {"id": task_id, "spiderId": spider_id, "spiderName": spider_id, "framework": "python",
            "command": None, "args": [], "env": {}, "timeoutSeconds": None, "codeVersion": None,
            "codePackage": None, "params": {}, **extra}


class HoldingSupervisor(Supervisor):
    """The real Supervisor, except that a task just holds its slot until ``release(task_id)``."""

    def __init__(self, max_workers: int, tmp_path: Path) -> None:
        # Nothing but admission is used: every collaborator (master, store, workspaces, ...) is None.
        required = {name: None for name, param in inspect.signature(Supervisor.__init__).parameters.items()
                    if param.kind is param.KEYWORD_ONLY and param.default is param.empty}
        super().__init__(RunnerConfig(tmp_path, 60.0, 1.0), None, None, None, None,  # type: ignore[arg-type]
                         max_workers, **required)
        self.started: list[str] = []
        self._release: dict[str, trio.Event] = {}

    async def run_task(self, rt: RunningTask) -> None:
        self.started.append(rt.task.id)
        try:
            await self._release.setdefault(rt.task.id, trio.Event()).wait()
        finally:
            self.task_left(rt.task.id)  # as the real runner does

    def release(self, task_id: str) -> None:
        self._release.setdefault(task_id, trio.Event()).set()


@dataclass
class Poll:
    """One poll a :class:`PollMaster` received: when (trio time) and its query parameters."""

    at: float
    params: dict[str, str]


@dataclass
class PollMaster:
    """Scripted answers to /tasks/pending (one per poll; then empty) and a log of what the agent sent."""

    answers: list[dict[str, Any]] = field(default_factory=list)
    hold_empty: bool = False  # long poll: an empty answer is held for waitSeconds
    claim_status: Callable[[str], int] = lambda task_id: 200
    claim_delay: float = 0.0  # seconds the master takes to answer a claim
    polls: list[Poll] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)
    results: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    poll_event: trio.Event = field(default_factory=trio.Event)
    features: list[str] = field(default_factory=list)  # the registration answer's (claim-in-poll)
    lose_polls: int = 0  # the first polls' answers are lost on the way (a 502 after the master acted)
    releases: list[str] = field(default_factory=list)

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/api/nodes/register":
            return httpx.Response(200, json={"nodeId": "node-1", "apiKey": "key-1", "features": self.features})
        if path.startswith("/api/tasks/") and path.endswith("/release"):
            self.releases.append(path.split("/")[3])
            return httpx.Response(200, json={"ok": True, "status": "PENDING"})
        if path == PENDING:
            self.polls.append(Poll(trio.current_time(), dict(request.url.params)))
            self.poll_event.set()
            self.poll_event = trio.Event()
            if self.lose_polls:
                self.lose_polls -= 1
                return httpx.Response(502, text="bad gateway")
            answer = self.answers.pop(0) if self.answers else {"tasks": [], "cancelTaskIds": []}
            if not answer["tasks"] and self.hold_empty:
                await trio.sleep(float(request.url.params["waitSeconds"]))
            self.answered_at.append(trio.current_time())
            return httpx.Response(200, json=answer)
        if path.startswith("/api/tasks/") and path.endswith("/result"):
            task_id = path.split("/")[3]
            body = json.loads(request.content)
            self.results.setdefault(task_id, []).append(body)
            if body["status"] == "RUNNING":
                await trio.sleep(self.claim_delay)
            status = self.claim_status(task_id) if body["status"] == "RUNNING" else 200
            return httpx.Response(status, json={"error": "already claimed"} if status == 409
                                  else {"ok": True, "status": body["status"]})
        return httpx.Response(404, json={"error": f"no route {path}"})

    async def wait_polls(self, count: int) -> None:
        while len(self.polls) < count:
            await self.poll_event.wait()


def register_request() -> RegisterRequest:
    """A node's registration (the wire type) for a MasterClient over a fake master."""
    return RegisterRequest(name="n1", ip="127.0.0.1", port=9000, version="0", os="linux", arch="x86_64",
                           python="3.11", cpu_count=2, memory_total_bytes=1 << 30, max_workers=2)


class BatchMaster:
    """One task's log and item batches under the seq rules of docs/protocol.md, in memory (``logs``,
    ``items``, ``results``, every batch in ``requests``), plus faults scripted per request (``fault``):
    for ``httpx.MockTransport`` (:func:`master_client`)."""

    def __init__(self) -> None:
        self.logs: list[str] = []
        self.items: list[Any] = []
        self.results: list[dict[str, Any]] = []
        self.requests: list[tuple[float, str, int, int]] = []  # (time, kind, seq, count)
        self.fault: Callable[[str, int, list[Any]], httpx.Response | None] = lambda kind, seq, batch: None
        self.attempts: list[int | None] = []  # each batch's ``attempt`` (None: absent)

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/api/nodes/register":
            return httpx.Response(200, json={"nodeId": "n1", "apiKey": "k" * 20})
        body = json.loads(request.content)
        if path.endswith("/result"):
            self.results.append(body)
            return httpx.Response(200, json={"status": body["status"]})  # ResultAccepted
        kind = path.rsplit("/", 1)[1]
        key = "lines" if kind == "logs" else "items"
        stored = self.logs if kind == "logs" else self.items
        seq, batch = body["seq"], body[key]
        self.requests.append((trio.current_time(), kind, seq, len(batch)))
        self.attempts.append(body.get("attempt"))
        assert len(request.content) <= MAX_BATCH_BYTES + 100 or len(batch) == 1
        fault = self.fault(kind, seq, batch)
        if fault is not None:
            return fault
        if seq > len(stored):
            return httpx.Response(409, json={"error": "gap", "expectedSeq": len(stored)})
        stored.extend(batch[len(stored) - seq :])
        return httpx.Response(200, json={"acceptedSeq": len(stored)})


def master_client(fake: BatchMaster) -> MasterClient:
    """A MasterClient whose master is ``fake`` (in memory, at http://master.test)."""
    def body() -> RegisterRequest:
        return RegisterRequest(name="n", ip="127.0.0.1", port=1, version="t", os="linux", arch="x", python="3",
                               cpu_count=1, memory_total_bytes=1, max_workers=1)

    return MasterClient("http://master.test", "token", body, transport=httpx.MockTransport(fake.handler))
