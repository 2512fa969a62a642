"""Ids in the reference master's URLs: one percent-encoded path segment each, decoded once.

An id is opaque (docs/protocol.md, "Ids"): ``a/b`` travels as ``a%2Fb`` and ``..`` as ``%2E%2E``. The
ASGI server hands Starlette a path that is already decoded, in which ``a%2Fb`` has become two segments.
:class:`SegmentPaths` rebuilds the path from ``raw_path`` one segment at a time, with a ``/`` inside a
segment kept as :data:`SLASH`, and the ``seg`` convertor of the routes (``{task_id:seg}``) turns it back.

:func:`check_spider_name` is what the admin API accepts as a spider's name: what an agent accepts as
an id (ckagent.master.ids) and printable, so this master never hands out a name an agent would refuse.
"""

from __future__ import annotations

import unicodedata
from typing import Any
from urllib.parse import unquote

from starlette.convertors import Convertor, register_url_convertor

from ckagent.master.ids import IdError, check_id, url_segment
from ckagent.master.protocol import ProtocolError

SLASH = "\uf8ff"
"""Stands for a ``/`` inside one segment between the path rebuild and the route's convertor."""


class SegmentConvertor(Convertor[str]):
    """``{name:seg}``: one path segment, with its encoded slashes given back."""

    regex = "[^/]+"

    def convert(self, value: str) -> str:
        return value.replace(SLASH, "/")

    def to_string(self, value: str) -> str:
        return url_segment(value)


register_url_convertor("seg", SegmentConvertor())


class SegmentPaths:
    """ASGI middleware: ``scope["path"]`` decoded segment by segment from ``raw_path`` (see module doc)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raw = scope.get("raw_path") if scope.get("type") in ("http", "websocket") else None
        if raw and b"%" in raw:
            text = raw.decode("latin-1").split("?", 1)[0]
            segments = [unquote(part, errors="surrogateescape").replace("/", SLASH) for part in text.split("/")]
            scope = {**scope, "path": "/".join(segments)}
        await self.app(scope, receive, send)


def check_spider_name(value: Any, field: str = "name") -> str:
    """A spider name the admin API accepts, or ProtocolError naming ``field`` (422): a non-empty
    string an agent can carry as an id (no NUL, at most ckagent.master.ids.MAX_ID_CHARS characters) without
    control characters."""
    if not isinstance(value, str) or not value.strip():
        raise ProtocolError(field, "expected a non-empty string")
    try:
        check_id(value)
    except IdError as exc:
        raise ProtocolError(field, f"{exc}; agents refuse such a spider name") from None
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise ProtocolError(field, "must not contain control characters (newlines, tabs, ...)")
    return value
