"""The master boundary's exception tree and its retry rule.

What the network answers is classified once, by :class:`ckagent.master.client.MasterClient`, into::

    MasterError
    ├── MasterUnavailable        transport error, timeout, 429 or 5xx — retry with backoff + jitter
    │   └── MasterProtocolError  a 2xx (or 1xx/3xx) whose body is not what the protocol says for
    │                            that call: not JSON, truncated, or the wrong shape (checked with
    │                            the types of ckagent.master.protocol); or a 4xx from the master's origin
    │                            without the protocol's ``{"error": …}`` body — a captive portal, a
    │                            misrouted proxy or ingress; retried like an unavailable master
    │   └── NameHeld             a 409 to registration: another live agent (another nodeUid) holds
    │                            the node's name; registration waits for it (backoff ≤ 30 s)
    ├── MasterRejected           any other 4xx (in the protocol's words): that request fails
    │   │                        (logged); a 401 was first answered by registering again, once.
    │   │                        What it means is the caller's: a task stream's batch is kept and
    │   │                        retried (ckagent.delivery.shipper), a heartbeat is just missed
    │   └── MasterConflict       409 — a protocol conflict its caller handles (a claim lost, a
    │                            result that disagrees, a sequence gap: ``.body['expectedSeq']``,
    │                            an attempt superseded: ``.superseded_by``)
    └── RegistrationRefused      the master refused registration for good (4xx other than 401/409/429)

:func:`retry_wait` is the one retry rule (stamina's hook): MasterUnavailable (so also
MasterProtocolError) is retried, after the ``Retry-After`` a 429/503 asked for; nothing else is.
Messages never carry a secret (:func:`redact`).
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable
from typing import Any

import httpx

from ckagent.master.connectivity import Answered

RETRY_AFTER_MAX = 300.0
"""Longest ``Retry-After`` (seconds) a 429/503 answer is obeyed for; a longer one waits this long."""


class MasterError(Exception):
    """Base of every error talking to the master."""


class MasterUnavailable(MasterError):
    """The master could not be reached or answered 429/5xx: worth retrying later.

    ``retry_after`` is the wait (seconds, at most RETRY_AFTER_MAX) a 429 or 503 asked for with its
    ``Retry-After`` header, or None: the retrying caller waits at least that long (:func:`retry_wait`).
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class MasterProtocolError(MasterUnavailable):
    """A 2xx whose body is not the protocol's answer for that call (not JSON, truncated, wrong shape).

    ``answered`` says what came back (status, content type, first bytes). Retried like an
    unavailable master: what stands between the agent and the master is not the master yet.
    """

    def __init__(self, message: str, answered: Answered) -> None:
        super().__init__(message)
        self.answered = answered


class NameHeld(MasterUnavailable):
    """A 409 to registration (in the protocol's words): the node's name belongs to another live agent,
    one that registered another ``nodeUid`` and still heartbeats (docs/protocol.md, "Register"). Not
    fatal: registration retries it with backoff until the holder's heartbeats stop, it leaves, or (with
    ``agent.name_exclusive``) the master hands the name over. ``name`` is the name asked for."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class MasterRejected(MasterError):
    """The master answered a 4xx that retrying will not fix. ``status`` and decoded ``body``.

    ``message`` replaces the default text ("<endpoint>: master answered <status> (<error>)").
    """

    def __init__(self, endpoint: str, status: int, body: Any, *, secrets: tuple[str, ...] = (),
                 message: str | None = None) -> None:
        self.endpoint = endpoint
        self.status = status
        self.body = body
        detail = body.get("error") if isinstance(body, dict) else None
        text = message or f"{endpoint}: master answered {status}" + (f" ({detail})" if detail else "")
        super().__init__(redact(text, secrets))


class MasterConflict(MasterRejected):
    """409: a claim lost, a final result that disagrees, a sequence gap (``body['expectedSeq']``), an
    attempt superseded (:attr:`superseded_by`), a checkpoint whose chunks or items the master lacks
    (``body['missingChunks']``, ``body['storedItems']``)."""

    @property
    def superseded_by(self) -> int | None:
        """The task's current attempt when the master answered that this batch, result or checkpoint is
        of an older one (``{"error": …, "supersededBy": 3}``): the agent stops that attempt and sends
        nothing more for it. None for any other conflict (or a value that is not an integer ≥ 1)."""
        value = self.body.get("supersededBy") if isinstance(self.body, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        return None


class RegistrationRefused(MasterError):
    """Registration failed for good (bad request, forbidden, ...); the agent cannot start."""


RequestObserver = Callable[[str, str, float], None]
"""``observer(endpoint, outcome, seconds)``: metrics hook called once per HTTP attempt; ``outcome`` is
``ok``, ``error`` (transport error or timeout), ``protocol_error`` (a 2xx that is not the protocol)
or the HTTP status."""


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header value asks for (delta-seconds or an HTTP date), capped at
    RETRY_AFTER_MAX; None when absent, unreadable or not in the future. ``now``: epoch seconds (tests)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        seconds = float(value)
    else:
        try:
            moment = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if moment.tzinfo is None:
            return None
        seconds = moment.timestamp() - (time.time() if now is None else now)
    if seconds <= 0:
        return None
    return min(seconds, RETRY_AFTER_MAX)


def retry_wait(exc: Exception) -> bool | float:
    """stamina's retry hook for master calls: retry MasterUnavailable (MasterProtocolError too), after
    the ``Retry-After`` the master asked for when it said one (else stamina's backoff); nothing else."""
    if not isinstance(exc, MasterUnavailable):
        return False
    return exc.retry_after if exc.retry_after else True


def json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def redact(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every non-empty secret replaced by ``***`` (a master may echo what it was sent)."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def in_protocol_words(body: Any) -> bool:
    """True for the protocol's error body, a JSON object with a string ``error`` (what a master answers;
    a proxy's or a portal's page is not)."""
    return isinstance(body, dict) and isinstance(body.get("error"), str)


def error_text(response: httpx.Response) -> str:
    body = json_or_none(response)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])[:300]
    return response.text[:300] or response.reason_phrase
