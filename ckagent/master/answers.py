"""What the master answered, classified once: each failure becomes its exception and its trouble.

:class:`Answers` is the classifying half of :class:`ckagent.master.client.MasterClient` (the other
half sends, authenticates and retries): it reads a 2xx body with the endpoint's reader, turns 4xx,
429/5xx, transport errors and bodies that are not the protocol's into the tree of
:mod:`ckagent.master.errors`, records each in :class:`ckagent.master.connectivity.Connectivity` (one log
line per episode) and tells the metrics observer about every attempt. Every method that classifies a
failure raises; secrets are masked in every message.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import httpx
import trio

from ckagent.master.connectivity import DOWN_EPISODE, Answered, Connectivity, Trouble
from ckagent.master.endpoints import TASK_DATA_ENDPOINTS
from ckagent.master.errors import (
    MasterConflict,
    MasterProtocolError,
    MasterRejected,
    MasterUnavailable,
    RequestObserver,
    error_text,
    in_protocol_words,
    parse_retry_after,
    redact,
)
from ckagent.master.protocol import ProtocolError

A = TypeVar("A")


class Answers:
    """Classifies the answers of one master (``base_url``): records them in ``connectivity``, tells
    ``observer`` (may be None) of each attempt; ``secrets()`` gives what no message may show."""

    def __init__(self, base_url: str, connectivity: Connectivity, observer: RequestObserver | None,
                 secrets: Callable[[], tuple[str, ...]]) -> None:
        self._base_url = base_url
        self.connectivity = connectivity
        self._observer = observer
        self.secrets = secrets

    def answer(self, endpoint: str, response: httpx.Response, reader: Callable[[Any], A]) -> A:
        """Classify a response that is not 429/5xx/4xx: decode and read its body, or raise
        MasterProtocolError (observed and recorded here)."""
        body = response.content
        problem: str | None = None
        if not 200 <= response.status_code < 300:
            problem = "not a 2xx answer"
        else:
            try:
                decoded = jsonlib.loads(body) if body.strip() else None
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                problem = "not JSON"
                if body.lstrip()[:1] in (b"{", b"[") and isinstance(exc, jsonlib.JSONDecodeError):
                    cut = exc.pos >= len(exc.doc.rstrip()) or exc.msg.startswith("Unterminated")
                    problem = "truncated JSON" if cut else "malformed JSON"
            else:
                try:
                    value = reader(decoded)
                except (ProtocolError, ValueError, TypeError, KeyError) as exc:
                    problem = f"wrong shape: {exc}"
                else:
                    self.observe(endpoint, "ok", response)
                    self.connectivity.succeeded(endpoint, sent_at(response))
                    return value
        self.not_protocol(endpoint, response, problem)

    def not_protocol(self, endpoint: str, response: httpx.Response, problem: str) -> NoReturn:
        """Record and raise MasterProtocolError: the answer is not in the protocol's words (``problem``)."""
        # A registration answer may hold a new key: its bytes are never quoted.
        shown = b"" if endpoint == "register" and 200 <= response.status_code < 300 else response.content
        answered = Answered.of(response, shown, self.secrets())
        self.observe(endpoint, "protocol_error", response)
        text = (f"master answers {answered.status} {answered.content_type} to {endpoint}: not the node "
                f"protocol ({problem}; {answered})")
        text = redact(text, self.secrets())
        self.trouble("protocol", endpoint, ("protocol", answered.status, answered.content_type), sent_at(response),
                      text)
        raise MasterProtocolError(text, answered)

    def rejected(self, endpoint: str, target: str, response: httpx.Response, body: Any, head: bytes) -> NoReturn:
        """Raise the MasterRejected (MasterConflict) for a 4xx other than 429; recorded here."""
        status = response.status_code
        secrets = self.secrets()
        if self.same_origin(target) and not in_protocol_words(body):
            self.not_protocol(endpoint, response, 'an error without the protocol\'s {"error": …} body')
        self.observe(endpoint, str(status), response)
        if status == 409:
            self.connectivity.succeeded(endpoint, sent_at(response))  # the master answered in the protocol's words
            raise MasterConflict(endpoint, status, body, secrets=secrets)
        if not self.same_origin(target):
            origin = _origin(httpx.URL(target))
            text = (f"{endpoint}: {origin} answered {status} ({Answered.of(response, head, secrets)}); it is not "
                    f"the master's origin ({_origin(httpx.URL(self._base_url))}), so no API key was sent: "
                    "the URL must be public (or pre-signed), or on the master (a relative URL)")
            self.trouble("rejected", endpoint, ("rejected", status, origin), sent_at(response),
                          redact(text, secrets))
            raise MasterRejected(endpoint, status, body, secrets=secrets, message=text)
        error = MasterRejected(endpoint, status, body, secrets=secrets)
        detail = redact(error_text(response), secrets)
        again = " even after registering again" if status == 401 else ""
        fate = ("the data stays on the node and is sent again with backoff" if endpoint in TASK_DATA_ENDPOINTS
                else "that request fails")
        self.trouble("rejected", endpoint, ("rejected", status), sent_at(response),
                      f"master refuses {endpoint} with {status}{again} ({detail}); {fate}")
        raise error

    def same_origin(self, target: str) -> bool:
        """True for a relative path or an absolute URL on the master's scheme, host and port."""
        if "://" not in target:
            return True
        base, url = httpx.URL(self._base_url), httpx.URL(target)
        return (base.scheme, base.host, base.port) == (url.scheme, url.host, url.port)

    def unreachable(self, endpoint: str, exc: Exception | None, started: float,
                     reason: str | None = None) -> NoReturn:
        """Record and raise MasterUnavailable for a transport error or timeout."""
        if reason is None:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        # No URL in the cause: /readyz shows it, and the status port never tells the master's address.
        text = redact(f"master unreachable ({endpoint}: {reason})", self.secrets())
        self.trouble("unreachable", endpoint, DOWN_EPISODE, started, text)
        raise MasterUnavailable(f"{endpoint}: {reason}") from exc

    def undecodable(self, endpoint: str, exc: Exception, started: float) -> NoReturn:
        """Record and raise MasterProtocolError for an answer httpx cannot read (a bad Content-Encoding,
        endless redirects): not the protocol, whoever sent it."""
        self.observe(endpoint, "protocol_error", started)
        text = redact(f"master answers {endpoint} with something that is not the node protocol "
                       f"({type(exc).__name__}: {exc})", self.secrets())
        self.trouble("protocol", endpoint, ("protocol", type(exc).__name__), started, text)
        raise MasterProtocolError(text, Answered(0, "", b"")) from exc

    def unavailable(self, endpoint: str, response: httpx.Response, started: float) -> NoReturn:
        """Record and raise MasterUnavailable for a 429 or 5xx answer (its body already read)."""
        status = response.status_code
        self.observe(endpoint, str(status), started)
        answered = Answered.of(response, response.content, self.secrets())
        retry_after = parse_retry_after(response.headers.get("retry-after")) if status in (429, 503) else None
        wait = f"; it asks to wait {retry_after:g} s (Retry-After)" if retry_after else ""
        text = redact(f"master unavailable ({endpoint}: answered {answered}{wait})", self.secrets())
        self.trouble("unavailable", endpoint, DOWN_EPISODE, started, text)
        raise MasterUnavailable(f"{endpoint}: master answered {status}", retry_after)

    def trouble(self, kind: str, endpoint: str, key: tuple[Any, ...], sent: float, text: str) -> None:
        self.connectivity.failed(Trouble(kind, endpoint, text, key), sent)

    def observe(self, endpoint: str, outcome: str, started: float | httpx.Response) -> None:
        """Tell the observer about one attempt; ``started`` is its trio start time, or a response of
        :meth:`_send` (which carries it)."""
        if self._observer is not None:
            if isinstance(started, httpx.Response):
                started = sent_at(started)
            self._observer(endpoint, outcome, trio.current_time() - started)


def sent_at(response: httpx.Response) -> float:
    """The trio time the request of ``response`` was sent (now, if not recorded)."""
    return float(response.extensions.get("ckagent_started", trio.current_time()))


def _origin(url: httpx.URL) -> str:
    port = f":{url.port}" if url.port is not None else ""
    return f"{url.scheme}://{url.host}{port}"
