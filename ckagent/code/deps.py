"""A spider's dependencies: content-addressed, shared, exact environments (uv for Python, npm for Node).

Every environment lives under one root (``work_dir/envs``), named by a key that hashes what
determines it (ckagent.code.envstore): the dependency files, the interpreter (path and version), the
framework's default packages, the SDK the agent bundles and the identity installers and spiders run
as. Two spiders of one project share one environment; a changed pin, a removed package, another
interpreter or ``run_as_user`` gives a new key and a new environment built from nothing (sync
semantics: what the project declares is exactly what is installed); the old one is collected,
least recently used first, when the environments exceed ``deps.env_budget_bytes``.

Python spiders (scrapy, python, playwright, selenium) get ``envs/py-<key>/``, a virtualenv whose
``bin`` goes first on the spider's PATH:

- ``uv.lock`` + ``pyproject.toml`` → ``uv export --frozen`` (the lock's exact versions, without
  the project itself) → ``uv pip sync`` (exactly those, through the configured index);
- ``pyproject.toml`` → ``uv pip install -r pyproject.toml``; ``requirements.txt`` → ``uv pip install
  -r requirements.txt`` (with the files it includes by ``-r``/``-c`` hashed into the key too);
- no dependency file → the framework's package (:data:`DEFAULT_PACKAGES`: a Scrapy project — or
  any code with a ``scrapy.cfg`` — gets ``scrapy``, playwright ``playwright``, selenium
  ``selenium``; a plain python spider gets an empty venv).

The SDK is always there: the bundled ``crawlerkeeper_sdk`` is importable through a ``.pth`` file
(which Python appends *after* site-packages), and a project requirement on ``crawlerkeeper-sdk``
is satisfied by a wheel of that same copy (a uv override), never looked up on an index.

Node spiders (``package.json``) get ``envs/node-<key>/``: the manifest, lockfile and ``.npmrc``
are copied there, ``npm ci`` (lockfile) or ``npm install`` runs there, and the task's working copy
gets a ``node_modules`` symlink to it. A version asked for in ``.nvmrc`` or ``engines.node`` is
taken from nvm when present (see ckagent.code.deps_node); otherwise the system node runs, with a warning
in the task log if it does not satisfy it.

Installer output streams into the task's log as it comes. ``deps.uv_sync_timeout`` bounds each
installer run (uv and npm alike). The package index is ``deps.uv_index_url`` when set; otherwise
PyPI is probed once (short timeout, the answer kept for the agent's life) and the fallback mirror
is used when it is unreachable. Exceptions::

    DepsError     the install failed, timed out or the tool is missing; the message says which
                  and carries the installer's last whole lines of output (task → DEPS_FAILED)
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from ckagent.code.deps_node import (
    NODE_DEP_FILES,
    link_node_modules,
    node_install_command,
    pick_nvm_node,
    stage_node_manifest,
    system_node_version,
    wanted_node,
)
from ckagent.code.envstore import EnvStore, is_ready, mark_ready, start_build
from ckagent.code.installenv import install_key_env
from ckagent.code.pylocks import LockError, lock_inputs
from ckagent.code.pyplan import (
    DEFAULT_PACKAGES,
    SDK_DISTRIBUTION,
    InterpreterError,
    PythonPlan,
    bundled_sdk_dir,
    interpreter_identity,
    python_plan,
    sdk_wheel,
)
from ckagent.code.runtimes import AGENT_BIN, find_npm, find_uv
from ckagent.containment.process import SPAWNED, terminate_group
from ckagent.containment.tails import TailBuffer, last_lines
from ckagent.node.errors import DepsError, os_error_text
from ckagent.node.noderange import satisfies
from ckagent.node.runas import RunAs, popen_identity

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PACKAGES", "NPM_MISSING", "PYTHON_FRAMEWORKS", "UV_MISSING", "Dependencies", "DepsError",
           "IndexChooser", "Prepared", "bundled_sdk_dir", "python_plan", "remove_legacy_environments",
           "spider_base_env", "wanted_node"]

PYTHON_FRAMEWORKS = ("scrapy", "python", "playwright", "selenium")
OFFICIAL_INDEX = "https://pypi.org/simple"
_SDK_PTH = "_crawlerkeeper_sdk_fallback.pth"
_LOCKED_REQUIREMENTS = ".ckagent-locked.txt"
_LOCK_CONSTRAINTS = ".ckagent-lock-constraints.txt"
UV_MISSING = (
    "uv is not installed on this node. Install it into the agent's Python with `pip install uv` "
    "(or system-wide: see https://docs.astral.sh/uv/getting-started/installation/), or set "
    "deps.uv_path / AGENT_UV_PATH to the uv executable"
)
NPM_MISSING = "npm is not installed on this node: install Node.js with npm (e.g. `apt-get install nodejs npm`)"


@dataclass
class Prepared:
    """The outcome of :meth:`Dependencies.prepare`: what to put first on PATH and extra env vars.

    ``notes`` are lines for the task log (e.g. a node version warning); ``seconds`` the time taken;
    ``env_dir`` the environment the task uses (hand the object back to :meth:`Dependencies.release`).
    """

    path_prefix: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cache_hit: bool = True
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    env_dir: Path | None = None


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


Spawn = Callable[..., tuple[list[str], dict[str, Any]]]
"""``spawn(argv, env, forking=bool) -> (argv, Popen kwargs)``: how a task's process starts in its jail."""

