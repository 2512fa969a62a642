"""A small async client of the dev master's admin API, for demos and end-to-end tests.

Exceptions::

    Exception
    └── AdminApiError        the master answered non-2xx; ``status_code``, ``message`` (its "error" text)
    TimeoutError             ``wait_task_final`` ran out of time (message names the last status)

Transport failures surface as ``httpx.TransportError``.
"""

from __future__ import annotations

import io
import os
import stat
import zipfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx
import trio

from ckagent.master.ids import api_path

__all__ = ["FINAL_TASK_STATUSES", "SKIPPED_DIRS", "AdminApiError", "AdminClient", "zip_directory"]

FINAL_TASK_STATUSES = frozenset({"SUCCESS", "FAILED", "CANCELLED"})
SKIPPED_DIRS = frozenset({"__pycache__", ".venv", ".git", "node_modules"})
"""Directory names ``zip_directory`` leaves out."""


class AdminApiError(Exception):
    """The dev master answered an admin call with a non-2xx status."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"dev master answered {status_code}: {message}")
        self.status_code = status_code
        self.message = message


class AdminClient:
    """Async client of the admin API. Use as ``async with AdminClient(base_url, admin_token) as admin:``.

    Every method raises AdminApiError on a non-2xx answer and httpx.TransportError when the master
    cannot be reached. Cancelling a call abandons the request.
    """

    def __init__(self, base_url: str, admin_token: str, *, request_timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {admin_token}"},
            timeout=request_timeout,
        )

    def __repr__(self) -> str:
        return f"AdminClient({self.base_url!r})"

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = await self._http.request(method, path, **kwargs)
        if response.status_code >= 300:
            try:
                message = str(response.json().get("error", response.text))
            except (ValueError, AttributeError):
                message = response.text
            raise AdminApiError(response.status_code, message)
        return response

    async def create_spider(
        self,
        name: str,
        framework: str,
        command: list[str] | str | None = None,
        timeout_seconds: float | None = None,
        code_mode: str = "package",
        env: dict[str, str] | None = None,
        resources: dict[str, Any] | None = None,
        stop_signal: str | None = None,
        outputs: dict[str, Any] | None = None,
        egress: dict[str, Any] | None = None,
        stop_grace_seconds: float | None = None,
        retry: dict[str, Any] | None = None,
        resume: str | None = None,
        checkpoint_interval_seconds: float | None = None,
    ) -> str:
        """Create a spider; returns its id. ``code_mode`` is "package" (zip) or "files" (file sync).
        Its tasks' defaults: ``resources`` ({memoryBytes, pids, cpus, memorySoftBytes}), ``stop_signal`` ("SIGINT"),
        ``outputs`` ({items: [glob], artifacts: [glob]}) and ``egress`` ({deny: [str], allow: [str]}: the
        network policy added to the node's), ``stop_grace_seconds`` (seconds from a stop signal to the kill),
        ``retry`` ({maxAttempts, backoffSeconds, factor, on, exitCodes}), ``resume`` ("restart-replace" or
        "restart-keep") and ``checkpoint_interval_seconds``."""
        body = {
            "retry": retry,
            "resume": resume,
            "checkpointIntervalSeconds": checkpoint_interval_seconds,
            "stopGraceSeconds": stop_grace_seconds,
            "outputs": outputs,
            "egress": egress,
            "resources": resources,
            "stopSignal": stop_signal,
            "name": name,
            "framework": framework,
            "command": command,
            "timeoutSeconds": timeout_seconds,
            "codeMode": code_mode,
            "env": env or {},
        }
        return str((await self._call("POST", "/api/spiders", json=body)).json()["id"])

    async def update_spider(self, spider_id: str, **changes: Any) -> dict[str, Any]:
        """PATCH a spider: ``command``, ``env``, ``timeoutSeconds``, ``framework``, ``name``, ``resources``,
        ``stopSignal``, ``outputs``, ``egress`` (camelCase keys, as on the wire; ``None`` clears command,
        timeout and the last four). Returns the spider."""
        result: dict[str, Any] = (await self._call("PATCH", api_path("/api/spiders/{spider}", spider=spider_id), json=changes)).json()
        return result

    async def get_spider(self, spider_id: str) -> dict[str, Any]:
        """One spider (its fields and the defaults of its tasks)."""
        result: dict[str, Any] = (await self._call("GET", api_path("/api/spiders/{spider}", spider=spider_id))).json()
        return result

    async def list_spiders(self) -> list[dict[str, Any]]:
        """Every spider."""
        result: list[dict[str, Any]] = (await self._call("GET", "/api/spiders")).json()
        return result

    async def upload_package(self, spider_id: str, zip_bytes: bytes) -> dict[str, Any]:
        """Upload a zip as the spider's code; returns ``{codeVersion, sha256, sizeBytes, fileCount}``."""
        response = await self._call(
            "PUT",
            api_path("/api/spiders/{spider}/package", spider=spider_id),
            content=zip_bytes,
            headers={"Content-Type": "application/zip"},
        )
        result: dict[str, Any] = response.json()
        return result

    async def create_task(
        self,
        spider_id: str,
        *,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        timeout_seconds: float | None = None,
        stall_timeout_seconds: float | None = None,
        resources: dict[str, Any] | None = None,
        stop_signal: str | None = None,
        egress: dict[str, Any] | None = None,
        stop_grace_seconds: float | None = None,
        clean_start: bool = False,
        retry: dict[str, Any] | None = None,
        resume: str | None = None,
        checkpoint_interval_seconds: float | None = None,
    ) -> str:
        """Queue a task of the spider; returns its id. ``timeout_seconds`` None = the spider's;
        ``stall_timeout_seconds`` None = the node's ``task.stall_timeout``; ``resources`` keys and
        ``stop_signal`` None = the spider's; ``egress`` ({deny, allow}) replaces the spider's, None = the spider's; ``stop_grace_seconds`` None =
        the spider's; ``clean_start``: the spider's data on the node starts empty (cleanStart); ``retry``,
        ``resume``, ``checkpoint_interval_seconds`` None = the spider's."""
        body = {
            "retry": retry,
            "resume": resume,
            "checkpointIntervalSeconds": checkpoint_interval_seconds,
            "stopGraceSeconds": stop_grace_seconds,
            "cleanStart": clean_start,
            "egress": egress,
            "resources": resources,
            "stopSignal": stop_signal,
            "args": args or [],
            "env": env or {},
            "params": params or {},
            "timeoutSeconds": timeout_seconds,
            "stallTimeoutSeconds": stall_timeout_seconds,
        }
        return str((await self._call("POST", api_path("/api/spiders/{spider}/tasks", spider=spider_id), json=body)).json()["id"])

    async def get_task(self, task_id: str) -> dict[str, Any]:
        """One task (status, exitCode, errorCode, nodeId, times, counts, cancelRequested, its ``attempts``
        and newest ``checkpoint``, ...)."""
        result: dict[str, Any] = (await self._call("GET", api_path("/api/tasks/{task}", task=task_id))).json()
        return result

    async def list_tasks(
        self, *, status: str | None = None, spider_id: str | None = None
    ) -> list[dict[str, Any]]:
        """Tasks oldest first, optionally filtered by status and spider."""
        params = {k: v for k, v in (("status", status), ("spiderId", spider_id)) if v}
        result: list[dict[str, Any]] = (await self._call("GET", "/api/tasks", params=params)).json()
        return result

    async def get_logs(self, task_id: str) -> list[str]:
        """The task's stored log lines, in order."""
        text = (await self._call("GET", api_path("/api/tasks/{task}/logs", task=task_id))).text
        return text.split("\n") if text else []

    async def get_log_digest(self, task_id: str) -> dict[str, Any]:
        """``{"count", "sha256", "discarded"}`` of the task's log lines (each followed by ``\\n``)."""
        result: dict[str, Any] = (await self._call("GET", api_path("/api/tasks/{task}/logs/digest", task=task_id))).json()
        return result

    async def get_items(self, task_id: str) -> list[dict[str, Any]]:
        """The task's stored items, in order."""
        result: list[dict[str, Any]] = (await self._call("GET", api_path("/api/tasks/{task}/items", task=task_id))).json()
        return result

    async def get_stats(self, task_id: str) -> dict[str, Any]:
        """The task's stats: ``{"latest": snapshot | None, "final": bool, "history": [...]}``."""
        result: dict[str, Any] = (await self._call("GET", api_path("/api/tasks/{task}/stats", task=task_id))).json()
        return result

    async def list_artifacts(self, task_id: str) -> list[dict[str, Any]]:
        """The task's artifacts ``[{path, sizeBytes, sha256, storedAt}]`` in path order."""
        result: list[dict[str, Any]] = (await self._call("GET", f"/api/tasks/{task_id}/artifacts")).json()
        return result

    async def get_artifact(self, task_id: str, path: str) -> bytes:
        """One artifact's bytes (``path`` as listed)."""
        return (await self._call("GET", f"/api/tasks/{task_id}/artifacts/{quote(path)}")).content

    async def cancel_task(self, task_id: str) -> dict[str, Any]:
        """Cancel: a PENDING task becomes CANCELLED, a RUNNING one gets cancelRequested. Returns the task."""
        result: dict[str, Any] = (await self._call("POST", api_path("/api/tasks/{task}/cancel", task=task_id))).json()
        return result

    async def list_nodes(self) -> list[dict[str, Any]]:
        """Registered nodes with their last heartbeat figures."""
        result: list[dict[str, Any]] = (await self._call("GET", "/api/nodes")).json()
        return result

    async def set_agent_versions(self, minimum: str | None, desired: str | None) -> dict[str, Any]:
        """Set (None clears) the minimum and desired agent versions the master tells its agents."""
        body = {"minAgentVersion": minimum, "desiredAgentVersion": desired}
        result: dict[str, Any] = (await self._call("PUT", "/api/agent-versions", json=body)).json()
        return result

    # `timeout` (seconds) is part of the agreed API; it bounds a polling loop, not one call: noqa ASYNC109
    async def wait_task_final(self, task_id: str, timeout: float) -> dict[str, Any]:  # noqa: ASYNC109
        """Poll every 0.1 s until the task is SUCCESS, FAILED or CANCELLED; returns it.

        Raises TimeoutError (naming the last status seen) after ``timeout`` seconds.
        """
        last: dict[str, Any] = {}
        with trio.move_on_after(timeout):
            while True:
                last = await self.get_task(task_id)
                if last.get("status") in FINAL_TASK_STATUSES:
                    return last
                await trio.sleep(0.1)
        raise TimeoutError(f"task {task_id} not final after {timeout} s (last status: {last.get('status')})")


def zip_directory(path: Path, skip: frozenset[str] = frozenset()) -> bytes:
    """A deterministic zip of the regular files under ``path`` (blocking: call via trio.to_thread).

    Entries are sorted, dated 1980-01-01, keep the owner-execute bit and skip ``SKIPPED_DIRS``,
    symlinks, special files and the paths in ``skip`` (POSIX, relative to ``path``; a folder's
    with a trailing ``/``). The same tree always gives the same bytes (and so the same
    codeVersion). Raises OSError if the tree cannot be read.
    """
    root = Path(path)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath).relative_to(root)
            dirnames[:] = sorted(d for d in dirnames
                                 if d not in SKIPPED_DIRS and (here / d).as_posix() + "/" not in skip)
            for name in sorted(filenames):
                file_path = Path(dirpath) / name
                if (here / name).as_posix() in skip:
                    continue
                st = file_path.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue
                info = zipfile.ZipInfo(
                    file_path.relative_to(root).as_posix(), date_time=(1980, 1, 1, 0, 0, 0)
                )
                mode = 0o755 if st.st_mode & stat.S_IXUSR else 0o644
                info.external_attr = (stat.S_IFREG | mode) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                archive.writestr(info, file_path.read_bytes())
    return buffer.getvalue()


def zip_files(files: Mapping[str, str | bytes]) -> bytes:
    """A deterministic zip of ``files`` (archive path → text or bytes), as :func:`zip_directory` writes them.

    For packages made in code (tests, benchmarks). Paths are taken as given: a hostile name such
    as ``../x`` is written as is (the agent's checks are what such a package exercises).
    """
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in sorted(files.items()):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (stat.S_IFREG | 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    return buffer.getvalue()
