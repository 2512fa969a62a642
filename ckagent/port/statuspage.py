"""The status page on the agent's port: ``GET /`` — one small HTML page, and a live tail of a task's log.

============================  ==================================================================
path                          answer
============================  ==================================================================
``/``                         HTML: the node (name, id, state, up since, version, containment,
                              egress level, identity level (whom spiders run as, each stronger
                              level not had), the tasks re-adopted at start and handed over at the
                              stop, the last upgrade or rollback and the failed versions, slots,
                              free disk and the last full disk's culprit), running tasks (phase, attempt, last
                              checkpoint: its age, size and items position, live stats, progress, resource
                              figures when the agent has them), the last lines of each running
                              task's log (live), recent tasks with their outcome (attempt, cause class,
                              the checkpoint it shipped last)
``/tasks/<id>/tail?from=N``   server-sent events: the task's log lines from byte N of output.log
                              on, as they are written (``event: end`` when the task is over)
``/tasks/<id>/log.txt``       the last TAIL_TXT_LINES lines of the task's log as plain text
``/tasks/<id>/artifacts/<p>`` one artifact of the task still on this node (listed in its manifest,
                              linked from the recent tasks; ckagent.delivery.outputs), as a download
============================  ==================================================================

Read-only, no framework, no build step: the tables are plain HTML (readable without JavaScript);
twenty lines of script feed the live tails and fetch the tables again every REFRESH_SECONDS. Log lines are masked like the shipped ones
(the task's secret-looking env values and the agent's credentials become ``***``); the page shows
no env, arguments, tokens or keys. Only tasks the agent knows (running, or in its state store) are
served, by their directory in the state store, never by a path from the request; at most
MAX_TAILS live tails at a time (503 beyond).
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, unquote

import trio

from ckagent.delivery import OUTPUT_LOG, LineSplitter, Masker, decode_lines, secret_values
from ckagent.delivery.crawlstats import summary
from ckagent.delivery.outputs import read_artifact
from ckagent.delivery.spool import open_spool, read_spool
from ckagent.master.ids import task_dir as task_dir_of
from ckagent.master.protocol import Task
from ckagent.port.statusrows import (
    attempt_text,
    backlog_text,
    cause_text,
    checkpoint_text,
    identity_rows,
    level_row,
    node_history_rows,
    size_text,
)

if TYPE_CHECKING:
    from ckagent.delivery import Outbox
    from ckagent.task.supervisor import Supervisor

log = logging.getLogger(__name__)

RECENT_TASKS = 20
"""Finished tasks listed on the page (newest first)."""
PAGE_TAIL_LINES = 30
"""Log lines of each running task rendered into the page."""
TAIL_TXT_LINES = 500
TAIL_READ_BYTES = 256 * 1024
"""Bytes read from the end of output.log to find the last lines."""
TAIL_INTERVAL = 0.5
"""Seconds between looks at a tailed output.log while its task has no delivery to say when it grew
(between the claim and the process's start); otherwise the tail waits on the delivery's event."""
MAX_TAILS = 8
"""Live tails served at the same time."""
REFRESH_SECONDS = 5.0
"""The page's script fetches the tables again this often (the log tails are live anyway)."""
MAX_TAIL_SECONDS = 3600.0
"""A live tail ends after this long (the browser reconnects)."""

_TASK_PATH = re.compile(r"^/tasks/([A-Za-z0-9._:-]{1,200})/(tail|log\.txt|artifacts/.{1,1024})$")

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _iso(epoch: float | None) -> str:
    if epoch is None:
        return "—"
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def resource_text(figures: dict[str, Any] | None) -> str:
    """Resource figures a record carries (any of cpuSeconds, memoryBytes, memoryPeakBytes,
    memoryCurrentBytes, pids), as one short text; "—" when there are none."""
    if not figures:
        return "—"
    parts = []
    if isinstance(figures.get("cpuSeconds"), int | float):
        parts.append(f"CPU {figures['cpuSeconds']:.1f} s")
    for key, label in (("memoryCurrentBytes", "mem"), ("memoryBytes", "mem"), ("memoryPeakBytes", "peak")):
        if isinstance(figures.get(key), int | float):
            parts.append(f"{label} {size_text(figures[key])}")
    if isinstance(figures.get("pids"), int):
        parts.append(f"{figures['pids']} procs")
    return ", ".join(parts) or "—"


def _masker(task_json: dict[str, Any] | None, agent_secrets: tuple[str, ...]) -> Masker:
    env = (task_json or {}).get("env") or {}
    command = (task_json or {}).get("command") or []
    words = [*(command.split() if isinstance(command, str) else command), *((task_json or {}).get("args") or [])]
    return Masker(secret_values({str(k): str(v) for k, v in env.items()}, agent_secrets, [str(w) for w in words]))


def last_lines(path: Path, masker: Masker, count: int, *, unfinished: bool = False) -> tuple[list[str], int]:
    """The last ``count`` complete lines of ``path`` (masked; with ``unfinished`` also an unterminated
    last one) and the byte offset after the last line returned (blocking)."""
    try:
        fd = open_spool(path)  # the spider's task dir: never through a link it planted, never a FIFO
    except OSError:
        return [], 0
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - TAIL_READ_BYTES)
        data = os.pread(fd, size - start, start)
    except OSError:
        return [], 0
    finally:
        os.close(fd)
    if start:  # begin after the first line end: the bytes before it are the end of a longer line
        cut = data.find(b"\n") + 1
        start, data = start + cut, data[cut:] if cut else b""
    splitter = LineSplitter(start)
    lines = splitter.feed(data)[0]
    if unfinished:
        lines += splitter.flush()[0]
        return decode_lines(lines[-count:], masker), start + len(data)
    return decode_lines(lines[-count:], masker), splitter.offset


