"""The reference master's errors: each ApiError carries the HTTP status the app answers with.

::

    Exception
    ├── SchemaError               the file is not a dev master database of SCHEMA_VERSION (Store())
    └── ApiError                  status_code, message, extra (merged into the JSON error body)
        ├── BadRequestError       400  the body is not JSON / the upload is not a zip
        ├── UnauthorizedError     401  missing or wrong token / api key
        ├── ForbiddenError        403  a valid node key used on another node's path
        ├── NotFoundError         404  unknown node, spider, task, file or package
        ├── ConflictError         409  the request contradicts the stored state (claims, seq gaps)
        └── PayloadTooLargeError  413  body or batch over the limits

A payload that breaks the schema raises ``ckagent.master.protocol.ProtocolError`` (422) instead.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ApiError",
    "BadRequestError",
    "ConflictError",
    "ForbiddenError",
    "NotFoundError",
    "PayloadTooLargeError",
    "SchemaError",
    "UnauthorizedError",
]


class SchemaError(Exception):
    """The database file is not a dev master database of SCHEMA_VERSION (an older layout, a newer one,
    or another application's file). Nothing in it is changed; the fix is another file.
    """


class ApiError(Exception):
    """An error the HTTP layer turns into ``{"error": message, **extra}`` with ``status_code``."""

    status_code = 500

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra


class BadRequestError(ApiError):
    """400: the request body cannot be read (not JSON, not a zip)."""

    status_code = 400


class UnauthorizedError(ApiError):
    """401: missing or wrong credentials. The message never contains the credential."""

    status_code = 401


class ForbiddenError(ApiError):
    """403: a valid node key used on a path of another node."""

    status_code = 403


class NotFoundError(ApiError):
    """404: the named object does not exist."""

    status_code = 404


class ConflictError(ApiError):
    """409: the request contradicts the stored state; ``extra`` may carry ``expectedSeq``."""

    status_code = 409


class PayloadTooLargeError(ApiError):
    """413: the body or a batch is over the limit."""

    status_code = 413
