"""``GET /livez``: whether the pod's agent is wedged — the container's liveness, answered by PID 1.

==========================================================  ====  =====================================
the agent                                                   code  body (one line)
==========================================================  ====  =====================================
answers its ``/healthz`` 200 within :data:`PROBE_TIMEOUT`   200   ``ok``
has not answered since it was (re)started, for less than    200   ``starting: ...`` (why not yet)
``--start-timeout`` seconds (a restart in backoff included)
the same for longer; or it answered once and does not now   503   ``wedged: ...`` (what the probe got)
the supervisor is stopping (the agent exited as asked)      200   ``stopping: ...``
==========================================================  ====  =====================================

(Re)starting since: the supervisor's start, or the end of the last agent that was up — one that had
answered, or lived :data:`UP_AFTER` seconds. An agent that dies young again and again (a crash loop)
does not restart the clock: after ``--start-timeout`` the pod is reported not live.

The answer comes from one probe of the agent's ``/healthz`` (h11 client, bounded by
:data:`PROBE_TIMEOUT`), shared by the requests that wait for it and reused for :data:`PROBE_REUSE`
seconds; no probe runs when nobody asks (no wake-up at idle).

The listener is an edge (design.md, "House rules for edges"): h11 parses every request; only
``/livez`` (GET or HEAD) is served, any other path is 404, another method 405, bytes that are not
HTTP/1.1 a 400; every response closes its connection. A connection lives at most
:data:`CONNECTION_TIMEOUT` seconds whatever it sends (idle, slowloris), a request head of more than
:data:`MAX_HEAD_BYTES` is refused (431), at most :data:`MAX_CONNECTIONS` are open (the oldest is closed
for a new one), so no client can keep the answer from the next. Nothing a client sends raises out of
:class:`LiveServer`: a socket error ends that connection.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

import h11

from ckagent.pod.loop import Loop, Timer

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 2.0
"""Seconds the agent's /healthz has to answer."""
PROBE_REUSE = 1.0
"""Seconds a probe's result answers further /livez requests."""
EXIT_GRACE = 0.25
"""Seconds a failed probe waits for the agent's end to be known before it is judged."""
UP_AFTER = 60.0
"""Seconds after which a running agent counts as up even if nobody asked it (also the backoff's reset)."""
CONNECTION_TIMEOUT = 5.0
"""Seconds a /livez connection may live, from accept to close."""
MAX_HEAD_BYTES = 8192
"""The largest request head (request line + headers) read."""
MAX_CONNECTIONS = 64
"""Open /livez connections at most; the oldest is closed to accept one more."""

Reply = Callable[[int, str], None]
"""Receives the answer: (HTTP status, one-line reason)."""


@dataclass(frozen=True)
class Answer:
    """What a probe found: ``ok`` (200 from /healthz) and what it got otherwise."""

    ok: bool
    reason: str
    at: float


class Probe:
    """One ``GET /healthz`` to the agent at ``address`` per :meth:`start`, on the loop (h11 client)."""

    def __init__(self, loop: Loop, address: tuple[str, int], timeout: float = PROBE_TIMEOUT) -> None:
        self.loop = loop
        self.address = address
        self.timeout = timeout

    def start(self, done: Callable[[bool, str], None]) -> None:
        """Connect, ask, and call ``done(ok, reason)`` exactly once: within ``timeout`` seconds, on the
        loop (never from inside this call). Never raises."""
        host, port = self.address
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        client = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        pending = bytearray(client.send(h11.Request(method="GET", target="/healthz", headers=[
            ("Host", f"[{host}]:{port}" if ":" in host else f"{host}:{port}"), ("Connection", "close"),
            ("User-Agent", "ckagent-supervise")])) or b"")
        pending += client.send(h11.EndOfMessage()) or b""
        timer: Timer | None = None
        finished = False

        def finish(ok: bool, reason: str) -> None:
            nonlocal finished
            if finished:
                return
            finished = True
            if timer is not None:
                timer.cancel()
            self.loop.remove(sock)
            sock.close()
            done(ok, reason)

        def ready(mask: int) -> None:
            try:
                if mask & selectors.EVENT_WRITE:
                    failure = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if failure:
                        raise OSError(failure, errno.errorcode.get(failure, str(failure)))
                    del pending[:sock.send(pending)]
                    if not pending:
                        self.loop.add(sock, selectors.EVENT_READ, ready)
                    return
                data = sock.recv(4096)
                client.receive_data(data)
                event = client.next_event()
                if isinstance(event, h11.Response):
                    code = event.status_code
                    finish(code == 200, f"/healthz answered {code}")
                elif event is h11.PAUSED or isinstance(event, h11.ConnectionClosed) or not data:
                    finish(False, "/healthz: connection closed without an answer")
            except h11.RemoteProtocolError as exc:
                finish(False, f"/healthz answered no HTTP/1.1 ({exc})")
            except OSError as exc:
                finish(False, f"/healthz on port {port}: {exc.strerror or exc}")

        failure = sock.connect_ex(self.address)
        if failure not in (0, errno.EINPROGRESS):
            self.loop.call_later(0, lambda: finish(False, f"/healthz on port {port}: {errno.errorcode.get(failure, failure)}"))
            return
        self.loop.add(sock, selectors.EVENT_WRITE, ready)
        timer = self.loop.call_later(self.timeout, lambda: finish(False, f"/healthz did not answer within {self.timeout:g} s"))


