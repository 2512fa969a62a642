"""The agent's own HTTP port: /metrics, /healthz, /readyz, /status — hypercorn on the agent's Trio loop.

======== ===================================================================================
path     answer
======== ===================================================================================
/metrics Prometheus text format (OpenMetrics when the scraper asks for it); see ckagent.port.metrics
/healthz 200 ``ok`` — served by the agent's own event loop, so a stuck loop fails it
/readyz  200 ``ready`` when registered and the last heartbeat was acknowledged within
         ``3 × heartbeat.interval`` seconds and the agent is RUNNING; else 503 with the reason
/status  JSON: state, node id, uptime, slots (total, busy, idle seconds), containment, egress and identity levels, running tasks (id, spider, since, pid,
         phase, live resource figures, attempt, last checkpoint: ckagent.port.taskstats), the tasks re-adopted at start and those handed over at the stop,
         the last upgrade/rollback and failed versions (run.sh's records, ckagent.port.statusrunsh), the
         last full disk's culprit, outbox, versions
/        the HTML status page, and /tasks/<id>/tail, /tasks/<id>/log.txt (see ckagent.port.statuspage)
other    404 (a known path with a method other than GET/HEAD: 405)
======== ===================================================================================

It listens on ``agent.bind`` (default: ``agent.ip``) port ``agent.port``. Nothing it serves
carries a secret (no token, key, task environment or arguments), but it does tell who runs what:
bind it to an address only your monitoring can reach.

Exception tree::

    OSError
    └── StatusPortError   the address cannot be bound (in use, not local, no permission); the
                          message names the address and the setting to change
"""

from __future__ import annotations

import json
import logging
import os
import platform
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import trio

from ckagent import __version__
from ckagent.master.protocol import utc_iso
from ckagent.node.listen import bind_socket
from ckagent.port.metrics import PHASES, AgentMetrics, LiveFigures, OutboxFigures
from ckagent.port.statusrunsh import read_runsh_state, state_dir_from
from ckagent.port.taskstats import TaskStatistics, checkpoint_json

if TYPE_CHECKING:
    from hypercorn.typing import ASGIFramework

    from ckagent.delivery import Outbox

log = logging.getLogger(__name__)


