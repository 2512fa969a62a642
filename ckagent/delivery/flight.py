"""A stream's batch on its way and what the master's answer to it means (for the stream shipper).

Pure logic, no I/O: :func:`refused_element` reads a 422, :func:`placeholder` is the stand-in for an
element the master refused on its own. See the package docstring (ckagent.delivery).
"""

from __future__ import annotations

import json

from ckagent.delivery.lines import encode_json
from ckagent.master.client import MasterRejected

CEILING_RECOVERY = 8
"""Acknowledgements in a row after which a batch size lowered by a 413 may double again."""


def refused_element(exc: MasterRejected, key: str, count: int) -> int | None:
    """The index (0-based, within the batch of ``count`` elements) of the element a 422 names as the
    one it refuses — its ``field`` is ``"<key>[i]"`` or a path inside it (``"items[3].price"``) —
    or None: only such a 422 drops an element (docs/protocol.md, "When something fails")."""
    body = exc.body
    field = body.get("field") if isinstance(body, dict) else None
    if exc.status != 422 or not isinstance(field, str) or not field.startswith(f"{key}["):
        return None
    digits, _, _ = field[len(key) + 1:].partition("]")
    if not digits.isdigit() or int(digits) >= count:
        return None
    return int(digits)


class Flight:
    """A batch on its way: ``count`` leading elements of the pending ones, ``size`` their estimated bytes."""

    __slots__ = ("answer", "count", "size")

    def __init__(self, count: int, size: int) -> None:
        self.count = count
        self.size = size
        self.answer: Answer | None = None


class Answer:
    """What the master's answer to a batch means for the stream: ``kind`` ok / expected (``expected``:
    the count the master holds), shrink (a 413), element (``expected``: the index of the element a
    422 names), refused (for good; ``reason``: the master's words), superseded (``expected``: the attempt the
    master moved on to), retry (after a backoff of at least
    ``retry_after`` seconds)."""

    __slots__ = ("expected", "kind", "reason", "retry_after")

    def __init__(self, kind: str, expected: int | None = None, retry_after: float | None = None,
                 reason: str | None = None) -> None:
        self.kind = kind  # ok | expected | shrink | element (expected = its index) | refused | retry | superseded
        self.expected = expected
        self.retry_after = retry_after  # retry: at least this long (a 429/503's Retry-After), or None
        self.reason = reason


RETRY = Answer("retry")


def placeholder(kind: str, element: bytes) -> bytes:
    """The encoded stand-in (a log line for ``kind`` "logs", else an item) for an encoded ``element``
    the master refused on its own."""
    size = len(element)
    if kind == "logs":
        return encode_json(f"[ckagent] a log line of {size} bytes was refused by the master and dropped")
    return encode_json(
        {"_invalidItem": None, "_error": f"an item of {size} bytes was refused by the master and dropped"}
    )


def is_placeholder(element: bytes) -> bool:
    """True when the encoded ``element`` is a placeholder (see :func:`placeholder`)."""
    try:
        decoded = json.loads(element)
    except ValueError:
        return False
    if isinstance(decoded, str):
        return decoded.startswith("[ckagent] a log line of ")
    return isinstance(decoded, dict) and "_invalidItem" in decoded and decoded.get("_invalidItem") is None
