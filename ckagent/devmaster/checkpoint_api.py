"""The dev master's checkpoint routes (docs/protocol.md, "Checkpoints"; the store: store/checkpoints.py)::

    PUT  /api/tasks/{taskId}/checkpoint-chunks/{sha256}  body: gzip bytes → {"stored": true}
         (422: not a gzip of ≤ CHUNK_BYTES bytes of that sha256; 413 over MAX_CHUNK_BODY_BYTES, or the task
          would hold more than MAX_TASK_CHUNK_BYTES of chunks;
          409: the node does not run the task, supersededBy when it ran an older attempt)
    GET  /api/tasks/{taskId}/checkpoint-chunks/{sha256}  → the gzip bytes
    POST /api/tasks/{taskId}/checkpoints                 body: the manifest → {"checkpointId": id}
         (409 missingChunks / storedItems / supersededBy; 422 a manifest that breaks the rules; 413 over
          MAX_MANIFEST_BYTES)
    GET  /api/tasks/{taskId}/checkpoints/{id}            → the manifest

Every route takes a node's api key. Writes come only from the node that runs the task's current
attempt; any node may read (the next attempt's node restores from them before or after its claim).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from ckagent.devmaster.store.checkpoints import MAX_CHUNK_BODY_BYTES, ChunkError, check_sha
from ckagent.devmaster.web import Api, json_body, read_body, route
from ckagent.master.protocol import CheckpointManifest, ProtocolError

MAX_MANIFEST_BYTES = 32 * 1024 * 1024
"""Largest manifest body (bytes; 100,000 files with their chunk lists fit); larger → 413."""


def routes(api: Api) -> list[BaseRoute]:
    """The checkpoint routes over ``api``."""
    store, run, node_auth = api.store, api.run, api.node_auth

    async def put_chunk(request: Request) -> Response:
        node_id = await node_auth(request)
        sha256 = check_sha(request.path_params["sha256"])
        gz = await read_body(request, MAX_CHUNK_BODY_BYTES)
        try:
            await run(store.put_checkpoint_chunk, request.path_params["task_id"], node_id, sha256, gz)
        except ChunkError as exc:
            raise ProtocolError("", str(exc)) from None
        return JSONResponse({"stored": True})

    async def get_chunk(request: Request) -> Response:
        await node_auth(request)
        sha256 = check_sha(request.path_params["sha256"])
        data = await run(store.checkpoint_chunk, request.path_params["task_id"], sha256)
        return Response(data, media_type="application/gzip")

    async def post_manifest(request: Request) -> Response:
        node_id = await node_auth(request)
        body = await json_body(request, MAX_MANIFEST_BYTES)
        manifest = await run(CheckpointManifest.from_json, body)  # up to 100,000 entries: off the loop
        checkpoint_id = await run(store.record_checkpoint, request.path_params["task_id"], node_id, manifest)
        return JSONResponse({"checkpointId": checkpoint_id})

    async def get_manifest(request: Request) -> Response:
        await node_auth(request)
        manifest = await run(store.checkpoint_manifest, request.path_params["task_id"],
                             request.path_params["checkpoint_id"])
        return JSONResponse(manifest)

    return [
        route("node", "/api/tasks/{task_id:seg}/checkpoint-chunks/{sha256:seg}", put_chunk, "PUT"),
        route("node", "/api/tasks/{task_id:seg}/checkpoint-chunks/{sha256:seg}", get_chunk, "GET"),
        route("node", "/api/tasks/{task_id:seg}/checkpoints", post_manifest, "POST"),
        route("node", "/api/tasks/{task_id:seg}/checkpoints/{checkpoint_id:seg}", get_manifest, "GET"),
    ]