class Health:
    """The liveness rules of the module docstring; the supervisor tells it the agent's life."""

    def __init__(self, loop: Loop, probe: Probe, start_timeout: float, *, up_after: float = UP_AFTER) -> None:
        self.loop = loop
        self.probe = probe
        self.start_timeout = start_timeout
        self.up_after = up_after
        self.starting_since = loop.now()
        self.agent_since: float | None = None
        """When the running agent was spawned; None while none runs."""
        self.answered = False
        """Whether the running agent has answered /healthz since it was spawned."""
        self.stopping = False
        self._generation = 0
        self._last: Answer | None = None
        self._waiting: list[Reply] = []
        self.check: Callable[[], None] = lambda: None
        """Called before a failed probe is believed: the supervisor reaps, so an agent that has just
        died is judged as restarting, not as wedged."""

    def spawned(self) -> None:
        """A new agent runs."""
        self._generation += 1
        self.agent_since = self.loop.now()
        self.answered = False
        self._last = None

    def exited(self) -> None:
        """The agent ended; if it was up, a new (re)start begins now (module docstring)."""
        now = self.loop.now()
        if self.answered or (self.agent_since is not None and now - self.agent_since >= self.up_after):
            self.starting_since = now
        self._generation += 1
        self.agent_since = None
        self.answered = False
        self._last = None
        self._answer_waiting()

    def ask(self, reply: Reply) -> None:
        """Call ``reply(status, reason)`` now or once the probe ends (≤ PROBE_TIMEOUT + EXIT_GRACE). Never raises."""
        now = self.loop.now()
        if self.agent_since is None or self.stopping:
            reply(*self._judge(None))
        elif self._last is not None and now - self._last.at < PROBE_REUSE:
            reply(*self._judge(self._last))
        else:
            self._waiting.append(reply)
            if len(self._waiting) == 1:
                generation = self._generation
                self.probe.start(lambda ok, reason: self._probed(generation, ok, reason))

    def _probed(self, generation: int, ok: bool, reason: str, *, again: bool = False) -> None:
        if not ok:
            self.check()
            if not again and generation == self._generation:
                # A dying agent closes its sockets before it becomes a zombie (SIGCHLD): a refusal may
                # come first. Judged once more after EXIT_GRACE, so it reads as a restart, not a wedge.
                self.loop.call_later(EXIT_GRACE, lambda: self._probed(generation, ok, reason, again=True))
                return
        if generation == self._generation:
            self._last = Answer(ok, reason, self.loop.now())
            if ok:
                self.answered = True
        self._answer_waiting()

    def _answer_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for reply in waiting:
            reply(*self._judge(self._last))

    def _judge(self, answer: Answer | None) -> tuple[int, str]:
        if self.stopping:
            return 200, "stopping: the agent exited as asked; waiting for its last processes"
        if answer is not None and answer.ok:
            return 200, "ok"
        got = answer.reason if answer is not None else "the agent is not running: restart pending"
        if self.agent_since is not None and self.answered:
            return 503, f"wedged: the agent answered /healthz before, now {got}"
        starting = self.loop.now() - self.starting_since
        if starting < self.start_timeout:
            return 200, f"starting: {got} ({starting:.1f} s of --start-timeout {self.start_timeout:g} s)"
        return 503, f"wedged: not answering /healthz {starting:.1f} s after its (re)start: {got}"


