"""A raw node's attempts and checkpoints at the dev master: batches and results that name their attempt,
checkpoint chunks and manifests as the wire has them, and a dev master with a short node-lost grace."""

from __future__ import annotations

import gzip
import hashlib
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from ckagent.devmaster.client import AdminClient
from ckagent.devmaster.server import DevMasterConfig, serve
from ckagent.master.protocol import CHUNK_BYTES
from harness.rawnode import Node

__all__ = [
    "LostGraceMaster",
    "checkpoint_files",
    "gz",
    "manifest_body",
    "post_checkpoint",
    "post_items",
    "post_logs",
    "put_chunk",
    "sha256_of",
    "ship_checkpoint",
    "short_grace_master",
]


def gz(data: bytes) -> bytes:
    """``data`` gzip-compressed at level 1, as the agent sends a chunk."""
    return gzip.compress(data, compresslevel=1)


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def checkpoint_files(files: dict[str, bytes]) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
    """The manifest entries of ``files`` (path → bytes) cut in CHUNK_BYTES pieces, and the chunks by sha256."""
    entries: list[dict[str, Any]] = []
    chunks: dict[str, bytes] = {}
    for path, data in files.items():
        shas = []
        for i in range(0, len(data), CHUNK_BYTES):
            piece = data[i:i + CHUNK_BYTES]
            chunks[sha256_of(piece)] = piece
            shas.append(sha256_of(piece))
        entries.append({"path": path, "type": "file", "size": len(data), "mode": 0o644, "chunks": shas})
    return entries, chunks


def manifest_body(checkpoint_id: str, attempt: int, item_seq: int, files: list[dict[str, Any]],
                  log_seq: int = 0, reason: str = "interval") -> dict[str, Any]:
    """A manifest as ``POST /api/tasks/{id}/checkpoints`` takes it."""
    return {"id": checkpoint_id, "attempt": attempt, "createdAt": "2026-12-05T18:00:00.000Z", "reason": reason,
            "itemSeq": item_seq, "logSeq": log_seq, "sizeBytes": sum(f["size"] for f in files),
            "packedBytes": 0, "files": files}


async def put_chunk(node: Node, task_id: str, sha256: str, body: bytes) -> httpx.Response:
    return await node.http.put(f"/api/tasks/{task_id}/checkpoint-chunks/{sha256}", content=body, headers=node.auth)


async def post_checkpoint(node: Node, task_id: str, body: Any) -> httpx.Response:
    return await node.http.post(f"/api/tasks/{task_id}/checkpoints", json=body, headers=node.auth)


async def ship_checkpoint(node: Node, task_id: str, checkpoint_id: str, attempt: int, item_seq: int,
                          files: dict[str, bytes]) -> httpx.Response:
    """Upload the chunks of ``files`` and post their manifest (the manifest's answer)."""
    entries, chunks = checkpoint_files(files)
    for sha, data in chunks.items():
        r = await put_chunk(node, task_id, sha, gz(data))
        assert r.status_code == 200, r.text
    return await post_checkpoint(node, task_id, manifest_body(checkpoint_id, attempt, item_seq, entries))


async def post_items(node: Node, task_id: str, seq: int, items: list[dict[str, Any]],
                     attempt: int | None = None) -> httpx.Response:
    body: dict[str, Any] = {"seq": seq, "items": items}
    if attempt is not None:
        body["attempt"] = attempt
    return await node.http.post(f"/api/tasks/{task_id}/items", json=body, headers=node.auth)


async def post_logs(node: Node, task_id: str, seq: int, lines: list[str], attempt: int | None = None) -> httpx.Response:
    body: dict[str, Any] = {"seq": seq, "lines": lines}
    if attempt is not None:
        body["attempt"] = attempt
    return await node.http.post(f"/api/tasks/{task_id}/logs", json=body, headers=node.auth)


@dataclass
class LostGraceMaster:
    """A dev master started by :func:`short_grace_master`."""

    base_url: str
    registration_token: str
    admin: AdminClient


async def short_grace_master(nursery: trio.Nursery, tmp_path: Path, node_lost_after: float) -> LostGraceMaster:
    """An in-process dev master (port 0) whose node-lost grace is ``node_lost_after`` seconds; its admin
    client is closed when ``nursery`` ends."""
    config = DevMasterConfig(db_path=tmp_path / "lost.sqlite", registration_token=secrets.token_urlsafe(16),
                             admin_token=secrets.token_urlsafe(16), port=0, node_lost_after=node_lost_after)
    base_url = await nursery.start(serve, config)
    admin = AdminClient(base_url, config.admin_token)

    async def close_later() -> None:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await admin.aclose()

    nursery.start_soon(close_later)
    return LostGraceMaster(base_url, config.registration_token, admin)
