"""The agent's one long-lived connection to the master: auth, error classification, retries.

Every call goes through :meth:`MasterClient.call`, which classifies the outcome once:

    MasterError
    ├── MasterUnavailable    transport error, timeout, 429 or 5xx — retry with backoff + jitter
    ├── MasterRejected       any other 4xx (after a 401 was answered by re-registering once)
    │   └── MasterConflict   409 — the master refuses a claim or wants a resend (``.body``)
    └── RegistrationRefused  the master refused registration for good (4xx other than 401/429)

Retrying is the caller's choice: :meth:`MasterClient.call_retrying` retries MasterUnavailable with
stamina's exponential backoff and jitter (forever unless ``attempts``/``timeout`` say otherwise).
Connectivity changes are logged once per change ("master unreachable …" / "reachable again after
N attempts, T s"), not once per attempt. Secrets never appear in a message: errors quote the
endpoint name and status, not headers.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import stamina
import trio

from ckagent.protocol import ProtocolError, RegisterRequest, RegisterResponse

log = logging.getLogger(__name__)


class MasterError(Exception):
    """Base of every error talking to the master."""


class MasterUnavailable(MasterError):
    """The master could not be reached or answered 429/5xx: worth retrying later."""


class MasterRejected(MasterError):
    """The master answered a 4xx that retrying will not fix. ``status`` and decoded ``body``."""

    def __init__(self, endpoint: str, status: int, body: Any, *, secrets: tuple[str, ...] = ()) -> None:
        self.endpoint = endpoint
        self.status = status
        self.body = body
        detail = body.get("error") if isinstance(body, dict) else None
        text = f"{endpoint}: master answered {status}" + (f" ({detail})" if detail else "")
        super().__init__(_redact(text, secrets))


class MasterConflict(MasterRejected):
    """409: a claim lost, a final result that disagrees, or a sequence gap (``body['expectedSeq']``)."""


class RegistrationRefused(MasterError):
    """Registration failed for good (bad request, forbidden, ...); the agent cannot start."""


@dataclass
class Connectivity:
    """Tracks up/down of the master so retries are logged once per state change.

    ``on_change(up)`` (optional) is called on each transition — metrics and /readyz use it.
    """

    up: bool = True
    failures: int = 0
    down_since: float = 0.0
    on_change: Callable[[bool], None] | None = None

    def failed(self, what: str, reason: str) -> None:
        """Record a failed attempt; logs only on the up → down transition."""
        self.failures += 1
        if self.up:
            self.up = False
            self.down_since = trio.current_time()
            log.warning("master unreachable (%s: %s); retrying with backoff", what, reason)
            if self.on_change:
                self.on_change(False)

    def succeeded(self) -> None:
        """Record a success; logs only on the down → up transition."""
        if not self.up:
            took = trio.current_time() - self.down_since
            log.info("master reachable again after %d failed attempts, %.1f s", self.failures, took)
            self.up = True
            if self.on_change:
                self.on_change(True)
        self.failures = 0


RequestObserver = Callable[[str, str, float], None]
"""``observer(endpoint, outcome, seconds)``: metrics hook called once per HTTP attempt."""


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
        self._token = registration_token
        self._register_body = register_body
        self._timeout = request_timeout
        self._verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._transport = transport
        self._observer = observer
        self.node_id: str | None = None
        self._api_key: str | None = api_key
        self._key_generation = 0
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

        Transport errors, 401 (token not accepted yet), 429 and 5xx are retried forever with
        backoff; any other 4xx raises RegistrationRefused with the master's reason. Cancellation
        stops the retries.
        """
        generation = self._key_generation
        async with self._register_lock:
            if self._key_generation != generation and self.registered:
                return RegisterResponse(node_id=self.node_id or "", api_key=self._api_key or "")
            async for attempt in stamina.retry_context(
                on=MasterUnavailable, attempts=None, timeout=None, wait_initial=0.5, wait_max=30.0
            ):
                with attempt:
                    answer = await self._register_once()
            self.node_id, self._api_key = answer.node_id, answer.api_key
            self._key_generation += 1
            log.info("registered with %s as node %s", self._base_url, answer.node_id)
            return answer

    async def _register_once(self) -> RegisterResponse:
        body = self._register_body().to_json()
        response = await self._send("register", "POST", "/api/nodes/register", json=body,
                                    headers={"X-Registration-Token": self._token})
        if response.status_code == 401:
            self.connectivity.failed("register", "registration token not accepted (401)")
            raise MasterUnavailable("register: registration token not accepted (401)")
        if 400 <= response.status_code < 500:
            reason = _redact(_error_text(response), (self._token,))
            raise RegistrationRefused(
                f"the master refused registration with {response.status_code}: {reason}; "
                "check server.url and the agent section of the config"
            )
        try:
            return RegisterResponse.from_json(response.json())
        except (ValueError, ProtocolError) as exc:
            raise MasterUnavailable(f"register: unreadable answer: {exc}") from exc

    # ------------------------------------------------------------------ calls

    async def call(
        self,
        endpoint: str,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        params: dict[str, Any] | None = None,
        read_timeout: float | None = None,
        raw: bool = False,
    ) -> Any:
        """One authenticated request; returns the decoded JSON (or the response when ``raw``).

        The body is ``json`` (encoded here) or ``content``: JSON already encoded (UTF-8 bytes), sent
        as it is with ``Content-Type: application/json`` (a stream batch is encoded once, by its reader).

        ``path`` may contain ``{node}``, replaced by the node id. A 401 re-registers once and
        retries. Raises MasterUnavailable, MasterConflict, MasterRejected (see module docstring).
        ``read_timeout`` overrides the request timeout (seconds; the long poll needs more).
        Cancellation abandons the request.
        """
        if not self.registered:
            await self.register()
        target = path.replace("{node}", self.node_id or "")
        for second_try in (False, True):
            generation = self._key_generation
            # The API key goes to the master only: a code package on another host (object storage,
            # a CDN) gets no Authorization header.
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._same_origin(target) else {}
            if content is not None:
                headers["Content-Type"] = "application/json"
            response = await self._send(
                endpoint, method, target, json=json, content=content, params=params, headers=headers,
                read_timeout=read_timeout,
            )
            if response.status_code == 401 and not second_try:
                log.warning("%s: master answered 401; registering again", endpoint)
                if generation == self._key_generation:
                    self._api_key = None
                await self.register()
                continue
            break
        status = response.status_code
        if 200 <= status < 300:
            self.connectivity.succeeded()
            if raw:
                return response
            return response.json() if response.content else None
        body = _json_or_none(response)
        secrets = (self._token, self._api_key or "")
        if status == 409:
            raise MasterConflict(endpoint, status, body, secrets=secrets)
        raise MasterRejected(endpoint, status, body, secrets=secrets)

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
            on=MasterUnavailable, attempts=attempts, timeout=retry_timeout, wait_initial=0.5, wait_max=30.0
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
        """GET ``url`` (a path or an absolute URL) and hand the body to ``sink`` chunk by chunk as it arrives.

        Nothing is buffered here: ``sink`` writes and enforces its caps (it may raise to abort; its
        exception propagates unchanged). Returns the bytes received. Auth, the 401 re-registration and
        the error classes are those of :meth:`call` (the key goes to the master's origin only;
        redirects are followed, httpx drops the key on a cross-origin hop); a transport error mid-body
        is MasterUnavailable, so a retrying caller must restart its sink. Cancellation abandons it.
        """
        if not self.registered:
            await self.register()
        for second_try in (False, True):
            generation = self._key_generation
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._same_origin(url) else {}
            started = trio.current_time()
            try:
                async with self._client.stream(
                    "GET", url, headers=headers, timeout=read_timeout or self._timeout, follow_redirects=True
                ) as response:
                    status = response.status_code
                    if status == 401 and not second_try:
                        log.warning("%s: master answered 401; registering again", endpoint)
                        if generation == self._key_generation:
                            self._api_key = None
                        await self.register()
                        continue
                    if status == 429 or status >= 500:
                        self._observe(endpoint, str(status), started)
                        self.connectivity.failed(endpoint, f"HTTP {status}")
                        raise MasterUnavailable(f"{endpoint}: master answered {status}")
                    if not 200 <= status < 300:
                        self._observe(endpoint, str(status), started)
                        await response.aread()
                        cls = MasterConflict if status == 409 else MasterRejected
                        raise cls(endpoint, status, _json_or_none(response),
                                  secrets=(self._token, self._api_key or ""))
                    received = 0
                    async for chunk in response.aiter_bytes():
                        received += len(chunk)
                        await sink(chunk)
            except httpx.TransportError as exc:
                self._observe(endpoint, "error", started)
                self.connectivity.failed(endpoint, type(exc).__name__)
                raise MasterUnavailable(f"{endpoint}: {type(exc).__name__}: {exc}") from exc
            self._observe(endpoint, "ok", started)
            self.connectivity.succeeded()
            return received
        raise MasterRejected(endpoint, 401, None)

    async def _send(
        self, endpoint: str, method: str, path: str, *, read_timeout: float | None = None, **kwargs: Any
    ) -> httpx.Response:
        started = trio.current_time()
        try:
            response = await self._client.request(method, path, timeout=read_timeout or self._timeout, **kwargs)
        except httpx.PoolTimeout as exc:
            # httpcore #1093: after cancellations the pool can stay jammed; start a fresh one.
            self._observe(endpoint, "error", started)
            old, self._client = self._client, self._new_client()
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await old.aclose()
            self.connectivity.failed(endpoint, "connection pool timeout")
            raise MasterUnavailable(f"{endpoint}: connection pool timeout") from exc
        except httpx.TransportError as exc:
            self._observe(endpoint, "error", started)
            self.connectivity.failed(endpoint, type(exc).__name__)
            raise MasterUnavailable(f"{endpoint}: {type(exc).__name__}: {exc}") from exc
        status = response.status_code
        if status == 429 or status >= 500:
            self._observe(endpoint, str(status), started)
            self.connectivity.failed(endpoint, f"HTTP {status}")
            raise MasterUnavailable(f"{endpoint}: master answered {status}")
        self._observe(endpoint, "ok" if status < 400 else str(status), started)
        return response

    def _observe(self, endpoint: str, outcome: str, started: float) -> None:
        if self._observer is not None:
            self._observer(endpoint, outcome, trio.current_time() - started)


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


def _error_text(response: httpx.Response) -> str:
    body = _json_or_none(response)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])[:300]
    return response.text[:300] or response.reason_phrase
