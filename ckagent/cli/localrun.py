"""``ckagent exec``: run one spider from a local folder, zip or Scrapyd egg exactly as a node runs it — no master needed.

Exactly as a node: the command composes the agent's own parts, unchanged. It starts a private
reference master on 127.0.0.1 (port 0, random tokens, its SQLite file ``exec-master.sqlite`` in the
work dir; nothing leaves the machine), uploads the folder (zipped like an upload to a master) or the
zip as the package of the spider of that name, framework and command (the same spider as last time,
so its code version and environment are reused), starts an agent against it, and schedules one task
with the given ``--param``, ``--env``, ``--timeout``, ``--stall-timeout``. So the package checks,
the dependency install (uv / npm), the environment, the containment, the capture, items and stats
are the node's — and whom the spider runs as: the agent's identity rules (ckagent.node.identity; as
root, a uid of the spider's own by default), said in the header line before the task starts (with the
level's notice where spiders run as root or as the agent's own uid). Finished task directories are kept for a day (``task.retention``) for a look.

While it runs, the spider's output (``output.log``, the agent's notices included) streams to
stdout, the items the master stored are copied to ``--items`` (JSON lines, in the stream's order,
whichever road they took: ckagent.cli.execview; a non-empty file there is said, then replaced; it
and ``--artifacts`` are left out of a folder's package when inside it), and when stderr is a terminal one
progress line (items, requests, elapsed) is kept at the bottom. ``--args`` are appended to the
command like a task's ``args``; ``--output-items``/``--output-artifacts`` declare the spider's
``outputs`` (globs; without them the conventions apply). At the end the task's artifacts (the files it created or changed
in its working copy, ckagent.delivery.outputs) are written to ``--artifacts`` (default ``./artifacts/``;
files of the same path are replaced, others left alone), the log's ``outputs:`` line says what
became of each file, and the summary says the outcome, the counts, the stats and resource figures
the result carries, and an exit code:

==========  =================================================================
exit code   outcome
==========  =================================================================
0           SUCCESS (also LOG_BUDGET: succeeded, output cut)
1           FAILED in the spider: EXIT_NONZERO, SIGNALED, STALLED, OOM_KILLED…
3           could not start: DEPLOY_FAILED, DEPS_FAILED, AGENT_ERROR, BAD_TASK
124         TIMEOUT
130         CANCELLED (Ctrl-C)
2           usage error (bad arguments, not a package)
==========  =================================================================

The agent's own log goes to ``<work dir>/exec.log``. Ctrl-C terminates the agent, which stops the
spider the graceful way (CANCELLED).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import secrets
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import trio

from ckagent.cli.execview import Follower as _Follower
from ckagent.cli.execview import Terminal as _Terminal
from ckagent.cli.execview import attempt_lines, say_identity
from ckagent.code import frameworks
from ckagent.master.ids import task_dir

log = logging.getLogger(__name__)

EXIT_SUCCESS = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_STARTED = 3
EXIT_TIMEOUT = 124
EXIT_CANCELLED = 130
FOLLOW_INTERVAL = 0.2
"""Seconds between looks at the task's files while it runs."""
_STARTED = time.monotonic()
"""When the command started (this module is imported first thing): the summary's wall time."""


class ExecUsageError(ValueError):
    """The command line cannot be run as given; the message says what to change."""


@dataclass(frozen=True)
class ExecRequest:
    """What to run: ``source`` folder or zip; ``framework`` None = detected; ``command`` None = the
    framework's default; ``spider`` the spider name (scrapy's ``scrapy crawl <spider>``); ``timeout``
    seconds (None = the agent's default, 0 = none); ``items`` the JSON lines file to write;
    ``artifacts`` the folder the task's artifacts are written to; ``args`` appended to the command."""

    source: Path
    items: Path
    work_dir: Path
    framework: str | None = None
    command: str | None = None
    spider: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    stall_timeout: float | None = None
    config: Path | None = None
    artifacts: Path = Path("artifacts")
    args: list[str] = field(default_factory=list)
    outputs: dict[str, list[str]] | None = None
    """The spider's declared ``outputs`` ({items: [glob], artifacts: [glob]}); None = the conventions."""


