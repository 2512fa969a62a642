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

import contextlib
import logging
import os
import re
import time
from functools import partial
from pathlib import Path
from typing import cast

import httpx
import trio

from ckagent.code.envstore import Checked, EnvStore, Prepared, is_ready, mark_ready, start_build
from ckagent.code.installenv import install_key_env
from ckagent.code.installer import Installers, Output
from ckagent.code.pylocks import LockError, lock_inputs
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
    """Picks the package index once: the configured one, else PyPI if reachable, else the mirror.

    ``probe_timeout`` in seconds; the probe result is kept for the life of the object.
    """

    def __init__(self, configured: str | None, fallback: str, probe_timeout: float = 3.0) -> None:
        self._configured = configured
        self._fallback = fallback
        self._timeout = probe_timeout
        self._chosen: str | None = configured
        self._lock = trio.Lock()

    async def index_url(self) -> str:
        """The index to give uv (probes at most once per agent run). Never raises."""
        async with self._lock:
            if self._chosen is None:
                try:
                    async with httpx.AsyncClient(timeout=self._timeout) as client:
                        response = await client.head(OFFICIAL_INDEX + "/pip/")
                    ok = response.status_code < 500
                except httpx.HTTPError:
                    ok = False
                self._chosen = OFFICIAL_INDEX if ok else self._fallback
                if not ok:
                    log.warning("PyPI is unreachable; using the fallback index %s", self._fallback)
            return self._chosen


