"""The dev master's admin API (docs/protocol.md, "The reference master's admin API"): spiders and
their code, tasks and what they delivered, nodes, the agent version policy. Every route takes the
admin token; a payload that breaks the rules is 422 naming the field.
"""

from __future__ import annotations

import difflib
import math
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute

from ckagent.devmaster.errors import BadRequestError
from ckagent.devmaster.packages import MAX_PACKAGE_BYTES, read_package
from ckagent.devmaster.paths import check_spider_name
from ckagent.devmaster.web import Api, json_body, json_object, query_int, read_body, route
from ckagent.master.protocol import (
    FRAMEWORKS,
    RESUME_MODES,
    ProtocolError,
    RetryPolicy,
    TaskOutputs,
    TaskResources,
    VersionPolicy,
    parse_egress,
    parse_stop_signal,
)
from ckagent.master.protocol.outputs import check_artifact_path

TASK_STATUSES = ("PENDING", "RUNNING", "SUCCESS", "FAILED", "CANCELLED")


# --------------------------------------------------------------------------- payload checks


def _opt_str_list(o: dict[str, Any], key: str) -> list[str]:
    value = o.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProtocolError(key, "expected an array of strings")
    return value


def _opt_str_map(o: dict[str, Any], key: str) -> dict[str, str]:
    # Names are not checked against the env-name rule on purpose: a bad name makes a task the agent
    # must refuse with BAD_TASK, which is how that path is tested.
    value = o.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ProtocolError(key, "expected an object of strings")
    return value


def _opt_seconds(o: dict[str, Any], key: str) -> float | None:
    value = o.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ProtocolError(key, "expected a number of seconds >= 0 or null")
    return float(value)


SPIDER_FIELDS = ("name", "framework", "command", "codeMode", "env", "timeoutSeconds", "resources", "stopSignal",
                 "outputs", "egress", "stopGraceSeconds", "retry", "resume", "checkpointIntervalSeconds")
"""What ``POST /api/spiders`` takes."""
TASK_FIELDS = ("args", "env", "params", "timeoutSeconds", "stallTimeoutSeconds", "resources", "stopSignal", "egress",
               "stopGraceSeconds", "cleanStart", "retry", "resume", "checkpointIntervalSeconds")
"""What ``POST /api/spiders/{id}/tasks`` takes."""


def _opt_flag(o: dict[str, Any], key: str) -> bool:
    """An optional boolean of a request body (absent or null: False). Raises ProtocolError (422)."""
    value = o.get(key)
    if value is not None and not isinstance(value, bool):
        raise ProtocolError(key, "expected true, false or null")
    return bool(value)