class LiveServer:
    """The /livez listener on the loop (module docstring); ``health.ask`` decides each answer."""

    def __init__(self, loop: Loop, sock: socket.socket, health: Health) -> None:
        self.loop = loop
        self.sock = sock
        self.health = health
        self.connections: dict[int, _Connection] = {}
        self._ids = 0
        sock.setblocking(False)
        loop.add(sock, selectors.EVENT_READ, self._accept)

    def _accept(self, _mask: int) -> None:
        for _ in range(16):
            try:
                conn, _address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE, ECONNABORTED: this client's trouble, not the listener's
                log.warning("livez: accept failed: %s", exc.strerror or exc)
                return
            while len(self.connections) >= MAX_CONNECTIONS:
                self.connections[min(self.connections)].close()
            self._ids += 1
            self.connections[self._ids] = _Connection(self, self._ids, conn)

    def close(self) -> None:
        """Stop listening and close every connection."""
        for connection in list(self.connections.values()):
            connection.close()
        self.loop.remove(self.sock)
        self.sock.close()


class _Connection:
    """One client: read a request head (h11), route it, write one response, close."""

    def __init__(self, server: LiveServer, ident: int, sock: socket.socket) -> None:
        self.server = server
        self.ident = ident
        self.sock = sock
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.out = bytearray()
        self.answered = False
        self.closed = False
        sock.setblocking(False)
        server.loop.add(sock, selectors.EVENT_READ, self._ready)
        self.deadline = server.loop.call_later(CONNECTION_TIMEOUT, self.close)

    def _ready(self, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush()
                return
            data = self.sock.recv(4096)
            if self.answered:  # (what follows a request is not read: the response closes the connection)
                if not data:
                    self.close()
                return
            self.h11.receive_data(data)
            event = self.h11.next_event()
            if isinstance(event, h11.Request):
                self._route(event)
            elif isinstance(event, h11.ConnectionClosed) or not data:
                self.close()  # (closed or half-closed before a whole request head: nothing to answer)
        except h11.RemoteProtocolError as exc:
            self._respond(exc.error_status_hint, "request head too large" if exc.error_status_hint == 431
                          else "bad request")
        except OSError:
            self.close()

    def _route(self, request: h11.Request) -> None:
        path = request.target.split(b"?", 1)[0]
        if path != b"/livez":
            self._respond(404, "not found: only /livez is served here")
        elif request.method not in (b"GET", b"HEAD"):
            self._respond(405, "method not allowed: GET or HEAD")
        else:
            self.answered = True
            self.server.health.ask(lambda status, reason: self._respond(status, reason, head=request.method == b"HEAD"))

    def _respond(self, status: int, reason: str, *, head: bool = False) -> None:
        if self.closed:
            return
        self.answered = True
        body = (reason + "\n").encode("utf-8", "replace")
        headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                   ("Connection", "close"), ("Cache-Control", "no-store")]
        if status == 405:
            headers.append(("Allow", "GET, HEAD"))
        try:  # (after a RemoteProtocolError h11 still lets the server send its one response)
            self.out += self.h11.send(h11.Response(status_code=status, headers=headers,
                                                   reason=HTTPStatus(status).phrase.encode())) or b""
            if not head:
                self.out += self.h11.send(h11.Data(data=body)) or b""
            self.out += self.h11.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError:
            self.close()
            return
        self._flush()

    def _flush(self) -> None:
        try:
            del self.out[:self.sock.send(self.out)]
        except BlockingIOError:
            pass
        except OSError:
            self.close()
            return
        if self.out:
            self.server.loop.add(self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, self._ready)
        else:
            self.close(graceful=True)

    def close(self, *, graceful: bool = False) -> None:
        """End the connection (idempotent); ``graceful``: the response is out, half-close first."""
        if self.closed:
            return
        self.closed = True
        self.deadline.cancel()
        self.server.connections.pop(self.ident, None)
        self.server.loop.remove(self.sock)
        if graceful:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)
        self.sock.close()