def _not_chatter(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


_server_log = logging.getLogger(f"{__name__}.hypercorn")
"""hypercorn's error log. Its INFO lines are startup chatter ("Running on http://… (CTRL + C to quit)",
which reads like an error and speaks of Ctrl-C to a daemon): dropped; serve_status logs the address
itself. A filter, not a level, so the agent's own log level still applies to hypercorn's warnings."""
_server_log.addFilter(_not_chatter)

LISTEN_BACKLOG = 100
"""Connections the kernel queues before the server accepts them (hypercorn's default backlog)."""
READY_HEARTBEATS = 3
"""/readyz fails once no heartbeat was acknowledged for this many heartbeat intervals."""

Body = tuple[int, str, bytes]
"""(HTTP status, content type, body)."""


@dataclass(frozen=True)
class AgentStatistics:
    """A snapshot of the agent for its own HTTP port (``Agent.statistics()``); this module only renders it.

    ``heartbeat_last_success`` is the ``trio.current_time()`` of the last acknowledged heartbeat
    (None before the first); ``heartbeat_interval`` seconds; ``runtimes`` name → version only.
    """

    state: str
    name: str
    node_id: str | None
    registered: bool
    master_up: bool
    heartbeat_last_success: float | None
    heartbeat_interval: float
    max_workers: int
    free_slots: int
    tasks: tuple[TaskStatistics, ...] = ()
    slots_busy: int = 0
    """Claimed tasks not ended here, re-adopted ones included (may exceed ``max_workers`` after a
    restart with fewer workers than the adopted tasks)."""
    idle_seconds: float = 0.0
    """Seconds since the node last had a claimed task or an open delivery (ckagent.port.snapshot.idle_seconds)."""
    code_download_bytes: int = 0
    runtimes: tuple[tuple[str, Any], ...] = ()
    master_problem: str | None = None
    """What is wrong with the master, in one line (ckagent.master.connectivity), None when nothing is."""
    master_problem_age: float = 0.0
    """Seconds that problem has lasted."""
    intake_reason: str | None = None
    """Why the node takes no tasks for a reason that makes it not ready (ckagent.node.intake: its busy
    causes, e.g. a spent ``--max-tasks`` budget, left out), None when there is none."""
    containment: tuple[tuple[str, Any], ...] | None = None
    """The containment level in force (``Containment.to_json()`` items), None before it is opened."""
    egress: tuple[tuple[str, Any], ...] | None = None
    """The egress level and node policy (``Egress.to_json()`` items), None before it is opened."""
    identity: tuple[tuple[str, Any], ...] | None = None
    """Whom spiders run as: the identity level (``Identities.to_json()`` items), None before it is decided."""
    warnings: tuple[str, ...] = ()
    """Operator notices in force (ckagent.node.notices): spiders as root, the master's clock."""
    started_at: float | None = None
    """When the agent started (epoch seconds)."""
    uptime_seconds: float | None = None
    """Seconds since the agent started (monotonic)."""
    readopted_ids: tuple[str, ...] = ()
    """The tasks an earlier agent left running that this one re-adopted at its start."""
    not_readopted: tuple[tuple[str, str], ...] = ()
    """(task id, why) of the tasks found running at the start that could not be re-adopted (reported
    AGENT_LOST)."""
    handed_over_ids: tuple[str, ...] = ()
    ephemeral: tuple[tuple[str, Any], ...] | None = None
    """An ephemeral worker's settings, tasks claimed and why it stopped (ckagent.node.ephemeral); None: not one."""
    """The running tasks this agent leaves to the next one (a hand-over, SIGUSR2); empty otherwise."""
    disk_culprit: tuple[tuple[str, Any], ...] | None = None
    """The last task blamed for a full disk (``taskId``, ``usedBytes``, ``at`` epoch seconds, ``reason``),
    None when none was (or the agent has no disk watch that says)."""


@dataclass(frozen=True)
class Readiness:
    """The answer of /readyz: ``ready`` and, when not, why (one line, no secrets)."""

    ready: bool
    reason: str = "ready"


@dataclass(frozen=True)
class StatusRoutes:
    """What the server serves; each callable runs on the Trio loop.

    ``metrics(accept_header)`` → (body, content type); ``readiness()`` → Readiness;
    ``status()`` → a JSON-able dict. An exception in one of them answers 500 (and is logged).
    """

    metrics: Callable[[str], Awaitable[tuple[bytes, str]]]
    readiness: Callable[[], Readiness]
    status: Callable[[], Awaitable[dict[str, Any]]]
    page: Any = None
    """An ASGI app with ``handles(path)`` for the HTML page (``ckagent.port.statuspage.StatusPage``), or None."""


class StatusApp:
    """The ASGI application (plain ASGI: four routes need no framework)."""

    def __init__(self, routes: StatusRoutes) -> None:
        self._routes = routes
        self._paths: dict[str, Callable[[dict[str, Any]], Awaitable[Body]]] = {
            "/metrics": self._metrics,
            "/healthz": self._healthz,
            "/readyz": self._readyz,
            "/status": self._status,
        }

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """ASGI entry point (``http`` and ``lifespan`` scopes)."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        handler = self._paths.get(scope["path"])
        page = self._routes.page
        if handler is None and page is not None and page.handles(scope["path"]) and scope["method"] in ("GET", "HEAD"):
            try:
                await page(scope, receive, send)
            except Exception:
                log.exception("status server: %s failed", scope["path"])
            return
        headers: list[tuple[bytes, bytes]] = []
        if handler is None:
            status, ctype, body = 404, "text/plain; charset=utf-8", b"not found\n"
        elif scope["method"] not in ("GET", "HEAD"):
            status, ctype, body = 405, "text/plain; charset=utf-8", b"method not allowed\n"
            headers.append((b"allow", b"GET, HEAD"))
        else:
            try:
                status, ctype, body = await handler(scope)
            except Exception:
                log.exception("status server: %s failed", scope["path"])
                status, ctype, body = 500, "text/plain; charset=utf-8", b"internal error\n"
        headers += [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode()),
                    (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    async def _metrics(self, scope: dict[str, Any]) -> Body:
        accept = ""
        for name, value in scope.get("headers", []):
            if name == b"accept":
                accept = value.decode("latin-1")
        body, ctype = await self._routes.metrics(accept)
        return 200, ctype, body

    async def _healthz(self, scope: dict[str, Any]) -> Body:
        return 200, "text/plain; charset=utf-8", b"ok\n"

    async def _readyz(self, scope: dict[str, Any]) -> Body:
        answer = self._routes.readiness()
        return (200 if answer.ready else 503), "text/plain; charset=utf-8", (answer.reason + "\n").encode()

    async def _status(self, scope: dict[str, Any]) -> Body:
        data = await self._routes.status()
        return 200, "application/json", json.dumps(data, ensure_ascii=False, indent=1).encode() + b"\n"


async def serve_status(
    routes: StatusRoutes,
    host: str,
    port: int,
    *,
    serve_after: Callable[[], Awaitable[object]] | None = None,
    on_serving: Callable[[], object] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the status routes on ``host:port`` until cancelled; ``task_status.started(bound_port)``.

    ``started`` comes as soon as the socket listens: a client may connect from then on, and its
    request waits in the socket's backlog until the server answers it. hypercorn (~45 ms of imports,
    hence imported here and not at module level) starts at once, or, with ``serve_after``, once that
    returns: the agent uses it to keep this work off the way to its first heartbeat. ``on_serving()``
    is called once hypercorn serves (the agent freezes its start-up objects for the GC there).

    Raises StatusPortError (before ``started``) when the address cannot be bound. Cancellation
    closes the socket; in-flight requests are abandoned (they are all short).
    """
    sock = bind_socket(host, port)
    try:
        sock.listen(LISTEN_BACKLOG)
        bound_port = int(sock.getsockname()[1])
        task_status.started(bound_port)
        if serve_after is not None:
            await serve_after()
        from hypercorn.config import Config as HypercornConfig
        from hypercorn.trio import serve as hypercorn_serve

        config = HypercornConfig()
        config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns (and closes) the descriptor from here
    finally:
        sock.close()  # a no-op once detached
    config.accesslog = None
    config.errorlog = _server_log
    config.include_server_header = False
    config.graceful_timeout = 1.0
    config.backlog = LISTEN_BACKLOG
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(hypercorn_serve, cast("ASGIFramework", StatusApp(routes)), config))
        if on_serving is not None:
            on_serving()
        shown = f"[{host}]" if ":" in host else host
        log.info("status server on http://%s:%d (/metrics /healthz /readyz /status)", shown, bound_port)