def _known_keys(o: dict[str, Any], fields: tuple[str, ...], what: str) -> None:
    """422 naming the first key of ``o`` that is not one of ``fields``: a misspelt key (``timeout`` for
    ``timeoutSeconds``) would otherwise be ignored, and the spider or task made without it."""
    unknown = sorted(set(o) - set(fields))
    if unknown:
        close = difflib.get_close_matches(unknown[0], fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ProtocolError(unknown[0], f"unknown key{hint}: {what} takes {', '.join(fields)}")


SPIDER_PATCH_FIELDS = ("name", "framework", "command", "env", "timeoutSeconds", "resources", "stopSignal", "outputs",
                       "egress", "stopGraceSeconds", "retry", "resume", "checkpointIntervalSeconds")
"""What ``PATCH /api/spiders/{id}`` may change."""


def _outputs(o: dict[str, Any]) -> dict[str, Any] | None:
    """A spider's ``outputs`` (validated, a misspelt key refused; null or absent = None: the conventions)."""
    raw = o.get("outputs")
    unknown = sorted(set(raw) - {"items", "artifacts"}) if isinstance(raw, dict) else []
    if unknown:
        raise ProtocolError(f"outputs.{unknown[0]}", "unknown key: outputs takes 'items' and 'artifacts'")
    outputs = TaskOutputs.from_json(raw, "outputs")
    return None if outputs is None else outputs.to_json()


def _egress(o: dict[str, Any]) -> dict[str, Any] | None:
    """``egress`` of a spider or task (the wire shape of a task's ``egress``: ``{"deny": [...], "allow":
    [...]}``), validated as an agent validates it and normalised (``127.0.0.2`` → ``127.0.0.2/32``);
    null or absent = None. Raises ProtocolError naming the entry (``egress.deny``...)."""
    policy = parse_egress(o.get("egress"), "egress")
    return None if policy is None else policy.to_json()


def _retry(o: dict[str, Any]) -> dict[str, Any] | None:
    """``retry`` of a spider or task (the wire's RetryPolicy, every field filled in); null or absent = None."""
    policy = RetryPolicy.from_json(o.get("retry"), "retry")
    return None if policy is None else policy.to_json()


def _resume(o: dict[str, Any]) -> str | None:
    """``resume``: restart-replace or restart-keep; null or absent = None (the spider's, else replace)."""
    value = o.get("resume")
    if value is not None and value not in RESUME_MODES:
        raise ProtocolError("resume", f"expected one of {', '.join(RESUME_MODES)} or null")
    return value


def _interval(o: dict[str, Any]) -> float | None:
    """``checkpointIntervalSeconds``: a number of seconds > 0, or null (the node's task.checkpoint_interval)."""
    value = _opt_seconds(o, "checkpointIntervalSeconds")
    if value == 0:
        raise ProtocolError("checkpointIntervalSeconds", "expected a number of seconds > 0 or null")
    return value


def _command(o: dict[str, Any]) -> list[str] | str | None:
    value = o.get("command")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise ProtocolError("command", "expected a non-empty array of strings, a string or null")



def routes(api: Api) -> list[BaseRoute]:
    """The admin API's routes over ``api`` (the artifact reads only with ``api.artifacts``)."""
    store, notifier, run, admin_auth = api.store, api.notifier, api.run, api.admin_auth

    async def get_agent_versions(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse((await run(store.version_policy)).to_json())

    async def put_agent_versions(request: Request) -> Response:
        admin_auth(request)
        body = await json_body(request)
        if not isinstance(body, dict):
            raise BadRequestError("expected a JSON object {minAgentVersion, desiredAgentVersion}")
        policy = VersionPolicy.from_json(body)
        await run(store.set_version_policy, policy)
        notifier.notify()  # held polls look again: a node now below the minimum gets nothing
        return JSONResponse(policy.to_json())


    async def task_stats(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.task_stats, request.path_params["task_id"]))


    async def create_spider(request: Request) -> Response:
        admin_auth(request)
        o = json_object(await json_body(request))
        _known_keys(o, SPIDER_FIELDS, "a spider")
        name = check_spider_name(o.get("name"))
        framework = o.get("framework")
        if framework not in FRAMEWORKS:
            raise ProtocolError("framework", f"expected one of {', '.join(FRAMEWORKS)}")
        code_mode = o.get("codeMode") or "package"
        if code_mode not in ("package", "files"):
            raise ProtocolError("codeMode", "expected package or files")
        spider_id = await run(
            store.create_spider,
            name=name,
            framework=framework,
            command=_command(o),
            timeout_seconds=_opt_seconds(o, "timeoutSeconds"),
            code_mode=code_mode,
            env=_opt_str_map(o, "env"),
            resources=TaskResources.from_json(o.get("resources"), "resources").to_json(),
            stop_signal=parse_stop_signal(o, ""),
            outputs=_outputs(o),
            egress=_egress(o),
            stop_grace_seconds=_opt_seconds(o, "stopGraceSeconds"),
            retry=_retry(o),
            resume=_resume(o),
            checkpoint_interval_seconds=_interval(o),
        )
        return JSONResponse({"id": spider_id})

    async def list_spiders(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.list_spiders))

    async def get_spider(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.get_spider, request.path_params["spider_id"]))

    async def update_spider(request: Request) -> Response:
        """PATCH: change the fields given (command, env, timeoutSeconds, framework, name, resources,
        stopSignal, outputs, egress, stopGraceSeconds, retry, resume, checkpointIntervalSeconds; null clears
        the last eight); tasks created afterwards use them (a task already created keeps what it had)."""
        admin_auth(request)
        o = json_object(await json_body(request))
        unknown = sorted(set(o) - set(SPIDER_PATCH_FIELDS))
        if unknown:
            raise ProtocolError(unknown[0], f"cannot be changed; a PATCH may hold {', '.join(SPIDER_PATCH_FIELDS)}")
        changes: dict[str, Any] = {}
        if "name" in o:
            changes["name"] = check_spider_name(o["name"])
        if "framework" in o:
            if o["framework"] not in FRAMEWORKS:
                raise ProtocolError("framework", f"expected one of {', '.join(FRAMEWORKS)}")
            changes["framework"] = o["framework"]
        if "command" in o:
            changes["command"] = _command(o)
        if "timeoutSeconds" in o:
            changes["timeout_seconds"] = _opt_seconds(o, "timeoutSeconds")
        if "env" in o:
            changes["env"] = _opt_str_map(o, "env")
        if "resources" in o:
            changes["resources"] = TaskResources.from_json(o["resources"], "resources").to_json() or None
        if "stopSignal" in o:
            changes["stop_signal"] = parse_stop_signal(o, "")
        if "outputs" in o:
            changes["outputs"] = _outputs(o)
        if "egress" in o:
            changes["egress"] = _egress(o)
        if "stopGraceSeconds" in o:
            changes["stop_grace_seconds"] = _opt_seconds(o, "stopGraceSeconds")
        if "retry" in o:
            changes["retry"] = _retry(o)
        if "resume" in o:
            changes["resume"] = _resume(o)
        if "checkpointIntervalSeconds" in o:
            changes["checkpoint_interval_seconds"] = _interval(o)
        return JSONResponse(await run(store.update_spider, request.path_params["spider_id"], changes))

    async def upload_package(request: Request) -> Response:
        admin_auth(request)
        spider_id = request.path_params["spider_id"]
        await run(store.get_spider, spider_id)  # 404 before reading a large body
        data = await read_body(request, MAX_PACKAGE_BYTES)
        contents = await run(read_package, data)
        answer = await run(store.store_package, spider_id, contents, data)
        return JSONResponse(answer)

    async def create_task(request: Request) -> Response:
        admin_auth(request)
        o = json_object(await json_body(request))
        _known_keys(o, TASK_FIELDS, "a task")
        params = o.get("params")
        if params is not None and not isinstance(params, dict):
            raise ProtocolError("params", "expected an object")
        task_id = await run(
            store.create_task,
            request.path_params["spider_id"],
            args=_opt_str_list(o, "args"),
            env=_opt_str_map(o, "env"),
            params=params or {},
            timeout_seconds=_opt_seconds(o, "timeoutSeconds"),
            stall_timeout_seconds=_opt_seconds(o, "stallTimeoutSeconds"),
            resources=TaskResources.from_json(o.get("resources"), "resources").to_json(),
            stop_signal=parse_stop_signal(o, ""),
            egress=_egress(o),
            stop_grace_seconds=_opt_seconds(o, "stopGraceSeconds"),
            clean_start=_opt_flag(o, "cleanStart"),
            retry=_retry(o),
            resume=_resume(o),
            checkpoint_interval_seconds=_interval(o),
        )
        notifier.notify()
        return JSONResponse({"id": task_id})

    async def list_tasks(request: Request) -> Response:
        admin_auth(request)
        status = request.query_params.get("status") or None
        if status is not None and status not in TASK_STATUSES:
            raise ProtocolError("status", f"expected one of {', '.join(TASK_STATUSES)}")
        limit = query_int(request, "limit", 1000, 1, 100_000)
        spider_id = request.query_params.get("spiderId") or None
        return JSONResponse(await run(store.list_tasks, status=status, spider_id=spider_id, limit=limit))

    async def get_task(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.get_task, request.path_params["task_id"]))

    # These bodies (up to every line or item of a task) are built and encoded in the worker thread.
    def log_text(task_id: str) -> Response:
        return PlainTextResponse(store.task_log_text(task_id))

    def items_json(task_id: str) -> Response:
        return JSONResponse(store.task_items(task_id))

    async def task_logs(request: Request) -> Response:
        admin_auth(request)
        return await run(log_text, request.path_params["task_id"])

    async def task_log_digest(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.log_digest, request.path_params["task_id"]))

    async def task_items(request: Request) -> Response:
        admin_auth(request)
        return await run(items_json, request.path_params["task_id"])


    async def list_artifacts(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.list_artifacts, request.path_params["task_id"]))

    async def get_artifact(request: Request) -> Response:
        admin_auth(request)
        path = check_artifact_path(request.path_params["path"], "path")
        blob = await run(store.artifact_bytes, request.path_params["task_id"], path)
        headers = {"Content-Disposition": f"attachment; filename*=UTF-8''{quote(path.rsplit('/', 1)[-1])}"}
        if isinstance(blob, bytes):  # a small artifact, kept in the database
            return Response(blob, media_type="application/octet-stream", headers=headers)
        return FileResponse(blob, media_type="application/octet-stream", headers=headers)

    async def cancel_task(request: Request) -> Response:
        admin_auth(request)
        task = await run(store.cancel_task, request.path_params["task_id"])
        notifier.notify()
        return JSONResponse(task)

    async def list_nodes(request: Request) -> Response:
        admin_auth(request)
        return JSONResponse(await run(store.list_nodes))


    return [
        route("admin", "/api/nodes", list_nodes, "GET"),
        route("admin", "/api/agent-versions", get_agent_versions, "GET"),
        route("admin", "/api/agent-versions", put_agent_versions, "PUT"),
        route("admin", "/api/tasks/{task_id:seg}/logs", task_logs, "GET"),
        route("admin", "/api/tasks/{task_id:seg}/logs/digest", task_log_digest, "GET"),
        route("admin", "/api/tasks/{task_id:seg}/items", task_items, "GET"),
        route("admin", "/api/tasks/{task_id:seg}/stats", task_stats, "GET"),
        route("admin", "/api/tasks/{task_id:seg}/cancel", cancel_task, "POST"),
        *([route("admin", "/api/tasks/{task_id:seg}/artifacts/{path:path}", get_artifact, "GET"),
           route("admin", "/api/tasks/{task_id:seg}/artifacts", list_artifacts, "GET")] if api.artifacts else []),
        route("admin", "/api/tasks/{task_id:seg}", get_task, "GET"),
        route("admin", "/api/tasks", list_tasks, "GET"),
        route("admin", "/api/spiders", create_spider, "POST"),
        route("admin", "/api/spiders", list_spiders, "GET"),
        route("admin", "/api/spiders/{spider_id:seg}", get_spider, "GET"),
        route("admin", "/api/spiders/{spider_id:seg}", update_spider, "PATCH"),
        route("admin", "/api/spiders/{spider_id:seg}/package", upload_package, "PUT"),
        route("admin", "/api/spiders/{spider_id:seg}/tasks", create_task, "POST"),
    ]
