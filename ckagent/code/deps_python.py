"""Python spiders' environments: a virtualenv per key, built with uv, with the bundled SDK in it.

``envs/py-<key>/`` (ckagent.code.pyplan computes the key and the mode), whose ``bin`` goes first on
the spider's PATH:

- ``uv.lock`` + ``pyproject.toml`` → ``uv export --frozen`` (the lock's exact versions, without
  the project itself) → ``uv pip sync`` (exactly those, through the configured index);
- another lock (ckagent.code.pylocks) → exactly what it pins;
- ``pyproject.toml`` → ``uv pip install -r pyproject.toml``; ``requirements.txt`` → ``uv pip install
  -r requirements.txt``;
- no dependency file → the framework's default packages (ckagent.code.frameworks).

The SDK is always there: the bundled ``crawlerkeeper_sdk`` is importable through a ``.pth`` file
(which Python appends *after* site-packages) that also attaches the SDK's Scrapy hook
(ckagent.code.scrapyhook); a project requirement on ``crawlerkeeper-sdk`` is satisfied by a wheel of
that same copy (a uv override), never looked up on an index. The package index is
``deps.uv_index_url`` when set; otherwise PyPI is probed once (:class:`IndexChooser`) and the
fallback mirror is used when it is unreachable. Raises DepsError (ckagent.code.installer).
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial
from pathlib import Path
from typing import cast

import httpx
import trio

from ckagent.code.builder import Builder, remove_tree
from ckagent.code.envstore import Checked, EnvStore, Prepared, is_ready, mark_ready, start_build
from ckagent.code.installenv import install_key_env, installer_env
from ckagent.code.installer import Installers, Output
from ckagent.code.pylocks import LockError
from ckagent.code.pyplan import (
    SDK_DISTRIBUTION,
    InterpreterError,
    PythonPlan,
    bundled_sdk_dir,
    interpreter_identity,
    python_plan,
    sdk_wheel,
)
from ckagent.code.runtimes import find_uv
from ckagent.code.stage import ProjectFiles, write_staged
from ckagent.containment import TaskJail
from ckagent.node.errors import DepsError

log = logging.getLogger(__name__)

OFFICIAL_INDEX = "https://pypi.org/simple"
UV_MISSING = (
    "uv is not installed on this node. Install it into the agent's Python with `pip install uv` "
    "(or system-wide: see https://docs.astral.sh/uv/getting-started/installation/), or set "
    "deps.uv_path / AGENT_UV_PATH to the uv executable"
)
_SDK_PTH = "_crawlerkeeper_sdk_fallback.pth"
_LOCKED_REQUIREMENTS = ".ckagent-locked.txt"
_LOCK_CONSTRAINTS = ".ckagent-lock-constraints.txt"
_SCRAPY_HOOK_LINE = 'import os; os.environ.get("CK_SCRAPY_HOOK") and __import__("crawlerkeeper_sdk._scrapy_hook")\n'
"""The ``.pth`` line that attaches the SDK's Scrapy extensions to any Scrapy run (ckagent.code.scrapyhook)."""


class IndexChooser:
    """Picks the package index: the configured one, else PyPI if reachable, else the mirror.

    PyPI counts as unreachable only when two probes in a row fail (the second with twice the time:
    ``probe_timeout`` seconds, then ``2 × probe_timeout``), so one slow answer on a busy node does not
    send its installs to the mirror; and the mirror is chosen for ``retry_after`` seconds only, after
    which the next install probes PyPI again (a blip of the network does not pin an agent to the
    mirror for its life). While PyPI answers, it is not probed again.
    """

    def __init__(self, configured: str | None, fallback: str, probe_timeout: float = 3.0,
                 retry_after: float = 600.0) -> None:
        self._configured = configured
        self._fallback = fallback
        self._timeout = probe_timeout
        self._retry_after = retry_after
        self._chosen: str | None = configured
        self._fallback_until: float | None = None
        self._lock = trio.Lock()

    async def index_url(self) -> str:
        """The index to give uv. Never raises. Cancellation: a probe in flight is abandoned; the next
        call probes again."""
        async with self._lock:
            stale = self._fallback_until is not None and trio.current_time() >= self._fallback_until
            if self._chosen is None or stale:
                ok = await self._pypi_answers()
                self._chosen = OFFICIAL_INDEX if ok else self._fallback
                self._fallback_until = None if ok else trio.current_time() + self._retry_after
                if not ok:
                    log.warning("PyPI is unreachable (two probes); using the fallback index %s for the next %.0f s",
                                self._fallback, self._retry_after)
            return self._chosen

    async def _pypi_answers(self) -> bool:
        for timeout in (self._timeout, 2 * self._timeout):
            try:
                async with httpx.AsyncClient(timeout=timeout) as client:
                    response = await client.head(OFFICIAL_INDEX + "/pip/")
            except httpx.HTTPError:
                continue
            if response.status_code < 500:
                return True
        return False