class StatusPage:
    """The ASGI app of ``/`` and ``/tasks/...`` (see module docstring). ``status()`` is the /status
    JSON of :class:`ckagent.port.status.AgentStatus`; the running tasks (their stats, task dirs) are read
    from ``supervisor`` and the finished ones from ``outbox``'s state store, at request time.
    ``work_dir`` is where a task's dir is made before its delivery starts (``<work_dir>/tasks/<id>``)."""

    def __init__(self, supervisor: Supervisor, outbox: Outbox, work_dir: Path,
                 status: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        self._supervisor = supervisor
        self._outbox = outbox
        self._work_dir = work_dir
        self._status = status
        self._tails = trio.CapacityLimiter(MAX_TAILS)

    def handles(self, path: str) -> bool:
        """True for the paths this app answers."""
        return path == "/" or _TASK_PATH.match(path) is not None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """ASGI entry (http scope, GET/HEAD checked by the caller)."""
        path = scope["path"]
        if path == "/":
            body = (await self.render()).encode()
            await _respond(send, scope, 200, "text/html; charset=utf-8", body)
            return
        match = _TASK_PATH.match(path)
        assert match is not None
        task_id, what = match.group(1), match.group(2)
        found = await self._find(task_id)
        if found is None:
            await _respond(send, scope, 404, "text/plain; charset=utf-8", b"no such task on this node\n")
            return
        task_dir, masker = found
        if what.startswith("artifacts/"):
            rel = unquote(what[len("artifacts/"):])
            data = await trio.to_thread.run_sync(_artifact_bytes, task_dir, rel)
            if data is None:
                await _respond(send, scope, 404, "text/plain; charset=utf-8", b"no such artifact on this node\n")
            else:
                await _respond(send, scope, 200, "application/octet-stream", data)
            return
        if what == "log.txt":
            lines, _ = await trio.to_thread.run_sync(
                partial(last_lines, unfinished=True), task_dir / OUTPUT_LOG, masker, TAIL_TXT_LINES)
            await _respond(send, scope, 200, "text/plain; charset=utf-8", "".join(f"{x}\n" for x in lines).encode())
            return
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        try:
            offset = max(0, int(query.get("from", ["0"])[0]))
        except ValueError:
            offset = 0
        try:
            self._tails.acquire_nowait()
        except trio.WouldBlock:
            await _respond(send, scope, 503, "text/plain; charset=utf-8", b"too many live tails\n")
            return
        try:
            await self._tail(task_id, task_dir / OUTPUT_LOG, masker, offset, receive, send)
        finally:
            self._tails.release()

    # ------------------------------------------------------------------ data

    def _agent_secrets(self) -> tuple[str, ...]:
        return tuple(self._outbox.config.agent_secrets)

    def _task_dir(self, rt: Any) -> Path:
        """A running task's directory: its delivery's, else where the supervisor makes it."""
        delivery = getattr(rt, "delivery", None)
        return Path(delivery.task_dir) if delivery is not None else task_dir_of(self._work_dir, rt.task.id)

    async def _find(self, task_id: str) -> tuple[Path, Masker] | None:
        rt = self._supervisor.running.get(task_id)
        if rt is not None:
            return self._task_dir(rt), _masker(rt.task.to_json(), self._agent_secrets())
        record = await self._outbox.store.get(task_id)
        if record is None:
            return None
        return record.task_dir, _masker(record.task_json, self._agent_secrets())

    # ------------------------------------------------------------------ live tail

    async def _tail(self, task_id: str, path: Path, masker: Masker, offset: int, receive: Receive,
                    send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-store"),
            (b"x-accel-buffering", b"no")]})
        splitter = LineSplitter(offset)

        async def watch_disconnect(cancel: trio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, nursery.cancel_scope)
            with trio.move_on_after(MAX_TAIL_SECONDS):
                await send({"type": "http.response.body", "body": b": tail\n\n", "more_body": True})
                while True:
                    running = self._may_grow(task_id)
                    try:
                        data = await trio.to_thread.run_sync(read_spool, path, offset, TAIL_READ_BYTES)
                    except OSError:
                        data = b""
                    offset += len(data)
                    lines = splitter.feed(data)[0]
                    if not running and not data:
                        lines += splitter.flush()[0]
                    if lines:
                        events = "".join(f"data: {line}\n\n" for line in decode_lines(lines, masker))
                        await send({"type": "http.response.body", "body": events.encode(), "more_body": True})
                    if not running and not data:
                        await send({"type": "http.response.body", "body": b"event: end\ndata: \n\n",
                                    "more_body": True})
                        break
                    if not data:
                        await self._output_grew(task_id)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()

    def _may_grow(self, task_id: str) -> bool:
        """Whether the task's output.log may still grow: it runs and its process is not over."""
        rt = self._supervisor.running.get(task_id)
        delivery = getattr(rt, "delivery", None) if rt is not None else None
        return rt is not None and (delivery is None or not delivery.ended.is_set())

    async def _output_grew(self, task_id: str) -> None:
        """Wait until the running task's output.log grew (the delivery's event: no timed look) or the
        task is over; TAIL_INTERVAL while the task has no delivery yet."""
        rt = self._supervisor.running.get(task_id)
        delivery = getattr(rt, "delivery", None) if rt is not None else None
        if delivery is None:
            if rt is not None:
                await trio.sleep(TAIL_INTERVAL)
            return
        await delivery.wait_output()

    # ------------------------------------------------------------------ the page

    async def render(self) -> str:
        """The whole page (HTML text)."""
        status = await self._status()
        secrets_ = self._agent_secrets()
        outbox = self._outbox
        free_disk = outbox.guard.free_bytes
        containment = status.get("containment") or "—"
        if isinstance(containment, dict):
            containment = containment.get("level") or json.dumps(containment)
        running_by_id = {t["id"]: t for t in status.get("runningTasks", [])}
        running = list(self._supervisor.running.values())
        tails: list[tuple[str, str, list[str], int]] = []
        rows = []
        for rt in sorted(running, key=lambda r: r.claimed_at):
            task = rt.task
            stats_snapshot = rt.delivery.stats.latest if rt.delivery is not None else None
            figures = stats_snapshot.stats if stats_snapshot is not None else {}
            counts = summary(figures)
            progress = (stats_snapshot.data.get("progress") if stats_snapshot is not None else None) or {}
            done, total = progress.get("done"), progress.get("total")
            progress_text = "—" if done is None else (f"{done} / {total}" if total is not None else str(done))
            record = running_by_id.get(task.id, {})
            resources = record.get("resources") if isinstance(record.get("resources"), dict) else record
            by_status = figures.get("responsesByStatus")
            if not isinstance(by_status, dict):
                by_status = {}
            statuses = ", ".join(f"{k}: {v}" for k, v in sorted(by_status.items())[:6]) or "—"
            rows.append(
                f"<tr><td><code>{_e(task.id)}</code></td><td>{_e(task.spider_name or task.spider_id)}</td>"
                f"<td>{_e(task.framework)}</td><td>{_e(rt.phase)}</td><td>{_iso(rt.started_at or rt.claimed_at)}</td>"
                f"<td class=n>{task.attempt}</td><td>{_e(checkpoint_text(record.get('checkpoint')))}</td>"
                f"<td class=n>{counts['items']}</td><td class=n>{counts['requests']}</td><td>{_e(statuses)}</td>"
                f"<td class=n>{counts['errors']}</td><td>{_e(progress_text)}</td>"
                f"<td>{_e(resource_text(resources))}</td>"
                f"<td><a href=\"/tasks/{_e(task.id)}/log.txt\">log</a></td></tr>")
            lines, offset = await trio.to_thread.run_sync(
                last_lines, self._task_dir(rt) / OUTPUT_LOG,
                _masker(task.to_json(), secrets_), PAGE_TAIL_LINES)
            tails.append((task.id, task.spider_name or task.spider_id, lines, offset))
        recent_rows = []
        records = await outbox.store.recent_finished(RECENT_TASKS)
        for record in records:
            result = record.result or {}
            try:
                name = Task.from_json(record.task_json).spider_name or record.spider_id
            except ValueError:
                name = record.spider_id
            masker = _masker(record.task_json, secrets_)
            code = result.get("errorCode")
            outcome = f"{result.get('status', '?')}" + (f" ({code})" if code else "")
            reason = result.get("finishReason")
            message = masker(str(result.get("errorMessage") or ""))[:200]
            duration = result.get("durationMs")
            recent_rows.append(
                f"<tr><td><code>{_e(record.task_id)}</code></td><td>{_e(name)}</td>"
                f"<td class=\"o-{_e(str(result.get('status', '')).lower())}\">{_e(outcome)}</td>"
                f"<td class=n>{attempt_text(result.get('attempt'))}</td><td>{_e(cause_text(result))}</td>"
                f"<td>{_e(result.get('checkpointId') or '—')}</td>"
                f"<td>{_e(reason or '—')}</td><td>{_e(message or '—')}</td><td>{_iso(record.finished_at)}</td>"
                f"<td class=n>{'—' if not isinstance(duration, int) else f'{duration / 1000:.1f} s'}</td>"
                f"<td class=n>{_e(result.get('itemCount', '—'))}</td><td class=n>{_e(result.get('logLines', '—'))}</td>"
                f"<td>{_e(resource_text(result))}</td>"
                f"<td>{'delivered' if record.result_acked or outbox.marking(record.task_id) else 'sending'}</td>"
                f"<td><a href=\"/tasks/{_e(record.task_id)}/log.txt\">log</a>"
                f"{_artifact_links(record.task_id, result.get('artifacts'))}</td></tr>")
        versions = status.get("versions", {})
        node_rows = [
            ("name", status.get("name")), ("node id", status.get("nodeId") or "— (not registered)"),
            ("state", status.get("state")), ("ready", status.get("readyReason")),
            ("version", f"ckagent {versions.get('agent')} · Python {versions.get('python')}"),
            ("containment", containment),
            level_row("egress", status.get("egress")),
            *identity_rows(status.get("identity")),
            ("slots", f"{status.get('freeSlots')} free of {status.get('maxWorkers')}"),
            ("free disk (work dir)", size_text(free_disk)),
            ("master", ("reachable" if status.get("masterUp") else "unreachable")
             + (f"; {status['masterProblem']}" if status.get("masterProblem") else "")),
            ("waiting for the master", backlog_text(status.get("outbox") or {})),
            *node_history_rows(status),
            *(("warning", text) for text in status.get("warnings") or ()),
        ]
        parts = [_HEAD.replace("{title}", _e(f"ckagent · {status.get('name')}"))]
        parts.append(f"<h1>ckagent · {_e(status.get('name'))}</h1>")
        parts.append(f"<p class=small>as of {_iso(time.time())} UTC · <a href=\"/\">refresh</a> · "
                     "<a href=\"/status\">/status</a> · <a href=\"/metrics\">/metrics</a></p>")
        parts.append("<div data-live=node><h2>Node</h2><table class=kv>" + "".join(
            f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in node_rows) + "</table></div>")
        parts.append(f"<div data-live=running><h2>Running tasks ({len(rows)})</h2>")
        if rows:
            parts.append("<table><tr><th>task</th><th>spider</th><th>framework</th><th>phase</th><th>since</th>"
                         "<th>attempt</th><th>last checkpoint</th><th>items</th><th>requests</th><th>responses</th><th>errors</th><th>progress</th>"
                         "<th>resources</th><th></th></tr>" + "".join(rows) + "</table>")
        else:
            parts.append("<p>none</p>")
        parts.append("</div>")
        backlog = (status.get("outbox") or {}).get("backlog") or []
        if backlog:  # each task's data the master has not taken yet, the longest wait first
            parts.append(f"<div data-live=backlog><h2>Waiting for the master ({len(backlog)})</h2><table>"
                         "<tr><th>task</th><th>log lines</th><th>items</th><th>≈ bytes</th><th>waiting</th></tr>"
                         + "".join(f"<tr><td><code>{_e(b['taskId'])}</code></td><td class=n>{b['logLines']}</td>"
                                   f"<td class=n>{b['items']}</td><td class=n>{size_text(b['bytes'])}</td>"
                                   f"<td class=n>{b['ageSeconds']:.1f} s</td></tr>" for b in backlog)
                         + "</table></div>")
        for task_id, name, lines, offset in tails:
            parts.append(f"<h3>Log of {_e(name)} <code>{_e(task_id)}</code> (live)</h3>"
                         f"<pre class=tail data-tail=\"/tasks/{_e(task_id)}/tail?from={offset}\">"
                         + "".join(_e(line) + "\n" for line in lines) + "</pre>")
        parts.append(f"<div data-live=recent><h2>Recent tasks ({len(recent_rows)})</h2>")
        if recent_rows:
            parts.append("<table><tr><th>task</th><th>spider</th><th>outcome</th><th>attempt</th><th>cause</th>"
                         "<th>checkpoint</th><th>finish reason</th>"
                         "<th>message</th><th>finished (UTC)</th><th>duration</th><th>items</th><th>log lines</th>"
                         "<th>resources</th><th>result</th><th></th></tr>" + "".join(recent_rows) + "</table>")
        else:
            parts.append("<p>none yet</p>")
        parts.append("</div>" + _SCRIPT.replace("REFRESH_MS", str(int(REFRESH_SECONDS * 1000)))
                     + "</body></html>\n")
        return "".join(parts)


