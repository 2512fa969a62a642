"""The proxy's listeners: one per task on 127.0.0.1, each connection in a boundary of its own.

:class:`ProxyServer` runs in the agent's root nursery (:meth:`ProxyServer.run`, startable) and owns a
nursery of its own, in which every task's listener and every connection is a child. Nothing a client
or a destination does — and no bug of the exchange — leaves a connection: its handler catches it,
counts it (:attr:`ProxyServer.errors`), logs it once per task and kind, and the proxy goes on. Only
cancellation passes (the agent stopping, or the task's listener closed).

Cancellation: cancelling :meth:`run` closes every listener and connection.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import socket
import sys
from typing import Any

import trio

from ckagent.containment.egress.proxy.exchange import serve_client
from ckagent.containment.egress.proxy.fdstore import FdStore
from ckagent.containment.egress.proxy.limits import Limits
from ckagent.containment.egress.proxy.peer import peer_uid
from ckagent.containment.egress.proxy.taskproxy import TaskProxy

if sys.version_info < (3, 11):  # pragma: no cover - the backport trio depends on there
    from exceptiongroup import BaseExceptionGroup

log = logging.getLogger("ckagent.containment.egress.proxy")

_BUSY_TEXT = b"too many connections of this task to its egress proxy\n"
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(_BUSY_TEXT), _BUSY_TEXT))
"""The answer to a connection over the task's limit (:attr:`Limits.max_connections`)."""