def detect_framework(source: Path) -> str:
    """The framework whose marker files the project's top holds (ckagent.code.frameworks: scrapy.cfg →
    ``scrapy``, package.json → ``node``, a Scrapyd egg's EGG-INFO/entry_points.txt → ``scrapy``), else
    ``python``; a zip (an egg) is looked into (its top and one folder down, as a single top folder is unwrapped)."""
    if source.is_dir():
        names = {p.name for p in source.iterdir()}
    else:
        with zipfile.ZipFile(source) as archive:
            listed = archive.namelist()
            names = {n.rstrip("/").split("/")[-1] for n in listed if n.count("/") <= 1}
            names |= {n for n in listed if n.count("/") == 1}  # an egg's EGG-INFO/entry_points.txt
    return (frameworks.detect(names.__contains__) or frameworks.DEFAULT).name


def parse_assignments(values: list[str], what: str, *, json_values: bool) -> dict[str, Any]:
    """``["k=v", ...]`` → dict. With ``json_values`` a value that is valid JSON is decoded
    (``n=3`` → 3, ``tags=["a"]`` → list), else kept as text. Raises ExecUsageError naming the bad one."""
    out: dict[str, Any] = {}
    for raw in values:
        key, sep, value = raw.partition("=")
        if not sep or not key:
            raise ExecUsageError(f"{what} {raw!r}: expected NAME=VALUE")
        if json_values:
            try:
                out[key] = json.loads(value)
            except ValueError:
                out[key] = value
        else:
            out[key] = value
    return out


def exit_code_of(task: dict[str, Any]) -> int:
    """The process exit code for a final task record (see module docstring)."""
    status, code = task.get("status"), task.get("errorCode")
    if status == "SUCCESS":
        return EXIT_SUCCESS
    if status == "CANCELLED":
        return EXIT_CANCELLED
    if code == "TIMEOUT":
        return EXIT_TIMEOUT
    if code in ("DEPLOY_FAILED", "DEPS_FAILED", "AGENT_ERROR", "BAD_TASK"):
        return EXIT_NOT_STARTED
    return EXIT_FAILED


def _check_settings(request: ExecRequest) -> None:
    """Refuse what the agent or the master would refuse only once started (blocking): the
    configuration (file:line or the variable) and a task ``env`` naming a variable the agent sets."""
    from ckagent.master.protocol import ProtocolError
    from ckagent.master.protocol._fields import str_map
    from ckagent.node.config import ConfigError, load_settings

    try:
        load_settings(request.config, env=_agent_env(request, "http://127.0.0.1:9", "exec"))
    except ConfigError as exc:
        raise ExecUsageError(f"config error: {exc}") from None
    try:
        str_map({"env": request.env}, "env", env_names=True)
    except ProtocolError as exc:
        raise ExecUsageError(f"--env {str(exc).removeprefix('env.')}") from None


def _own_outputs_in(source: Path, request: ExecRequest) -> list[str]:
    """The ``--items`` file and the ``--artifacts`` folder as paths relative to the spider folder
    ``source`` (POSIX, a folder with a trailing ``/``), for those inside it."""
    root = source.resolve()
    found = []
    for path, suffix in ((request.items, ""), (request.artifacts, "/")):
        resolved = path.resolve()
        if resolved != root and resolved.is_relative_to(root):
            found.append(resolved.relative_to(root).as_posix() + suffix)
    return found


def _count_lines(path: Path) -> int | None:
    """The lines of a non-empty file (a last one without a line end counts), None for an empty or
    missing one (blocking)."""
    try:
        with path.open("rb") as fh:
            lines, last = 0, b""
            while block := fh.read(1 << 20):
                lines += block.count(b"\n")
                last = block
    except (FileNotFoundError, IsADirectoryError):
        return None
    if not last:
        return None
    return lines + (not last.endswith(b"\n"))


EXEC_RETENTION = 86400.0
"""Seconds a finished task's directory stays in the exec work dir."""


def _open_master_db(path: Path) -> None:
    """Make sure the exec master's file can be opened: one of another schema version is a cache, so
    it is replaced (blocking)."""
    from ckagent.devmaster.errors import SchemaError
    from ckagent.devmaster.store import Store

    try:
        Store(path).close()
    except SchemaError:
        for extra in ("", "-wal", "-shm"):
            Path(f"{path}{extra}").unlink(missing_ok=True)


