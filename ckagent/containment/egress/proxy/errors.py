"""What the proxy answers a client instead of forwarding its request: one exception per answer.

Exception tree (every one carries the HTTP status the client gets and a reason for its body)::

    Exception
    └── ProxyError              answered on the client's connection, never raised past it
        ├── BadRequest          400: a request the proxy cannot route (not absolute-form, a malformed
        │                       host or port, userinfo, both Content-Length and Transfer-Encoding)
        ├── HeadTooLarge        431: a head over the size or header-count limit
        ├── HeadTimeout         408: a head that did not arrive in time (a slow-loris)
        ├── AuthRequired        407: credentials that are not this task's (Proxy-Authenticate is sent)
        ├── Refused             403: the task's egress policy denies the destination (counted)
        ├── UpstreamError       502: the destination cannot be resolved or reached, or it answered
        │   │                   something that is not HTTP/1.1
        │   └── UpstreamTimeout 504: the destination did not answer in time
        └── ChainRefused        the task's own proxy refused a tunnel: its status passed on (403, 503…;
                                its 407 becomes 502: the client's credentials are the agent's, not its)

``keep_alive`` says whether the client's connection may carry its next request after the answer
(the request's body, if any, is read and dropped first); a framing error (400, 408, 431) closes it.
"""

from __future__ import annotations

import http


class ProxyError(Exception):
    """An answer of the proxy's own: ``status`` (int), ``str()`` the reason (one line, no secrets)."""

    status = 502
    keep_alive = False

    def __init__(self, reason: str) -> None:
        super().__init__(reason)


class BadRequest(ProxyError):
    """400: the request cannot be routed; the message says what was wrong and what is expected."""

    status = 400


class HeadTooLarge(ProxyError):
    """431: the request head is over the size or header-count limit."""

    status = 431


class HeadTimeout(ProxyError):
    """408: the request head did not arrive within the head timeout."""

    status = 408


class AuthRequired(ProxyError):
    """407: the request carries credentials that are not this task's."""

    status = 407
    keep_alive = True


class Refused(ProxyError):
    """403: the task's egress policy denies the destination (``address``, ``port``: what was judged)."""

    status = 403
    keep_alive = True

    def __init__(self, reason: str, refused: tuple[tuple[str, int], ...] = ()) -> None:
        super().__init__(reason)
        self.refused = refused
        """The (address, port) pairs the policy refused, for the task's refusal counts."""


class UpstreamError(ProxyError):
    """502: the destination cannot be resolved or reached, or its answer is not HTTP/1.1."""

    status = 502
    keep_alive = True


class UpstreamTimeout(UpstreamError):
    """504: the destination did not connect or answer within the proxy's timeout."""

    status = 504


class ChainRefused(ProxyError):
    """The task's own proxy answered a CONNECT with ``status`` (passed on to the client, so that a
    crawler tells "forbidden" from "bad gateway" as it would without the agent)."""

    keep_alive = True

    def __init__(self, reason: str, status: int) -> None:
        super().__init__(reason)
        self.status = 502 if status == 407 or not 400 <= status <= 599 else status


REASONS: dict[int, str] = {
           400: "Bad Request", 403: "Forbidden", 407: "Proxy Authentication Required", 408: "Request Timeout",
           431: "Request Header Fields Too Large", 502: "Bad Gateway", 504: "Gateway Timeout"}
"""The reason phrase of each status the proxy answers with (others: :func:`reason`)."""


def reason(status: int) -> str:
    """The reason phrase of ``status`` ("" for one HTTP does not name)."""
    try:
        return REASONS.get(status) or http.HTTPStatus(status).phrase
    except ValueError:
        return ""
