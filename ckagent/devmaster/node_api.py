"""The dev master's node protocol routes (docs/protocol.md, ckagent/master/protocol/openapi.yaml):
registration, heartbeats, leaving, the long-polled queue, claims and results, logs/items/stats streams,
artifact uploads and code downloads. Every route but registration takes the node's api key.
"""

from __future__ import annotations

import re
from typing import Any

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from ckagent.devmaster.artifacts import MAX_ARTIFACT_BYTES
from ckagent.devmaster.errors import ApiError, BadRequestError, PayloadTooLargeError, UnauthorizedError
from ckagent.devmaster.web import (
    Api,
    bearer,
    disconnected,
    items_body,
    json_body,
    json_object,
    query_ids,
    query_int,
    query_seconds,
    read_body,
    route,
    same_secret,
)
from ckagent.master.protocol import (
    FINAL_STATUSES,
    NODE_BATCHES,
    POLL_FOLLOWS_RESULTS,
    Heartbeat,
    ItemBatch,
    LogBatch,
    NodeLeaving,
    ProtocolError,
    RegisterRequest,
    TaskResult,
    TaskStats,
)
from ckagent.master.protocol.outputs import check_artifact_path

MAX_BATCH_ELEMENTS = 5000
"""Most lines or items in one logs/items batch; more → 413."""
MAX_NODE_BATCHES = 256
"""Most batches in one ``POST /api/nodes/{id}/batches``; more → 413."""
MASTER_FEATURES = [NODE_BATCHES]
"""What this master always offers beyond the core (the registration answer's ``features``; claim-in-poll
as configured)."""
MAX_POLL_LIMIT = 50
"""Most tasks in one poll answer (a larger ``limit`` is capped)."""