_SPAWN: contextvars.ContextVar[Spawn | None] = contextvars.ContextVar("ckagent_installer_spawn", default=None)
"""The jail spawn of the task being prepared (set by Dependencies.prepare, read by each installer run)."""


class Dependencies:
    """Makes tasks' environments ready (see module docstring).

    ``envs_root`` holds every environment (``work_dir/envs``); ``budget_bytes`` bounds them (LRU
    collection; 0 = unbounded). ``base_env`` is the minimal environment installers run with (never
    the agent's secrets); its PATH is also where uv and npm are looked for (uv also at ``uv_path``
    and in ``agent_bin``). ``timeout`` bounds one installer run (seconds). ``python`` is the
    interpreter Python spiders' venvs are built on. ``nvm_dir`` is nvm's home (default: $NVM_DIR
    or ``~/.nvm``; nvm counts as present when ``nvm.sh`` is there). ``run_as``: installers run as
    that user and the environments belong to it (``task.run_as_user``).
    """

    def __init__(
        self,
        envs_root: Path,
        *,
        uv_path: Path | None,
        index: IndexChooser,
        uv_cache_dir: Path | None,
        timeout: float,
        base_env: dict[str, str],
        python: str = sys.executable,
        run_as: RunAs | None = None,
        agent_bin: Path | None = AGENT_BIN,
        nvm_dir: Path | None = None,
        budget_bytes: int = 0,
    ) -> None:
        self.envs_root = envs_root
        self.store = EnvStore(envs_root, budget_bytes)
        self._run_as = run_as
        self._uv_path = uv_path
        self._agent_bin = agent_bin
        self._index = index
        self._cache_dir = uv_cache_dir
        self._timeout = timeout
        self._base_env = base_env
        self._python = python
        self._identity = "agent" if run_as is None else f"uid={run_as.uid},gid={run_as.gid}"
        nvm_home = os.environ.get("NVM_DIR") or str(Path.home() / ".nvm")
        self.nvm_dir = nvm_dir if nvm_dir is not None else Path(nvm_home)

    async def prepare(
        self,
        framework: str,
        spider_id: str,
        code_dir: Path,
        output: Callable[[bytes], None],
        *,
        marker: dict[str, str] | None = None,
        spawn: Spawn | None = None,
        task_env: dict[str, str] | None = None,
        home: Path | None = None,
    ) -> Prepared:
        """Make the spider's environment ready; returns PATH additions and env (release it after the run).

        ``code_dir`` is the task's working copy (a Node spider gets its ``node_modules`` link in it).
        ``output`` receives the installer's output bytes as they come (the task log); ``marker``
        (the task's ``CK_TASK_ID``) is added to the installers' environment so the task's sweep
        finds whatever they leave behind. Raises DepsError. Cancellation stops the installer
        (TERM → 5 s → KILL of its process group) before it propagates; the half-built environment
        is removed by its next build or by collection. ``spawn`` (the task's jail's
        :meth:`~ckagent.containment.TaskJail.spawn`) wraps every installer's command so it joins
        the task's cgroup before it execs. ``task_env`` (the task's ``env``) reaches every installer;
        the variables of it that change what an install does enter the environment's key
        (ckagent.code.installenv). ``home``: the spider's HOME, the installers' too when they run as
        ``run_as_user`` (that user's passwd home may not exist or not be writable).
        """
        token = _SPAWN.set(spawn)
        try:
            env = {**(task_env or {}), **(marker or {})}
            if home is not None and self._run_as is not None:
                env["HOME"] = str(home)
            return await self._prepare(framework, spider_id, code_dir, output, env)
        except OSError as exc:  # the environment's files (a full disk, a permission): the install fails
            raise DepsError(f"cannot prepare the spider's environment: {os_error_text(exc)}") from exc
        finally:
            _SPAWN.reset(token)

    async def _prepare(self, framework: str, spider_id: str, code_dir: Path, output: Callable[[bytes], None],
                       task_env: dict[str, str]) -> Prepared:
        started = trio.current_time()
        if framework in PYTHON_FRAMEWORKS:
            prepared = await self._python_env(code_dir, framework, output, task_env)
        elif framework == "node":
            prepared = await self._node_env(code_dir, output, task_env)
        else:
            prepared = Prepared()
        prepared.seconds = trio.current_time() - started
        if not prepared.cache_hit:
            collected = False
            try:
                await self.store.collect()
                collected = True
            finally:
                if not collected:  # cancelled: the caller never gets the environment to release
                    self.release(prepared)
        return prepared

    def adopt(self, env_dir: Path) -> Prepared:
        """A re-adopted task's spider runs with ``env_dir`` (from its stored handle): it counts as in
        use, so collection leaves it alone, until :meth:`release` of what this returns."""
        self.store.acquire(env_dir)
        return Prepared(env_dir=env_dir)

    def release(self, prepared: Prepared) -> None:
        """The task that got ``prepared`` has finished with its environment (collection may take it)."""
        if prepared.env_dir is not None:
            self.store.release(prepared.env_dir)
            prepared.env_dir = None

    def _installer_env(self, task_env: dict[str, str]) -> dict[str, str]:
        """The base, the run-as identity (USER, LOGNAME; HOME unless the task's is given), the task's env."""
        env = dict(self._base_env)
        if self._run_as is not None:
            env.update(self._run_as.env())
        env.update(task_env)
        return env

    # ------------------------------------------------------------------ python

    async def _python_env(
        self, code_dir: Path, framework: str, output: Callable[[bytes], None], task_env: dict[str, str],
    ) -> Prepared:
        def plan_sync() -> tuple[PythonPlan, Path | None]:
            sdk = sdk_wheel(self.envs_root)
            try:
                interpreter = interpreter_identity(self._python)
            except InterpreterError as exc:
                raise DepsError(str(exc)) from exc
            return python_plan(code_dir, framework, interpreter, self._identity, sdk[0] if sdk else "",
                               install_key_env(task_env)), (sdk[1] if sdk else None)

        plan, overrides = await trio.to_thread.run_sync(plan_sync)
        venv = self.store.path("py", plan.key)
        bin_dir = venv / "bin"
        prepared = Prepared(path_prefix=[str(bin_dir)], env={"VIRTUAL_ENV": str(venv)})
        async with self.store.lock(plan.key):
            with self._using(venv, prepared):
                if not await trio.to_thread.run_sync(is_ready, venv, plan.key):
                    prepared.cache_hit = False
                    with self.store.building(venv):
                        await self._build_python(venv, plan, overrides, code_dir, output, task_env)
                else:
                    await trio.to_thread.run_sync(_install_sdk_pth, venv)
        return prepared

    @contextlib.contextmanager
    def _using(self, env_dir: Path, prepared: Prepared) -> Iterator[None]:
        """Mark ``env_dir`` in use before it is checked or built (collection never takes it from under
        a starting task); on success it is ``prepared.env_dir``, on any failure the mark is dropped."""
        self.store.acquire(env_dir)
        ok = False
        try:
            yield
            ok = True
        finally:
            if ok:
                prepared.env_dir = env_dir
            else:
                self.store.release(env_dir)

    async def _build_python(self, venv: Path, plan: PythonPlan, overrides: Path | None, code_dir: Path,
                            output: Callable[[bytes], None], task_env: dict[str, str]) -> None:
        uv = await trio.to_thread.run_sync(find_uv, self._uv_path, self._base_env.get("PATH"), self._agent_bin)
        if uv is None:
            raise DepsError(UV_MISSING)
        output(f"[ckagent] building environment {venv.name} ({plan.mode})\n".encode())
        env = self._installer_env(task_env)
        env.update({"VIRTUAL_ENV": str(venv), "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1"})
        await trio.to_thread.run_sync(start_build, venv)
        cache_dir = self._cache_dir
        if self._run_as is not None:
            # The user owns its venv; uv's cache must be writable by it too (its HOME may be bare).
            cache_dir = cache_dir or self.envs_root / ".uv-cache"
            await trio.to_thread.run_sync(_give_dirs, self._run_as, [venv, cache_dir])
        if cache_dir is not None:
            env["UV_CACHE_DIR"] = str(cache_dir)
        if not any(name in task_env for name in ("UV_DEFAULT_INDEX", "UV_INDEX_URL")):
            env["UV_DEFAULT_INDEX"] = await self._index.index_url()  # else the spider's own index
        python = str(venv / "bin" / "python")
        await self._run([uv, "venv", "--quiet", "--allow-existing", "--python", self._python, str(venv)],
                        code_dir, env, output)
        override = ["--override", str(overrides)] if overrides is not None and plan.sdk else []
        if plan.mode == "locked":
            locked = venv / _LOCKED_REQUIREMENTS
            skip_sdk = ["--no-emit-package", SDK_DISTRIBUTION] if plan.sdk else []
            await self._run([uv, "export", "--frozen", "--no-emit-project", "--no-hashes", "--no-header",
                             *skip_sdk, "--output-file", str(locked), "--quiet"], code_dir, env, output)
            await self._run([uv, "pip", "sync", "--python", python, str(locked)], code_dir, env, output)
        elif plan.mode == "lock" and plan.lock is not None:
            await self._install_lock(uv, python, venv, plan.lock, override, code_dir, env, output)
        elif plan.mode in ("pyproject", "requirements"):
            source = "pyproject.toml" if plan.mode == "pyproject" else "requirements.txt"
            await self._run([uv, "pip", "install", "--python", python, "-r", source, *override], code_dir, env, output)
        elif plan.packages:
            await self._run([uv, "pip", "install", "--python", python, *plan.packages], code_dir, env, output)
        await trio.to_thread.run_sync(_install_sdk_pth, venv)
        size = await trio.to_thread.run_sync(mark_ready, venv, plan.key, "py")
        log.info("built Python environment %s (%s, %d bytes)", venv.name, plan.mode, size)

    async def _install_lock(self, uv: str, python: str, venv: Path, lock: str, override: list[str], code_dir: Path,
                            env: dict[str, str], output: Callable[[bytes], None]) -> None:
        """Install what ``lock`` pins (ckagent.code.pylocks); a lock that cannot be honoured raises DepsError."""
        try:
            how, requirements, constraints = await trio.to_thread.run_sync(lock_inputs, code_dir, lock)
        except LockError as exc:
            raise DepsError(f"{exc}; the install was not attempted (the lock would not be honoured)") from exc

        def not_sdk(line: str) -> bool:  # the bundled SDK (the .pth) serves it, never an index
            return re.split(r"[\s=<>!~;@\[]", line.strip(), maxsplit=1)[0].lower().replace("_", "-") != SDK_DISTRIBUTION

        if how == "sync-file":
            output(f"[ckagent] installing exactly what {lock} pins (uv reads it)\n".encode())
            await self._run([uv, "pip", "sync", "--python", python, lock], code_dir, env, output)
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
            await self._run([uv, "pip", "sync", "--python", python, str(locked)], code_dir, env, output)
        else:
            output(f"[ckagent] installing the project's {len(requirements)} dependencies at the versions {lock} "
                   f"pins ({len(constraints)} pins)\n".encode())
            await self._run([uv, "pip", "install", "--python", python, "-r", str(locked), "-c", str(pins),
                             *override], code_dir, env, output)

    # ------------------------------------------------------------------ node

    async def _node_env(self, code_dir: Path, output: Callable[[bytes], None], task_env: dict[str, str]) -> Prepared:
        prepared = Prepared()
        spec, source = await trio.to_thread.run_sync(wanted_node, code_dir)
        env = self._installer_env(task_env)
        if spec is not None:
            await self._select_node(spec, source, env, code_dir, output, prepared)
        path = os.pathsep.join([*prepared.path_prefix, env.get("PATH", "")])
        layout, key = await trio.to_thread.run_sync(self._node_plan, code_dir, spec, path, install_key_env(task_env))
        if layout == "no-package":
            return prepared
        if layout == "ships-node-modules":
            prepared.notes.append("node_modules ships with the code: npm is not run")
            return prepared
        install_dir = self.store.path("node", key)
        async with self.store.lock(key):
            with self._using(install_dir, prepared):
                if not await trio.to_thread.run_sync(is_ready, install_dir, key):
                    prepared.cache_hit = False
                    with self.store.building(install_dir):
                        npm = find_npm(path)
                        if npm is None:
                            raise DepsError(NPM_MISSING)
                        env["PATH"] = path
                        await trio.to_thread.run_sync(start_build, install_dir)
                        await trio.to_thread.run_sync(stage_node_manifest, code_dir, install_dir)
                        if self._run_as is not None:
                            await trio.to_thread.run_sync(_give_dirs, self._run_as, [install_dir])
                        argv, note = await trio.to_thread.run_sync(node_install_command, install_dir, npm, path)
                        if note is not None:
                            output(f"[ckagent] {note}\n".encode())
                        env.setdefault("COREPACK_ENABLE_DOWNLOAD_PROMPT", "0")
                        await self._run(argv, install_dir, env, output)
                        await trio.to_thread.run_sync(_finish_node_env, install_dir, key)
        await trio.to_thread.run_sync(link_node_modules, code_dir, install_dir / "node_modules")
        return prepared

    def _node_plan(self, code_dir: Path, spec: str | None, path: str, key_env: dict[str, str]) -> tuple[str, str]:
        """(layout, key) of a Node spider (blocking: stats, hashing, ``node --version`` once per binary).

        layout: ``"no-package"`` (no package.json: nothing to install), ``"ships-node-modules"`` (the
        code carries its node_modules: npm is not run) or ``"install"``.
        """
        if not (code_dir / "package.json").is_file():
            return "no-package", ""
        shipped = code_dir / "node_modules"
        if shipped.exists() and not shipped.is_symlink():
            return "ships-node-modules", ""
        files = {name: hashlib.sha256((code_dir / name).read_bytes()).hexdigest()
                 for name in NODE_DEP_FILES if (code_dir / name).is_file()}
        node = shutil.which("node", path=path)
        version = system_node_version(path)
        source: dict[str, Any] = {"schema": 1, "files": files, "spec": spec, "node": node and os.path.realpath(node),
                                  "version": version, "identity": self._identity}
        if key_env:  # only then: environments of spiders without such variables keep their keys
            source["env"] = key_env
        return "install", hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()

    async def _select_node(self, spec: str, source: str, env: dict[str, str], code_dir: Path,
                           output: Callable[[bytes], None], prepared: Prepared) -> None:
        """Put an nvm node satisfying ``spec`` first on PATH (installing it with nvm if needed), or warn."""
        nvm_sh = self.nvm_dir / "nvm.sh"
        has_nvm = await trio.to_thread.run_sync(nvm_sh.is_file)
        if has_nvm:
            chosen = await trio.to_thread.run_sync(pick_nvm_node, self.nvm_dir, spec)
            if chosen is None:
                nvm_env = {**env, "NVM_DIR": str(self.nvm_dir)}
                await self._run(["bash", "-c", '. "$NVM_DIR/nvm.sh" && nvm install "$1"', "nvm-install", spec],
                                code_dir, nvm_env, output, label="nvm install")
                chosen = await trio.to_thread.run_sync(pick_nvm_node, self.nvm_dir, spec)
            if chosen is not None:
                prepared.path_prefix.insert(0, str(chosen[1]))
                prepared.notes.append(f"node {chosen[0]} from nvm ({source} wants {spec!r})")
                return
        system = await trio.to_thread.run_sync(system_node_version, env.get("PATH", ""))
        where = "nvm has none installed" if has_nvm else f"nvm not found ({nvm_sh})"
        if system is None:
            prepared.notes.append(f"warning: {source} wants node {spec!r} but no node is installed ({where})")
        elif satisfies(system, spec) is False:
            prepared.notes.append(
                f"warning: {source} wants node {spec!r} but the system node is v{system} ({where}); "
                "running with it anyway"
            )

    # ------------------------------------------------------------------ running installers

    async def _run(self, argv: list[str], cwd: Path, env: dict[str, str], output: Callable[[bytes], None],
                   label: str | None = None) -> None:
        tail = TailBuffer(16384)
        output(f"[ckagent] $ {' '.join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv))}\n".encode())

        def sink(chunk: bytes) -> None:
            tail.write(chunk)
            output(chunk)

        result: subprocess.CompletedProcess[bytes] | None = None
        spawn = _SPAWN.get()
        spawn_argv, spawn_options = (argv, {}) if spawn is None else spawn(argv, env, forking=self._run_as is not None)
        spawned: list[int] = []
        try:
            with trio.move_on_after(self._timeout) as scope:
                async with trio.open_nursery() as nursery:
                    try:
                        process: trio.Process = await nursery.start(
                            partial(
                                trio.run_process, spawn_argv, cwd=str(cwd), env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False,
                                start_new_session=True, **popen_identity(self._run_as), **spawn_options,
                                deliver_cancel=lambda p: terminate_group(p.pid, 5.0),
                            )
                        )
                    except OSError as exc:  # not startable: no such file, not executable, no such cwd
                        raise DepsError(f"cannot start the installer {argv[0]!r}: {os_error_text(exc)}") from exc
                    spawned.append(process.pid)
                    SPAWNED.add(process.pid)  # trio reaps it; the subreaper's reaper must not
                    assert process.stdout is not None
                    while chunk := await process.stdout.receive_some(65536):
                        sink(bytes(chunk))
                    result = subprocess.CompletedProcess(argv, await process.wait())
        finally:  # run_process has reaped it by now
            SPAWNED.difference_update(spawned)
        name = label or " ".join([Path(argv[0]).name, *itertools.takewhile(lambda a: not a.startswith("-"), argv[1:3])])
        if scope.cancelled_caught:
            raise DepsError(
                f"{name} timed out after {self._timeout:g} s and was stopped (the limit is "
                f"deps.uv_sync_timeout / AGENT_UV_SYNC_TIMEOUT); its last output:\n{last_lines(tail.text())}"
            )
        if result is None or result.returncode != 0:
            code = None if result is None else result.returncode
            raise DepsError(f"{name} failed with exit code {code}:\n{last_lines(tail.text())}")


