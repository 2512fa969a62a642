"""The dev master's page of one task (``GET /tasks/{taskId}``): its status, its attempts — where each ran,
how it ended and why (errorCode, causeClass), what the master did next — and its newest checkpoint
(age, size, items position). The same facts as ``GET /api/tasks/{taskId}`` (admin JSON), for a browser.

An admin page: it takes the admin token as a bearer token, or as the password of HTTP Basic
authentication (any user name), so a browser asks for it. Every value is HTML-escaped.
"""

from __future__ import annotations

import base64
import binascii
import html
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute

from ckagent.devmaster.web import Api, bearer, route, same_secret

_STYLE = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}"
          "td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left;vertical-align:top}")


def _basic_password(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")[2]
    except (binascii.Error, UnicodeDecodeError):
        return None


def _cell(value: Any) -> str:
    return "<td>" + ("" if value is None else html.escape(str(value))) + "</td>"


def _size(n: int | None) -> str:
    """``n`` bytes in words (``183244`` → ``179.0 KiB``)."""
    if n is None:
        return ""
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def render(task: dict[str, Any], node_names: dict[str, str]) -> str:
    """The page of ``task`` (its admin JSON with ``attempts`` and ``checkpoint``)."""
    def node(node_id: str | None) -> str | None:
        return None if node_id is None else node_names.get(node_id, node_id)

    head = [("task", task["id"]), ("spider", task["spiderName"]), ("status", task["status"]),
            ("attempt", task.get("attempt")), ("not before", task.get("notBefore")),
            ("error", " ".join(str(v) for v in (task.get("errorCode"), task.get("errorMessage")) if v)),
            ("items", task.get("storedItems")), ("log lines", task.get("storedLogLines")),
            ("retry", task.get("retry")), ("resume", task.get("resume") or "restart-replace")]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>task {html.escape(task['id'])}</title>"
             f"<style>{_STYLE}</style></head><body><h1>Task {html.escape(task['id'])}</h1><table>"]
    parts += [f"<tr><th>{name}</th>{_cell(value)}</tr>" for name, value in head]
    parts.append("</table><h2>Newest checkpoint</h2>")
    cp = task.get("checkpoint")
    if cp is None:
        parts.append("<p>none</p>")
    else:
        parts.append("<table>" + "".join(f"<tr><th>{name}</th>{_cell(value)}</tr>" for name, value in (
            ("id", cp["id"]), ("attempt", cp["attempt"]), ("age", f"{cp['ageSeconds']:.0f} s"),
            ("created", cp["createdAt"]), ("reason", cp["reason"]), ("size", _size(cp["sizeBytes"])),
            ("files", cp["fileCount"]), ("items position", cp["itemSeq"]), ("log position", cp["logSeq"]))) + "</table>")
    parts.append("<h2>Attempts</h2><table><tr><th>#</th><th>node</th><th>status</th><th>errorCode</th>"
                 "<th>causeClass</th><th>counted</th><th>then</th><th>resumed from</th><th>items kept / dropped</th>"
                 "<th>started</th><th>finished</th><th>message</th></tr>")
    for a in task.get("attempts", []):
        counted = None if a["counted"] is None else ("yes" if a["counted"] else "no")
        message = (a.get("errorMessage") or "")[:300]
        parts.append("<tr>" + "".join(_cell(v) for v in (
            a["attempt"], node(a["nodeId"]), a["status"], a["errorCode"], a["causeClass"], counted, a["decision"],
            a["resumedFrom"], f"{a['itemsKept']} / {a['itemsDropped']}", a["startedAt"], a["finishedAt"],
            message)) + "</tr>")
    parts.append("</table></body></html>")
    return "".join(parts)


def routes(api: Api) -> list[BaseRoute]:
    """The task page over ``api`` (an admin route)."""
    store, run = api.store, api.run

    async def task_page(request: Request) -> Response:
        token = bearer(request) or _basic_password(request)
        if not same_secret(token, api.admin_token):
            return HTMLResponse("<p>the admin token is needed (as the password)</p>", status_code=401,
                                headers={"WWW-Authenticate": 'Basic realm="ckagent dev master", charset="UTF-8"'})
        task = await run(store.get_task, request.path_params["task_id"])
        nodes = await run(store.list_nodes)
        return HTMLResponse(render(task, {n["id"]: n["name"] for n in nodes}))

    return [route("admin", "/tasks/{task_id:seg}", task_page, "GET")]
