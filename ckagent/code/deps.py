"""A spider's dependencies: content-addressed, shared, exact environments (uv for Python, npm for Node).

Every environment lives under one root (``work_dir/envs``, mode 0711: spiders reach their own
environment but cannot list the others), named by a key that hashes what determines it
(ckagent.code.envstore): the dependency files, the interpreter (path and version), the framework's
default packages, the SDK the agent bundles and the builder (who installs and who owns the result).
Two spiders of one project share one environment; a changed pin, a removed package, another
interpreter or another builder gives a new key and a new environment built from nothing (sync
semantics: what the project declares is exactly what is installed); the old one is collected,
least recently used first, when the environments exceed ``deps.env_budget_bytes``.

Environments and caches no spider can write (ckagent.code.builder): installers run as the node's
builder (:class:`~ckagent.code.builder.Builder`: the dedicated builder uid at the ``spider-uids``
identity level), from the dependency files the agent staged out of the project (ckagent.code.stage:
the project's own code is never built or run by them), with the builder's own HOME and TMPDIR; a
finished environment is sealed (root's, no write bit) before it is marked ready; uv's cache
(``deps.uv_cache_dir``, else ``envs/.uv-cache``), npm's (``envs/.npm-cache``) and the builder's
home are the builder's, mode 0700. A spider that writes into its environment at run time (``pip
install``, npm writing ``node_modules``, a browser download into the venv) gets EACCES — or nothing
at all at the ``root`` level, where the mode bits do not hold.

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
import threading
from pathlib import Path

import trio

from ckagent.code import frameworks
from ckagent.code.builder import Builder, writable_by_others
from ckagent.code.deps_node import NPM_MISSING, NodeEnvs, wanted_node
from ckagent.code.deps_python import UV_MISSING, IndexChooser, PythonEnvs
from ckagent.code.envstore import Checked, EnvStore, Prepared
from ckagent.code.installer import KILL_GRACE, Installers, Output
from ckagent.code.pyplan import bundled_sdk_dir, python_plan
from ckagent.code.runtimes import AGENT_BIN, BROWSER_VARS, browser_env, find_uv
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
    or ``~/.nvm``; nvm counts as present when ``nvm.sh`` is there). ``run_as``: the builder's identity
    (``ckagent.node.identity.Identities.builder``; None: the agent's own uid): installers run as it,
    its HOME is ``work_dir/builder-home`` unless the identity has one of its own. ``uv_cache_dir``:
    uv's cache (default ``envs_root/.uv-cache``), the builder's. ``kill_grace``: seconds a stopped
    installer gets between its stop signal and the kill (the node's ``task.kill_grace``).
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
        self.builder = Builder.of(run_as, envs_root.parent)
        self.installers = Installers(timeout, base_env, self.builder, kill_grace)
        self.uv_cache_dir = uv_cache_dir if uv_cache_dir is not None else envs_root / ".uv-cache"
        self.npm_cache_dir = envs_root / ".npm-cache"
        self.python = PythonEnvs(self.store, self.installers, uv_path=uv_path, agent_bin=agent_bin, index=index,
                                 cache_dir=self.uv_cache_dir, python=python)
        nvm_home = os.environ.get("NVM_DIR") or str(Path.home() / ".nvm")
        self.node = NodeEnvs(self.store, self.installers, nvm_dir if nvm_dir is not None else Path(nvm_home),
                             self.npm_cache_dir)
        self._set_up = False
        self._setup_lock = threading.Lock()

    def setup(self) -> None:
        """Make the environments' root, the builder's home and the caches what they must be (see module
        docstring), once per agent process: the root 0711 and the agent's; a cache or home another
        identity owns — an older agent's (root), the one ``task.run_as_user``'s — is emptied and given
        to the builder (a cache: nothing is lost but downloads), one log line each; and, where the agent
        is root, a warning when the bundled SDK or the node's browsers could be changed by a spider.
        Called at start; :meth:`check` and :meth:`prepare` call it too. Blocking. Raises OSError."""
        with self._setup_lock:
            if self._set_up:
                return
            builder = self.builder
            self.envs_root.mkdir(parents=True, exist_ok=True)
            os.chmod(self.envs_root, 0o711)
            builder.prepare_home()
            for cache in (self.uv_cache_dir, self.npm_cache_dir):
                existed = cache.exists()
                if builder.own(cache, fresh=True) and existed:
                    log.info("the cache %s belonged to another identity (an older agent's, or the one "
                             "task.run_as_user's: spiders may have written it): emptied and given to the node's "
                             "builder, %s", cache, builder.describe())
            if os.geteuid() == 0:
                self._warn_writable(builder)
                if builder.run_as is not None:
                    self._warn_unreachable(builder)
            self._set_up = True

    def _warn_unreachable(self, builder: Builder) -> None:
        """Warn when the builder cannot run an installer the agent found (uv or npm under /root, say):
        one ``--version`` of each, as the builder."""
        path = self.installers.base_env.get("PATH")
        tools = {"uv": find_uv(self.python.uv_path, path, self.python.agent_bin), "npm": shutil.which("npm", path=path)}
        for name, tool in tools.items():
            if tool is None:
                continue
            why = builder.cannot_run([tool, "--version"], self.installers.env({}))
            if why is not None:
                log.warning("the node's builder (%s) cannot run %s (%s): %s; every %s install will fail — install it "
                            "where every user can run it (e.g. /usr/local/bin)%s", builder.describe(), name, tool, why,
                            name, ", or set deps.uv_path" if name == "uv" else "")

    def _warn_writable(self, builder: Builder) -> None:
        """Warn when a spider could change what every spider runs: the bundled SDK, the node's browsers."""
        trusted = {0, os.geteuid()}
        shared = {"the bundled SDK": bundled_sdk_dir()}
        browsers = browser_env({})
        for runtime, variable in BROWSER_VARS.items():
            if variable in browsers:
                shared[f"the node's {runtime} ({variable})"] = Path(browsers[variable])
        for what, path in shared.items():
            if path is None:
                continue
            why = writable_by_others(path, trusted)
            if why is not None:
                log.warning("%s (%s) is not read-only for spiders: %s; every spider runs it, so one that can change "
                            "it changes the others' — make it root's, without group or other write (chmod go-w)",
                            what, path, why)

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
        (ckagent.code.installenv); what of it reaches them is ckagent.code.installenv.installer_env's.
        ``home``: the spider's HOME (unused: installers have the builder's own). ``checked``: what
        :meth:`check` found already, with the same arguments, in a thread hop of the caller's (None:
        the look is made here).
        """
        try:
            if not self._set_up:
                await trio.to_thread.run_sync(self.setup)
            env = self._env(task_env, marker)
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
        del home  # installers have the builder's own HOME
        runtime = frameworks.framework(framework).runtime
        if runtime not in (frameworks.PYTHON, frameworks.NODE):
            return None
        try:
            self.setup()
        except OSError as exc:
            return Checked(error=exc)
        if runtime is frameworks.PYTHON:
            return self.python.check(code_dir, framework, self._env(task_env, marker))
        return self.node.check(code_dir, self._env(task_env, marker))

    @staticmethod
    def _env(task_env: dict[str, str] | None, marker: dict[str, str] | None) -> dict[str, str]:
        return {**(task_env or {}), **(marker or {})}

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
