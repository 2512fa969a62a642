"""The agent's one long-lived connection to the master: auth, error classification, retries.

Every call goes through :meth:`MasterClient.call` (or :meth:`MasterClient.download`), which
classifies what came back once, into one exception tree (translated with ``raise … from exc``)::

    MasterError
    ├── MasterUnavailable        transport error, timeout, 429 or 5xx — retry with backoff + jitter
    │   └── MasterProtocolError  a 2xx (or 1xx/3xx) whose body is not what the protocol says for
    │                            that call: not JSON, truncated, or the wrong shape (checked with
    │                            the types of ckagent.master.protocol); or a 4xx from the master's origin
    │                            without the protocol's ``{"error": …}`` body — a captive portal, a
    │                            misrouted proxy or ingress; retried like an unavailable master
    ├── MasterRejected           any other 4xx (in the protocol's words): that request fails
    │   │                        (logged); a 401 was first answered by registering again, once.
    │   │                        What it means is the caller's: a task stream's batch is kept and
    │   │                        retried (ckagent.delivery.shipper), a heartbeat is just missed
    │   └── MasterConflict       409 — a protocol conflict its caller handles (a claim lost, a
    │                            result that disagrees, a sequence gap: ``.body['expectedSeq']``)
    └── RegistrationRefused      the master refused registration for good (4xx other than 401/429)

Nothing else leaves this module for an answer of the network: ``httpx`` errors, ``JSONDecodeError``
and ProtocolError are all translated. Retrying is the caller's choice: :meth:`MasterClient.call_retrying`
retries MasterUnavailable (so also MasterProtocolError) with stamina's exponential backoff and
jitter (forever unless ``attempts``/``retry_timeout`` say otherwise); registration 401 (a wrong
``AGENT_REGISTRATION_TOKEN``, or one the master does not know yet) is retried the same way.

**One log line per episode.** :class:`ckagent.master.connectivity.Connectivity` keeps the trouble of each endpoint; the first
failure of a kind logs one WARNING line saying what was answered (status, content type, the first
bytes: "master answers 200 text/html to heartbeat: not the node protocol (…)"), the end of it one
INFO line ("… again after N failed attempts, T s"); retries in between log nothing. The current
trouble is :attr:`Connectivity.problem`, which /readyz shows. Secrets never appear in a message:
errors quote the endpoint name, status and body head with the token and key masked, never headers.

**URLs.** Ids go into a path as one percent-encoded segment each (:func:`ckagent.master.ids.api_path`; the
node id of ``{node}`` here); a URL httpx cannot build is MasterRejected for that request. A path (or a URL relative to ``server.url``, e.g. ``/api/packages/…`` or
``api/packages/…``) is resolved against ``server.url``, so a master behind a proxy or an ingress
with a path prefix works. The API key goes to the master's origin only; a URL on another origin
(object storage, a CDN) gets no key, and its 401/403 is reported as that origin's refusal, not as
the master's (no re-registration).
"""

from __future__ import annotations

import email.utils
import json as jsonlib
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import httpx
import stamina
import trio

from ckagent.master.connectivity import DOWN_EPISODE, TASK_DATA_ENDPOINTS, Answered, Connectivity, Trouble
from ckagent.master.ids import url_segment
from ckagent.master.masterclock import MasterClock
from ckagent.master.protocol import ProtocolError, RegisterRequest, RegisterResponse
from ckagent.master.protocol._fields import req_object

log = logging.getLogger(__name__)

URL_CACHE_SIZE = 256
"""Request URLs kept parsed (see MasterClient._url); the cache starts over when full."""
REQUEST_DEADLINE_SLACK = 1.0
"""Seconds beyond a request's timeout its whole exchange may take (httpx's timeout bounds each read)."""
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
        super().__init__(_redact(text, secrets))


class MasterConflict(MasterRejected):
    """409: a claim lost, a final result that disagrees, or a sequence gap (``body['expectedSeq']``)."""


class RegistrationRefused(MasterError):
    """Registration failed for good (bad request, forbidden, ...); the agent cannot start."""