class PythonEnvs:
    """Makes Python spiders' virtualenvs ready in ``store`` (see module docstring).

    ``python`` is the interpreter the venvs are built on; uv is looked for at ``uv_path``, on the
    installers' PATH and in ``agent_bin``; ``cache_dir`` is uv's cache (the builder's:
    ckagent.code.deps makes it so).
    """

    def __init__(self, store: EnvStore, installers: Installers, *, uv_path: Path | None, agent_bin: Path | None,
                 index: IndexChooser, cache_dir: Path, python: str) -> None:
        self.store = store
        self._installers = installers
        self.uv_path = uv_path
        self.agent_bin = agent_bin
        self._index = index
        self._cache_dir = cache_dir
        self._python = python

    def check(self, code_dir: Path, framework: str, task_env: dict[str, str]) -> Checked:
        """The plan of the spider's venv (its key from the dependency files in ``code_dir``, read without
        following a link: ckagent.code.stage) and whether it is ready (sealed, its SDK ``.pth`` as this
        agent writes it); the venv is marked in use. Blocking: the prepare hop's (ckagent.task.runner).
        Never raises for the plan: its error is in the result."""
        started = time.monotonic()
        try:
            sdk = sdk_wheel(self.store.root)
            try:
                interpreter = interpreter_identity(self._python)
            except InterpreterError as exc:
                raise DepsError(str(exc)) from exc
            try:
                plan = python_plan(ProjectFiles(code_dir), framework, interpreter, self._installers.identity,
                                   sdk[0] if sdk else "", install_key_env(task_env))
            except LockError as exc:
                raise DepsError(f"{exc}; the install was not attempted (the lock would not be honoured)") from exc
        except (DepsError, OSError) as exc:
            return Checked(error=exc, seconds=time.monotonic() - started)
        venv = self.store.path("py", plan.key)
        self.store.acquire(venv)
        try:
            ready = _ready_with_sdk(venv, plan.key, self._installers.builder.owner)
        except OSError as exc:
            self.store.release(venv)
            return Checked(error=exc, seconds=time.monotonic() - started)
        except BaseException:
            self.store.release(venv)
            raise
        return Checked(venv, ready, (plan, sdk[1] if sdk else None), time.monotonic() - started, store=self.store)

    async def prepare(self, code_dir: Path, framework: str, output: Output, task_env: dict[str, str],
                      jail: TaskJail | None = None, checked: Checked | None = None) -> Prepared:
        """The spider's venv, built if its key has none ready (``framework`` picks the default
        packages; the installers run in ``jail``, the task's, as the builder). ``checked``: what
        :meth:`check` found already (None: looked at here, one thread hop). Raises DepsError;
        cancellation stops the installer (ckagent.code.installer)."""
        if checked is None:
            checked = await trio.to_thread.run_sync(self.check, code_dir, framework, task_env)
        venv = checked.take()
        plan, overrides = cast("tuple[PythonPlan, Path | None]", checked.plan)
        bin_dir = venv / "bin"
        prepared = Prepared(path_prefix=[str(bin_dir)], env={"VIRTUAL_ENV": str(venv)})
        if plan.python_path:
            prepared.env["PYTHONPATH"] = os.pathsep.join(str(code_dir / rel) for rel in plan.python_path)
        with self.store.using(venv, prepared, marked=True):
            if not checked.ready:  # under its key's lock: one build per key; another may have finished it
                async with self.store.lock(plan.key):
                    owner = self._installers.builder.owner
                    if not await trio.to_thread.run_sync(_ready_with_sdk, venv, plan.key, owner):
                        prepared.cache_hit = False
                        with self.store.building(venv):
                            await self._build(venv, plan, overrides, output, task_env, jail)
        prepared.notes.extend(plan.notes)
        return prepared

    async def _build(self, venv: Path, plan: PythonPlan, overrides: Path | None, output: Output,
                     task_env: dict[str, str], jail: TaskJail | None) -> None:
        installers = self._installers
        builder = installers.builder
        uv = await trio.to_thread.run_sync(find_uv, self.uv_path, installers.base_env.get("PATH"), self.agent_bin)
        if uv is None:
            raise DepsError(UV_MISSING)
        output(f"[ckagent] building environment {venv.name} ({plan.mode}) as the node's builder, "
               f"{builder.describe()}\n".encode())
        given = installer_env(task_env, plan.named)
        if (notice := given.notice()) is not None:
            output(f"[ckagent] {notice}\n".encode())
        env = installers.env(given.env)
        env.update({"VIRTUAL_ENV": str(venv), "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1",
                    "UV_CACHE_DIR": str(self._cache_dir), "UV_NO_CONFIG": "1", "UV_LINK_MODE": "copy",
                    "UV_COMPILE_BYTECODE": "1"})
        _PTH_CHECKED.discard(venv)
        stage = venv / _STAGE
        await trio.to_thread.run_sync(self._start, venv, stage, plan)
        if not any(name in given.env for name in ("UV_DEFAULT_INDEX", "UV_INDEX_URL")):
            env["UV_DEFAULT_INDEX"] = await self._index.index_url()  # else the spider's own index
        python = str(venv / "bin" / "python")
        run = partial(installers.run, jail=jail)
        await run([uv, "venv", "--quiet", "--allow-existing", "--python", self._python, str(venv)], stage, env, output)
        override = ["--override", str(overrides)] if overrides is not None and plan.sdk else []
        if plan.mode == "locked":
            exported = venv / _LOCKED_REQUIREMENTS
            skip_sdk = ["--no-emit-package", SDK_DISTRIBUTION] if plan.sdk else []
            await run([uv, "export", "--frozen", "--no-emit-project", "--no-hashes", "--no-header",
                       *skip_sdk, "--output-file", str(exported), "--quiet"], stage, env, output)
            locked = stage / _LOCKED_REQUIREMENTS
            dropped = await trio.to_thread.run_sync(_own_code_left_out, exported, locked, frozenset(plan.staged))
            if dropped:
                output(f"[ckagent] left out of the export (the project's own code): {', '.join(dropped)}\n".encode())
            await run([uv, "pip", "sync", "--python", python, str(locked)], stage, env, output)
        elif plan.mode == "lock" and plan.how == "sync-file" and plan.lock is not None:
            output(f"[ckagent] installing exactly what {plan.lock} pins (uv reads it)\n".encode())
            await run([uv, "pip", "sync", "--python", python, plan.lock], stage, env, output)
        elif plan.mode == "lock" and plan.how == "sync":
            output(f"[ckagent] installing exactly the {len(plan.requirements)} packages {plan.lock} pins\n".encode())
            await run([uv, "pip", "sync", "--python", python, _REQUIREMENTS], stage, env, output)
        elif plan.mode in ("lock", "pyproject", "requirements"):
            if plan.mode == "lock":
                output(f"[ckagent] installing the project's {len(plan.requirements)} dependencies at the versions "
                       f"{plan.lock} pins ({len(plan.constraints)} pins)\n".encode())
            if not plan.requirements:
                output(b"[ckagent] the project declares no dependencies; nothing to install\n")
            else:
                pins = ["-c", _CONSTRAINTS] if plan.constraints else []
                await run([uv, "pip", "install", "--python", python, "-r", _REQUIREMENTS, *pins, *override],
                          stage, env, output)
        elif plan.packages:
            await run([uv, "pip", "install", "--python", python, *plan.packages], stage, env, output)
        size = await trio.to_thread.run_sync(_finish, venv, stage, plan.key, builder)
        log.info("built Python environment %s (%s, %d bytes) as %s", venv.name, plan.mode, size, builder.describe())

    def _start(self, venv: Path, stage: Path, plan: PythonPlan) -> None:
        """A fresh build directory for ``venv``, the staged files in it (the agent's, read-only to the
        builder), given to the builder; its cache and home its own. Blocking."""
        builder = self._installers.builder
        start_build(venv)
        files = dict(plan.staged)
        if plan.mode in ("lock", "pyproject", "requirements") and plan.how != "sync-file":
            files[_REQUIREMENTS] = ("\n".join(plan.requirements) + "\n").encode()
            if plan.constraints:
                files[_CONSTRAINTS] = ("\n".join(plan.constraints) + "\n").encode()
        write_staged(stage, files)
        builder.give_top(venv)


