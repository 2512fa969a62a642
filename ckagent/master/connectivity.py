"""The master's health as the agent sees it: one *episode* per kind of trouble, logged once at its start
and once at its end, and the current cause for /readyz.

:class:`ckagent.master.client.MasterClient` classifies every answer (see its module docstring) and reports
each failed call here as a :class:`Trouble` and each call answered in the protocol's words as a
success. Kinds, and what makes one episode of them and what ends it:

- ``unreachable`` (transport error, timeout) and ``unavailable`` (429, 5xx): one episode together
  ("the master is away"), ended by any call answered in the protocol's words;
- ``protocol`` (an answer not in the protocol's words): one episode per status and content type,
  ended by a success of each endpoint that had it (or forgotten 90 s after its last retry);
- ``unauthorized`` (registration 401): ended by a registration that succeeds;
- ``rejected`` (another 4xx in the protocol's words): one episode per status, ended as ``protocol``;
- ``partial`` (one endpoint class hangs or fails while the others get answers — only ``/batches``
  hangs mid-body, only downloads stall): one episode per class (the ``outage`` column of
  the endpoint table, ckagent.master.endpoints: heartbeat, poll, task streams, artifacts, downloads, checkpoints),
  started by the second failure in a row of an endpoint whose failures other calls' successes make
  look stale, ended by a success of that class.

Stale news is ignored both ways: a success of a call sent before the latest failure (a long poll
held by the master) ends nothing, and a failure of a call sent before the latest success (a request
that timed out after the trouble was over) starts nothing — once; twice in a row it is a partial
outage. A refusal of a task's claim or download is that task's affair: logged, but not the node's
problem on /readyz; a refusal of the task streams (logs, items, batches, result) is: the data waits
on the node while it lasts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from ckagent.master.endpoints import ENDPOINTS, TASK_DATA_ENDPOINTS

log = logging.getLogger("ckagent.master.client")  # the boundary's log: one logger for its episodes and errors

HEAD_BYTES = 64
"""How many leading bytes of an unexpected answer its message quotes."""
STALE_TROUBLE = 90.0
"""Seconds after which an endpoint's open trouble (a protocol error or a refusal) that was not tried
again is forgotten once other calls succeed (its caller gave up, e.g. a claim past its retry time)."""


@dataclass(frozen=True)
class Answered:
    """What came back for one request, for messages: HTTP status, media type, the first bytes."""

    status: int
    content_type: str
    head: bytes

    @classmethod
    def of(cls, response: httpx.Response, body: bytes, secrets: tuple[str, ...] = ()) -> Answered:
        """From a response and (the start of) its body; secrets in the body head are masked."""
        media = response.headers.get("content-type", "").split(";")[0].strip() or "without content type"
        head = body[:HEAD_BYTES]
        for secret in secrets:
            if secret:
                head = head.replace(secret.encode(), b"***")
        return cls(response.status_code, media, head)

    def __str__(self) -> str:
        more = "…" if len(self.head) >= HEAD_BYTES else ""
        return f"{self.status} {self.content_type}" + (f", first bytes {self.head!r}{more}" if self.head else "")


@dataclass(frozen=True)
class Trouble:
    """One failed call, classified: ``kind`` is unreachable (transport error, timeout), unavailable
    (429/5xx), protocol (a 2xx that is not the protocol), unauthorized (registration 401), name
    (registration 409: another live agent holds the node's name) or rejected (other 4xx). ``text`` is the one-line cause; ``key`` identifies its episode."""

    kind: str
    endpoint: str
    text: str
    key: tuple[Any, ...]


_DOWN_KINDS = frozenset({"unreachable", "unavailable", "protocol", "unauthorized"})
"""Kinds that mean "the master is not answering in the protocol": ``Connectivity.up`` goes False."""
_GLOBAL_KINDS = frozenset({"unreachable", "unavailable"})
"""Kinds any successful call ends (the master answers again); the others end with their endpoint's success."""
DOWN_EPISODE = ("down",)
"""The one episode of transport errors, timeouts, 429 and 5xx: a master that is away, whatever the mix."""
_NODE_ENDPOINTS = frozenset(e.name for e in ENDPOINTS.values() if e.scope == "node")
"""Endpoints whose refusals concern the node (the others concern one task): /readyz shows them. The
task streams are among them (:data:`TASK_DATA_ENDPOINTS`): what a refusal holds back waits on the node."""
ENDPOINT_CLASSES: dict[str, str] = {e.name: e.outage for e in ENDPOINTS.values()}
"""Endpoint → the class whose partial outage it is part of (unknown endpoints are a class of their own)."""


def endpoint_class(endpoint: str) -> str:
    """The class of ``endpoint`` (see :data:`ENDPOINT_CLASSES`)."""
    return ENDPOINT_CLASSES.get(endpoint, endpoint)


@dataclass
class _Open:
    trouble: Trouble
    last: float


@dataclass
class _Episode:
    trouble: Trouble
    started: float
    failures: int = 1


@dataclass
class Connectivity:
    """The master's health as this agent sees it: one episode per kind of trouble, logged at its start
    and its end (see module docstring), not per attempt.

    ``up`` is False while a call fails for a reason of :data:`_DOWN_KINDS`; ``on_change(up)`` (optional)
    is called on each transition; ``failures`` counts the failed attempts since the last time it was
    up. :attr:`problem` is the current cause, for /readyz.
    """

    up: bool = True
    failures: int = 0
    down_since: float = 0.0
    on_change: Callable[[bool], None] | None = None
    _back_up: trio.Event | None = None
    """Set when the master is reachable again (created when it goes away): :meth:`wait_up`."""
    _open: dict[str, _Open] = field(default_factory=dict)
    _episodes: dict[tuple[Any, ...], _Episode] = field(default_factory=dict)
    _last_ok: dict[str, float] = field(default_factory=dict)
    """Per endpoint ("" for any), the send time of the latest call that succeeded."""
    _shadowed: dict[str, int] = field(default_factory=dict)
    """Per endpoint, failures in a row that other calls' successes made look stale (see ``partial``)."""

    def failed(self, trouble: Trouble, sent: float | None = None) -> None:
        """Record a failed attempt sent at trio time ``sent``; logs only when it starts an episode.

        A call sent before one that has since succeeded (it timed out after the trouble was over)
        is old news: ignored."""
        now = trio.current_time()
        scope = "" if trouble.kind in _GLOBAL_KINDS else trouble.endpoint
        if sent is not None and sent < self._last_ok.get(scope, float("-inf")):
            if trouble.kind not in _GLOBAL_KINDS or sent < self._last_ok.get(trouble.endpoint, float("-inf")):
                return
            # Others got answers since this call was sent, this endpoint none: once is old news (a
            # request that timed out after an outage), twice in a row a partial outage of its class.
            shadowed = self._shadowed[trouble.endpoint] = self._shadowed.get(trouble.endpoint, 0) + 1
            if shadowed < 2:
                return
            cls = endpoint_class(trouble.endpoint)
            trouble = Trouble("partial", trouble.endpoint,
                              f"{trouble.text}, while other calls get answers (a partial outage: {cls})",
                              ("partial", cls))
        elif trouble.kind in _GLOBAL_KINDS:
            self._shadowed.pop(trouble.endpoint, None)  # a failure in step with the others: not partial
        previous = self._open.get(trouble.endpoint)
        self._open[trouble.endpoint] = _Open(trouble, now)
        episode = self._episodes.get(trouble.key)
        if episode is None:
            self._episodes[trouble.key] = _Episode(trouble, now)
            retry = "" if trouble.kind == "rejected" else "; retrying with backoff"
            log.warning("%s%s", trouble.text, retry)
        else:
            episode.failures += 1
        if previous is not None and previous.trouble.key != trouble.key:
            self._maybe_end(previous.trouble.key, now, quiet=True)  # the new episode's line says it
        if trouble.kind in _DOWN_KINDS:
            self.failures += 1
            if self.up:
                self.up = False
                self.down_since = now
                self._back_up = trio.Event()
                if self.on_change:
                    self.on_change(False)

    def succeeded(self, endpoint: str = "", started: float | None = None) -> None:
        """Record a call of ``endpoint`` the master answered in the protocol (a 409 counts); logs only
        when that ends an episode. ``started`` is the trio time the call was sent: a call sent before
        a failure (a long poll held by the master) says nothing about the trouble since, and ends none."""
        now = trio.current_time()
        sent = now if started is None else started
        for scope in ("", endpoint):
            self._last_ok[scope] = max(sent, self._last_ok.get(scope, float("-inf")))
        self._shadowed.pop(endpoint, None)
        ended = []
        mine = self._open.get(endpoint)
        if mine is not None and mine.last <= sent:
            del self._open[endpoint]
            ended.append(mine.trouble.key)
        cls = endpoint_class(endpoint)
        for name, entry in list(self._open.items()):  # a partial outage (a refusal of the task streams)
            class_wide = entry.trouble.kind == "partial" or (  # ends with a success of its class
                entry.trouble.kind == "rejected" and name in TASK_DATA_ENDPOINTS)
            if class_wide and endpoint_class(name) == cls and entry.last <= sent:
                del self._open[name]
                ended.append(entry.trouble.key)
        for name, entry in list(self._open.items()):
            if (entry.trouble.kind in _GLOBAL_KINDS and entry.last <= sent) or now - entry.last > STALE_TROUBLE:
                del self._open[name]
                ended.append(entry.trouble.key)
        for key in ended:
            self._maybe_end(key, now)
        if not self.up and not any(e.trouble.kind in _DOWN_KINDS for e in self._open.values()):
            self.up = True
            self.failures = 0
            if self._back_up is not None:
                self._back_up.set()
                self._back_up = None
            if self.on_change:
                self.on_change(True)

    async def wait_up(self) -> None:
        """Return once the master is reachable (:attr:`up`), at once if it is; an event, no polling.
        Cancellation just stops the wait."""
        while not self.up:
            if self._back_up is None:  # down without a transition seen here (set by hand): make one
                self._back_up = trio.Event()
            await self._back_up.wait()

    @property
    def problem(self) -> str | None:
        """The cause of the oldest open episode that concerns the node (one line), or None."""
        causes = self._node_causes()
        return min(causes)[1] if causes else None

    def problem_age(self) -> float:
        """Seconds since the episode of :attr:`problem` started (0 when there is none)."""
        causes = self._node_causes()
        return trio.current_time() - min(causes)[0] if causes else 0.0

    def _node_causes(self) -> list[tuple[float, str]]:
        """(episode start, cause) of each endpoint in trouble, but a task call's refusal (one task's affair)."""
        return [
            (self._episodes[entry.trouble.key].started, entry.trouble.text) for entry in self._open.values()
            if (entry.trouble.kind != "rejected" or entry.trouble.endpoint in _NODE_ENDPOINTS)
            and entry.trouble.key in self._episodes
        ]

    def _maybe_end(self, key: tuple[Any, ...], now: float, *, quiet: bool = False) -> None:
        if any(entry.trouble.key == key for entry in self._open.values()):
            return
        episode = self._episodes.pop(key, None)
        if episode is None or quiet:
            return
        t = episode.trouble
        attempts = f"after {episode.failures} failed attempt{'s' if episode.failures != 1 else ''}, " \
                   f"{now - episode.started:.1f} s"
        if t.kind in _GLOBAL_KINDS:
            log.info("master reachable again %s", attempts)
        elif t.kind == "partial":
            log.info("master answers %s again %s", endpoint_class(t.endpoint), attempts)
        elif t.kind == "protocol":
            log.info("master answers %s in the node protocol again %s", t.endpoint, attempts)
        elif t.kind == "unauthorized":
            log.info("registration token accepted %s", attempts)
        elif t.kind == "name":
            log.info("the node's name is this agent's now: registered %s", attempts)
        else:
            log.info("master accepts %s again %s", t.endpoint, attempts)