RequestObserver = Callable[[str, str, float], None]
"""``observer(endpoint, outcome, seconds)``: metrics hook called once per HTTP attempt; ``outcome`` is
``ok``, ``error`` (transport error or timeout), ``protocol_error`` (a 2xx that is not the protocol)
or the HTTP status."""


class MasterClient:
    """Talks to the master over one ``httpx.AsyncClient`` (pool larger than our concurrent users).

    ``register_body`` builds the registration payload (called at every (re-)registration, so it
    carries fresh figures). ``transport`` is for tests (``httpx.MockTransport``).
    """

    def __init__(
        self,
        base_url: str,
        registration_token: str,
        register_body: Callable[[], RegisterRequest],
        *,
        request_timeout: float = 30.0,
        ca_file: str | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        observer: RequestObserver | None = None,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._urls: dict[str, httpx.URL] = {}  # see _url()
        self.clock: MasterClock | None = None
        """Watches the answers' Date headers (ckagent.master.masterclock), when the agent sets one."""
        self._token = registration_token
        self._register_body = register_body
        self._timeout = request_timeout
        self._verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._transport = transport
        self._observer = observer
        self.node_id: str | None = None
        self._api_key: str | None = api_key
        self._key_generation = 0
        self.features: frozenset[str] = frozenset()
        """What the master said it supports at the last registration (e.g. ``claim-in-poll``)."""
        self._register_lock = trio.Lock()
        self.connectivity = Connectivity()
        self._client = self._new_client()

    def _new_client(self) -> httpx.AsyncClient:
        # The pool is larger than the number of concurrent users (poller, heartbeat, one shipper
        # per stream): httpcore can jam after cancellations when more requests wait than fit.
        return httpx.AsyncClient(
            base_url=self._base_url,
            timeout=self._timeout,
            verify=self._verify,
            transport=self._transport,
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20),
            headers={"User-Agent": "ckagent"},
        )

    @property
    def registered(self) -> bool:
        """True once the master has given us a node id and key."""
        return self.node_id is not None and self._api_key is not None

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    # ------------------------------------------------------------------ registration

    async def register(self) -> RegisterResponse:
        """Register until the master answers; returns the node id and key (also kept here).

        Transport errors, 401 (token not accepted, or not yet), 429, 5xx and an answer that is not
        the protocol's (MasterProtocolError) are retried forever with backoff, each kind logged once
        (see :class:`Connectivity`); any other 4xx raises RegistrationRefused with the master's reason. Cancellation
        stops the retries.
        """
        generation = self._key_generation
        async with self._register_lock:
            if self._key_generation != generation and self.registered:
                return RegisterResponse(node_id=self.node_id or "", api_key=self._api_key or "")
            async for attempt in stamina.retry_context(
                on=retry_wait, attempts=None, timeout=None, wait_initial=0.5, wait_max=30.0
            ):
                with attempt:
                    answer = await self._register_once()
            again = self.node_id == answer.node_id
            self.node_id, self._api_key = answer.node_id, answer.api_key
            self.features = frozenset(answer.features)
            self._key_generation += 1
            # A re-registration after a 401 keeps the node id: not worth a line each time a proxy says 401.
            log.log(logging.DEBUG if again else logging.INFO, "registered with %s as node %s",
                    self._base_url, answer.node_id)
            return answer

    async def _register_once(self) -> RegisterResponse:
        body = self._register_body().to_json()
        response = await self._send("register", "POST", "/api/nodes/register", json=body,
                                    headers={"X-Registration-Token": self._token})
        status = response.status_code
        if status == 401:
            self._observe("register", "401", response)
            self._trouble("unauthorized", "register", ("unauthorized",), _sent(response),
                          "registration refused: 401, check AGENT_REGISTRATION_TOKEN (the master does not "
                          "accept this node's registration token)")
            raise MasterUnavailable("register: registration token not accepted (401)")
        if 400 <= status < 500 and status != 429:
            if not _in_protocol_words(_json_or_none(response)):
                self._not_protocol("register", response, 'an error without the protocol\'s {"error": …} body')
            self._observe("register", str(status), response)
            reason = _redact(_error_text(response), self._secrets())
            self.connectivity.succeeded("register", _sent(response))
            raise RegistrationRefused(
                f"the master refused registration with {status}: {reason}; "
                "check server.url and the agent section of the config"
            )
        return self._answer("register", response, RegisterResponse.from_json)

    # ------------------------------------------------------------------ calls

    async def call(
        self,
        endpoint: str,
        method: str,
        path: str,
        *,
        answer: Callable[[Any], Any] | None = None,
        json: Any = None,
        content: bytes | None = None,
        params: dict[str, Any] | None = None,
        read_timeout: float | None = None,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One authenticated request; returns the decoded answer.

        ``answer`` is the protocol's reader for this call's 2xx body (``HeartbeatResponse.from_json``,
        ``SeqAccepted.from_json``, …): it gets the decoded JSON (None for an empty body) and returns
        what ``call`` returns, or raises ProtocolError/ValueError. Without it the body must be empty or
        JSON, and the decoded JSON (or None) is returned. A body that fails either way raises
        MasterProtocolError.

        The body is ``json`` (encoded here) or ``content``: JSON already encoded (UTF-8 bytes), sent
        as it is with ``Content-Type: application/json`` (a stream batch is encoded once, by its reader),
        or with ``content_type`` (an artifact's bytes); ``headers`` are added to the request.

        ``path`` may contain ``{node}``, replaced by the node id. A 401 re-registers once and
        retries. Raises MasterUnavailable (MasterProtocolError), MasterConflict, MasterRejected (see
        module docstring). ``read_timeout`` overrides the request timeout (seconds; the long poll
        needs more). Cancellation abandons the request.
        """
        if not self.registered:
            await self.register()
        target = path.replace("{node}", url_segment(self.node_id or ""))
        for second_try in (False, True):
            generation = self._key_generation
            # The API key goes to the master only: a code package on another host (object storage,
            # a CDN) gets no Authorization header.
            sent = dict(headers or {})
            if self._same_origin(target):
                sent["Authorization"] = f"Bearer {self._api_key}"
            if content is not None:
                sent["Content-Type"] = content_type
            response = await self._send(
                endpoint, method, target, json=json, content=content, params=params, headers=sent,
                read_timeout=read_timeout,
            )
            if response.status_code == 401 and not second_try and self._same_origin(target):
                self._observe(endpoint, "401", response)
                log.debug("%s: master answered 401; registering again", endpoint)
                if generation == self._key_generation:
                    self._api_key = None
                await self.register()
                continue
            break
        status = response.status_code
        if 400 <= status < 500:
            self._rejected(endpoint, target, response, _json_or_none(response), response.content)
        return self._answer(endpoint, response, answer)

    def _answer(self, endpoint: str, response: httpx.Response, reader: Callable[[Any], Any] | None) -> Any:
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
                    value = reader(decoded) if reader is not None else decoded
                except (ProtocolError, ValueError, TypeError, KeyError) as exc:
                    problem = f"wrong shape: {exc}"
                else:
                    self._observe(endpoint, "ok", response)
                    self.connectivity.succeeded(endpoint, _sent(response))
                    return value
        self._not_protocol(endpoint, response, problem)

    def _not_protocol(self, endpoint: str, response: httpx.Response, problem: str) -> NoReturn:
        """Record and raise MasterProtocolError: the answer is not in the protocol's words (``problem``)."""
        # A registration answer may hold a new key: its bytes are never quoted.
        shown = b"" if endpoint == "register" and 200 <= response.status_code < 300 else response.content
        answered = Answered.of(response, shown, self._secrets())
        self._observe(endpoint, "protocol_error", response)
        text = (f"master answers {answered.status} {answered.content_type} to {endpoint}: not the node "
                f"protocol ({problem}; {answered})")
        text = _redact(text, self._secrets())
        self._trouble("protocol", endpoint, ("protocol", answered.status, answered.content_type), _sent(response),
                      text)
        raise MasterProtocolError(text, answered)

    def _rejected(self, endpoint: str, target: str, response: httpx.Response, body: Any, head: bytes) -> NoReturn:
        """Raise the MasterRejected (MasterConflict) for a 4xx other than 429; recorded here."""
        status = response.status_code
        secrets = self._secrets()
        if self._same_origin(target) and not _in_protocol_words(body):
            self._not_protocol(endpoint, response, 'an error without the protocol\'s {"error": …} body')
        self._observe(endpoint, str(status), response)
        if status == 409:
            self.connectivity.succeeded(endpoint, _sent(response))  # the master answered in the protocol's words
            raise MasterConflict(endpoint, status, body, secrets=secrets)
        if not self._same_origin(target):
            origin = _origin(httpx.URL(target))
            text = (f"{endpoint}: {origin} answered {status} ({Answered.of(response, head, secrets)}); it is not "
                    f"the master's origin ({_origin(httpx.URL(self._base_url))}), so no API key was sent: "
                    "the URL must be public (or pre-signed), or on the master (a relative URL)")
            self._trouble("rejected", endpoint, ("rejected", status, origin), _sent(response),
                          _redact(text, secrets))
            raise MasterRejected(endpoint, status, body, secrets=secrets, message=text)
        error = MasterRejected(endpoint, status, body, secrets=secrets)
        detail = _redact(_error_text(response), secrets)
        again = " even after registering again" if status == 401 else ""
        fate = ("the data stays on the node and is sent again with backoff" if endpoint in TASK_DATA_ENDPOINTS
                else "that request fails")
        self._trouble("rejected", endpoint, ("rejected", status), _sent(response),
                      f"master refuses {endpoint} with {status}{again} ({detail}); {fate}")
        raise error

    def _same_origin(self, target: str) -> bool:
        """True for a relative path or an absolute URL on the master's scheme, host and port."""
        if "://" not in target:
            return True
        base, url = httpx.URL(self._base_url), httpx.URL(target)
        return (base.scheme, base.host, base.port) == (url.scheme, url.host, url.port)

    async def call_retrying(
        self,
        endpoint: str,
        method: str,
        path: str,
        *,
        attempts: int | None = None,
        retry_timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """:meth:`call`, retrying MasterUnavailable with exponential backoff (0.5 s → 30 s) and jitter.

        Forever by default; ``attempts``/``retry_timeout`` bound it (then MasterUnavailable is
        raised). Cancellation stops the retries.
        """
        async for attempt in stamina.retry_context(
            on=retry_wait, attempts=attempts, timeout=retry_timeout, wait_initial=0.5, wait_max=30.0
        ):
            with attempt:
                return await self.call(endpoint, method, path, **kwargs)
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    async def download(
        self,
        endpoint: str,
        url: str,
        sink: Callable[[bytes], Awaitable[None]],
        *,
        read_timeout: float | None = None,
    ) -> int:
        """GET ``url`` (a path, a URL relative to ``server.url`` or an absolute URL) and hand the body to
        ``sink`` chunk by chunk as it arrives.

        Nothing is buffered here: ``sink`` writes and enforces its caps (it may raise to abort; its
        exception propagates unchanged). Returns the bytes received. Auth, the 401 re-registration and
        the error classes are those of :meth:`call` (the key goes to the master's origin only;
        redirects are followed, httpx drops the key on a cross-origin hop; a 401/403 from another
        origin is that origin's refusal: MasterRejected saying so, no re-registration); a transport
        error mid-body is MasterUnavailable, so a retrying caller must restart its sink. The body is
        not checked here (the caller checks size and sha256). Cancellation abandons it.
        """
        if not self.registered:
            await self.register()
        for second_try in (False, True):
            generation = self._key_generation
            same_origin = self._same_origin(url)
            headers = {"Authorization": f"Bearer {self._api_key}"} if same_origin else {}
            started = trio.current_time()
            try:
                async with self._client.stream(
                    "GET", url, headers=headers, timeout=read_timeout or self._timeout, follow_redirects=True
                ) as response:
                    status = response.status_code
                    final_same_origin = same_origin and self._same_origin(str(response.url))
                    if status == 401 and not second_try and final_same_origin:
                        self._observe(endpoint, "401", started)
                        log.debug("%s: master answered 401; registering again", endpoint)
                        if generation == self._key_generation:
                            self._api_key = None
                        await self.register()
                        continue
                    if status == 429 or status >= 500:
                        await response.aread()
                        self._unavailable(endpoint, response, started)
                    if not 200 <= status < 300:
                        await response.aread()
                        response.extensions["ckagent_started"] = started
                        if 400 <= status < 500:
                            target = url if final_same_origin or not same_origin else str(response.url)
                            self._rejected(endpoint, target, response, _json_or_none(response), response.content)
                        self._answer(endpoint, response, None)  # 1xx/3xx: raises MasterProtocolError
                    received = 0
                    async for chunk in response.aiter_bytes():
                        received += len(chunk)
                        await sink(chunk)
            except httpx.TransportError as exc:
                self._observe(endpoint, "error", started)
                self._unreachable(endpoint, exc, started)
            except (httpx.DecodingError, httpx.TooManyRedirects) as exc:
                self._undecodable(endpoint, exc, started)
            except (httpx.InvalidURL, UnicodeEncodeError) as exc:
                raise MasterRejected(endpoint, 0, None, message=f"{endpoint}: not a valid URL: {exc}") from exc
            self._observe(endpoint, "ok", started)
            self.connectivity.succeeded(endpoint, started)
            return received
        raise MasterRejected(endpoint, 401, None)

    async def _send(
        self, endpoint: str, method: str, path: str, *, read_timeout: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        """Send one request; raises MasterUnavailable for a transport error, a timeout, 429 or 5xx
        (observed and recorded here). Any other answer is returned for the caller to classify."""
        started = trio.current_time()
        timeout = read_timeout or self._timeout
        try:
            # httpx bounds each read and write; this bounds the whole exchange (an answer that trickles
            # in a byte at a time would otherwise hold its caller for ever).
            with trio.move_on_after(timeout + REQUEST_DEADLINE_SLACK) as deadline:
                response = await self._client.request(method, self._url(path), timeout=timeout, **kwargs)
            if deadline.cancelled_caught:
                self._observe(endpoint, "error", started)
                self._unreachable(endpoint, None, started, f"no complete answer within {timeout:g} s")
        except httpx.PoolTimeout as exc:
            # httpcore #1093: after cancellations the pool can stay jammed; start a fresh one.
            self._observe(endpoint, "error", started)
            old, self._client = self._client, self._new_client()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await old.aclose()
            self._unreachable(endpoint, exc, started, "connection pool timeout")
        except httpx.TransportError as exc:
            self._observe(endpoint, "error", started)
            self._unreachable(endpoint, exc, started)
        except (httpx.DecodingError, httpx.TooManyRedirects) as exc:
            self._undecodable(endpoint, exc, started)
        except (httpx.InvalidURL, UnicodeEncodeError) as exc:
            # A URL the master's data made (an id is one encoded path segment, so this is a bug or a
            # bad codePackage URL): that request fails, never the agent.
            raise MasterRejected(endpoint, 0, None, message=f"{endpoint}: not a valid URL ({exc})") from exc
        if self.clock is not None:
            self.clock.observe(response.headers.get("date"))
        status = response.status_code
        if status == 429 or status >= 500:
            self._unavailable(endpoint, response, started)
        response.extensions["ckagent_started"] = started
        return response

    def _url(self, path: str) -> httpx.URL:
        """``path`` (relative to server.url, or an absolute URL) as the URL the request goes to, parsed
        once: httpx parses a string twice per request (the path, then its merge with the base URL),
        which costs more CPU than the rest of building the request; a task's few paths are reused
        (the long poll, each stream's batches). Raises httpx.InvalidURL as httpx does."""
        url = self._urls.get(path)
        if url is None:
            if len(self._urls) >= URL_CACHE_SIZE:
                self._urls.clear()
            url = httpx.URL(path if "://" in path else f"{self._base_url}/{path.lstrip('/')}")
            self._urls[path] = url
        return url

    def _unreachable(self, endpoint: str, exc: Exception | None, started: float,
                     reason: str | None = None) -> NoReturn:
        """Record and raise MasterUnavailable for a transport error or timeout."""
        if reason is None:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        # No URL in the cause: /readyz shows it, and the status port never tells the master's address.
        text = _redact(f"master unreachable ({endpoint}: {reason})", self._secrets())
        self._trouble("unreachable", endpoint, DOWN_EPISODE, started, text)
        raise MasterUnavailable(f"{endpoint}: {reason}") from exc

    def _undecodable(self, endpoint: str, exc: Exception, started: float) -> NoReturn:
        """Record and raise MasterProtocolError for an answer httpx cannot read (a bad Content-Encoding,
        endless redirects): not the protocol, whoever sent it."""
        self._observe(endpoint, "protocol_error", started)
        text = _redact(f"master answers {endpoint} with something that is not the node protocol "
                       f"({type(exc).__name__}: {exc})", self._secrets())
        self._trouble("protocol", endpoint, ("protocol", type(exc).__name__), started, text)
        raise MasterProtocolError(text, Answered(0, "", b"")) from exc

    def _unavailable(self, endpoint: str, response: httpx.Response, started: float) -> NoReturn:
        """Record and raise MasterUnavailable for a 429 or 5xx answer (its body already read)."""
        status = response.status_code
        self._observe(endpoint, str(status), started)
        answered = Answered.of(response, response.content, self._secrets())
        retry_after = parse_retry_after(response.headers.get("retry-after")) if status in (429, 503) else None
        wait = f"; it asks to wait {retry_after:g} s (Retry-After)" if retry_after else ""
        text = _redact(f"master unavailable ({endpoint}: answered {answered}{wait})", self._secrets())
        self._trouble("unavailable", endpoint, DOWN_EPISODE, started, text)
        raise MasterUnavailable(f"{endpoint}: master answered {status}", retry_after)

    def _trouble(self, kind: str, endpoint: str, key: tuple[Any, ...], sent: float, text: str) -> None:
        self.connectivity.failed(Trouble(kind, endpoint, text, key), sent)

    def _secrets(self) -> tuple[str, ...]:
        return (self._token, self._api_key or "")

    def _observe(self, endpoint: str, outcome: str, started: float | httpx.Response) -> None:
        """Tell the observer about one attempt; ``started`` is its trio start time, or a response of
        :meth:`_send` (which carries it)."""
        if self._observer is not None:
            if isinstance(started, httpx.Response):
                started = _sent(started)
            self._observer(endpoint, outcome, trio.current_time() - started)


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


def json_object(obj: Any) -> dict[str, Any]:
    """The ``answer`` reader of calls whose 2xx body the protocol defines as any JSON object (a claim,
    a final result). Raises ProtocolError for anything else (an empty body included)."""
    return req_object(obj, "")


def _sent(response: httpx.Response) -> float:
    """The trio time the request of ``response`` was sent (now, if not recorded)."""
    return float(response.extensions.get("ckagent_started", trio.current_time()))


def _origin(url: httpx.URL) -> str:
    port = f":{url.port}" if url.port is not None else ""
    return f"{url.scheme}://{url.host}{port}"


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _redact(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every non-empty secret replaced by ``***`` (a master may echo what it was sent)."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def _in_protocol_words(body: Any) -> bool:
    """True for the protocol's error body, a JSON object with a string ``error`` (what a master answers;
    a proxy's or a portal's page is not)."""
    return isinstance(body, dict) and isinstance(body.get("error"), str)


def _error_text(response: httpx.Response) -> str:
    body = _json_or_none(response)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])[:300]
    return response.text[:300] or response.reason_phrase
