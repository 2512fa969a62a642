"""A spider's dependencies: content-addressed, shared, exact environments (uv for Python, npm for Node).

Every environment lives under one root (``work_dir/envs``), named by a key that hashes what
determines it (ckagent.code.envstore): the dependency files, the interpreter (path and version), the
framework's default packages, the SDK the agent bundles and the identity installers and spiders run
as. Two spiders of one project share one environment; a changed pin, a removed package, another
interpreter or ``run_as_user`` gives a new key and a new environment built from nothing (sync
semantics: what the project declares is exactly what is installed); the old one is collected,
least recently used first, when the environments exceed ``deps.env_budget_bytes``.

:class:`Dependencies` is the one door: it picks the builder by the framework's runtime
(ckagent.code.frameworks):

- Python spiders → ckagent.code.deps_python (a virtualenv per key, the bundled SDK in it; without a
  dependency file the framework's default packages, e.g. ``scrapy`` for a Scrapy project — or any
  code with a ``scrapy.cfg`` — and an empty venv for a plain python spider);
- Node spiders → ckagent.code.deps_node (``node_modules`` per key, linked into the working copy; a
  node from nvm when the project asks for a version).

Installers (ckagent.code.installer) stream their output into the task's log as it comes, run in
the task's jail, and are bounded by ``deps.uv_sync_timeout`` each (uv and npm alike). Exceptions::

    DepsError     the install failed, timed out or the tool is missing; the message says which
                  and carries the installer's last whole lines of output (task → DEPS_FAILED)
"""


from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import trio

from ckagent.code import frameworks
from ckagent.code.deps_node import NPM_MISSING, NodeEnvs, wanted_node
from ckagent.code.deps_python import UV_MISSING, IndexChooser, PythonEnvs
from ckagent.code.envstore import Checked, EnvStore, Prepared
from ckagent.code.installer import KILL_GRACE, Installers, Output
from ckagent.code.pyplan import bundled_sdk_dir, python_plan
from ckagent.code.runtimes import AGENT_BIN
from ckagent.containment import TaskJail
from ckagent.node.errors import DepsError, os_error_text
from ckagent.node.runas import RunAs

log = logging.getLogger(__name__)

__all__ = ["NPM_MISSING", "UV_MISSING", "Checked", "Dependencies", "DepsError",
           "IndexChooser", "Prepared", "bundled_sdk_dir", "python_plan", "remove_legacy_environments",
           "spider_base_env", "wanted_node"]



