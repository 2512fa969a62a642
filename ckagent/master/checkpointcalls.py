"""The checkpoint calls of the master client (docs/protocol.md, "Checkpoints"): chunks up and down, the
manifest posted and read.

:class:`CheckpointCalls` adds them to the typed face of the endpoint table
(:class:`ckagent.master.endpoints.MasterCalls`); :class:`ckagent.master.client.MasterClient` is one. They
classify the master's answers as every call does (ckagent.master.errors): transport error, timeout, 429,
5xx → MasterUnavailable; a 2xx that is not the protocol's answer (a manifest that breaks
ckagent.master.protocol.checkpoints' rules, an acknowledgement of another checkpoint, a chunk over
:data:`MAX_CHUNK_DOWNLOAD_BYTES`) → MasterProtocolError; 409 → MasterConflict (``superseded_by``,
``body['missingChunks']``, ``body['storedItems']``); another 4xx → MasterRejected. Cancellation abandons
the request.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

import trio

from ckagent.master.connectivity import Answered
from ckagent.master.endpoints import (
    CHECKPOINT_CHUNK_GET,
    CHECKPOINT_CHUNK_PUT,
    CHECKPOINT_GET,
    CHECKPOINT_POST,
    MAX_CHUNK_DOWNLOAD_BYTES,
    MasterCalls,
    Retry,
    checkpoint_accepted,
)
from ckagent.master.errors import MasterProtocolError, MasterRejected
from ckagent.master.protocol import CheckpointManifest, CheckpointRef, ProtocolError
from ckagent.master.protocol.checkpoints import check_sha256

__all__ = ["MAX_CHUNK_DOWNLOAD_BYTES", "CheckpointCalls", "checkpoint_id"]


class CheckpointCalls(MasterCalls):
    """The four checkpoint calls (see module docstring), on :meth:`call` and :meth:`download`."""

    async def put_checkpoint_chunk(self, task_id: str, sha256: str, gz: bytes, *, retry: Retry | None = None) -> None:
        """``PUT /api/tasks/{task}/checkpoint-chunks/{sha}``: one chunk of a checkpoint, ``gz`` the gzip
        bytes of at most CHUNK_BYTES whose sha256 is ``sha256`` (sent as ``application/gzip``, no
        Content-Encoding). Idempotent. MasterRejected 422: the master refused the bytes (not that sha256,
        too large); MasterConflict with ``superseded_by``: the attempt is over. ValueError: ``sha256`` is not
        64 lowercase hex digits (nothing sent)."""
        try:
            check_sha256(sha256, "sha256")
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None
        await self.call(CHECKPOINT_CHUNK_PUT, {"task": task_id, "sha": sha256}, content=gz,
                        content_type="application/gzip", retry=retry)

    async def post_checkpoint(self, task_id: str, manifest: CheckpointManifest, *, retry: Retry | None = None) -> str:
        """``POST /api/tasks/{task}/checkpoints``: a checkpoint's manifest, once every chunk is stored and the
        items stream is acknowledged up to ``manifest.item_seq``; returns its id. The answer must name
        ``manifest.id`` (else MasterProtocolError). MasterConflict: ``body['missingChunks']`` (upload them,
        post again), ``body['storedItems']`` (the items are not there yet), or ``superseded_by``."""
        def acknowledged(body: Any) -> str:
            got = checkpoint_accepted(body)
            if got != manifest.id:
                raise ValueError(f"acknowledged checkpoint {got!r} for {manifest.id!r}")
            return got
        return await self.call(CHECKPOINT_POST, {"task": task_id}, json=manifest.to_json(), answer=acknowledged,
                               retry=retry)

    async def get_checkpoint(self, task_id: str, ref_or_url: CheckpointRef | str, *,
                             retry: Retry | None = None) -> CheckpointManifest:
        """``GET /api/tasks/{task}/checkpoints/{id}``: the manifest of a checkpoint, validated as hostile input
        (ckagent.master.protocol.checkpoints) and naming the id asked for (else MasterProtocolError).
        ``ref_or_url``: a CheckpointRef, a checkpoint id, or a URL whose path ends in this task's
        checkpoint path (a ref's ``url``; always read from the master's own route: the key never goes
        elsewhere). MasterRejected: a URL that is not this task's checkpoint, a 404."""
        checkpoint = checkpoint_id(task_id, ref_or_url)

        def read(body: Any) -> CheckpointManifest:
            manifest = CheckpointManifest.from_json(body)
            if manifest.id != checkpoint:
                raise ValueError(f"answered checkpoint {manifest.id!r} for {checkpoint!r}")
            return manifest
        return await self.call(CHECKPOINT_GET, {"task": task_id, "checkpoint": checkpoint}, answer=read, retry=retry)

    async def get_checkpoint_chunk(self, task_id: str, sha256: str, *, read_timeout: float | None = None) -> bytes:
        """``GET /api/tasks/{task}/checkpoint-chunks/{sha}``: a chunk's gzip bytes, as they are (the caller
        unpacks and checks the sha256). At most MAX_CHUNK_DOWNLOAD_BYTES: a longer body is
        MasterProtocolError (abandoned at that size). Errors as :meth:`download`; ValueError for a
        ``sha256`` that is not 64 lowercase hex digits."""
        try:
            check_sha256(sha256, "sha256")
        except ProtocolError as exc:
            raise ValueError(str(exc)) from None
        parts: list[bytes] = []
        size = 0

        async def sink(chunk: bytes) -> None:
            nonlocal size
            await trio.lowlevel.checkpoint()  # download() takes an async sink; this one only counts
            size += len(chunk)
            if size > MAX_CHUNK_DOWNLOAD_BYTES:
                raise MasterProtocolError(
                    f"{CHECKPOINT_CHUNK_GET.name}: a checkpoint chunk of more than {MAX_CHUNK_DOWNLOAD_BYTES} bytes "
                    "is not the protocol's (a chunk is at most 1 MiB unpacked)", Answered(200, "", b""))
            parts.append(chunk)
        await self.download(CHECKPOINT_CHUNK_GET, CHECKPOINT_CHUNK_GET.path(task=task_id, sha=sha256), sink,
                            read_timeout=read_timeout)
        return b"".join(parts)


def checkpoint_id(task_id: str, ref_or_url: CheckpointRef | str) -> str:
    """The checkpoint id of a CheckpointRef, an id, or a URL (a string with ``/``) whose path ends in
    this task's checkpoint path. Raises MasterRejected for a URL that is not this task's checkpoint."""
    if isinstance(ref_or_url, CheckpointRef):
        return ref_or_url.id
    if "/" not in ref_or_url:
        return ref_or_url
    path = urlsplit(ref_or_url).path
    candidate = unquote(path.rpartition("/")[2])
    if candidate and path.endswith(CHECKPOINT_GET.path(task=task_id, checkpoint=candidate)):
        return candidate
    raise MasterRejected(CHECKPOINT_GET.name, 0, None,
                         message=f"{CHECKPOINT_GET.name}: {ref_or_url[:200]!r} is not a checkpoint of task {task_id[:80]!r}")