LEGACY_DIRS = ("venvs", "node")
"""Per-spider environment roots of agents before content-addressed environments (``work_dir/envs``)."""


def remove_legacy_environments(work_dir: Path) -> list[Path]:
    """Remove the per-spider environments older agents left in ``work_dir`` (blocking; never raises)."""
    removed = []
    for name in LEGACY_DIRS:
        path = work_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.info("removed %s: environments are content-addressed under %s now", path, work_dir / "envs")
    return removed


def _finish_node_env(install_dir: Path, key: str) -> None:
    (install_dir / "node_modules").mkdir(exist_ok=True)
    mark_ready(install_dir, key, "node")


def _give_dirs(run_as: RunAs, paths: list[Path]) -> None:
    """Create ``paths`` if missing and give them (and their contents) to ``run_as`` (blocking)."""
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
        if path.stat().st_uid != run_as.uid:
            run_as.chown_tree(path)


_SCRAPY_HOOK_LINE = 'import os; os.environ.get("CK_SCRAPY_HOOK") and __import__("crawlerkeeper_sdk._scrapy_hook")\n'
"""The ``.pth`` line that attaches the SDK's Scrapy extensions to any Scrapy run (ckagent.task.scrapyhook)."""


def _write_files(files: dict[Path, str]) -> None:
    for path, text in files.items():
        path.write_text(text)


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