class Dependencies:
    """Makes tasks' environments ready (see module docstring).

    ``envs_root`` holds every environment (``work_dir/envs``); ``budget_bytes`` bounds them (LRU
    collection; 0 = unbounded). ``base_env`` is the minimal environment installers run with (never
    the agent's secrets); its PATH is also where uv and npm are looked for (uv also at ``uv_path``
    and in ``agent_bin``). ``timeout`` bounds one installer run (seconds). ``python`` is the
    interpreter Python spiders' venvs are built on. ``nvm_dir`` is nvm's home (default: $NVM_DIR
    or ``~/.nvm``; nvm counts as present when ``nvm.sh`` is there). ``run_as``: installers run as
    that user and the environments belong to it (``task.run_as_user``). ``kill_grace``: seconds a
    stopped installer gets between its stop signal and the kill (the node's ``task.kill_grace``).
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
        kill_grace: float = KILL_GRACE,
    ) -> None:
        self.envs_root = envs_root
        self.store = EnvStore(envs_root, budget_bytes)
        self.installers = Installers(timeout, base_env, run_as, kill_grace)
        self._run_as = run_as
        self.python = PythonEnvs(self.store, self.installers, uv_path=uv_path, agent_bin=agent_bin, index=index,
                                 uv_cache_dir=uv_cache_dir, python=python)
        nvm_home = os.environ.get("NVM_DIR") or str(Path.home() / ".nvm")
        self.node = NodeEnvs(self.store, self.installers, nvm_dir if nvm_dir is not None else Path(nvm_home))

    async def prepare(
        self,
        framework: str,
        spider_id: str,
        code_dir: Path,
        output: Output,
        *,
        marker: dict[str, str] | None = None,
        jail: TaskJail | None = None,
        task_env: dict[str, str] | None = None,
        home: Path | None = None,
        checked: Checked | None = None,
    ) -> Prepared:
        """Make the spider's environment ready; returns PATH additions and env (release it after the run).

        ``code_dir`` is the task's working copy (a Node spider gets its ``node_modules`` link in it).
        ``output`` receives the installer's output bytes as they come (the task log); ``marker``
        (the task's ``CK_TASK_ID``) is added to the installers' environment so the task's sweep
        finds whatever they leave behind. Raises DepsError. Cancellation stops the installer (its
        stop signal → the node's ``kill_grace`` → every process of its jail killed:
        ckagent.containment.stopping) before it propagates; the half-built environment is removed by
        its next build or by collection. ``jail``: the task's; every installer joins it before it
        execs (None: each runs in a process group of its own). ``task_env`` (the task's ``env``) reaches every installer;
        the variables of it that change what an install does enter the environment's key
        (ckagent.code.installenv). ``home``: the spider's HOME, the installers' too when they run as
        ``run_as_user`` (that user's passwd home may not exist or not be writable). ``checked``: what
        :meth:`check` found already, with the same arguments, in a thread hop of the caller's (None:
        the look is made here).
        """
        try:
            env = self._env(task_env, marker, home)
            return await self._prepare(framework, spider_id, code_dir, output, env, jail, checked)
        except OSError as exc:  # the environment's files (a full disk, a permission): the install fails
            raise DepsError(f"cannot prepare the spider's environment: {os_error_text(exc)}") from exc

    def check(self, framework: str, code_dir: Path, *, marker: dict[str, str] | None = None,
              task_env: dict[str, str] | None = None, home: Path | None = None) -> Checked | None:
        """Blocking: the look :meth:`prepare` begins with — the environment's key from the dependency
        files in ``code_dir`` and whether it is ready — for a caller that does it in a thread hop
        of its own (the task's prepare hop); pass the result to :meth:`prepare` as ``checked`` (or
        ``drop()`` it). The arguments are :meth:`prepare`'s. None for a runtime without such a look
        (a Node project that asks for a node version: nvm's choice is :meth:`prepare`'s). Never raises
        for the look: its error is in the result."""
        runtime = frameworks.framework(framework).runtime
        if runtime is frameworks.PYTHON:
            return self.python.check(code_dir, framework, self._env(task_env, marker, home))
        if runtime is frameworks.NODE:
            return self.node.check(code_dir, self._env(task_env, marker, home))
        return None

    def _env(self, task_env: dict[str, str] | None, marker: dict[str, str] | None, home: Path | None) -> dict[str, str]:
        env = {**(task_env or {}), **(marker or {})}
        if home is not None and self._run_as is not None:
            env["HOME"] = str(home)
        return env

    async def _prepare(self, name: str, spider_id: str, code_dir: Path, output: Output,
                       task_env: dict[str, str], jail: TaskJail | None, checked: Checked | None) -> Prepared:
        started = trio.current_time()
        runtime = frameworks.framework(name).runtime
        if runtime is frameworks.PYTHON:
            prepared = await self.python.prepare(code_dir, name, output, task_env, jail, checked)
        elif runtime is frameworks.NODE:
            prepared = await self.node.prepare(code_dir, output, task_env, jail, checked)
        else:  # a runtime without an environment builder yet
            prepared = Prepared()
        prepared.seconds = trio.current_time() - started + (checked.seconds if checked is not None else 0.0)
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
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy", "no_proxy",
)
"""Variables copied from the agent's environment into every spider's, when set."""
