"""A dev master that records the final results it receives and the API keys it issues."""

from __future__ import annotations

import json
import re
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio
import yaml
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from ckagent.devmaster.app import Notifier, create_app
from ckagent.devmaster.client import AdminClient
from ckagent.devmaster.store import Store


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with libyaml's parser when PyYAML has it (the same documents, ~10× less CPU:
    openapi.yaml takes 0.1 s in pure Python, and every pytest-xdist worker loads it at collection)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


FINAL = ("SUCCESS", "FAILED", "CANCELLED")
_RESULT_PATH = re.compile(r"^/api/tasks/([^/]+)/result$")


class Recorder:
    """ASGI wrapper around the dev master app: final results received per task, API keys issued."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.final_posts: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
        self.api_keys: list[str] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        result = _RESULT_PATH.match(path) if scope["type"] == "http" and scope["method"] == "POST" else None
        register = scope["type"] == "http" and path == "/api/nodes/register"
        if result is None and not register:
            await self.app(scope, receive, send)
            return
        messages: list[dict[str, Any]] = []
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        status: list[int] = []
        answer = bytearray()

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body":
                answer.extend(message.get("body", b""))
            await send(message)

        await self.app(scope, replay, capture)
        if result is not None:
            data = json.loads(body or b"{}")
            if data.get("status") in FINAL:
                self.final_posts[result.group(1)].append((status[0], data))
        elif status and status[0] == 200:
            self.api_keys.append(json.loads(bytes(answer))["apiKey"])


@dataclass
class RecordingMaster:
    """A running dev master (in this process) and what it recorded."""

    base_url: str
    registration_token: str
    admin_token: str
    admin: AdminClient
    recorder: Recorder = field(repr=False)

    def finals(self, task_id: str) -> list[tuple[int, dict[str, Any]]]:
        """Every final result (status code, body) the master received for ``task_id``."""
        return list(self.recorder.final_posts.get(task_id, []))


@asynccontextmanager
async def serve_recording_master(tmp_path: Path) -> AsyncIterator[RecordingMaster]:
    """The dev master app behind :class:`Recorder` (its SQLite file in ``tmp_path``), served by hypercorn
    on 127.0.0.1:0 until the block ends (the ``recording_master`` fixture of conftest.py)."""
    store = await trio.to_thread.run_sync(Store, tmp_path / "master.sqlite")
    registration_token, admin_token = uuid.uuid4().hex, uuid.uuid4().hex
    recorder = Recorder(create_app(store, Notifier(), registration_token=registration_token,
                                   admin_token=admin_token, max_long_poll_seconds=30.0))
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.loglevel = "WARNING"
    config.graceful_timeout = 0.5
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(hypercorn_serve, recorder, config))
            base_url = str(binds[0]).rstrip("/")
            async with AdminClient(base_url, admin_token) as admin:
                yield RecordingMaster(base_url, registration_token, admin_token, admin, recorder)
            nursery.cancel_scope.cancel()
    finally:
        store.close()
