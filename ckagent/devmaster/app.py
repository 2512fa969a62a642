"""The dev master's HTTP API (Starlette, run on Trio by hypercorn): node protocol + admin API + demo site.

Node endpoints (``Authorization: Bearer <apiKey>``; registration uses ``X-Registration-Token``)::

    POST /api/nodes/register                    → {nodeId, apiKey, minAgentVersion?, desiredAgentVersion?}
                                                  (409 when the name belongs to another live nodeUid)
    POST /api/nodes/{nodeId}/heartbeat          → {cancelTaskIds, minAgentVersion?, desiredAgentVersion?}
    GET  /api/nodes/{nodeId}/tasks/pending      → {tasks, cancelTaskIds}   (long poll: waitSeconds;
                                                  claim=N&pollId=P: the tasks come claimed)
    POST /api/tasks/{taskId}/result             → {ok: true}
    POST /api/tasks/{taskId}/release            → {ok: true, status}         (a claim given back)
    POST /api/tasks/{taskId}/logs               → {acceptedSeq}            (409 {expectedSeq} on a gap)
    POST /api/tasks/{taskId}/items              → {acceptedSeq}
    POST /api/nodes/{nodeId}/batches            → {results: [{acceptedSeq} | {status, error, ...}]}
                                                  (several tasks' logs/items batches; "node-batches")
    GET  /api/spider-files/spider/{spiderId}    → [{id, path, sizeBytes, sha256}]
    GET  /api/spider-files/{fileId}             → bytes
    GET  /api/packages/{spiderId}/{codeVersion}.zip → zip bytes
    PUT  /api/tasks/{taskId}/artifacts/{path}   → {path, sizeBytes, sha256}  (body: the file; header
                                                  X-Content-SHA256; "artifacts", ckagent.devmaster.artifacts)

Admin endpoints (``Authorization: Bearer <admin token>``)::

    POST /api/spiders, GET /api/spiders, GET /api/spiders/{id}, PATCH /api/spiders/{id},
    PUT /api/spiders/{id}/package,
    POST /api/spiders/{id}/tasks, GET /api/tasks, GET /api/tasks/{id}, GET /api/tasks/{id}/logs, GET /api/tasks/{id}/logs/digest,
    GET /api/tasks/{id}/items, GET /api/tasks/{id}/artifacts, GET /api/tasks/{id}/artifacts/{path},
    POST /api/tasks/{id}/cancel, GET /api/nodes,
    GET /api/agent-versions, PUT /api/agent-versions {minAgentVersion, desiredAgentVersion} (null clears)

Errors are JSON ``{"error": "..."}`` (plus ``field`` for 422, ``expectedSeq`` for a seq gap); the
exception classes live in :mod:`ckagent.devmaster.store`. Secrets never appear in an answer or a log.
"""

from __future__ import annotations

import hmac
import json
import math
import re
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar
from urllib.parse import quote

import trio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from ckagent.devmaster import demosite
from ckagent.devmaster.artifacts import MAX_ARTIFACT_BYTES
from ckagent.devmaster.errors import (
    ApiError,
    BadRequestError,
    ForbiddenError,
    PayloadTooLargeError,
    UnauthorizedError,
)
from ckagent.devmaster.packages import MAX_PACKAGE_BYTES, read_package
from ckagent.devmaster.paths import SegmentPaths, check_spider_name
from ckagent.devmaster.store import Store
from ckagent.master.protocol import (
    ARTIFACTS,
    CLAIM_IN_POLL,
    FRAMEWORKS,
    NODE_BATCHES,
    Heartbeat,
    ItemBatch,
    LogBatch,
    ProtocolError,
    RegisterRequest,
    TaskOutputs,
    TaskResources,
    TaskResult,
    TaskStats,
    VersionPolicy,
    parse_stop_signal,
)
from ckagent.master.protocol.outputs import check_artifact_path

__all__ = ["MAX_BATCH_ELEMENTS", "MAX_NODE_BODY_BYTES", "Notifier", "create_app"]