def _agent_env(request: ExecRequest, base_url: str, token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith("AGENT_")}
    env.update({
        "AGENT_SERVER_URL": base_url,
        "AGENT_REGISTRATION_TOKEN": token,
        "AGENT_WORK_DIR": str(request.work_dir),
        "AGENT_NAME": "ckagent-exec",
        "AGENT_IP": "127.0.0.1",
        "AGENT_BIND": "127.0.0.1",
        "AGENT_PORT": "0",
        "AGENT_MAX_WORKERS": "1",
        "AGENT_HEARTBEAT_INTERVAL": "2",
        "AGENT_TASK_POLL_INTERVAL": "0.5",
        "AGENT_TASK_LONG_POLL_WAIT": "5",
        "AGENT_LOG_FILE": str(request.work_dir / "exec.log"),
        "AGENT_TASK_RETENTION": str(EXEC_RETENTION),
    })
    env.pop("AGENT_API_KEY", None)
    return env


def _summary(task: dict[str, Any], stats: dict[str, Any] | None, items_path: Path, seconds: float) -> list[str]:
    code = task.get("errorCode")
    outcome = str(task.get("status")) + (f" ({code})" if code else "")
    if task.get("finishReason"):
        outcome += f", finish reason {task['finishReason']}"
    lines = [f"[ckagent exec] outcome: {outcome}"]
    if task.get("errorMessage"):
        lines.append(f"[ckagent exec] message: {task['errorMessage']}")
    lines += attempt_lines(task)
    counts = f"{task.get('itemCount') or 0} items -> {items_path}, {task.get('logLines') or 0} log lines"
    figures = (stats or {}).get("stats") or {}
    for key in ("requests", "responses", "errors", "retries"):
        if isinstance(figures.get(key), int):
            counts += f", {figures[key]} {key}"
    lines.append(f"[ckagent exec] counts: {counts}")
    resources = [f"{seconds:.1f} s wall"]
    if isinstance(task.get("durationMs"), int):
        resources.append(f"{task['durationMs'] / 1000:.1f} s task")
    if isinstance(task.get("cpuSeconds"), int | float):
        resources.append(f"{task['cpuSeconds']:.1f} s CPU")
    if isinstance(task.get("memoryPeakBytes"), int):
        resources.append(f"{task['memoryPeakBytes'] / 2**20:.0f} MiB memory peak")
    lines.append("[ckagent exec] resources: " + ", ".join(resources))
    refused = task.get("egressRefused")
    if isinstance(refused, list) and refused:
        from ckagent.containment.egress import Refusal, describe_refusals

        lines.append("[ckagent exec] " + describe_refusals(
            [Refusal(str(r.get("address")), int(r.get("port") or 0), int(r.get("count") or 0))
             for r in refused if isinstance(r, dict)]))
    return lines