class AgentStatus:
    """The agent's routes: render ``statistics()`` (an AgentStatistics snapshot) at request time.

    The start (``trio.current_time()`` when built) stands in for the last heartbeat before the first.
    run.sh's state dir, where it keeps its records of upgrades and failed versions, is read from
    ``environ`` (default ``os.environ``; ckagent.port.statusrunsh.state_dir_from); the records are read
    at each /status, in a thread (not started by run.sh: shown as unknown).
    """

    def __init__(self, statistics: Callable[[], AgentStatistics], metrics: AgentMetrics,
                 outbox: Outbox | None, *, environ: Mapping[str, str] | None = None) -> None:
        self._statistics = statistics
        self._metrics = metrics
        self._outbox = outbox
        self._runsh_state_dir = state_dir_from(os.environ if environ is None else environ)
        """run.sh's state dir (ckagent.port.statusrunsh), None when not started by run.sh."""
        self._started = trio.current_time()

    def routes(self, page: Any = None) -> StatusRoutes:
        """The callables :func:`serve_status` serves; ``page``: the HTML page's app (StatusRoutes.page)."""
        return StatusRoutes(metrics=self.metrics, readiness=self.readiness, status=self.status, page=page)

    def heartbeat_age(self, stats: AgentStatistics | None = None) -> float:
        """Seconds since the last acknowledged heartbeat (since the start when there was none)."""
        last = (stats or self._statistics()).heartbeat_last_success
        return max(0.0, trio.current_time() - (self._started if last is None else last))

    def readiness(self, stats: AgentStatistics | None = None) -> Readiness:
        """Ready = RUNNING, registered, a heartbeat acknowledged within READY_HEARTBEATS intervals, and
        no trouble with the master (:attr:`ckagent.master.connectivity.Connectivity.problem`) lasting longer
        than that. When not ready, the reason names the master's trouble if there is one ("registration
        refused: 401, check AGENT_REGISTRATION_TOKEN", "master answers 200 text/html to heartbeat: not
        the node protocol (…)")."""
        stats = stats or self._statistics()
        problem = stats.master_problem
        if stats.state == "STARTING" and problem:
            return Readiness(False, f"not ready: {problem}")
        if stats.state != "RUNNING":
            return Readiness(False, f"not ready: the agent is {stats.state}")
        if stats.intake_reason:
            return Readiness(False, f"not ready: {stats.intake_reason}")
        if not stats.registered:
            return Readiness(False, f"not ready: {problem or 'not registered with the master yet'}")
        if stats.heartbeat_last_success is None:
            return Readiness(False, f"not ready: {problem or 'no heartbeat acknowledged by the master yet'}")
        age = trio.current_time() - stats.heartbeat_last_success
        limit = READY_HEARTBEATS * stats.heartbeat_interval
        if age > limit:
            master = problem or ("the master is reachable" if stats.master_up else "the master is unreachable")
            return Readiness(False, f"not ready: the last heartbeat was acknowledged {age:.1f} s ago "
                                    f"(limit {limit:g} s = {READY_HEARTBEATS} x heartbeat.interval); {master}")
        if problem and stats.master_problem_age > limit:
            return Readiness(False, f"not ready: {problem}")
        return Readiness(True, "ready")

    async def _outbox_figures(self) -> OutboxFigures:
        if self._outbox is None:
            return OutboxFigures()
        return await self._outbox.figures()  # on the loop, in slices: no thread holding the GIL

    def live(self, outbox: OutboxFigures, stats: AgentStatistics | None = None) -> LiveFigures:
        """The scrape-time snapshot (on the Trio thread)."""
        stats = stats or self._statistics()
        phases = dict.fromkeys(PHASES, 0)
        for task in stats.tasks:
            phases[task.phase] = phases.get(task.phase, 0) + 1
        return LiveFigures(
            state=stats.state,
            registered=stats.registered,
            master_up=stats.master_up and stats.registered,
            node_id=stats.node_id,
            heartbeat_age_seconds=self.heartbeat_age(stats),
            max_workers=stats.max_workers,
            free_slots=stats.free_slots,
            slots_busy=stats.slots_busy,
            idle_seconds=stats.idle_seconds,
            phases=phases,
            code_download_bytes=stats.code_download_bytes,
            outbox=outbox,
        )

    async def metrics(self, accept: str) -> tuple[bytes, str]:
        """/metrics: the outbox figures and the exposition, both on the loop in slices of about
        0.25 ms of work each (SLICE_SECONDS in ckagent.port.exposition and ckagent.delivery.statistics)."""
        live = self.live(await self._outbox_figures())
        return await self._metrics.render_sliced(live, accept)

    async def status(self) -> dict[str, Any]:
        """/status as a JSON-able dict (camelCase keys, times ISO-8601 UTC, no secrets)."""
        outbox = await self._outbox_figures()
        stats = self._statistics()
        readiness = self.readiness(stats)
        resources: list[dict[str, Any]] = []
        egress: list[dict[str, Any] | None] = []
        for task in stats.tasks:  # the cgroup reads: one task per loop step
            resources.append(dict(task.resources if task.sample_resources is None else task.sample_resources()))
            egress.append(None if task.sample_egress is None else dict(task.sample_egress()))
            await trio.lowlevel.checkpoint()
        runsh = await trio.to_thread.run_sync(read_runsh_state, self._runsh_state_dir)  # (two small reads)
        changes = runsh.to_json()
        if isinstance(changes["lastChange"], dict):
            changes["lastChange"]["at"] = _iso(changes["lastChange"]["at"])
        culprit = dict(stats.disk_culprit) if stats.disk_culprit is not None else None
        if culprit is not None:
            culprit["at"] = _iso(culprit.get("at")) if isinstance(culprit.get("at"), int | float) else None
        tasks = [{
            "id": task.id,
            "spiderId": task.spider_id,
            "spiderName": task.spider_name,
            "framework": task.framework,
            "phase": task.phase,
            "since": _iso(task.claimed_at),
            "startedAt": _iso(task.started_at),
            "pid": task.pid,
            # Live figures from the task's cgroup (read above; none at the process-group level).
            "resources": figures,
            # Connections its network policy refused so far (kernel counters; None without them).
            "egress": refused,
            "attempt": task.attempt,
            "checkpoint": checkpoint_json(task.checkpoint),  # the newest the master holds; None: none yet
        } for task, figures, refused in zip(stats.tasks, resources, egress, strict=True)]
        return {
            "state": stats.state,
            "ready": readiness.ready,
            "readyReason": readiness.reason,
            "name": stats.name,
            "nodeId": stats.node_id,
            "registered": stats.registered,
            "masterUp": stats.master_up,
            "heartbeatAgeSeconds": round(self.heartbeat_age(stats), 3),
            "startedAt": _iso(stats.started_at),
            "uptimeSeconds": None if stats.uptime_seconds is None else round(stats.uptime_seconds, 1),
            "containment": dict(stats.containment) if stats.containment is not None else None,
            "egress": dict(stats.egress) if stats.egress is not None else None,
            "identity": dict(stats.identity) if stats.identity is not None else None,
            "warnings": list(stats.warnings),
            "maxWorkers": stats.max_workers,
            "freeSlots": stats.free_slots,
            # the autoscaler's figures, as ckagent_slots_capacity / _slots_busy / _idle_seconds
            "slotsCapacity": stats.max_workers,
            "slotsBusy": stats.slots_busy,
            "idleSeconds": round(stats.idle_seconds, 3),
            "runningTasks": sorted(tasks, key=lambda t: str(t["since"])),
            # at the start: what an earlier agent left running (re-adopted, or not: reported AGENT_LOST)
            "tasksAtStart": {
                "readopted": {"count": len(stats.readopted_ids), "ids": list(stats.readopted_ids[:IDS_SHOWN])},
                "notReadopted": {"count": len(stats.not_readopted),
                                 "tasks": [{"id": i, "why": why} for i, why in stats.not_readopted[:IDS_SHOWN]]},
            },
            # at a hand-over (SIGUSR2): the running tasks left to the next agent
            "handedOver": {"count": len(stats.handed_over_ids), "ids": list(stats.handed_over_ids[:IDS_SHOWN])},
            "ephemeral": dict(stats.ephemeral) if stats.ephemeral is not None else None,
            "upgrades": changes,
            "diskCulprit": culprit,
            "outbox": {"logLines": outbox.log_lines, "items": outbox.items, "results": outbox.results,
                       "tasks": outbox.tasks, "bytes": outbox.bytes,
                       "oldestSeconds": round(outbox.oldest_seconds, 1),
                       "backlog": [{"taskId": b.task_id, "logLines": b.log_lines, "items": b.items,
                                    "bytes": b.bytes, "ageSeconds": round(b.age_seconds, 1)}
                                   for b in outbox.backlog[:BACKLOG_SHOWN]]},
            "masterProblem": stats.master_problem,
            "versions": {"agent": __version__, "python": platform.python_version(),
                         "runtimes": dict(stats.runtimes)},
        }


BACKLOG_SHOWN = 50
"""Most tasks /status lists in ``outbox.backlog`` (the longest waits first)."""
IDS_SHOWN = 50
"""Most task ids /status lists for the re-adopted and handed-over tasks (``count`` counts them all)."""


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else utc_iso(datetime.fromtimestamp(epoch, timezone.utc))


def runtime_versions(runtimes: dict[str, Any]) -> dict[str, Any]:
    """Versions only (no paths) from the runtime scan."""
    out: dict[str, Any] = {}
    for name, info in runtimes.items():
        if isinstance(info, dict):
            out[name] = info.get("version")
        elif isinstance(info, str | None):
            out[name] = info
    return out
