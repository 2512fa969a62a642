"""The master's endpoints: one table, and one typed method per call.

Each row of :data:`ENDPOINTS` (an :class:`Endpoint`) says everything the agent knows of one call:

- ``name`` — what logs, ``/readyz``, the ``endpoint`` label of ``ckagent_master_requests_total`` and
  ``ckagent_master_request_duration_seconds``, and the tests' fault proxy call it;
- ``method`` and ``template`` — the path with its parameters: ``{task}`` is one percent-encoded path
  segment (:func:`ckagent.master.ids.url_segment`), ``{path:path}`` a relative path of such segments;
  ``{node}`` is filled by the client with its node id;
- ``scope`` — whose affair a refusal (another 4xx) is: ``node`` (/readyz shows it) or ``task`` (that
  task's, logged); ``holds_data`` — the spider's data waits on the node until it is acknowledged;
- ``outage`` — the class of a partial outage it belongs to (ckagent.master.connectivity);
- ``answer`` — the protocol's reader of its 2xx body (the answer type), ``None`` for a download
  streamed to a sink; ``answer_schema`` its schema in ``protocol/openapi.yaml``.

Two rows may share a route (a claim and a final result are both ``POST /api/tasks/{task}/result``):
they differ in what they mean, so in how a refusal is read. A test holds the table against
``openapi.yaml`` (every node operation is a row, every row an operation) and the reference master's
routes. :class:`MasterCalls` is the typed face of the table, mixed into
:class:`ckagent.master.client.MasterClient`: ``await master.heartbeat(beat) -> HeartbeatResponse``.

**To add an endpoint**: a row here and its method on :class:`MasterCalls` (the checkpoint calls: on
:class:`ckagent.master.checkpointcalls.CheckpointCalls`); its types in
:mod:`ckagent.master.protocol`, its operation in ``openapi.yaml`` and ``docs/protocol.md``, its route in
the reference master. Connectivity's classes, the metric labels and the fault proxy follow the table.

Errors: every method raises what :meth:`ckagent.master.client.MasterClient.call` raises (the tree of
:mod:`ckagent.master.errors`); ``retry`` (a :class:`Retry`) retries MasterUnavailable with backoff
within its bounds. Cancellation abandons the request (and stops the retries).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from ckagent.master.ids import url_path, url_segment
from ckagent.master.protocol import (
    ArtifactRef,
    CheckpointManifest,
    Heartbeat,
    HeartbeatResponse,
    PendingTasks,
    ProtocolError,
    RegisterResponse,
    ResultAccepted,
    SeqAccepted,
    SpiderFile,
    TaskRelease,
    TaskResult,
    TaskStats,
)
from ckagent.master.protocol._fields import req_object

__all__ = [
    "ENDPOINTS", "LEAVING", "MAX_CHUNK_DOWNLOAD_BYTES", "TASK_DATA_ENDPOINTS", "Endpoint", "MasterCalls", "Retry",
    "any_json", "checkpoint_accepted", "chunk_stored", "json_object", "node_batch_results",
]

A = TypeVar("A")
Scope = Literal["node", "task"]
Sink = Callable[[bytes], Awaitable[None]]

MAX_CHUNK_DOWNLOAD_BYTES = 2 << 20
"""Most bytes a checkpoint chunk's download may have (gzip of at most CHUNK_BYTES, with room to spare)."""

_PARAM = re.compile(r"\{([a-z_]+)(:path)?\}")


def json_object(obj: Any) -> dict[str, Any]:
    """The reader of answers the protocol defines as any JSON object (a claim, a result, a release).
    Raises ProtocolError for anything else (an empty body included)."""
    return req_object(obj, "")


def any_json(obj: Any) -> Any:
    """The reader of an answer the agent ignores (live stats): empty or any JSON."""
    return obj


def node_batch_results(obj: Any) -> list[Any]:
    """The ``results`` array of a node batches answer (one per batch, in order). Raises ProtocolError."""
    results = obj.get("results") if isinstance(obj, dict) else None
    if not isinstance(results, list):
        raise ProtocolError("results", "expected an array")
    return results


def chunk_stored(obj: Any) -> bool:
    """The reader of a checkpoint chunk's answer: ``{"stored": true}``. Raises ProtocolError otherwise."""
    if req_object(obj, "").get("stored") is not True:
        raise ProtocolError("stored", "expected true")
    return True


def checkpoint_accepted(obj: Any) -> str:
    """The reader of a checkpoint manifest's answer: ``{"checkpointId": id}`` → the id. Raises ProtocolError."""
    value = req_object(obj, "").get("checkpointId")
    if not isinstance(value, str) or not value:
        raise ProtocolError("checkpointId", "expected the checkpoint's id")
    return value