async def run_exec(request: ExecRequest, out: TextIO, err: TextIO) -> int:
    """Run ``request`` (see module docstring); returns the exit code. Raises ExecUsageError for bad
    input (the spider did not run then). Cancellation terminates the agent and the master."""
    from ckagent.devmaster.client import zip_directory

    source = request.source
    if not source.exists():
        raise ExecUsageError(f"{source}: no such folder or zip")
    if source.is_file() and source.suffix.lower() not in (".zip", ".egg"):
        raise ExecUsageError(f"{source}: expected a spider's folder, a .zip of it or a Scrapyd .egg")
    if source.is_file() and not await trio.to_thread.run_sync(zipfile.is_zipfile, source):
        raise ExecUsageError(f"{source}: not a zip file")
    await trio.to_thread.run_sync(_check_settings, request)
    framework = request.framework
    if not framework:
        framework = await trio.to_thread.run_sync(detect_framework, source)
    try:
        record = frameworks.framework(framework)
    except frameworks.UnknownFramework as exc:
        raise ExecUsageError(f"--framework: {exc}") from None
    if (record.spider_names is not None and frameworks.SPIDER_NAME in record.command and request.command is None
            and request.spider is None):
        names = await trio.to_thread.run_sync(record.spider_names, source)
        if len(names) != 1:
            found = f"its spiders are {', '.join(names)}" if names else "no spider found in its spiders/ modules"
            shown = " ".join("NAME" if part == frameworks.SPIDER_NAME else part for part in record.command)
            raise ExecUsageError(f"a {record.title} project with more or less than one spider needs --spider NAME "
                                 f"(what `{shown}` runs) or --command; {found}")
        request = dataclasses.replace(request, spider=names[0])
        print(f"spider: {names[0]} (the project's only spider)", file=err)
    if source.is_dir():
        own = _own_outputs_in(source, request)
        if own:
            print(f"[ckagent exec] left out of the package (exec's own output): {', '.join(own)}", file=err)
        package = await trio.to_thread.run_sync(lambda: zip_directory(source, skip=frozenset(own)))
    else:
        package = await trio.to_thread.run_sync(source.read_bytes)

    def prepare() -> Path:
        request.work_dir.mkdir(parents=True, exist_ok=True)
        request.items.parent.mkdir(parents=True, exist_ok=True)
        lines = _count_lines(request.items)
        if lines is not None:
            print(f"[ckagent exec] replacing {request.items} ({lines} lines)", file=err)
        request.items.write_bytes(b"")
        db_path = request.work_dir / "exec-master.sqlite"
        _open_master_db(db_path)
        return db_path

    db_path = await trio.to_thread.run_sync(prepare)
    terminal = _Terminal(out, err)
    outcome: list[int] = []
    refused: list[ExecUsageError] = []
    try:
        async with trio.open_nursery() as root:
            root.start_soon(_session, request, framework, package, db_path, terminal, outcome, refused, root)
    finally:
        terminal.done()
    if refused:
        raise refused[0]
    return outcome[0] if outcome else EXIT_CANCELLED


async def _session(request: ExecRequest, framework: str, package: bytes, db_path: Path, terminal: _Terminal,
                   outcome: list[int], refused: list[ExecUsageError], root: trio.Nursery) -> None:
    """Master + agent + the task in ``root``; appends the exit code to ``outcome`` (or the reason
    the package was refused to ``refused``), then cancels ``root``."""
    from ckagent.agent import Agent
    from ckagent.devmaster.client import AdminApiError, AdminClient
    from ckagent.devmaster.server import DevMasterConfig, serve
    from ckagent.devmaster.store import Store
    from ckagent.node.config import load_settings

    source = request.source
    name = request.spider or (source.stem if source.is_file() else source.resolve().name)
    token, admin_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    config = DevMasterConfig(db_path=db_path, registration_token=token,
                             admin_token=admin_token, port=0)
    base_url = await root.start(serve, config)
    settings = load_settings(request.config, env=_agent_env(request, base_url, token))
    agent = Agent(settings)
    agent_done = trio.Event()

    async def run_agent() -> None:
        try:
            await agent.run()
        finally:
            agent_done.set()

    root.start_soon(run_agent)
    reader: Store | None = None  # the exec's own look at the master's database: the items it stored
    try:
        reader = await trio.to_thread.run_sync(Store, db_path)
        with trio.fail_after(60):
            await agent.started.wait()
        async with AdminClient(base_url, admin_token) as admin:
            spider_id = await _spider(admin, name, framework, request.command)
            await admin.update_spider(spider_id, outputs=request.outputs)
            try:
                await admin.upload_package(spider_id, package)
            except AdminApiError as exc:
                refused.append(ExecUsageError(f"{source}: not a spider package the agent can take: {exc.message}"))
                return
            await say_identity(agent.identities, spider_id, terminal.err)
            task_id = await admin.create_task(spider_id, params=request.params, env=request.env,
                                              timeout_seconds=request.timeout, args=request.args,
                                              stall_timeout_seconds=request.stall_timeout)
            follower = _Follower(task_dir(settings.task.work_dir, task_id), request.items, terminal,
                                 functools.partial(reader.item_chunks_from, task_id))
            task = await _follow(admin, task_id, follower, agent_done)
            stats = (await admin.get_stats(task_id))["latest"]
            saved = await _save_artifacts(admin, task_id, request.artifacts)
        await trio.to_thread.run_sync(follower.step, True)
        terminal.done()
        terminal.end_line()
        err = terminal.err
        for line in _summary(task, stats, request.items, time.monotonic() - _STARTED):
            err.write(line + "\n")
        if saved:
            err.write(f"[ckagent exec] artifacts: {saved[0]} file(s), {saved[1]} bytes -> {request.artifacts}\n")
        err.flush()
        outcome.append(exit_code_of(task))
    finally:
        agent.terminate()
        with trio.CancelScope(shield=True), trio.move_on_after(30):
            await agent_done.wait()
        if reader is not None:
            reader.close()
        root.cancel_scope.cancel()