_STAGE = ".ckagent-build"
"""The directory in a venv under construction with what uv reads (removed before the venv is sealed)."""
_REQUIREMENTS = "requirements.txt"
_CONSTRAINTS = "constraints.txt"


def _own_code_left_out(exported: Path, locked: Path, staged: frozenset[str]) -> list[str]:
    """Copy uv's export to ``locked`` without the lines that name the project's own code (``-e ./member``,
    ``./libs/x``, ``file:``: ckagent.code.pyplan put them on PYTHONPATH); a staged wheel of the project
    stays. Returns the lines left out. Blocking."""
    kept, dropped = [], []
    data = ProjectFiles(exported.parent).read(exported.name)  # the builder's file: no link followed
    if data is None:
        raise DepsError(f"uv export wrote no {exported.name}")
    for line in data.decode(errors="replace").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        target = stripped[3:].strip() if stripped.startswith("-e ") else stripped
        location = target.split(" @ ", 1)[1].strip() if " @ " in target else target
        local = location.startswith((".", "/")) or location.lower().startswith("file:")
        if local and not (location.endswith(".whl") and location.lstrip("./") in staged):
            dropped.append(stripped)
            continue
        kept.append(line)
    write_staged(locked.parent, {locked.name: ("\n".join(kept) + "\n").encode()})
    return dropped