def routes(api: Api) -> list[BaseRoute]:
    """The node protocol's routes over ``api`` (``PUT .../artifacts/{path}`` only with ``api.artifacts``)."""
    store, notifier, run, node_auth = api.store, api.notifier, api.run, api.node_auth
    poll_cap, claim_in_poll, package_base = api.poll_cap, api.claim_in_poll, api.package_base
    registration_token, master_features = api.registration_token, api.features
    follows_results = POLL_FOLLOWS_RESULTS in master_features

    async def register(request: Request) -> Response:
        if not same_secret(request.headers.get("x-registration-token"), registration_token):
            raise UnauthorizedError("missing or wrong registration token")
        req = RegisterRequest.from_json(await json_body(request))
        node_id, api_key = await run(store.register_node, req)
        policy = await run(store.version_policy)
        return JSONResponse({"nodeId": node_id, "apiKey": api_key, **policy.to_json(), "features": [*master_features, *MASTER_FEATURES]})

    async def heartbeat(request: Request) -> Response:
        node_id = await node_auth(request)
        beat = Heartbeat.from_json(await json_body(request))
        cancel = await run(store.heartbeat, node_id, beat)
        if await run(store.reconcile, node_id, beat):  # tasks the node does not run: PENDING again
            notifier.notify()
        return JSONResponse({"cancelTaskIds": cancel, **(await run(store.version_policy)).to_json()})

    async def leaving(request: Request) -> Response:
        node_id = await node_auth(request)
        body = NodeLeaving.from_json(await json_body(request))
        await run(store.leave_node, node_id, bearer(request) or "", body)  # (the key checked again, in one tx)
        return JSONResponse({"released": True})

    async def pending(request: Request) -> Response:
        node_id = await node_auth(request)
        limit = query_int(request, "limit", 1, 1, MAX_POLL_LIMIT)
        wait = query_seconds(request, "waitSeconds", poll_cap)
        exclude = query_ids(request, "excludeSpiderIds")
        # poll-follows-results: these exclusions end once the node's task of that spider has ended
        # here (its final result arrived), held poll or not; a result wakes the held polls.
        running = query_ids(request, "runningSpiderIds") if follows_results else []
        claim = query_int(request, "claim", 0, 0, MAX_POLL_LIMIT) if claim_in_poll else 0
        poll_id = None
        if claim:
            if "pollId" not in request.query_params:
                raise BadRequestError("claim needs pollId (an integer naming the poll; see docs/protocol.md)")
            poll_id = query_int(request, "pollId", 0, 0, 2**53)
        deadline = trio.current_time() + wait
        url = package_base
        gone = trio.Event()  # the client went away: no answer will reach it
        answer: dict[str, Any] = {"tasks": [], "cancelTaskIds": []}
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                await disconnected(request)
                gone.set()

            nursery.start_soon(watch)
            def look() -> tuple[list[dict[str, Any]], list[str]]:
                """What the poll would answer now (blocking: one thread hop per look)."""
                if store.below_minimum(node_id):  # told so: it gets nothing until upgraded
                    return [], store.cancel_ids(node_id)
                if poll_id is not None:
                    # Claimed and answered in one transaction. Claims whose answer does not reach the
                    # node are never given back here (a re-sent poll with the same pollId may have
                    # answered them already): the re-sent poll or the reconciliation settles them.
                    return store.claim_pending(node_id, poll_id=poll_id, limit=min(limit, claim),
                                               exclude_spider_ids=exclude, base_url=url, running_spider_ids=running)
                return (store.pending_tasks(limit=limit, exclude_spider_ids=exclude, base_url=url, node_id=node_id,
                                            running_spider_ids=running), store.cancel_ids(node_id))

            while not gone.is_set():  # a poll nobody waits for any more claims nothing
                changed = notifier.event()
                tasks, cancel_ids = await run(look)
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
        report = TaskResult.from_json(await json_body(request))
        task = await run(store.report_result, request.path_params["task_id"], node_id, report, report.attempt)
        if report.status in FINAL_STATUSES and (follows_results or task["status"] == "PENDING"):
            # a held poll's runningSpiderIds may have lapsed (poll-follows-results); a retry may be due
            notifier.notify()
        # the attempt's status (the task may be PENDING again at its next attempt)
        return JSONResponse({"ok": True, "status": report.status if report.status in FINAL_STATUSES else task["status"]})

    async def release(request: Request) -> Response:
        node_id = await node_auth(request)
        body = json_object(await json_body(request))
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
        body = await json_body(request)
        check_batch_size(body, "lines")
        batch = LogBatch.from_json(body)
        accepted = await run(
            store.append_logs, request.path_params["task_id"], node_id, batch.seq, batch.lines, batch.attempt
        )
        return JSONResponse({"acceptedSeq": accepted})

    async def items(request: Request) -> Response:
        node_id = await node_auth(request)
        body, items_text = await items_body(request)
        check_batch_size(body, "items")
        batch = ItemBatch.from_json(body)
        accepted = await run(
            store.append_items, request.path_params["task_id"], node_id, batch.seq, batch.items, items_text,
            batch.attempt,
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
                accepted = store.append_logs(task_id, node_id, logs.seq, logs.lines, logs.attempt)
            elif stream == "items":
                check_batch_size(entry, "items")
                items = ItemBatch.from_json(entry)
                accepted = store.append_items(task_id, node_id, items.seq, items.items, attempt=items.attempt)
            else:
                raise BadRequestError('stream: expected "logs" or "items"')
        except ApiError as exc:
            return {"status": exc.status_code, "error": exc.message, **exc.extra}
        except ProtocolError as exc:
            return {"status": 422, "error": str(exc), "field": exc.field}
        return {"acceptedSeq": accepted}

    async def node_batches(request: Request) -> Response:
        node_id = await node_auth(request)
        body = await json_body(request)
        entries = body.get("batches") if isinstance(body, dict) else None
        if not isinstance(entries, list):
            raise BadRequestError('expected a JSON object {"batches": [...]}')
        if len(entries) > MAX_NODE_BATCHES:
            raise PayloadTooLargeError(f"a request holds at most {MAX_NODE_BATCHES} batches")
        results = await run(lambda: [apply_batch(node_id, entry) for entry in entries])  # one thread hop
        return JSONResponse({"results": results})

    async def stats(request: Request) -> Response:
        node_id = await node_auth(request)
        snapshot = TaskStats.from_json(await json_body(request))
        stored = await run(store.save_stats, request.path_params["task_id"], node_id, snapshot)
        return JSONResponse({"ok": True, "stored": stored})


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

    async def put_artifact(request: Request) -> Response:
        """A node uploads one artifact of its task (ckagent.devmaster.artifacts)."""
        node_id = await node_auth(request)
        task_id = request.path_params["task_id"]
        path = check_artifact_path(request.path_params["path"], "path")
        sha256 = (request.headers.get("x-content-sha256") or "").lower()
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise ProtocolError("X-Content-SHA256", "required: the body's sha256 as 64 hexadecimal digits")
        data = await read_body(request, MAX_ARTIFACT_BYTES)
        return JSONResponse(await run(store.store_artifact, task_id, node_id, path, data, sha256))


    return [
        route("node", "/api/nodes/register", register, "POST"),
        route("node", "/api/nodes/{node_id:seg}/heartbeat", heartbeat, "POST"),
        route("node", "/api/nodes/{node_id:seg}/leaving", leaving, "POST"),
        route("node", "/api/nodes/{node_id:seg}/batches", node_batches, "POST"),
        route("node", "/api/nodes/{node_id:seg}/tasks/pending", pending, "GET"),
        route("node", "/api/tasks/{task_id:seg}/result", result, "POST"),
        route("node", "/api/tasks/{task_id:seg}/release", release, "POST"),
        route("node", "/api/tasks/{task_id:seg}/logs", logs, "POST"),
        route("node", "/api/tasks/{task_id:seg}/items", items, "POST"),
        route("node", "/api/tasks/{task_id:seg}/stats", stats, "POST"),
        *([route("node", "/api/tasks/{task_id:seg}/artifacts/{path:path}", put_artifact, "PUT")]
          if api.artifacts else []),
        route("node", "/api/spider-files/spider/{spider_id:seg}", spider_files, "GET"),
        route("node", "/api/spider-files/{file_id:seg}", spider_file, "GET"),
        route("node", "/api/packages/{spider_id:seg}/{file_name:seg}", package, "GET"),
    ]