MAX_NODE_BODY_BYTES = 8 * 1024 * 1024
"""Largest request body a node may send (bytes); larger → 413."""
MAX_DRAIN_BYTES = 64 * 1024 * 1024
"""A too-large body up to this size is read and dropped before the 413 (so the client sees it)."""
MAX_BATCH_ELEMENTS = 5000
"""Most lines or items in one logs/items batch; more → 413."""
MAX_NODE_BATCHES = 256
"""Most batches in one ``POST /api/nodes/{id}/batches``; more → 413."""
MASTER_FEATURES = [NODE_BATCHES]
"""What this master always offers beyond the core (the registration answer's ``features``; claim-in-poll
as configured)."""
MAX_POLL_LIMIT = 50
"""Most tasks in one poll answer (a larger ``limit`` is capped)."""
TASK_STATUSES = ("PENDING", "RUNNING", "SUCCESS", "FAILED", "CANCELLED")

_T = TypeVar("_T")


class Notifier:
    """Wakes long polls when something a poll answer depends on changed.

    Take ``event()`` *before* reading the state, then wait on it: a change between the read and the
    wait is never lost. ``close()`` wakes every waiter for good (server shutdown).
    """

    def __init__(self) -> None:
        self._event = trio.Event()
        self.closed = False

    def event(self) -> trio.Event:
        """The event the next ``notify()`` sets."""
        return self._event

    def notify(self) -> None:
        """Wake every current waiter (a task was created or returned to PENDING, or a cancel was asked)."""
        self._event.set()
        self._event = trio.Event()

    def close(self) -> None:
        """Wake everyone and make later polls answer at once."""
        self.closed = True
        self._event.set()


# --------------------------------------------------------------------------- request helpers


async def _body(request: Request, max_bytes: int) -> bytes:
    """The request body, at most ``max_bytes``; PayloadTooLargeError beyond.

    A too-large body is still read (and dropped) up to MAX_DRAIN_BYTES before the 413 goes out: a
    client blocked writing the rest of its body would otherwise never see the answer.
    """
    too_large = PayloadTooLargeError(f"request body is larger than {max_bytes} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max(max_bytes, MAX_DRAIN_BYTES):
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            chunks.clear()
            if size > MAX_DRAIN_BYTES:
                break
        else:
            chunks.append(chunk)
    if size > max_bytes:
        raise too_large
    return b"".join(chunks)


async def _json_body(request: Request, max_bytes: int = MAX_NODE_BODY_BYTES) -> Any:
    raw = await _body(request, max_bytes)
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}") from exc


_ITEMS_PREFIX = re.compile(r'\{\s*"seq"\s*:\s*(0|[1-9][0-9]*)\s*,\s*"items"\s*:\s*(?=\[)')
_JSON_DECODER = json.JSONDecoder()