async def _save_artifacts(admin: Any, task_id: str, folder: Path) -> tuple[int, int] | None:
    """Write the task's artifacts (as the master holds them) under ``folder``; (files, bytes) or None
    when there are none. A path that is not a plain relative path is skipped (never written outside)."""
    from ckagent.master.protocol import ProtocolError
    from ckagent.master.protocol.outputs import check_artifact_path

    listed = await admin.list_artifacts(task_id)
    if not listed:
        return None
    count = size = 0
    for entry in listed:
        try:
            rel = check_artifact_path(entry.get("path"))
        except ProtocolError as exc:
            log.warning("exec: artifact skipped: %s", exc)
            continue
        data = await admin.get_artifact(task_id, rel)

        def write(rel: str = rel, data: bytes = data) -> None:
            target = folder / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

        await trio.to_thread.run_sync(write)
        count += 1
        size += len(data)
    return count, size


async def _spider(admin: Any, name: str, framework: str, command: str | None) -> str:
    """The id of the exec master's spider of this name, framework and command (created if new)."""
    for spider in await admin.list_spiders():
        if (spider["name"], spider["framework"], spider["command"]) == (name, framework, command):
            return str(spider["id"])
    return str(await admin.create_spider(name=name, framework=framework, command=command))


async def _follow(admin: Any, task_id: str, follower: _Follower, agent_done: trio.Event) -> dict[str, Any]:
    """Follow the task's files until the master holds its final result; return the task record."""
    while True:
        await trio.to_thread.run_sync(follower.step)
        task: dict[str, Any] = await admin.get_task(task_id)
        if task["status"] in ("SUCCESS", "FAILED", "CANCELLED"):
            return task
        if agent_done.is_set():  # Ctrl-C: the agent stopped; its CANCELLED result may be on its way
            with trio.move_on_after(5):  # noqa: ASYNC912 - nothing to wait for when the task is final
                while task["status"] not in ("SUCCESS", "FAILED", "CANCELLED"):
                    await trio.sleep(0.1)
                    task = await admin.get_task(task_id)
            if task["status"] == "RUNNING":
                task = {**task, "status": "CANCELLED", "errorCode": "CANCELLED",
                        "errorMessage": "interrupted"}
            return task
        await trio.sleep(FOLLOW_INTERVAL)


def default_work_dir() -> Path:
    """``$XDG_CACHE_HOME/ckagent/exec`` (``~/.cache/ckagent/exec``): environments are reused across runs."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ckagent" / "exec"


def exec_main(request: ExecRequest) -> int:
    """Entry point of ``ckagent exec``: runs :func:`run_exec` in Trio; ExecUsageError → exit 2."""
    from ckagent.node.logs import setup_logging
    from ckagent.node.workdir import WorkDirError, WorkDirLock

    try:
        request.work_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"ckagent exec: cannot create the work dir {request.work_dir}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        lock = WorkDirLock.acquire(request.work_dir)
    except WorkDirError as exc:
        print(f"ckagent exec: {exc}; pass another --work-dir", file=sys.stderr)
        return EXIT_USAGE
    setup_logging("INFO", request.work_dir / "exec.log", stderr=False)
    logging.getLogger("ckagent.devmaster").setLevel(logging.WARNING)
    try:
        return trio.run(run_exec, request, sys.stdout, sys.stderr)
    except ExecUsageError as exc:
        print(f"ckagent exec: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_CANCELLED
    finally:
        lock.release()
