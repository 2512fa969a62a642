"""What the dev master's routes share: reading request bodies and queries, the two kinds of
authentication, the long-poll notifier, and :class:`Api`, the context every route module gets.

Request bodies are bounded (:func:`read_body`: 413 beyond the limit, after draining the rest so the
client sees the answer); JSON that does not decode is 400; a bad query value is 422 naming it.
"""

from __future__ import annotations

import hmac
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import trio
from starlette.requests import Request
from starlette.routing import Route

from ckagent.devmaster.errors import BadRequestError, ForbiddenError, PayloadTooLargeError, UnauthorizedError
from ckagent.devmaster.store import Store
from ckagent.master.protocol import ProtocolError

MAX_NODE_BODY_BYTES = 8 * 1024 * 1024
"""Largest request body a node may send (bytes); larger → 413."""
MAX_DRAIN_BYTES = 64 * 1024 * 1024
"""A too-large body up to this size is read and dropped before the 413 (so the client sees it)."""

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


async def read_body(request: Request, max_bytes: int) -> bytes:
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


async def json_body(request: Request, max_bytes: int = MAX_NODE_BODY_BYTES) -> Any:
    raw = await read_body(request, max_bytes)
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}") from exc


_ITEMS_PREFIX = re.compile(r'\{\s*"seq"\s*:\s*(0|[1-9][0-9]*)\s*,'
                           r'(?:\s*"attempt"\s*:\s*([1-9][0-9]{0,15})\s*,)?\s*"items"\s*:\s*(?=\[)')
_ITEMS_SUFFIX = re.compile(r'\s*(?:,\s*"attempt"\s*:\s*([1-9][0-9]{0,15})\s*)?\}\s*')
_JSON_DECODER = json.JSONDecoder()


async def items_body(request: Request, max_bytes: int = MAX_NODE_BODY_BYTES) -> tuple[Any, str | None]:
    """An items batch body: (the decoded JSON, the items array's own JSON text or None).

    The text comes with a body of exactly ``{"seq": N, "items": [...]}``, ``{"seq": N, "attempt": A,
    "items": [...]}`` (the agent's forms) or ``{"seq": N, "items": [...], "attempt": A}``, read
    with one decode that also says where the array ends: the store keeps that text as it came
    instead of encoding every item again (half the master's CPU per item, bench/items.py). Any
    other body is decoded as :func:`_json_body` does. Raises BadRequestError for a body that is
    not JSON, PayloadTooLargeError beyond ``max_bytes``.
    """
    raw = await read_body(request, max_bytes)
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
            tail = _ITEMS_SUFFIX.fullmatch(text, end)
            if tail is not None and not (match.group(2) and tail.group(1)):  # "attempt" once at most
                body = {"seq": int(match.group(1)), "items": items}
                attempt = match.group(2) or tail.group(1)
                if attempt is not None:
                    body["attempt"] = int(attempt)
                return body, text[match.end():end]
    if not raw.strip():
        return {}, None
    try:
        return json.loads(raw), None
    except ValueError as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}") from exc


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def same_secret(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


async def disconnected(request: Request) -> None:
    """Return when the client of ``request`` (whose body was read, or that has none) has gone away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
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


def query_ids(request: Request, name: str) -> list[str]:
    """The comma-separated ids of query parameter ``name`` (blanks dropped; none when absent)."""
    return [part.strip() for part in request.query_params.get(name, "").split(",") if part.strip()]


def query_seconds(request: Request, name: str, hi: float) -> float:
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



def json_object(body: Any) -> dict[str, Any]:
    """``body`` when it is a JSON object; else ProtocolError (422) for the whole body."""
    if not isinstance(body, dict):
        raise ProtocolError("", "expected a JSON object")
    return body


def route(scope: str, path: str, endpoint: Callable[[Request], Any], method: str) -> Route:
    """One route named ``<scope>:<endpoint name>`` (scope ``node``, ``admin`` or ``page``): the name
    says which side of the API it belongs to (ckagent.devmaster.app.route_table)."""
    return Route(path, endpoint, methods=[method], name=f"{scope}:{endpoint.__name__}")


@dataclass
class Api:
    """The context of every route: the store and notifier, the secrets, the options of create_app.

    ``poll_cap``: the longest long poll (seconds); ``package_base``: the prefix of codePackage urls
    ("" = relative); ``features``: what the registration answer offers beyond MASTER_FEATURES.
    """

    store: Store
    notifier: Notifier
    registration_token: str
    admin_token: str
    poll_cap: float
    package_base: str
    claim_in_poll: bool
    artifacts: bool
    features: list[str]

    async def run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)`` in a worker thread (the store blocks); cancellation abandons the
        wait, not the call (trio.to_thread's default)."""
        return await trio.to_thread.run_sync(partial(fn, *args, **kwargs))

    async def node_auth(self, request: Request) -> str:
        """The node id of the request's api key. Raises UnauthorizedError (no or unknown key: register
        again) and ForbiddenError (the key of another node than the path's ``node_id``)."""
        key = bearer(request)
        node_id = None if key is None else await self.run(self.store.node_for_key, key)
        if node_id is None:
            raise UnauthorizedError("missing, unknown or revoked api key: register again")
        path_node = request.path_params.get("node_id")
        if path_node is not None and path_node != node_id:
            raise ForbiddenError("this api key belongs to another node")
        return node_id

    def admin_auth(self, request: Request) -> None:
        """Raises UnauthorizedError unless the request carries the admin token."""
        if not same_secret(bearer(request), self.admin_token):
            raise UnauthorizedError("missing or wrong admin token")