async def _items_body(request: Request, max_bytes: int = MAX_NODE_BODY_BYTES) -> tuple[Any, str | None]:
    """An items batch body: (the decoded JSON, the items array's own JSON text or None).

    The text comes with a body of exactly ``{"seq": N, "items": [...]}`` (the agent's form), read
    with one decode that also says where the array ends: the store keeps that text as it came
    instead of encoding every item again (half the master's CPU per item, bench/items.py). Any
    other body is decoded as :func:`_json_body` does. Raises BadRequestError for a body that is
    not JSON, PayloadTooLargeError beyond ``max_bytes``.
    """
    raw = await _body(request, max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    match = _ITEMS_PREFIX.match(text)
    if match is not None:
        try:
            items, end = _JSON_DECODER.raw_decode(text, match.end())
        except ValueError:
            pass
        else:
            if text[end:].strip() == "}":
                return {"seq": int(match.group(1)), "items": items}, text[match.end():end]
    if not raw.strip():
        return {}, None
    try:
        return json.loads(raw), None
    except ValueError as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}") from exc


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def _same_secret(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


async def _disconnected(request: Request) -> None:
    """Return when the client of ``request`` (whose body was read, or that has none) has gone away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ProtocolError(name, f"expected an integer, got {raw[:40]!r}") from None
    if value < lo:
        raise ProtocolError(name, f"must be >= {lo}, got {value}")
    return min(value, hi)


def _query_seconds(request: Request, name: str, hi: float) -> float:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ProtocolError(name, f"expected a number of seconds, got {raw[:40]!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ProtocolError(name, f"must be a number >= 0, got {raw[:40]!r}")
    return min(value, hi)


# --------------------------------------------------------------------------- admin payload checks


def _obj(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError("", "expected a JSON object")
    return body


def _opt_str_list(o: dict[str, Any], key: str) -> list[str]:
    value = o.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProtocolError(key, "expected an array of strings")
    return value


def _opt_str_map(o: dict[str, Any], key: str) -> dict[str, str]:
    # Names are not checked against the env-name rule on purpose: a bad name makes a task the agent
    # must refuse with BAD_TASK, which is how that path is tested.
    value = o.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ProtocolError(key, "expected an object of strings")
    return value


def _opt_seconds(o: dict[str, Any], key: str) -> float | None:
    value = o.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ProtocolError(key, "expected a number of seconds >= 0 or null")
    return float(value)


SPIDER_PATCH_FIELDS = ("name", "framework", "command", "env", "timeoutSeconds", "resources", "stopSignal", "outputs")
"""What ``PATCH /api/spiders/{id}`` may change."""


def _outputs(o: dict[str, Any]) -> dict[str, Any] | None:
    """A spider's ``outputs`` (validated, a misspelt key refused; null or absent = None: the conventions)."""
    raw = o.get("outputs")
    unknown = sorted(set(raw) - {"items", "artifacts"}) if isinstance(raw, dict) else []
    if unknown:
        raise ProtocolError(f"outputs.{unknown[0]}", "unknown key: outputs takes 'items' and 'artifacts'")
    outputs = TaskOutputs.from_json(raw, "outputs")
    return None if outputs is None else outputs.to_json()


def _command(o: dict[str, Any]) -> list[str] | str | None:
    value = o.get("command")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise ProtocolError("command", "expected a non-empty array of strings, a string or null")


# --------------------------------------------------------------------------- the app


def create_app(
    store: Store,
    notifier: Notifier,
    *,
    registration_token: str,
    admin_token: str,
    max_long_poll_seconds: float = 30.0,
    public_url: str | None = None,
    claim_in_poll: bool = True,
    artifacts: bool = True,
) -> Starlette:
    """Build the ASGI app over ``store``. Must run inside a Trio loop (hypercorn's trio worker).

    ``max_long_poll_seconds`` caps ``waitSeconds`` (never above 30 s). ``public_url`` prefixes the
    codePackage urls handed out; None hands them out relative to the agent's ``server.url``
    (``/api/packages/…``), which works behind any proxy or ingress. ``claim_in_poll`` False leaves
    the ``claim-in-poll`` feature out of registration answers and ignores ``claim`` (an older master);
    ``artifacts`` False leaves out the ``artifacts`` feature and its endpoints (404, as an older master).
    """
    poll_cap = min(max_long_poll_seconds, 30.0)
    master_features = [CLAIM_IN_POLL] if claim_in_poll else []
    if artifacts:
        master_features.append(ARTIFACTS)

    async def run(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        return await trio.to_thread.run_sync(partial(fn, *args, **kwargs))

    async def node_auth(request: Request) -> str:
        key = _bearer(request)
        node_id = None if key is None else await run(store.node_for_key, key)
        if node_id is None:
            raise UnauthorizedError("missing, unknown or revoked api key: register again")
        path_node = request.path_params.get("node_id")
        if path_node is not None and path_node != node_id:
            raise ForbiddenError("this api key belongs to another node")
        return node_id

    def admin_auth(request: Request) -> None:
        if not _same_secret(_bearer(request), admin_token):
            raise UnauthorizedError("missing or wrong admin token")

    def base_url(request: Request) -> str:
        return str(request.base_url).rstrip("/")

    package_base = (public_url or "").rstrip("/")

    # ----------------------------------------------------------------------- node endpoints

    async def register(request: Request) -> Response:
        if not _same_secret(request.headers.get("x-registration-token"), registration_token):
            raise UnauthorizedError("missing or wrong registration token")
        req = RegisterRequest.from_json(await _json_body(request))
        node_id, api_key = await run(store.register_node, req)
        policy = await run(store.version_policy)
        return JSONResponse({"nodeId": node_id, "apiKey": api_key, **policy.to_json(), "features": [*master_features, *MASTER_FEATURES]})

    async def heartbeat(request: Request) -> Response:
        node_id = await node_auth(request)
        beat = Heartbeat.from_json(await _json_body(request))
        cancel = await run(store.heartbeat, node_id, beat)
        if await run(store.reconcile, node_id, beat):  # tasks the node does not run: PENDING again
            notifier.notify()
        return JSONResponse({"cancelTaskIds": cancel, **(await run(store.version_policy)).to_json()})

    async def get_agent_versions(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse((await run(store.version_policy)).to_json())

    async def put_agent_versions(request: Request) -> Response:
        admin_auth(request)
        body = await _json_body(request)
        if not isinstance(body, dict):
            raise BadRequestError("expected a JSON object {minAgentVersion, desiredAgentVersion}")
        policy = VersionPolicy.from_json(body)
        await run(store.set_version_policy, policy)
        notifier.notify()  # held polls look again: a node now below the minimum gets nothing
        return JSONResponse(policy.to_json())

    async def pending(request: Request) -> Response:
        node_id = await node_auth(request)
        limit = _query_int(request, "limit", 1, 1, MAX_POLL_LIMIT)
        wait = _query_seconds(request, "waitSeconds", poll_cap)
        raw_exclude = request.query_params.get("excludeSpiderIds", "")
        exclude = [s.strip() for s in raw_exclude.split(",") if s.strip()]
        claim = _query_int(request, "claim", 0, 0, MAX_POLL_LIMIT) if claim_in_poll else 0
        poll_id = None
        if claim:
            if "pollId" not in request.query_params:
                raise BadRequestError("claim needs pollId (an integer naming the poll; see docs/protocol.md)")
            poll_id = _query_int(request, "pollId", 0, 0, 2**53)
        deadline = trio.current_time() + wait
        url = package_base
        gone = trio.Event()  # the client went away: no answer will reach it
        answer: dict[str, Any] = {"tasks": [], "cancelTaskIds": []}
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                await _disconnected(request)
                gone.set()

            nursery.start_soon(watch)
            while not gone.is_set():  # a poll nobody waits for any more claims nothing
                changed = notifier.event()
                if await run(store.below_minimum, node_id):  # told so: it gets nothing until upgraded
                    tasks: list[dict[str, Any]] = []
                    cancel_ids = await run(store.cancel_ids, node_id)
                elif poll_id is not None:
                    # Claimed and answered in one transaction. Claims whose answer does not reach the
                    # node are never given back here (a re-sent poll with the same pollId may have
                    # answered them already): the re-sent poll or the reconciliation settles them.
                    tasks, cancel_ids = await run(store.claim_pending, node_id, poll_id=poll_id,
                                                  limit=min(limit, claim), exclude_spider_ids=exclude,
                                                  base_url=url)
                else:
                    tasks = await run(store.pending_tasks, limit=limit, exclude_spider_ids=exclude, base_url=url)
                    cancel_ids = await run(store.cancel_ids, node_id)
                remaining = deadline - trio.current_time()
                if tasks or cancel_ids or notifier.closed or remaining <= 0:
                    answer = {"tasks": tasks, "cancelTaskIds": cancel_ids}
                    break
                with trio.move_on_after(remaining):
                    async with trio.open_nursery() as waiting:  # a change, or the client gone

                        async def wake(event: trio.Event) -> None:
                            await event.wait()
                            waiting.cancel_scope.cancel()

                        waiting.start_soon(wake, changed)
                        waiting.start_soon(wake, gone)
            nursery.cancel_scope.cancel()
        return JSONResponse(answer)

    async def result(request: Request) -> Response:
        node_id = await node_auth(request)
        report = TaskResult.from_json(await _json_body(request))
        task = await run(store.report_result, request.path_params["task_id"], node_id, report)
        return JSONResponse({"ok": True, "status": task["status"]})

    async def release(request: Request) -> Response:
        node_id = await node_auth(request)
        body = _obj(await _json_body(request))
        reason = body.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise ProtocolError("reason", f"expected a string, got {type(reason).__name__}")
        task = await run(store.release_task, request.path_params["task_id"], node_id, reason)
        notifier.notify()
        return JSONResponse({"ok": True, "status": task["status"]})

    def check_batch_size(body: Any, key: str) -> None:
        if isinstance(body, dict) and isinstance(body.get(key), list) and len(body[key]) > MAX_BATCH_ELEMENTS:
            raise PayloadTooLargeError(f"a batch holds at most {MAX_BATCH_ELEMENTS} {key}")

    async def logs(request: Request) -> Response:
        node_id = await node_auth(request)
        body = await _json_body(request)
        check_batch_size(body, "lines")
        batch = LogBatch.from_json(body)
        accepted = await run(
            store.append_logs, request.path_params["task_id"], node_id, batch.seq, batch.lines
        )
        return JSONResponse({"acceptedSeq": accepted})

    async def items(request: Request) -> Response:
        node_id = await node_auth(request)
        body, items_text = await _items_body(request)
        check_batch_size(body, "items")
        batch = ItemBatch.from_json(body)
        accepted = await run(
            store.append_items, request.path_params["task_id"], node_id, batch.seq, batch.items, items_text
        )
        return JSONResponse({"acceptedSeq": accepted})

    def apply_batch(node_id: str, entry: Any) -> dict[str, Any]:
        """One batch of ``POST /api/nodes/{id}/batches``: its answer as the per-task endpoint would
        give it — ``{"acceptedSeq": n}``, or ``{"status": s, "error": ..., **extra}``. Blocking."""
        try:
            if not isinstance(entry, dict):
                raise BadRequestError("each batch is a JSON object {taskId, stream, seq, lines|items}")
            task_id, stream = entry.get("taskId"), entry.get("stream")
            if not isinstance(task_id, str) or not task_id:
                raise BadRequestError("taskId: expected the task's id (a non-empty string)")
            if stream == "logs":
                check_batch_size(entry, "lines")
                logs = LogBatch.from_json(entry)
                accepted = store.append_logs(task_id, node_id, logs.seq, logs.lines)
            elif stream == "items":
                check_batch_size(entry, "items")
                items = ItemBatch.from_json(entry)
                accepted = store.append_items(task_id, node_id, items.seq, items.items)
            else:
                raise BadRequestError('stream: expected "logs" or "items"')
        except ApiError as exc:
            return {"status": exc.status_code, "error": exc.message, **exc.extra}
        except ProtocolError as exc:
            return {"status": 422, "error": str(exc), "field": exc.field}
        return {"acceptedSeq": accepted}

    async def node_batches(request: Request) -> Response:
        node_id = await node_auth(request)
        body = await _json_body(request)
        entries = body.get("batches") if isinstance(body, dict) else None
        if not isinstance(entries, list):
            raise BadRequestError('expected a JSON object {"batches": [...]}')
        if len(entries) > MAX_NODE_BATCHES:
            raise PayloadTooLargeError(f"a request holds at most {MAX_NODE_BATCHES} batches")
        results = await run(lambda: [apply_batch(node_id, entry) for entry in entries])  # one thread hop
        return JSONResponse({"results": results})

    async def stats(request: Request) -> Response:
        node_id = await node_auth(request)
        snapshot = TaskStats.from_json(await _json_body(request))
        stored = await run(store.save_stats, request.path_params["task_id"], node_id, snapshot)
        return JSONResponse({"ok": True, "stored": stored})

    async def task_stats(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.task_stats, request.path_params["task_id"]))

    async def spider_files(request: Request) -> Response:
        await node_auth(request)
        return JSONResponse(await run(store.spider_files, request.path_params["spider_id"]))

    async def spider_file(request: Request) -> Response:
        await node_auth(request)
        data = await run(store.spider_file, request.path_params["file_id"])
        return Response(data, media_type="application/octet-stream")

    async def package(request: Request) -> Response:
        await node_auth(request)
        name: str = request.path_params["file_name"]
        if not name.endswith(".zip"):
            return JSONResponse({"error": "package urls end in .zip"}, status_code=404)
        data = await run(store.package_zip, request.path_params["spider_id"], name[: -len(".zip")])
        return Response(data, media_type="application/zip")

    # ----------------------------------------------------------------------- admin endpoints

    async def create_spider(request: Request) -> Response:
        admin_auth(request)
        o = _obj(await _json_body(request))
        name = check_spider_name(o.get("name"))
        framework = o.get("framework")
        if framework not in FRAMEWORKS:
            raise ProtocolError("framework", f"expected one of {', '.join(FRAMEWORKS)}")
        code_mode = o.get("codeMode") or "package"
        if code_mode not in ("package", "files"):
            raise ProtocolError("codeMode", "expected package or files")
        spider_id = await run(
            store.create_spider,
            name=name,
            framework=framework,
            command=_command(o),
            timeout_seconds=_opt_seconds(o, "timeoutSeconds"),
            code_mode=code_mode,
            env=_opt_str_map(o, "env"),
            resources=TaskResources.from_json(o.get("resources"), "resources").to_json(),
            stop_signal=parse_stop_signal(o, ""),
            outputs=_outputs(o),
        )
        return JSONResponse({"id": spider_id})

    async def list_spiders(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.list_spiders))

    async def get_spider(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.get_spider, request.path_params["spider_id"]))

    async def update_spider(request: Request) -> Response:
        """PATCH: change the fields given (command, env, timeoutSeconds, framework, name, resources,
        stopSignal; null clears the last two); tasks created
        afterwards use them (a task already created keeps what it had)."""
        admin_auth(request)
        o = _obj(await _json_body(request))
        unknown = sorted(set(o) - set(SPIDER_PATCH_FIELDS))
        if unknown:
            raise ProtocolError(unknown[0], f"cannot be changed; a PATCH may hold {', '.join(SPIDER_PATCH_FIELDS)}")
        changes: dict[str, Any] = {}
        if "name" in o:
            changes["name"] = check_spider_name(o["name"])
        if "framework" in o:
            if o["framework"] not in FRAMEWORKS:
                raise ProtocolError("framework", f"expected one of {', '.join(FRAMEWORKS)}")
            changes["framework"] = o["framework"]
        if "command" in o:
            changes["command"] = _command(o)
        if "timeoutSeconds" in o:
            changes["timeout_seconds"] = _opt_seconds(o, "timeoutSeconds")
        if "env" in o:
            changes["env"] = _opt_str_map(o, "env")
        if "resources" in o:
            changes["resources"] = TaskResources.from_json(o["resources"], "resources").to_json() or None
        if "stopSignal" in o:
            changes["stop_signal"] = parse_stop_signal(o, "")
        if "outputs" in o:
            changes["outputs"] = _outputs(o)
        return JSONResponse(await run(store.update_spider, request.path_params["spider_id"], changes))

    async def upload_package(request: Request) -> Response:
        admin_auth(request)
        spider_id = request.path_params["spider_id"]
        await run(store.get_spider, spider_id)  # 404 before reading a large body
        data = await _body(request, MAX_PACKAGE_BYTES)
        contents = await run(read_package, data)
        answer = await run(store.store_package, spider_id, contents, data)
        return JSONResponse(answer)

    async def create_task(request: Request) -> Response:
        admin_auth(request)
        o = _obj(await _json_body(request))
        params = o.get("params")
        if params is not None and not isinstance(params, dict):
            raise ProtocolError("params", "expected an object")
        task_id = await run(
            store.create_task,
            request.path_params["spider_id"],
            args=_opt_str_list(o, "args"),
            env=_opt_str_map(o, "env"),
            params=params or {},
            timeout_seconds=_opt_seconds(o, "timeoutSeconds"),
            stall_timeout_seconds=_opt_seconds(o, "stallTimeoutSeconds"),
            resources=TaskResources.from_json(o.get("resources"), "resources").to_json(),
            stop_signal=parse_stop_signal(o, ""),
        )
        notifier.notify()
        return JSONResponse({"id": task_id})

    async def list_tasks(request: Request) -> Response:
        admin_auth(request)
        status = request.query_params.get("status") or None
        if status is not None and status not in TASK_STATUSES:
            raise ProtocolError("status", f"expected one of {', '.join(TASK_STATUSES)}")
        limit = _query_int(request, "limit", 1000, 1, 100_000)
        spider_id = request.query_params.get("spiderId") or None
        return JSONResponse(await run(store.list_tasks, status=status, spider_id=spider_id, limit=limit))

    async def get_task(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.get_task, request.path_params["task_id"]))

    # These bodies (up to every line or item of a task) are built and encoded in the worker thread.
    def log_text(task_id: str) -> Response:
        return PlainTextResponse(store.task_log_text(task_id))

    def items_json(task_id: str) -> Response:
        return JSONResponse(store.task_items(task_id))

    async def task_logs(request: Request) -> Response:
        admin_auth(request)
        return await run(log_text, request.path_params["task_id"])

    async def task_log_digest(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.log_digest, request.path_params["task_id"]))

    async def task_items(request: Request) -> Response:
        admin_auth(request)
        return await run(items_json, request.path_params["task_id"])

    async def put_artifact(request: Request) -> Response:
        """A node uploads one artifact of its task (ckagent.devmaster.artifacts)."""
        node_id = await node_auth(request)
        task_id = request.path_params["task_id"]
        path = check_artifact_path(request.path_params["path"], "path")
        sha256 = (request.headers.get("x-content-sha256") or "").lower()
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise ProtocolError("X-Content-SHA256", "required: the body's sha256 as 64 hexadecimal digits")
        data = await _body(request, MAX_ARTIFACT_BYTES)
        return JSONResponse(await run(store.store_artifact, task_id, node_id, path, data, sha256))

    async def list_artifacts(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.list_artifacts, request.path_params["task_id"]))

    async def get_artifact(request: Request) -> Response:
        admin_auth(request)
        path = check_artifact_path(request.path_params["path"], "path")
        blob = await run(store.artifact_path, request.path_params["task_id"], path)
        return FileResponse(blob, media_type="application/octet-stream",
                            headers={"Content-Disposition": f"attachment; filename*=UTF-8''{quote(path.rsplit('/', 1)[-1])}"})

    async def cancel_task(request: Request) -> Response:
        admin_auth(request)
        task = await run(store.cancel_task, request.path_params["task_id"])
        notifier.notify()
        return JSONResponse(task)

    async def list_nodes(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.list_nodes))

    async def index(request: Request) -> Response:
        return JSONResponse({"service": "ckagent dev master", "demoSite": f"{base_url(request)}/demo-site/"})

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    # ----------------------------------------------------------------------- errors

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        return JSONResponse({"error": exc.message, **exc.extra}, status_code=exc.status_code, headers=headers)

    async def protocol_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProtocolError)
        return JSONResponse({"error": str(exc), "field": exc.field}, status_code=422)

    routes: list[BaseRoute] = [
        Route("/", index),
        Route("/healthz", healthz),
        Route("/api/nodes/register", register, methods=["POST"]),
        Route("/api/nodes/{node_id:seg}/heartbeat", heartbeat, methods=["POST"]),
        Route("/api/nodes/{node_id:seg}/batches", node_batches, methods=["POST"]),
        Route("/api/nodes/{node_id:seg}/tasks/pending", pending, methods=["GET"]),
        Route("/api/nodes", list_nodes, methods=["GET"]),
        Route("/api/agent-versions", get_agent_versions, methods=["GET"]),
        Route("/api/agent-versions", put_agent_versions, methods=["PUT"]),
        Route("/api/tasks/{task_id:seg}/result", result, methods=["POST"]),
        Route("/api/tasks/{task_id:seg}/release", release, methods=["POST"]),
        Route("/api/tasks/{task_id:seg}/logs", logs, methods=["POST"]),
        Route("/api/tasks/{task_id:seg}/logs", task_logs, methods=["GET"]),
        Route("/api/tasks/{task_id:seg}/logs/digest", task_log_digest, methods=["GET"]),
        Route("/api/tasks/{task_id:seg}/items", items, methods=["POST"]),
        Route("/api/tasks/{task_id:seg}/items", task_items, methods=["GET"]),
        Route("/api/tasks/{task_id:seg}/stats", stats, methods=["POST"]),
        Route("/api/tasks/{task_id:seg}/stats", task_stats, methods=["GET"]),
        Route("/api/tasks/{task_id:seg}/cancel", cancel_task, methods=["POST"]),
        *([Route("/api/tasks/{task_id:seg}/artifacts/{path:path}", put_artifact, methods=["PUT"]),
           Route("/api/tasks/{task_id:seg}/artifacts/{path:path}", get_artifact, methods=["GET"]),
           Route("/api/tasks/{task_id:seg}/artifacts", list_artifacts, methods=["GET"])] if artifacts else []),
        Route("/api/tasks/{task_id:seg}", get_task, methods=["GET"]),
        Route("/api/tasks", list_tasks, methods=["GET"]),
        Route("/api/spider-files/spider/{spider_id:seg}", spider_files, methods=["GET"]),
        Route("/api/spider-files/{file_id:seg}", spider_file, methods=["GET"]),
        Route("/api/packages/{spider_id:seg}/{file_name:seg}", package, methods=["GET"]),
        Route("/api/spiders", create_spider, methods=["POST"]),
        Route("/api/spiders", list_spiders, methods=["GET"]),
        Route("/api/spiders/{spider_id:seg}", get_spider, methods=["GET"]),
        Route("/api/spiders/{spider_id:seg}", update_spider, methods=["PATCH"]),
        Route("/api/spiders/{spider_id:seg}/package", upload_package, methods=["PUT"]),
        Route("/api/spiders/{spider_id:seg}/tasks", create_task, methods=["POST"]),
        *demosite.routes(),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        ApiError: api_error,
        ProtocolError: protocol_error,
    }
    # Ids are single percent-encoded path segments (``a%2Fb``): see ckagent.devmaster.paths.
    return Starlette(routes=routes, exception_handlers=handlers, middleware=[Middleware(SegmentPaths)])