_FOREIGN_TEXT = b"this proxy port belongs to another task: use your own HTTP_PROXY\n"
FOREIGN = (b"HTTP/1.1 403 Forbidden\r\ncontent-type: text/plain\r\nconnection: close\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(_FOREIGN_TEXT), _FOREIGN_TEXT))
"""The answer to a connection from another uid than the task's."""

FDS_PER_CONNECTION = 6
"""Descriptors one client connection may cost at most: its own, its destination's, and a splice pipe
(two) each way."""

FDS_KEPT = 256
"""Descriptors left to the rest of the agent (its state store, logs, the master, watches, tasks' files)."""


def connection_budget() -> int:
    """Client connections all tasks together may hold at once, from the process's open-files limit
    (at least 32)."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(32, (soft - FDS_KEPT) // FDS_PER_CONNECTION)


ACCEPT_PAUSE = 0.1
"""Seconds the accept loop waits when the process is out of file descriptors (as trio's serve_listeners)."""

_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


class ProxyServer:
    """The agent's forward proxy (see the package docstring). ``limits`` its timeouts and sizes;
    ``fdstore`` where the listeners outlive the agent (ckagent.containment.egress.proxy.fdstore; default:
    none).

    :meth:`open` and :meth:`close` run on the Trio thread once :meth:`run` has started."""

    def __init__(self, limits: Limits | None = None, fdstore: FdStore | None = None) -> None:
        self.limits = limits or Limits()
        self.fdstore = fdstore or FdStore()
        self.budget = connection_budget()
        """Client connections of every task together the proxy serves at once (one more: 503): what the
        process's open-files limit leaves, a connection costing up to :data:`FDS_PER_CONNECTION`."""
        self.open_connections = 0
        """Client connections open now, every task's."""
        self._foreign_seen: set[tuple[str, int]] = set()
        self.tasks: dict[str, TaskProxy] = {}
        """Task id → its side of the proxy (while its listener is open)."""
        self.errors: collections.Counter[str] = collections.Counter()
        """Connections that ended with an error of the proxy's own (a bug), by exception type."""
        self.outcomes: collections.Counter[str] = collections.Counter()
        """Every task's requests since the start, by outcome (:data:`.taskproxy.OUTCOMES`)."""
        self.connections = 0
        """Client connections accepted since the start."""
        self._nursery: trio.Nursery | None = None
        self._scopes: dict[str, tuple[trio.CancelScope, trio.SocketListener]] = {}

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled (startable: ``started()`` once tasks can be opened)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for task in self.tasks.values():
                for up in task.pool.drain():
                    up.stream.socket.close()
            self.tasks.clear()
            self._scopes.clear()

    @property
    def task_cap(self) -> int:
        """Client connections one task may hold: :attr:`Limits.max_connections`, and never more than
        half the :attr:`budget` (one task must not take every other task's connections)."""
        return min(self.limits.max_connections, max(16, self.budget // 2))

    @property
    def ports(self) -> set[int]:
        """The ports the task listeners listen on (the proxy's own: never a destination)."""
        return {task.port for task in self.tasks.values()}

    def open(self, task: TaskProxy, port: int = 0) -> int:
        """Listen for ``task`` on 127.0.0.1:``port`` (0: one the OS picks) and serve it; returns the
        port (also set in ``task.port``). The listener of ``port`` inherited from the descriptor store
        is taken when there is one (a re-adopted task: the connects that waited in its backlog while no
        agent ran are served now), and each listener opened is stored. Raises OSError when the port
        cannot be had, RuntimeError when the server does not run."""
        if self._nursery is None:
            raise RuntimeError("the egress proxy is not running")
        self.close(task.task_id)
        sock = self.fdstore.take(port)
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(128)
            except OSError:
                sock.close()
                raise
        task.port = sock.getsockname()[1]
        self.fdstore.store(task.port, sock)
        task.totals = self.outcomes
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        scope = trio.CancelScope()
        self.tasks[task.task_id], self._scopes[task.task_id] = task, (scope, listener)
        self._nursery.start_soon(self._serve_task, task, listener, scope, name=f"egress proxy {task.task_id!r}")
        return task.port

    def close(self, task_id: str) -> TaskProxy | None:
        """Stop serving a task: its listener closes at once (no connection is accepted after this call),
        its connections and its pool close, and its log gets :meth:`TaskProxy.summary`. Idempotent."""
        found = self._scopes.pop(task_id, None)
        task = self.tasks.pop(task_id, None)
        if found is not None:
            scope, listener = found
            if self.fdstore.active:  # (its copy in the store must stop listening now, too)
                with contextlib.suppress(OSError):
                    listener.socket.shutdown(socket.SHUT_RDWR)
                if task is not None:
                    self.fdstore.remove(task.port)
            listener.socket.close()
            scope.cancel()
        if task is not None:
            for up in task.pool.drain():
                up.stream.socket.close()
            line = task.summary()
            log.info("task %r: %s", task.task_id, line)
            if task.notice is not None:
                task.notice(line)
        return task

    async def _serve_task(self, task: TaskProxy, listener: trio.SocketListener, scope: trio.CancelScope) -> None:
        with scope:
            async with listener, trio.open_nursery() as connections:
                await self._accept(task, listener, connections)

    async def _accept(self, task: TaskProxy, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        """Accept the task's clients until its listener closes; each a child of ``connections``."""
        while True:
            await trio.lowlevel.checkpoint()
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    log.warning("egress proxy: the listener of task %r failed (%s)", task.task_id, exc)
                    return
                log.warning("egress proxy: cannot accept a connection of task %r (%s); waiting %g s",
                            task.task_id, exc, ACCEPT_PAUSE)
                await trio.sleep(ACCEPT_PAUSE)
                continue
            self.connections += 1
            if task.uid is not None and not self._from_task(task, stream):
                connections.start_soon(self._refuse_foreign, stream)
                continue
            if task.open_connections >= self.task_cap or self.open_connections >= self.budget:
                connections.start_soon(self._busy, task, stream)
                continue
            task.open_connections += 1
            self.open_connections += 1
            connections.start_soon(self._connection, task, stream)

    def _from_task(self, task: TaskProxy, stream: trio.SocketStream) -> bool:
        """True unless the kernel says another uid than the task's owns the client's socket."""
        try:
            uid = peer_uid(stream.socket.getpeername(), stream.socket.getsockname())
        except OSError:  # (the client has gone already)
            return True
        if uid is None or uid == task.uid:
            return True
        self.outcomes["foreign"] += 1
        if (task.task_id, uid) not in self._foreign_seen:
            self._foreign_seen.add((task.task_id, uid))
            log.warning("egress proxy: uid %d connected to the proxy port of task %r (uid %d): closed — a "
                        "spider tried to speak for another", uid, task.task_id, task.uid)
        return False

    async def _refuse_foreign(self, stream: trio.SocketStream) -> None:
        """A connection from another task's uid: 403 and closed at once, without reading it."""
        with trio.move_on_after(1.0), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await stream.send_all(FOREIGN)
        await trio.aclose_forcefully(stream)

    async def _busy(self, task: TaskProxy, stream: trio.SocketStream) -> None:
        """A connection over the task's limit: 503 and closed at once, without reading it."""
        if task.open_connections >= self.task_cap:
            why = f"the task holds {self.task_cap} connections to its proxy already (its limit)"
        else:
            why = (f"the proxy serves {self.budget} connections of all tasks already (what the agent's "
                   "open-files limit allows: raise LimitNOFILE)")
        task.note("busy", f"503 to a client: {why}; the new one is closed")
        with trio.move_on_after(1.0), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await stream.send_all(BUSY)
        await trio.aclose_forcefully(stream)

    async def _connection(self, task: TaskProxy, stream: trio.SocketStream) -> None:
        """One client connection, inside its error boundary (see the module docstring)."""
        try:
            await self._serve(task, stream)
        finally:
            task.open_connections -= 1
            self.open_connections -= 1

    async def _serve(self, task: TaskProxy, stream: trio.SocketStream) -> None:
        try:
            async with stream:
                await serve_client(stream, task, self.limits)
        except Exception as exc:  # the boundary: a bug of the exchange ends this connection only
            self._count(task, exc)
        except BaseExceptionGroup as group:  # errors beside a cancellation: only the cancellation goes on
            errors, passing = group.split(Exception)
            if errors is not None:
                self._count(task, errors)
            if passing is None:  # pragma: no cover - a group that is no ExceptionGroup holds a BaseException
                raise
            raise passing from None

    def _count(self, task: TaskProxy, exc: BaseException) -> None:
        kinds = [type(e).__name__ for e in _leaves(exc) if isinstance(e, Exception)]
        for kind in kinds:
            self.errors[kind] += 1
        if kinds:
            log.debug("egress proxy: a connection of task %r failed", task.task_id, exc_info=exc)
            task.note("error", f"a connection ended on an error of the proxy's own ({', '.join(kinds)})")


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]