@dataclass(frozen=True)
class Endpoint(Generic[A]):
    """One row of the table (see module docstring). ``answer`` turns the decoded 2xx body into ``A``
    (raising ProtocolError/ValueError for a wrong shape); None for a download."""

    name: str
    method: str
    template: str
    scope: Scope
    outage: str
    answer: Callable[[Any], A] | None
    answer_schema: str | None = None
    holds_data: bool = False
    params: tuple[str, ...] = field(init=False)
    """The template's parameters, in order (``node`` included)."""
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(m.group(1) for m in _PARAM.finditer(self.template)))
        parts = _PARAM.split(self.template)  # text, (name, kind, text)*: kind ":path" or None
        pattern = re.escape(parts[0])
        for i in range(1, len(parts), 3):
            pattern += (".+" if parts[i + 1] else "[^/]+") + re.escape(parts[i + 2])
        object.__setattr__(self, "_pattern", re.compile(pattern))

    def path(self, **ids: str) -> str:
        """The path with ``ids`` put in, each quoted once (one segment, or segments for ``{x:path}``);
        ``{node}`` may be left for the client. Raises KeyError naming a missing or unknown parameter."""
        unknown = set(ids) - set(self.params)
        if unknown:
            raise KeyError(f"{self.name}: {self.template!r} has no {{{sorted(unknown)[0]}}}")

        def put(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in ids:
                if name == "node":
                    return match.group(0)
                raise KeyError(f"{self.name}: {self.template!r} needs {{{name}}}")
            return url_path(ids[name]) if match.group(2) else url_segment(ids[name])

        return _PARAM.sub(put, self.template)

    def matches(self, method: str, path: str) -> bool:
        """True when a request (``method``, a raw ``path`` without its query) is this route."""
        return method.upper() == self.method and self._pattern.fullmatch(path) is not None


REGISTER: Endpoint[RegisterResponse] = Endpoint(
    "register", "POST", "/api/nodes/register", "node", "heartbeat", RegisterResponse.from_json, "RegisterResponse")
"""Registration: made by :meth:`ckagent.master.client.MasterClient.register` (its own rules: no key yet)."""
HEARTBEAT: Endpoint[HeartbeatResponse] = Endpoint(
    "heartbeat", "POST", "/api/nodes/{node}/heartbeat", "node", "heartbeat", HeartbeatResponse.from_json,
    "HeartbeatResponse")
LEAVING: Endpoint[dict[str, Any]] = Endpoint(
    "leaving", "POST", "/api/nodes/{node}/leaving", "node", "heartbeat", json_object)
"""The agent stopped on purpose and leaves no task running: the master releases its name. Made by
:meth:`ckagent.master.client.MasterClient.leave` (its own rules: once, bounded, never re-registering)."""
POLL: Endpoint[PendingTasks] = Endpoint(
    "poll", "GET", "/api/nodes/{node}/tasks/pending", "node", "poll", PendingTasks.from_json, "PendingTasks")
CLAIM: Endpoint[dict[str, Any]] = Endpoint(
    "claim", "POST", "/api/tasks/{task}/result", "task", "poll", json_object)
RELEASE: Endpoint[dict[str, Any]] = Endpoint(
    "release", "POST", "/api/tasks/{task}/release", "task", "poll", json_object)
RESULT: Endpoint[ResultAccepted] = Endpoint(
    "result", "POST", "/api/tasks/{task}/result", "node", "task streams", ResultAccepted.from_json, "ResultAccepted",
    holds_data=True)
"""A final result: acknowledged only by the task's final status in the answer (a claim shares the route)."""
LOGS: Endpoint[SeqAccepted] = Endpoint(
    "logs", "POST", "/api/tasks/{task}/logs", "node", "task streams", SeqAccepted.from_json, "SeqAccepted",
    holds_data=True)
ITEMS: Endpoint[SeqAccepted] = Endpoint(
    "items", "POST", "/api/tasks/{task}/items", "node", "task streams", SeqAccepted.from_json, "SeqAccepted",
    holds_data=True)
BATCHES: Endpoint[list[Any]] = Endpoint(
    "batches", "POST", "/api/nodes/{node}/batches", "node", "task streams", node_batch_results, "NodeBatchResults",
    holds_data=True)
STATS: Endpoint[Any] = Endpoint("stats", "POST", "/api/tasks/{task}/stats", "task", "task streams", any_json)
ARTIFACT: Endpoint[ArtifactRef] = Endpoint(
    "artifact", "PUT", "/api/tasks/{task}/artifacts/{path:path}", "task", "artifacts", ArtifactRef.from_json,
    "ArtifactRef")
SPIDER_FILES: Endpoint[list[SpiderFile]] = Endpoint(
    "spider_files", "GET", "/api/spider-files/spider/{spider}", "task", "downloads", SpiderFile.list_from_json,
    "SpiderFile[]")
SPIDER_FILE: Endpoint[None] = Endpoint("spider_file", "GET", "/api/spider-files/{file}", "task", "downloads", None)
DOWNLOAD: Endpoint[None] = Endpoint("download", "GET", "/api/packages/{spider}/{version}.zip", "task", "downloads", None)
"""A code package; the agent fetches the URL its task names (this template is the reference master's)."""

CHECKPOINT_CHUNK_PUT: Endpoint[bool] = Endpoint(
    "checkpoint_chunk_put", "PUT", "/api/tasks/{task}/checkpoint-chunks/{sha}", "task", "checkpoints", chunk_stored,
    "ChunkStored")
"""One chunk of a checkpoint (gzip bytes), stored by the sha256 of its uncompressed bytes (idempotent)."""
CHECKPOINT_CHUNK_GET: Endpoint[None] = Endpoint(
    "checkpoint_chunk_get", "GET", "/api/tasks/{task}/checkpoint-chunks/{sha}", "task", "checkpoints", None)
CHECKPOINT_POST: Endpoint[str] = Endpoint(
    "checkpoint_post", "POST", "/api/tasks/{task}/checkpoints", "task", "checkpoints", checkpoint_accepted,
    "CheckpointAccepted")
"""A checkpoint's manifest, after its chunks and after the items stream is acknowledged up to its itemSeq."""
CHECKPOINT_GET: Endpoint[CheckpointManifest] = Endpoint(
    "checkpoint_get", "GET", "/api/tasks/{task}/checkpoints/{checkpoint}", "task", "checkpoints",
    CheckpointManifest.from_json, "CheckpointManifest")

ENDPOINTS: dict[str, Endpoint[Any]] = {e.name: e for e in (
    REGISTER, HEARTBEAT, LEAVING, POLL, CLAIM, RELEASE, RESULT, LOGS, ITEMS, BATCHES, STATS, ARTIFACT, SPIDER_FILES,
    SPIDER_FILE, DOWNLOAD, CHECKPOINT_CHUNK_PUT, CHECKPOINT_CHUNK_GET, CHECKPOINT_POST, CHECKPOINT_GET)}
"""Every call the agent makes, by name."""
TASK_DATA_ENDPOINTS = frozenset(e.name for e in ENDPOINTS.values() if e.holds_data)
"""The task streams: what a refusal of them holds back is the spider's data, kept on the node."""
STREAMS: dict[str, Endpoint[SeqAccepted]] = {"logs": LOGS, "items": ITEMS}
"""A task's sequence-numbered streams by kind."""


@dataclass(frozen=True)
class Retry:
    """How a call is retried while the master is unavailable (MasterUnavailable, a protocol error too):
    with exponential backoff (0.5 s → server.max_backoff_interval, 30 s by default) and jitter, at most ``attempts`` times and ``timeout``
    seconds (None: no bound). ``Retry()`` retries for as long as it takes."""

    attempts: int | None = None
    timeout: float | None = None


class MasterCalls(ABC):
    """One typed method per endpoint of the table; mixed into MasterClient, which provides :meth:`call`
    and :meth:`download` (see module docstring for errors and cancellation)."""

    @abstractmethod
    async def call(
        self, endpoint: Endpoint[A], ids: Mapping[str, str] | None = None, *, retry: Retry | None = None,
        answer: Callable[[Any], A] | None = None, json: Any = None, content: bytes | None = None,
        params: Mapping[str, str | int | float] | None = None, read_timeout: float | None = None,
        content_type: str = "application/json", headers: Mapping[str, str] | None = None,
    ) -> A:
        """One call of ``endpoint`` with ``ids`` in its path; see MasterClient.call."""

    @abstractmethod
    async def download(self, endpoint: Endpoint[None], url: str, sink: Sink, *,
                       read_timeout: float | None = None) -> int:
        """One streamed GET of ``url`` into ``sink``; see MasterClient.download."""

    async def heartbeat(self, beat: Heartbeat) -> HeartbeatResponse:
        """``POST /api/nodes/{node}/heartbeat``: the tasks to cancel and the version policy."""
        return await self.call(HEARTBEAT, json=beat.to_json())

    async def poll(self, limit: int, *, exclude_spider_ids: Sequence[str] = (), wait_seconds: float = 0,
                   claim: int | None = None, poll_id: int | None = None, read_timeout: float | None = None,
                   retry: Retry | None = None, running_spider_ids: Sequence[str] = ()) -> PendingTasks:
        """``GET /api/nodes/{node}/tasks/pending``: at most ``limit`` tasks, none of the excluded spiders,
        held up to ``wait_seconds`` (a long poll: give ``read_timeout`` beyond it); ``claim``/``poll_id``
        ask the master to claim them in the answer (feature ``claim-in-poll``); ``running_spider_ids``
        (those of the excluded spiders this node runs a task of) stay excluded only until the master
        has this node's final result of that task (feature ``poll-follows-results``)."""
        params: dict[str, str | int | float] = {"limit": limit}
        if exclude_spider_ids:
            params["excludeSpiderIds"] = ",".join(exclude_spider_ids)
        if running_spider_ids:
            params["runningSpiderIds"] = ",".join(running_spider_ids)
        if wait_seconds:
            params["waitSeconds"] = wait_seconds
        if claim is not None:
            params["claim"] = claim
        if poll_id is not None:
            params["pollId"] = poll_id
        return await self.call(POLL, params=params, read_timeout=read_timeout, retry=retry)

    async def claim(self, task_id: str, claim: TaskResult, *, retry: Retry | None = None) -> dict[str, Any]:
        """``POST /api/tasks/{task}/result`` with status RUNNING. MasterConflict: claimed elsewhere."""
        return await self.call(CLAIM, {"task": task_id}, json=claim.to_json(), retry=retry)

    async def release(self, task_id: str, release: TaskRelease) -> dict[str, Any]:
        """``POST /api/tasks/{task}/release``: give back a claimed task that did not start."""
        return await self.call(RELEASE, {"task": task_id}, json=release.to_json())

    async def report_result(self, task_id: str, result: TaskResult, *, retry: Retry | None = None) -> ResultAccepted:
        """``POST /api/tasks/{task}/result`` with a final status; the answer must name the task's final
        status (else MasterProtocolError: not an acknowledgement)."""
        return await self.call(RESULT, {"task": task_id}, json=result.to_json(), retry=retry)

    async def post_stream(self, kind: str, task_id: str, body: bytes) -> SeqAccepted:
        """``POST /api/tasks/{task}/logs`` or ``/items`` (``kind``): one batch, JSON already encoded."""
        return await self.call(STREAMS[kind], {"task": task_id}, content=body)

    async def post_batches(self, body: bytes) -> list[Any]:
        """``POST /api/nodes/{node}/batches``: several tasks' batches (encoded); one result per batch."""
        return await self.call(BATCHES, content=body)

    async def post_stats(self, task_id: str, stats: TaskStats) -> None:
        """``POST /api/tasks/{task}/stats``: one live snapshot (its answer is ignored)."""
        await self.call(STATS, {"task": task_id}, json=stats.to_json())

    async def put_artifact(self, task_id: str, ref: ArtifactRef, data: bytes) -> ArtifactRef:
        """``PUT /api/tasks/{task}/artifacts/{path}``: one file's bytes; the master's acknowledgement
        must name the file sent (else MasterProtocolError)."""
        return await self.call(ARTIFACT, {"task": task_id, "path": ref.path}, content=data,
                               content_type="application/octet-stream", headers={"X-Content-SHA256": ref.sha256},
                               answer=_acknowledges(ref))

    async def spider_files(self, spider_id: str, *, retry: Retry | None = None) -> list[SpiderFile]:
        """``GET /api/spider-files/spider/{spider}``: the listing of a spider's files."""
        return await self.call(SPIDER_FILES, {"spider": spider_id}, retry=retry)

    async def download_spider_file(self, file_id: str, sink: Sink, *, read_timeout: float | None = None) -> int:
        """``GET /api/spider-files/{file}`` streamed into ``sink``; returns the bytes received."""
        return await self.download(SPIDER_FILE, SPIDER_FILE.path(file=file_id), sink, read_timeout=read_timeout)

    async def download_package(self, url: str, sink: Sink, *, read_timeout: float | None = None) -> int:
        """A task's code package (the ``url`` its task names, maybe on another origin) into ``sink``."""
        return await self.download(DOWNLOAD, url, sink, read_timeout=read_timeout)


def _acknowledges(ref: ArtifactRef) -> Callable[[Any], ArtifactRef]:
    """The reader of an artifact's answer: the master's ``{path, sizeBytes, sha256}`` must be ``ref``."""
    def read(body: Any) -> ArtifactRef:
        got = ArtifactRef.from_json(body)
        if got != ref:
            raise ValueError(f"acknowledged {got.to_json()} for {ref.to_json()}")
        return got
    return read
