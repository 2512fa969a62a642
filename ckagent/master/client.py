"""The agent's one long-lived connection to the master: auth, error classification, retries.

Every call goes through :meth:`MasterClient.call` (or :meth:`MasterClient.download`) with a row of
the endpoint table (:mod:`ckagent.master.endpoints`, whose typed methods — ``heartbeat``, ``poll``,
``claim``, … — this class has), which classifies what came back once, into the one exception tree of
:mod:`ckagent.master.errors` (translated with ``raise … from exc``): transport error, timeout, 429,
5xx → MasterUnavailable; a body that is not the protocol's answer for that call (the endpoint's
reader refuses it) → MasterProtocolError; 409 → MasterConflict; another 4xx → MasterRejected; a
registration's answers are classified by :mod:`ckagent.master.registration` (409: NameHeld, retried;
another 4xx: RegistrationRefused).

Nothing else leaves this module for an answer of the network: ``httpx`` errors, ``JSONDecodeError``
and ProtocolError are all translated. Retrying is the caller's choice: ``retry=Retry(...)``
retries MasterUnavailable (so also MasterProtocolError) with stamina's exponential backoff and
jitter (forever unless its ``attempts``/``timeout`` say otherwise); registration 401 (a wrong
``AGENT_REGISTRATION_TOKEN``, or one the master does not know yet) is retried the same way.

**One log line per episode.** :class:`ckagent.master.connectivity.Connectivity` keeps the trouble of each endpoint; the first
failure of a kind logs one WARNING line saying what was answered (status, content type, the first
bytes: "master answers 200 text/html to heartbeat: not the node protocol (…)"), the end of it one
INFO line ("… again after N failed attempts, T s"); retries in between log nothing. The current
trouble is :attr:`Connectivity.problem`, which /readyz shows. Secrets never appear in a message:
errors quote the endpoint name, status and body head with the token and key masked, never headers.

**URLs.** Ids go into a path as one percent-encoded segment each (:meth:`Endpoint.path
<ckagent.master.endpoints.Endpoint.path>`; the node id of ``{node}`` here); a URL httpx cannot build is MasterRejected for that request. A path (or a URL relative to ``server.url``, e.g. ``/api/packages/…`` or
``api/packages/…``) is resolved against ``server.url``, so a master behind a proxy or an ingress
with a path prefix works. The API key goes to the master's origin only; a URL on another origin
(object storage, a CDN) gets no key, and its 401/403 is reported as that origin's refusal, not as
the master's (no re-registration).

**Leaving.** :meth:`MasterClient.leave` is the one call with rules of its own: sent once, never
retried, never answered by registering again (a 401 means the key no longer holds the name), and after
it nothing registers again (:class:`RegistrationRefused`): the name it released is not taken back.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import suppress
from typing import Any, Literal, TypeVar

import httpx
import stamina
import trio

from ckagent.master.answers import Answers
from ckagent.master.checkpointcalls import CheckpointCalls
from ckagent.master.connectivity import Answered, Connectivity, Trouble
from ckagent.master.endpoints import (
    LEAVING,
    REGISTER,
    Endpoint,
    Retry,
    Sink,
    any_json,
    json_object,
)
from ckagent.master.errors import (
    RETRY_AFTER_MAX,
    MasterConflict,
    MasterError,
    MasterProtocolError,
    MasterRejected,
    MasterUnavailable,
    NameHeld,
    RegistrationRefused,
    RequestObserver,
    error_text,
    json_or_none,
    parse_retry_after,
    redact,
    retry_wait,
)
from ckagent.master.masterclock import MasterClock
from ckagent.master.protocol import NodeLeaving, RegisterRequest, RegisterResponse
from ckagent.master.registration import REGISTER_WAIT_MAX, registration_answer
from ckagent.master.wire import SENT_ONCE_BYTES, URL_CACHE_SIZE, Wire

__all__ = [
    "RETRY_AFTER_MAX", "SENT_ONCE_BYTES", "Answered", "Connectivity", "MasterClient", "MasterConflict", "MasterError",
    "MasterProtocolError", "MasterRejected", "MasterUnavailable", "NameHeld", "RegistrationRefused", "RequestObserver", "Retry",
    "Trouble", "json_object", "parse_retry_after", "retry_wait",
]

A = TypeVar("A")
LeaveOutcome = Literal["released", "unsupported", "refused", "unreachable", "not registered"]
"""What :meth:`MasterClient.leave` achieved (see there)."""

log = logging.getLogger(__name__)

REQUEST_DEADLINE_SLACK = 1.0
"""Seconds beyond a request's timeout its whole exchange may take (httpx's timeout bounds each read)."""


async def _run_out(response: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
    """End a body iterator that stopped early (the sink refused a chunk, a decoding error) here, on
    the loop, instead of leaving it to the garbage collector.

    ``aiter_bytes`` is the top of a chain of async generators (httpx's and httpcore's, down to the
    socket); closing the top one leaves the others suspended, and Trio warns for each one the
    collector finds (ResourceWarning). So the response is closed (its connection with it) and the
    iterator run out: its next read fails at once on the closed connection and that error ends every
    generator of the chain. Any error of the abandoned body is dropped; the caller shields and
    bounds the call (a cancellation would end the chain too). Returns at once for a body read to
    its end."""
    if getattr(chunks, "ag_frame", None) is None:  # finished (or not a generator)
        return
    with suppress(Exception):  # the abandoned body's end, whatever it is
        await response.aclose()
        async for _ in chunks:
            pass
    if isinstance(chunks, AsyncGenerator):
        await chunks.aclose()


class MasterClient(CheckpointCalls):
    """Talks to the master over one ``httpx.AsyncClient`` (pool larger than our concurrent users): calls
    are sent on its transport by :class:`ckagent.master.wire.Wire`, downloads through the client.

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
        max_backoff_interval: float = 30.0,
        ca_file: str | None = None,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        observer: RequestObserver | None = None,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._paths: dict[tuple[str, ...], str] = {}  # see _target()
        self.clock: MasterClock | None = None
        """Watches the answers' Date headers (ckagent.master.masterclock), when the agent sets one."""
        self._token = registration_token
        self._register_body = register_body
        self._timeout = request_timeout
        self.max_backoff_interval = max_backoff_interval
        """Seconds, the longest pause between two attempts of a request (server.max_backoff_interval)."""
        self._verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._transport = transport
        self._observer = observer
        self.node_id: str | None = None
        self._api_key: str | None = api_key
        self._key_generation = 0
        self.features: frozenset[str] = frozenset()
        """What the master said it supports at the last registration (e.g. ``claim-in-poll``)."""
        self._register_lock = trio.Lock()
        self._left = False  # leave() was called: no registration any more
        self.connectivity = Connectivity()
        self._answers = Answers(self._base_url, self.connectivity, observer, self._secrets)
        self._client = self._new_client()
        self._wire = Wire(self._base_url, self._client)

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

        Transport errors, 401 (token not accepted, or not yet), 409 (another live agent holds the name:
        NameHeld), 429, 5xx and an answer that is not the protocol's (MasterProtocolError) are retried
        forever with backoff (at most REGISTER_WAIT_MAX seconds apart), each kind logged once (see
        :class:`Connectivity` and :mod:`ckagent.master.registration`); any other 4xx raises
        RegistrationRefused with the master's reason. Cancellation stops the retries.
        """
        generation = self._key_generation
        if self._left:
            raise RegistrationRefused("this agent told the master it is leaving: it does not register again")
        async with self._register_lock:
            if self._key_generation != generation and self.registered:
                return RegisterResponse(node_id=self.node_id or "", api_key=self._api_key or "")
            async for attempt in stamina.retry_context(
                on=retry_wait, attempts=None, timeout=None, wait_initial=0.5,
                wait_max=min(self.max_backoff_interval, REGISTER_WAIT_MAX),
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
        request = self._register_body()
        response = await self._send(REGISTER.name, REGISTER.method, REGISTER.template, json=request.to_json(),
                                    headers={"X-Registration-Token": self._token})
        return registration_answer(self._answers, response, request.name, request.name_exclusive)

    async def leave(self, leaving: NodeLeaving) -> LeaveOutcome:
        """``POST /api/nodes/{node}/leaving`` once: this agent stops on purpose and leaves no task running,
        so the master may give its name to a replacement at once (docs/protocol.md, "Leaving").

        Call it last, after every other call of the run (the final heartbeat included): the master
        revokes the key, and from now on this client never registers again (RegistrationRefused), so
        nothing takes the released name back. Returns what came of it, each logged in one line:
        ``released`` (2xx in the protocol's words); ``unsupported`` (404/405: a master without the call —
        the name stays guarded until the master sees the heartbeats stopped); ``refused`` (another 4xx:
        401 — the key no longer holds the name, it registered again since; 409 — another nodeUid holds
        it); ``unreachable`` (transport error, timeout, 429/5xx, an answer not in the protocol's words);
        ``not registered`` (nothing sent). Never raises a MasterError and never retries: the caller
        bounds the call (``trio.move_on_after``); cancellation abandons it.
        """
        if not self.registered:
            self._left = True
            return "not registered"
        self._left = True
        endpoint = LEAVING.name
        try:
            response = await self._send(endpoint, LEAVING.method, self._target(LEAVING, None),
                                        json=leaving.to_json(), auth=True)
            status = response.status_code
            if status in (404, 405):
                self._answers.observe(endpoint, str(status), response)
                log.info("the master has no leaving call (%d: an older master): this node's name stays guarded "
                         "until the master sees its heartbeats stopped", status)
                return "unsupported"
            if 400 <= status < 500:
                self._answers.observe(endpoint, str(status), response)
                reason = redact(error_text(response), self._secrets())
                log.warning("the master refused leaving with %d (%s): the name is not released by this agent",
                            status, reason)
                return "refused"
            self._answers.answer(endpoint, response, LEAVING.answer or json_object)
        except MasterUnavailable as exc:  # (MasterProtocolError too)
            log.warning("could not tell the master this node is leaving (%s): its name stays guarded until "
                        "the master sees its heartbeats stopped", exc)
            return "unreachable"
        except MasterRejected as exc:  # a URL that cannot be built: nothing was sent
            log.warning("could not tell the master this node is leaving (%s)", exc)
            return "unreachable"
        log.info("told the master this node is leaving: its name is free for a replacement")
        self._api_key = None
        return "released"

    # ------------------------------------------------------------------ calls

    async def call(
        self,
        endpoint: Endpoint[A],
        ids: Mapping[str, str] | None = None,
        *,
        retry: Retry | None = None,
        answer: Callable[[Any], A] | None = None,
        json: Any = None,
        content: bytes | None = None,
        params: Mapping[str, str | int | float] | None = None,
        read_timeout: float | None = None,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> A:
        """One authenticated request of ``endpoint`` (a row of ckagent.master.endpoints) with ``ids`` put
        in its path (``{node}`` is this node's id); returns its answer as the endpoint's reader made it.

        The reader (``answer`` overrides the endpoint's) gets the decoded 2xx JSON (None for an empty
        body) and returns what ``call`` returns, or raises ProtocolError/ValueError: then, as for a body
        that is not JSON, MasterProtocolError.

        The body is ``json`` (encoded here) or ``content``: JSON already encoded (UTF-8 bytes), sent
        as it is with ``Content-Type: application/json`` (a stream batch is encoded once, by its reader),
        or with ``content_type`` (an artifact's bytes); ``headers`` are added to the request.

        A 401 re-registers once and retries. Raises MasterUnavailable (MasterProtocolError),
        MasterConflict, MasterRejected (see module docstring); ``retry`` retries MasterUnavailable
        with backoff and jitter within its bounds. ``read_timeout`` overrides the request timeout
        (seconds; the long poll needs more). Cancellation abandons the request and the retries.
        """
        reader = answer or endpoint.answer
        if reader is None:
            raise TypeError(f"{endpoint.name} is a download: use MasterClient.download")
        began = time.monotonic()  # stamina's clock
        try:  # the first attempt: stamina's machinery (a retrying object per call) only once it failed
            return await self._call(endpoint, ids, reader, json, content, params, read_timeout, content_type, headers)
        except MasterUnavailable as exc:
            if retry is None:
                raise
            failed: MasterUnavailable | None = exc
        # The first failure is handed to stamina as its first attempt (counted, backed off as before);
        # the time it took counts against the timeout.
        timeout = None if retry.timeout is None else max(0.0, retry.timeout - (time.monotonic() - began))
        async for attempt in stamina.retry_context(
            on=retry_wait, attempts=retry.attempts, timeout=timeout, wait_initial=0.5, wait_max=self.max_backoff_interval
        ):
            with attempt:
                if failed is not None:
                    first, failed = failed, None
                    raise first
                return await self._call(endpoint, ids, reader, json, content, params, read_timeout, content_type,
                                        headers)
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    async def _call(
        self, row: Endpoint[A], ids: Mapping[str, str] | None, reader: Callable[[Any], A], json: Any,
        content: bytes | None, params: Mapping[str, str | int | float] | None, read_timeout: float | None,
        content_type: str, headers: Mapping[str, str] | None,
    ) -> A:
        if not self.registered:
            await self.register()
        endpoint, method = row.name, row.method
        target = self._target(row, ids)
        for second_try in (False, True):
            generation = self._key_generation
            response = await self._send(
                endpoint, method, target, json=json, content=content, params=params, headers=headers,
                read_timeout=read_timeout, content_type=content_type, auth=True,
            )
            if response.status_code == 401 and not second_try and self._answers.same_origin(target):
                self._answers.observe(endpoint, "401", response)
                log.debug("%s: master answered 401; registering again", endpoint)
                if generation == self._key_generation:
                    self._api_key = None
                await self.register()
                continue
            break
        status = response.status_code
        if 400 <= status < 500:
            self._answers.rejected(endpoint, target, response, json_or_none(response), response.content)
        return self._answers.answer(endpoint, response, reader)

    async def download(self, row: Endpoint[None], url: str, sink: Sink, *, read_timeout: float | None = None) -> int:
        """GET ``url`` (a path, a URL relative to ``server.url`` or an absolute URL) of the download
        endpoint ``row`` and hand the body to ``sink`` chunk by chunk as it arrives.

        Nothing is buffered here: ``sink`` writes and enforces its caps (it may raise to abort; its
        exception propagates unchanged). Returns the bytes received. Auth, the 401 re-registration and
        the error classes are those of :meth:`call` (the key goes to the master's origin only;
        redirects are followed, httpx drops the key on a cross-origin hop; a 401/403 from another
        origin is that origin's refusal: MasterRejected saying so, no re-registration); a transport
        error mid-body is MasterUnavailable, so a retrying caller must restart its sink. The body is
        not checked here (the caller checks size and sha256). Cancellation abandons it.
        """
        endpoint = row.name
        if not self.registered:
            await self.register()
        for second_try in (False, True):
            generation = self._key_generation
            same_origin = self._answers.same_origin(url)
            headers = {"Authorization": f"Bearer {self._api_key}"} if same_origin else {}
            started = trio.current_time()
            try:
                async with self._client.stream(
                    "GET", url, headers=headers, timeout=read_timeout or self._timeout, follow_redirects=True
                ) as response:
                    status = response.status_code
                    final_same_origin = same_origin and self._answers.same_origin(str(response.url))
                    if status == 401 and not second_try and final_same_origin:
                        self._answers.observe(endpoint, "401", started)
                        log.debug("%s: master answered 401; registering again", endpoint)
                        if generation == self._key_generation:
                            self._api_key = None
                        await self.register()
                        continue
                    if status == 429 or status >= 500:
                        await response.aread()
                        self._answers.unavailable(endpoint, response, started)
                    if not 200 <= status < 300:
                        await response.aread()
                        response.extensions["ckagent_started"] = started
                        if 400 <= status < 500:
                            target = url if final_same_origin or not same_origin else str(response.url)
                            self._answers.rejected(endpoint, target, response, json_or_none(response), response.content)
                        self._answers.answer(endpoint, response, any_json)  # 1xx/3xx: raises MasterProtocolError
                    received = 0
                    chunks = response.aiter_bytes()
                    try:
                        async for chunk in chunks:
                            received += len(chunk)
                            await sink(chunk)
                    finally:
                        # on the closed connection it ends at once; a cancellation would end it too
                        with trio.CancelScope(shield=True), trio.move_on_after(1):
                            await _run_out(response, chunks)
            except httpx.TransportError as exc:
                self._answers.observe(endpoint, "error", started)
                self._answers.unreachable(endpoint, exc, started)
            except (httpx.DecodingError, httpx.TooManyRedirects) as exc:
                self._answers.undecodable(endpoint, exc, started)
            except (httpx.InvalidURL, UnicodeEncodeError) as exc:
                raise MasterRejected(endpoint, 0, None, message=f"{endpoint}: not a valid URL: {exc}") from exc
            self._answers.observe(endpoint, "ok", started)
            self.connectivity.succeeded(endpoint, started)
            return received
        raise MasterRejected(endpoint, 401, None)

    async def _send(
        self, endpoint: str, method: str, path: str, *, read_timeout: float | None = None, auth: bool = False,
        json: Any = None, content: bytes | None = None, content_type: str = "application/json",
        params: Mapping[str, str | int | float] | None = None, headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """Send one request (ckagent.master.wire), with the API key when ``auth`` and ``path`` is on the
        master's origin (a URL on another host, object storage or a CDN, never gets it); raises
        MasterUnavailable for a transport error, a timeout, 429 or 5xx (observed and recorded here).
        Any other answer is returned for the caller to classify."""
        started = trio.current_time()
        timeout = read_timeout or self._timeout
        try:
            key = self._wire.bearer(self._api_key or "") if auth and self._answers.same_origin(path) else None
            # httpx bounds each read and write; this bounds the whole exchange (an answer that trickles
            # in a byte at a time would otherwise hold its caller for ever).
            with trio.move_on_after(timeout + REQUEST_DEADLINE_SLACK) as deadline:
                response = await self._wire.send(method, path, io_timeout=timeout, auth=key, json=json, content=content,
                                                 content_type=content_type, params=params, headers=headers)
            if deadline.cancelled_caught:
                self._answers.observe(endpoint, "error", started)
                self._answers.unreachable(endpoint, None, started, f"no complete answer within {timeout:g} s")
        except httpx.PoolTimeout as exc:
            # httpcore #1093: after cancellations the pool can stay jammed; start a fresh one.
            self._answers.observe(endpoint, "error", started)
            old = self._client
            self._client = self._wire.client = self._new_client()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await old.aclose()
            self._answers.unreachable(endpoint, exc, started, "connection pool timeout")
        except httpx.TransportError as exc:
            self._answers.observe(endpoint, "error", started)
            self._answers.unreachable(endpoint, exc, started)
        except (httpx.DecodingError, httpx.TooManyRedirects) as exc:
            self._answers.undecodable(endpoint, exc, started)
        except (httpx.InvalidURL, UnicodeEncodeError) as exc:
            # A URL the master's data made (an id is one encoded path segment, so this is a bug or a
            # bad codePackage URL): that request fails, never the agent.
            raise MasterRejected(endpoint, 0, None, message=f"{endpoint}: not a valid URL ({exc})") from exc
        if self.clock is not None:
            self.clock.observe(response.headers.get("date"))
        status = response.status_code
        if status == 429 or status >= 500:
            self._answers.unavailable(endpoint, response, started)
        response.extensions["ckagent_started"] = started
        return response

    def _target(self, row: Endpoint[Any], ids: Mapping[str, str] | None) -> str:
        """The path of ``row`` with ``ids`` (and this node's id for ``{node}``) put in, built once per
        row and ids (a task's few calls are repeated). Raises MasterRejected for ids that do not fit."""
        given = dict(ids or {})
        if "node" in row.params:
            given["node"] = self.node_id or ""
        key = (row.name, *given.keys(), *given.values())
        path = self._paths.get(key)
        if path is None:
            try:
                path = row.path(**given)
            except KeyError as exc:
                raise MasterRejected(row.name, 0, None, message=f"{row.name}: cannot build its path ({exc})") from None
            if len(self._paths) >= URL_CACHE_SIZE:
                self._paths.clear()
            self._paths[key] = path
        return path

    def _secrets(self) -> tuple[str, ...]:
        return (self._token, self._api_key or "")