MAX_ARTIFACT_LINKS = 20
"""Artifacts linked per recent task (the rest are counted)."""


def _artifact_links(task_id: str, artifacts: Any) -> str:
    """`` · artifacts: a.json, images/1.jpg, … (+N)`` links of a result's ``artifacts`` (none: "")."""
    if not isinstance(artifacts, list) or not artifacts:
        return ""
    paths = [str(a.get("path")) for a in artifacts if isinstance(a, dict) and a.get("path")]
    links = [f"<a href=\"/tasks/{_e(task_id)}/artifacts/{_e(quote(p))}\">{_e(p)}</a>" for p in paths[:MAX_ARTIFACT_LINKS]]
    more = f" (+{len(paths) - MAX_ARTIFACT_LINKS})" if len(paths) > MAX_ARTIFACT_LINKS else ""
    return " · artifacts: " + ", ".join(links) + more


MAX_ARTIFACT_BYTES = 256 * 1024 * 1024
"""Largest artifact the page serves from this node (read whole into memory)."""


def _artifact_bytes(task_dir: Path, rel: str) -> bytes | None:
    """An artifact's bytes from this node (None: not in the manifest, gone, not a regular file of the
    task's, or larger than MAX_ARTIFACT_BYTES). Blocking."""
    return read_artifact(task_dir, rel, MAX_ARTIFACT_BYTES)