class PythonEnvs:
    """Makes Python spiders' virtualenvs ready in ``store`` (see module docstring).

    ``python`` is the interpreter the venvs are built on; uv is looked for at ``uv_path``, on the
    installers' PATH and in ``agent_bin``; ``uv_cache_dir`` is uv's cache (None: uv's default, or
    ``envs/.uv-cache`` when installers run as another user).
    """

    def __init__(self, store: EnvStore, installers: Installers, *, uv_path: Path | None, agent_bin: Path | None,
                 index: IndexChooser, uv_cache_dir: Path | None, python: str) -> None:
        self.store = store
        self._installers = installers
        self._uv_path = uv_path
        self._agent_bin = agent_bin
        self._index = index
        self._cache_dir = uv_cache_dir
        self._python = python

    def check(self, code_dir: Path, framework: str, task_env: dict[str, str]) -> Checked:
        """The plan of the spider's venv (its key from the dependency files in ``code_dir``) and whether
        it is ready (its SDK ``.pth`` then checked too); the venv is marked in use. Blocking: the
        prepare hop's (ckagent.task.runner). Never raises for the plan: its error is in the result."""
        started = time.monotonic()
        try:
            sdk = sdk_wheel(self.store.root)
            try:
                interpreter = interpreter_identity(self._python)
            except InterpreterError as exc:
                raise DepsError(str(exc)) from exc
            plan = python_plan(code_dir, framework, interpreter, self._installers.identity, sdk[0] if sdk else "",
                               install_key_env(task_env))
        except (DepsError, OSError) as exc:
            return Checked(error=exc, seconds=time.monotonic() - started)
        venv = self.store.path("py", plan.key)
        self.store.acquire(venv)
        try:
            ready = _ready_with_sdk(venv, plan.key)
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
        packages; the installers run in ``jail``, the task's). ``checked``: what :meth:`check` found
        already (None: looked at here, one thread hop). Raises DepsError; cancellation stops the
        installer (ckagent.code.installer)."""
        if checked is None:
            checked = await trio.to_thread.run_sync(self.check, code_dir, framework, task_env)
        venv = checked.take()
        plan, overrides = cast("tuple[PythonPlan, Path | None]", checked.plan)
        bin_dir = venv / "bin"
        prepared = Prepared(path_prefix=[str(bin_dir)], env={"VIRTUAL_ENV": str(venv)})
        with self.store.using(venv, prepared, marked=True):
            if not checked.ready:  # under its key's lock: one build per key; another may have finished it
                async with self.store.lock(plan.key):
                    if not await trio.to_thread.run_sync(_ready_with_sdk, venv, plan.key):
                        prepared.cache_hit = False
                        with self.store.building(venv):
                            await self._build(venv, plan, overrides, code_dir, output, task_env, jail)
        return prepared

    async def _build(self, venv: Path, plan: PythonPlan, overrides: Path | None, code_dir: Path,
                     output: Output, task_env: dict[str, str], jail: TaskJail | None) -> None:
        installers = self._installers
        uv = await trio.to_thread.run_sync(find_uv, self._uv_path, installers.base_env.get("PATH"), self._agent_bin)
        if uv is None:
            raise DepsError(UV_MISSING)
        output(f"[ckagent] building environment {venv.name} ({plan.mode})\n".encode())
        env = installers.env(task_env)
        env.update({"VIRTUAL_ENV": str(venv), "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1"})
        _PTH_CHECKED.discard(venv)
        await trio.to_thread.run_sync(start_build, venv)
        cache_dir = self._cache_dir
        if installers.run_as is not None:
            # The user owns its venv; uv's cache must be writable by it too (its HOME may be bare).
            cache_dir = cache_dir or self.store.root / ".uv-cache"
            await trio.to_thread.run_sync(installers.give_dirs, [venv, cache_dir])
        if cache_dir is not None:
            env["UV_CACHE_DIR"] = str(cache_dir)
        if not any(name in task_env for name in ("UV_DEFAULT_INDEX", "UV_INDEX_URL")):
            env["UV_DEFAULT_INDEX"] = await self._index.index_url()  # else the spider's own index
        python = str(venv / "bin" / "python")
        run = partial(installers.run, jail=jail)
        await run([uv, "venv", "--quiet", "--allow-existing", "--python", self._python, str(venv)], code_dir, env, output)
        override = ["--override", str(overrides)] if overrides is not None and plan.sdk else []
        if plan.mode == "locked":
            locked = venv / _LOCKED_REQUIREMENTS
            skip_sdk = ["--no-emit-package", SDK_DISTRIBUTION] if plan.sdk else []
            await run([uv, "export", "--frozen", "--no-emit-project", "--no-hashes", "--no-header",
                       *skip_sdk, "--output-file", str(locked), "--quiet"], code_dir, env, output)
            await run([uv, "pip", "sync", "--python", python, str(locked)], code_dir, env, output)
        elif plan.mode == "lock" and plan.lock is not None:
            await self._install_lock(uv, python, venv, plan.lock, override, code_dir, env, output, jail)
        elif plan.mode in ("pyproject", "requirements"):
            source = "pyproject.toml" if plan.mode == "pyproject" else "requirements.txt"
            await run([uv, "pip", "install", "--python", python, "-r", source, *override], code_dir, env, output)
        elif plan.packages:
            await run([uv, "pip", "install", "--python", python, *plan.packages], code_dir, env, output)
        await trio.to_thread.run_sync(_install_sdk_pth, venv)
        size = await trio.to_thread.run_sync(mark_ready, venv, plan.key, "py")
        log.info("built Python environment %s (%s, %d bytes)", venv.name, plan.mode, size)

    async def _install_lock(self, uv: str, python: str, venv: Path, lock: str, override: list[str], code_dir: Path,
                            env: dict[str, str], output: Output, jail: TaskJail | None) -> None:
        """Install what ``lock`` pins (ckagent.code.pylocks); a lock that cannot be honoured raises DepsError."""
        try:
            how, requirements, constraints = await trio.to_thread.run_sync(lock_inputs, code_dir, lock)
        except LockError as exc:
            raise DepsError(f"{exc}; the install was not attempted (the lock would not be honoured)") from exc

        def not_sdk(line: str) -> bool:  # the bundled SDK (the .pth) serves it, never an index
            return re.split(r"[\s=<>!~;@\[]", line.strip(), maxsplit=1)[0].lower().replace("_", "-") != SDK_DISTRIBUTION

        run = partial(self._installers.run, jail=jail)
        if how == "sync-file":
            output(f"[ckagent] installing exactly what {lock} pins (uv reads it)\n".encode())
            await run([uv, "pip", "sync", "--python", python, lock], code_dir, env, output)
            return
        if not requirements:
            output(f"[ckagent] {lock}: the project declares no dependencies; nothing to install\n".encode())
            return
        files = {venv / _LOCKED_REQUIREMENTS: "\n".join(filter(not_sdk, requirements)) + "\n",
                 venv / _LOCK_CONSTRAINTS: "\n".join(filter(not_sdk, constraints)) + "\n"}
        await trio.to_thread.run_sync(_write_files, files)
        locked, pins = venv / _LOCKED_REQUIREMENTS, venv / _LOCK_CONSTRAINTS
        if how == "sync":
            output(f"[ckagent] installing exactly the {len(requirements)} packages {lock} pins\n".encode())
            await run([uv, "pip", "sync", "--python", python, str(locked)], code_dir, env, output)
        else:
            output(f"[ckagent] installing the project's {len(requirements)} dependencies at the versions {lock} "
                   f"pins ({len(constraints)} pins)\n".encode())
            await run([uv, "pip", "install", "--python", python, "-r", str(locked), "-c", str(pins), *override],
                      code_dir, env, output)


def _write_files(files: dict[Path, str]) -> None:
    for path, text in files.items():
        path.write_text(text)


_PTH_CHECKED: set[Path] = set()
"""Ready environments whose SDK ``.pth`` this agent process has checked (a ready environment never
changes; a rebuild of its key drops it from here first)."""


def _ready_with_sdk(venv: Path, key: str) -> bool:
    """:func:`is_ready`, and for a ready environment its SDK ``.pth`` checked (once per agent process). Blocking."""
    if not is_ready(venv, key):
        return False
    if venv not in _PTH_CHECKED:
        _install_sdk_pth(venv)
        _PTH_CHECKED.add(venv)
    return True


def _install_sdk_pth(venv: Path) -> None:
    """Write the SDK's ``.pth`` (its directory, then the Scrapy hook) where it is missing or out of date
    (an environment built by an older agent gets the hook too). Blocking: a few small files."""
    sdk = bundled_sdk_dir()
    for site in (venv / "lib").glob("python*/site-packages"):
        pth = site / _SDK_PTH
        if sdk is None:
            pth.unlink(missing_ok=True)
            continue
        text = str(sdk) + "\n" + _SCRAPY_HOOK_LINE
        with contextlib.suppress(OSError):
            if pth.read_text() == text:
                continue
        tmp = pth.with_name(f".{pth.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, pth)