def _finish(venv: Path, stage: Path, key: str, builder: Builder) -> int:
    """The build is done: its staging dir and uv's export removed (they may name an index with its
    credentials), the SDK's ``.pth`` written, the venv sealed and marked ready. Returns its size in
    bytes. Blocking."""
    remove_tree(stage)
    (venv / _LOCKED_REQUIREMENTS).unlink(missing_ok=True)
    _install_sdk_pth(venv)
    return mark_ready(venv, key, "py", owner=builder.owner, builder=builder.identity, builder_uid=builder.own_uid)


_PTH_CHECKED: set[Path] = set()
"""Ready environments whose SDK ``.pth`` this agent process has checked (a ready environment never
changes; a rebuild of its key drops it from here first)."""


def _ready_with_sdk(venv: Path, key: str, owner: tuple[int, int]) -> bool:
    """:func:`is_ready` (sealed for ``owner``), and for a ready environment its SDK ``.pth`` checked (once
    per agent process): one that is not what this agent writes makes the environment not ready (a
    sealed environment is rebuilt, never changed). Blocking."""
    if not is_ready(venv, key, owner):
        return False
    if venv not in _PTH_CHECKED:
        if not _sdk_pth_current(venv):
            return False
        _PTH_CHECKED.add(venv)
    return True


def _sdk_pth_text() -> str | None:
    sdk = bundled_sdk_dir()
    return None if sdk is None else str(sdk) + "\n" + _SCRAPY_HOOK_LINE


def _sdk_pth_current(venv: Path) -> bool:
    """Whether every site-packages of ``venv`` has the SDK ``.pth`` this agent writes. Blocking."""
    text = _sdk_pth_text()
    for site in (venv / "lib").glob("python*/site-packages"):
        try:
            current: str | None = (site / _SDK_PTH).read_text()
        except OSError:
            current = None
        if current != text:
            return False
    return True


def _install_sdk_pth(venv: Path) -> None:
    """Write the SDK's ``.pth`` (its directory, then the Scrapy hook) into a venv being built (before it
    is sealed). Blocking: a few small files."""
    text = _sdk_pth_text()
    for site in (venv / "lib").glob("python*/site-packages"):
        pth = site / _SDK_PTH
        if text is None:
            pth.unlink(missing_ok=True)
            continue
        tmp = pth.with_name(f".{pth.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, pth)