async def _respond(send: Send, scope: dict[str, Any], status: int, ctype: str, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"), (b"x-content-type-options", b"nosniff"),
        (b"content-security-policy", b"default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'")]})
    await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})


_HEAD = """<!doctype html>
<html lang=en><head><meta charset=utf-8><meta name=viewport content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.5em}h3{font-size:1em}
table{border-collapse:collapse;margin:.5em 0}th,td{border:1px solid #ccc;padding:.25em .5em;text-align:left;
vertical-align:top}th{background:#f3f3f3}td.n{text-align:right}.kv th{width:12em}
pre.tail{background:#111;color:#ddd;padding:.5em;max-height:22em;overflow:auto;white-space:pre-wrap}
.o-success{color:#060}.o-failed{color:#a00}.o-cancelled{color:#850}.small{color:#666;font-size:.9em}
</style></head><body>
"""

_SCRIPT = """<script>
setInterval(async () => {  // the tables again every few seconds (the log tails stay as they are)
  try {
    const page = new DOMParser().parseFromString(await (await fetch("/", {cache: "no-store"})).text(), "text/html");
    for (const part of document.querySelectorAll("[data-live]")) {
      const fresh = page.querySelector(`[data-live="${part.dataset.live}"]`);
      if (fresh) part.innerHTML = fresh.innerHTML;
    }
  } catch (err) { /* the agent is restarting: try again later */ }
}, REFRESH_MS);
for (const pre of document.querySelectorAll("pre[data-tail]")) {
  const source = new EventSource(pre.dataset.tail);
  source.onmessage = (event) => {
    pre.append(event.data + "\\n");
    while (pre.textContent.length > 200000) pre.removeChild(pre.firstChild);
    pre.scrollTop = pre.scrollHeight;
  };
  source.addEventListener("end", () => { source.close(); pre.append("[task ended]\\n"); });
}
</script>
"""
