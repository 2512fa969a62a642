"""One task's side of the proxy: who it is (its listener port, user name and secret password), what it
may reach, which way its requests leave, its pool of kept-alive connections, and what it was refused.

The port identifies the task: a client that cannot send proxy credentials (Chromium ignores them in
a proxy URL) is served as the task whose port it connected to. A client that sends credentials must
send this task's — its user name and its secret password, compared in constant time — or it gets
407: one task can never present another's name. (A process that can read a task's environment can
read its password too; where tasks run under different users the kernel keeps them apart.)
"""

from __future__ import annotations

import base64
import binascii
import collections
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from ckagent.containment.egress.proxy.errors import AuthRequired
from ckagent.containment.egress.proxy.routes import Routes
from ckagent.containment.egress.proxy.upstream import Dialer, Pool

log = logging.getLogger("ckagent.containment.egress.proxy")

STATUS = {"auth": "407", "bad-request": "400", "timeout": "408", "too-large": "431", "upstream": "502/504",
          "busy": "503", "error": "(closed)"}
"""The answer of each outcome that is a trouble (not forwarded, a tunnel or refused by the policy)."""

OUTCOMES = ("forwarded", "tunnel", "refused", "auth", "bad-request", "timeout", "too-large", "upstream", "busy",
            "foreign", "error")
"""What becomes of a request at the proxy: answered by its destination (``forwarded``), a CONNECT
tunnel opened (``tunnel``), or an answer of the proxy's own — 403 ``refused`` by the policy, 407
``auth``, 400 ``bad-request``, 408 ``timeout``, 431 ``too-large``, 502/504 ``upstream``, 503 ``busy``
(a connection over the task's limit), ``foreign`` (a connection to the task's port from another
task's uid: closed, counted for the node only) — or a connection ended by an ``error`` of the
proxy's own."""


@dataclass
class TaskProxy:
    """A task at the proxy: ``task_id``; ``user`` and ``password`` (its credentials in the proxy URL);
    ``dialer`` (its policy and resolver); ``routes`` (its own proxies); ``notice`` writes one line into
    the task's log (None: the agent's log only); ``port`` the listener's, once it listens."""

    task_id: str
    user: str
    password: str
    dialer: Dialer
    routes: Routes = field(default_factory=Routes)
    notice: Callable[[str], None] | None = None
    port: int = 0
    uid: int | None = None
    """The uid the task's processes run as, where it is the task's own (spiders under uids of their
    own): a connection whose socket another uid owns is not served (None: not checked)."""
    pool: Pool = field(default_factory=Pool)
    refused: collections.Counter[tuple[str, int]] = field(default_factory=collections.Counter)
    """(address, port) → requests refused by the policy."""
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    """What became of the task's requests, by :data:`OUTCOMES` → count."""
    open_connections: int = 0
    """Client connections of the task open now."""
    _accepted: bytes = b""
    """The ``Proxy-Authorization`` value last found to be this task's."""
    totals: collections.Counter[str] | None = None
    """The server's counts of every task (set when it listens): :meth:`count` adds to both."""

    def url(self) -> str:
        """The task's proxy URL: ``http://<user>:<password>@127.0.0.1:<port>``."""
        return f"http://{self.user}:{self.password}@127.0.0.1:{self.port}"

    def authorize(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Check a request's ``Proxy-Authorization`` (none at all: the port says who asks). Raises
        AuthRequired for credentials that are not this task's, or not Basic."""
        values = [v for n, v in headers if n.lower() == b"proxy-authorization"]
        if not values:
            return
        if len(values) == 1 and self._accepted and hmac.compare_digest(values[0], self._accepted):
            return  # (the header that was checked before: no decoding on every request)
        scheme, _, token = values[0].strip().partition(b" ")
        if len(values) > 1 or scheme.lower() != b"basic":
            raise AuthRequired("send this task's proxy user name and password (Basic), as in its HTTP_PROXY")
        try:
            user, _, password = base64.b64decode(token.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            raise AuthRequired("the Proxy-Authorization header is not valid Basic credentials") from None
        ok = hmac.compare_digest(user, self.user.encode()) & hmac.compare_digest(password, self.password.encode())
        if not ok:
            raise AuthRequired("these proxy credentials are not this task's (each task has its own, in its HTTP_PROXY)")
        self._accepted = values[0]

    def count(self, outcome: str) -> None:
        """Count one request's outcome (one of :data:`OUTCOMES`)."""
        self.outcomes[outcome] += 1
        if self.totals is not None:
            self.totals[outcome] += 1

    def count_refused(self, refused: tuple[tuple[str, int], ...]) -> None:
        """Count a refused request, and it against each destination it was refused for (logged the
        first time)."""
        self.count("refused")
        for address, port in refused:
            if not self.refused[(address, port)]:
                shown = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
                log.warning("task %r: egress policy refused a connection to %s (proxy)", self.task_id, shown)
            self.refused[(address, port)] += 1

    def summary(self) -> str:
        """One line for the task's log at its end: what came through the proxy and what it answered
        itself, e.g. ``egress proxy: 40 requests forwarded, 2 tunnels, 3 refused; answered by the
        proxy: 400 bad-request ×3`` — or that nothing came (the task's programs ignored the proxy
        variables, and this level filtered nothing of theirs)."""
        done = [f"{self.outcomes[o]} {w}" for o, w in (("forwarded", "requests forwarded"), ("tunnel", "tunnels"),
                                                       ("refused", "refused by the policy")) if self.outcomes[o]]
        troubles = [f"{STATUS[o]} {o} ×{n}" for o, n in self.outcomes.items() if o in STATUS and n]
        if not done and not troubles:
            return ("egress proxy: no request came through the proxy (a program that ignores HTTP_PROXY — "
                    "Node's fetch before Node 24.5, a socket of its own — is not filtered at this level)")
        return "egress proxy: " + (", ".join(done) or "nothing forwarded") + \
            (f"; answered by the proxy: {', '.join(troubles)}" if troubles else "")

    def note(self, outcome: str, text: str) -> None:
        """Count a trouble (an outcome of :data:`OUTCOMES`); the first of each is logged, and said in
        the task's log."""
        self.count(outcome)
        if self.outcomes[outcome] == 1:
            log.warning("task %r: egress proxy: %s", self.task_id, text)
            if self.notice is not None:
                self.notice(f"egress proxy: {text} (said once; /status counts them)")
