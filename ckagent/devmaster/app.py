"""The dev master's HTTP API (Starlette, run on Trio by hypercorn): node protocol + admin API + demo site.

Node endpoints (``Authorization: Bearer <apiKey>``; registration uses ``X-Registration-Token``)::

    POST /api/nodes/register                    → {nodeId, apiKey, minAgentVersion?, desiredAgentVersion?}
                                                  (409 when the name belongs to another live nodeUid)
    POST /api/nodes/{nodeId}/heartbeat          → {cancelTaskIds, minAgentVersion?, desiredAgentVersion?}
    GET  /api/nodes/{nodeId}/tasks/pending      → {tasks, cancelTaskIds}   (long poll: waitSeconds;
                                                  claim=N&pollId=P: the tasks come claimed)
    POST /api/tasks/{taskId}/result             → {ok: true, status}
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
    PUT  /api/tasks/{taskId}/checkpoint-chunks/{sha256}, GET the same, POST /api/tasks/{taskId}/checkpoints,
    GET  /api/tasks/{taskId}/checkpoints/{id}   checkpoints (ckagent.devmaster.checkpoint_api)

Admin endpoints (``Authorization: Bearer <admin token>``)::

    POST /api/spiders, GET /api/spiders, GET /api/spiders/{id}, PATCH /api/spiders/{id},
    PUT /api/spiders/{id}/package,
    POST /api/spiders/{id}/tasks, GET /api/tasks, GET /api/tasks/{id}, GET /api/tasks/{id}/logs, GET /api/tasks/{id}/logs/digest,
    GET /api/tasks/{id}/items, GET /api/tasks/{id}/artifacts, GET /api/tasks/{id}/artifacts/{path},
    POST /api/tasks/{id}/cancel, GET /api/nodes,
    GET /api/agent-versions, PUT /api/agent-versions {minAgentVersion, desiredAgentVersion} (null clears)
    GET /metrics      the queue for an autoscaler (no auth; Prometheus text: ckagent.devmaster.queuemetrics)
    GET /tasks/{id}   a task's page (HTML: attempts, newest checkpoint; the admin token as a bearer token
                      or as the HTTP Basic password; ckagent.devmaster.taskpage)

Errors are JSON ``{"error": "..."}`` (plus ``field`` for 422, ``expectedSeq`` for a seq gap); the
exception classes live in :mod:`ckagent.devmaster.errors`. Secrets never appear in an answer or a log.

The routes live by side: :mod:`ckagent.devmaster.node_api` (the node protocol),
:mod:`ckagent.devmaster.admin_api` (the admin API), the pages here and in :mod:`ckagent.devmaster.demosite`;
what they share (request bodies, authentication, the notifier) in :mod:`ckagent.devmaster.web`.
:func:`route_table` lists an app's ``(method, path)`` pairs, by side.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from ckagent.devmaster import admin_api, checkpoint_api, demosite, node_api, queuemetrics, taskpage
from ckagent.devmaster.errors import ApiError
from ckagent.devmaster.node_api import MAX_BATCH_ELEMENTS
from ckagent.devmaster.paths import SegmentPaths
from ckagent.devmaster.store import Store
from ckagent.devmaster.web import MAX_NODE_BODY_BYTES, Api, Notifier, route
from ckagent.master.protocol import ARTIFACTS, CLAIM_IN_POLL, POLL_FOLLOWS_RESULTS, ProtocolError

__all__ = ["MAX_BATCH_ELEMENTS", "MAX_NODE_BODY_BYTES", "Notifier", "create_app", "route_table"]

SCOPES = ("node", "admin", "page")
"""The sides of the app a route belongs to (the first part of its name, see :func:`route_table`)."""


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
    poll_follows_results: bool = True,
) -> Starlette:
    """Build the ASGI app over ``store``. Must run inside a Trio loop (hypercorn's trio worker).

    ``max_long_poll_seconds`` caps ``waitSeconds`` (never above 30 s). ``public_url`` prefixes the
    codePackage urls handed out; None hands them out relative to the agent's ``server.url``
    (``/api/packages/…``), which works behind any proxy or ingress. ``claim_in_poll`` False leaves
    the ``claim-in-poll`` feature out of registration answers and ignores ``claim`` (an older master);
    ``artifacts`` False leaves out the ``artifacts`` feature and its endpoints (404, as an older master);
    ``poll_follows_results`` False leaves out ``poll-follows-results`` and ignores ``runningSpiderIds``.
    """
    poll_cap = min(max_long_poll_seconds, 30.0)
    master_features = [CLAIM_IN_POLL] if claim_in_poll else []
    if artifacts:
        master_features.append(ARTIFACTS)
    if poll_follows_results:
        master_features.append(POLL_FOLLOWS_RESULTS)
    api = Api(store=store, notifier=notifier, registration_token=registration_token, admin_token=admin_token,
              poll_cap=poll_cap, package_base=(public_url or "").rstrip("/"), claim_in_poll=claim_in_poll,
              artifacts=artifacts, features=master_features)

    async def index(request: Request) -> Response:
        base_url = str(request.base_url).rstrip("/")
        return JSONResponse({"service": "ckagent dev master", "demoSite": f"{base_url}/demo-site/"})

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        return JSONResponse({"error": exc.message, **exc.extra}, status_code=exc.status_code, headers=headers)

    async def protocol_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProtocolError)
        return JSONResponse({"error": str(exc), "field": exc.field}, status_code=422)

    routes: list[BaseRoute] = [
        route("page", "/", index, "GET"),
        route("page", "/healthz", healthz, "GET"),
        *queuemetrics.routes(store),
        *node_api.routes(api),
        *checkpoint_api.routes(api),
        *admin_api.routes(api),
        *taskpage.routes(api),
        *(Route(r.path, r.endpoint, methods=sorted(r.methods or ()), name=f"page:{r.name}")
          for r in demosite.routes() if isinstance(r, Route)),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        ApiError: api_error,
        ProtocolError: protocol_error,
    }
    # Ids are single percent-encoded path segments (``a%2Fb``): see ckagent.devmaster.paths.
    return Starlette(routes=routes, exception_handlers=handlers, middleware=[Middleware(SegmentPaths)])


def route_table(app: Starlette, scope: str | None = None) -> list[tuple[str, str]]:
    """The ``(method, path)`` pairs ``app`` (from :func:`create_app`) serves, in route order; only
    those of ``scope`` ("node": the node protocol, "admin", "page") when given. Paths are Starlette's
    templates with the convertor dropped (``/api/tasks/{task_id}/logs``); HEAD (Starlette adds it to
    GET) is left out. Raises ValueError for an unknown scope."""
    if scope is not None and scope not in SCOPES:
        raise ValueError(f"scope: expected one of {', '.join(SCOPES)}, got {scope!r}")
    pairs: list[tuple[str, str]] = []
    for r in app.routes:
        if not isinstance(r, Route) or (scope is not None and r.name.split(":", 1)[0] != scope):
            continue
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", r.path)
        pairs.extend((method, path) for method in sorted(r.methods or ()) if method != "HEAD")
    return pairs