def spider_base_env(path_prefix: list[str] | None = None) -> dict[str, str]:
    """The minimal environment every spider and installer starts from.

    PATH (the agent's, minus the agent's own interpreter dir), HOME, LANG/LC_ALL and the
    variables in PASS_THROUGH (time zone, temp dir, user, CA bundle and proxy settings) — and
    nothing else of the agent's environment (no secrets, no AGENT_*, no PYTHONPATH).
    """
    agent_bin = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(os.pathsep)
            if p and p != agent_bin]
    env = {
        "PATH": os.pathsep.join([*(path_prefix or []), *path]),
        "HOME": os.environ.get("HOME", "/tmp"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "LC_ALL": os.environ.get("LC_ALL", os.environ.get("LANG", "C.UTF-8")),
        "PYTHONUNBUFFERED": "1",
        "PYTHONIOENCODING": "utf-8",
    }
    for name in PASS_THROUGH:
        if name in os.environ:
            env[name] = os.environ[name]
    return env


PASS_THROUGH = (
    "TZ", "TMPDIR", "USER", "LOGNAME",
    # Network plumbing of the node (a private CA, a proxy): spiders and installers need it, and it
    # holds no secret of the agent's. A proxy URL with credentials is the operator's choice.
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
)
"""Variables copied from the agent's environment into every spider's, when set."""
