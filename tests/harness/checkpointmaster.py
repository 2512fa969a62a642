"""A master of checkpoints in memory (``httpx.MockTransport``), for the logic tests of ckagent.resume: the
chunk and manifest endpoints under the protocol's rules (a chunk gunzips to at most 1 MiB of bytes of its
sha256, a manifest names only stored chunks, a manifest waits for its items), with faults scripted per
request (:attr:`CheckpointMaster.fault`) and every request recorded. Real HTTP against the reference
master: tests/test_resume_master.py. :func:`snapshot_tree` writes a spider's snapshot dir.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ckagent.master.client import MasterClient
from ckagent.master.protocol import RegisterRequest

__all__ = ["CheckpointMaster", "checkpoint_client", "snapshot_tree"]

Fault = Callable[[str, httpx.Request], "httpx.Response | Exception | None"]


@dataclass
class CheckpointMaster:
    """One master's checkpoints, every task's, in memory. ``stored_items``: the items it holds per task
    (a manifest of a larger itemSeq gets 409 storedItems); ``superseded_by``: a task's newer attempt
    (409 supersededBy to everything of an older one); ``fault(kind, request)`` answers a request itself
    (a Response, or an exception httpx raises: a timeout) — kind is ``put``, ``post``, ``get``, ``chunk``."""

    chunks: dict[str, bytes] = field(default_factory=dict)
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    stores: list[str] = field(default_factory=list)
    """Every chunk stored, once per PUT that stored it (a chunk sent twice is here twice)."""
    stored_items: dict[str, int] = field(default_factory=dict)
    superseded_by: dict[str, int] = field(default_factory=dict)
    fault: Fault = lambda kind, request: None

    def posts(self) -> list[str]:
        """The manifest ids posted, one per POST (answered or not)."""
        return [what for kind, what in self.requests if kind == "post"]

    def puts(self) -> list[str]:
        return [what for kind, what in self.requests if kind == "put"]

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/api/nodes/register":
            return httpx.Response(200, json={"nodeId": "n1", "apiKey": "k" * 20})
        parts = path.split("/")  # "", api, tasks, <task>, checkpoint-chunks|checkpoints, [x]
        task = parts[3]
        if parts[4] == "checkpoint-chunks":
            kind = "put" if request.method == "PUT" else "chunk"
        else:
            kind = "post" if request.method == "POST" else "get"
        name = parts[5] if len(parts) > 5 else json.loads(request.content).get("id", "?")
        self.requests.append((kind, name))
        fault = self.fault(kind, request)
        if isinstance(fault, Exception):
            raise fault
        if fault is not None:
            return fault
        attempt = self._attempt(kind, request)
        newer = self.superseded_by.get(task)
        if attempt is not None and newer is not None and attempt < newer:
            return httpx.Response(409, json={"error": f"task {task} moved on to attempt {newer}", "supersededBy": newer})
        if kind == "put":
            return self._put(name, request.content)
        if kind == "chunk":
            gz = self.chunks.get(name)
            if gz is None:
                return httpx.Response(404, json={"error": "no such chunk"})
            return httpx.Response(200, content=gz, headers={"content-type": "application/gzip"})
        if kind == "post":
            return self._post(task, json.loads(request.content))
        manifest = self.manifests.get(f"{task}/{name}")
        if manifest is None:
            return httpx.Response(404, json={"error": "no such checkpoint"})
        return httpx.Response(200, json=manifest)

    def _attempt(self, kind: str, request: httpx.Request) -> int | None:
        if kind == "post":
            return int(json.loads(request.content)["attempt"])
        return 1 if kind == "put" else None

    def _put(self, sha: str, gz: bytes) -> httpx.Response:
        unpack = zlib.decompressobj(wbits=31)
        try:
            data = unpack.decompress(gz, (1 << 20) + 1)
        except zlib.error:
            return httpx.Response(422, json={"error": "not gzip"})
        if len(data) > 1 << 20 or hashlib.sha256(data).hexdigest() != sha:
            return httpx.Response(422, json={"error": "not the bytes of that sha256"})
        self.chunks[sha] = gz
        self.stores.append(sha)
        return httpx.Response(200, json={"stored": True})

    def _post(self, task: str, body: dict[str, Any]) -> httpx.Response:
        held = f"{task}/{body['id']}"
        if held in self.manifests:
            return httpx.Response(200, json={"checkpointId": body["id"]})
        missing = [sha for f in body["files"] for sha in f["chunks"] if sha not in self.chunks]
        if missing:
            return httpx.Response(409, json={"error": "chunks missing", "missingChunks": sorted(set(missing))})
        stored = self.stored_items.get(task)
        if stored is not None and stored < body["itemSeq"]:
            return httpx.Response(409, json={"error": "items missing", "storedItems": stored})
        self.manifests[held] = body
        return httpx.Response(200, json={"checkpointId": body["id"]})

    def files_of(self, task: str, checkpoint: str) -> dict[str, bytes]:
        """The files a stored checkpoint holds (path → bytes), from its chunks."""
        out = {}
        for entry in self.manifests[f"{task}/{checkpoint}"]["files"]:
            if entry["type"] == "file":
                out[entry["path"]] = b"".join(gzip.decompress(self.chunks[sha]) for sha in entry["chunks"])
        return out


def checkpoint_client(master: CheckpointMaster, **options: Any) -> MasterClient:
    """A MasterClient whose master is ``master`` (in memory, at http://master.test)."""
    def body() -> RegisterRequest:
        return RegisterRequest(name="n", ip="127.0.0.1", port=1, version="t", os="linux", arch="x", python="3",
                               cpu_count=1, memory_total_bytes=1, max_workers=1)

    return MasterClient("http://master.test", "token", body, transport=httpx.MockTransport(master.handler), **options)


def snapshot_tree(task_dir: Path, n: int, files: dict[str, bytes]) -> Path:
    """``task_dir/snapshots/N`` holding ``files`` (relative path → bytes), as a spider writes it."""
    top = task_dir / "snapshots" / str(n)
    top.mkdir(parents=True)
    for rel, data in files.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_bytes(data)
    return top
