"""A spider's dependencies: one virtualenv per Python spider (uv), one node_modules per Node spider (npm).

Python spiders (scrapy, python, playwright, selenium) get ``work_dir/venvs/<spiderId>/``, outside
the code dir and reused across code versions; its ``bin`` goes first on the spider's PATH:

- ``uv.lock`` + ``pyproject.toml`` → ``uv sync --frozen --no-install-project``
- ``pyproject.toml`` → ``uv pip install -r pyproject.toml``
- ``requirements.txt`` → ``uv pip install -r requirements.txt``
- no dependency file → the framework's package (:data:`DEFAULT_PACKAGES`: a Scrapy project — or
  any code with a ``scrapy.cfg`` — gets ``scrapy``, playwright ``playwright``, selenium
  ``selenium``; a plain python spider gets an empty venv). A documented, sensible default.

Node spiders (``package.json``) get ``work_dir/node/<spiderId>/``: the manifest and lockfile are
copied there, ``npm ci`` (lockfile) or ``npm install`` runs there, and the code dir gets a
``node_modules`` symlink to it (Node's resolution follows it), so a new code version with the same
dependencies installs nothing. A version asked for in ``.nvmrc`` or ``engines.node`` is taken from
nvm (``$NVM_DIR/nvm.sh``; an installed version satisfying it, else ``nvm install``) when nvm is
present; otherwise the system node runs, with a warning in the task log if it does not satisfy it.

Either install is skipped when the hash of the dependency files (and interpreter) matches the last
successful install — the common case of the same spider running again; that check costs a few
stat/read calls. The bundled ``crawlerkeeper_sdk`` is made importable through a ``.pth`` file,
which Python appends *after* site-packages: a spider that installs its own SDK version gets its
own, and nothing else of the agent leaks into the spider's import path.

Installer output streams into the task's log as it comes, line by line. ``deps.uv_sync_timeout``
bounds each installer run (uv and npm alike). The package index is ``deps.uv_index_url`` when set;
otherwise PyPI is probed once (short timeout, the answer kept for the agent's life) and the
fallback mirror is used when it is unreachable. Exceptions::

    DepsError     the install failed, timed out or the tool is missing; the message says which
                  and carries the tail of the installer's output (task → DEPS_FAILED)
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
import trio

from ckagent.process import RunAs, popen_identity, terminate_group
from ckagent.runtimes import NodeVersion, nvm_node_versions, parse_node_version, satisfies
from ckagent.workspace import safe_name

log = logging.getLogger(__name__)

PYTHON_FRAMEWORKS = ("scrapy", "python", "playwright", "selenium")
DEFAULT_PACKAGES: dict[str, list[str]] = {"scrapy": ["scrapy"], "playwright": ["playwright"],
                                          "selenium": ["selenium"]}
"""What a Python spider without a dependency file gets installed, by framework."""
OFFICIAL_INDEX = "https://pypi.org/simple"
_PY_DEP_FILES = ("uv.lock", "pyproject.toml", "requirements.txt", "scrapy.cfg")
_NODE_DEP_FILES = ("package.json", "package-lock.json", "npm-shrinkwrap.json", ".nvmrc")
_NODE_COPIED = ("package.json", "package-lock.json", "npm-shrinkwrap.json", ".npmrc")
_MARKER = ".ckagent-deps"
_SDK_PTH = "_crawlerkeeper_sdk_fallback.pth"
AGENT_BIN = Path(sys.executable).parent
"""The agent interpreter's bin dir: ``pip install uv`` next to the agent puts uv there."""
UV_MISSING = (
    "uv is not installed on this node. Install it into the agent's Python with `pip install uv` "
    "(or system-wide: see https://docs.astral.sh/uv/getting-started/installation/), or set "
    "deps.uv_path / AGENT_UV_PATH to the uv executable"
)
NPM_MISSING = "npm is not installed on this node: install Node.js with npm (e.g. `apt-get install nodejs npm`)"


class DepsError(Exception):
    """Installing a spider's dependencies failed; the message is meant for the task's errorMessage."""


@dataclass
class Prepared:
    """The outcome of :meth:`Dependencies.prepare`: what to put first on PATH and extra env vars.

    ``notes`` are lines for the task log (e.g. a node version warning); ``seconds`` the time taken.
    """

    path_prefix: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cache_hit: bool = True
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def bundled_sdk_dir() -> Path | None:
    """A directory holding only ``crawlerkeeper_sdk/`` (inside the installed agent, or the checkout)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_sdk", here.parent / "sdk" / "python" / "src"):
        if (candidate / "crawlerkeeper_sdk" / "__init__.py").is_file():
            return candidate
    return None


def find_uv(configured: Path | None, path: str | None = None, agent_bin: Path | None = AGENT_BIN) -> str | None:
    """uv on ``path`` (default: the agent's PATH), else ``configured``, else in ``agent_bin``; None if absent."""
    found = shutil.which("uv", path=path)
    if found:
        return found
    if configured is not None and configured.is_file() and os.access(configured, os.X_OK):
        return str(configured)
    if agent_bin is not None and (agent_bin / "uv").is_file():
        return str(agent_bin / "uv")
    return None


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


def deps_hash(code_dir: Path, names: tuple[str, ...], extra: str = "") -> str:
    """Hash of the files ``names`` present in ``code_dir`` plus ``extra`` (blocking: a few small reads)."""
    digest = hashlib.sha256(f"{extra}\0".encode())
    for name in names:
        path = code_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _read_marker(marker: Path) -> str | None:
    try:
        return marker.read_text()
    except OSError:
        return None


def _python_cached(venv: Path, code_dir: Path, extra: str) -> tuple[str, bool]:
    """(wanted hash, True when the venv's last successful install had it) — one thread hop for both."""
    wanted = deps_hash(code_dir, _PY_DEP_FILES, extra)
    return wanted, (venv / "bin" / "python").exists() and _read_marker(venv / _MARKER) == wanted


def _python_install_steps(uv: str, bin_dir: Path, code_dir: Path, framework: str) -> tuple[bool, list[list[str]]]:
    """(whether the venv's python exists, the uv commands that install the spider's dependencies),
    chosen from the dependency files in ``code_dir`` (blocking: a few stats)."""
    pip_install = [uv, "pip", "install", "--python", str(bin_dir / "python")]
    steps: list[list[str]] = []
    if (code_dir / "uv.lock").is_file() and (code_dir / "pyproject.toml").is_file():
        steps.append([uv, "sync", "--frozen", "--no-install-project"])
    elif (code_dir / "pyproject.toml").is_file():
        steps.append([*pip_install, "-r", "pyproject.toml"])
    elif (code_dir / "requirements.txt").is_file():
        steps.append([*pip_install, "-r", "requirements.txt"])
    elif (code_dir / "scrapy.cfg").is_file():
        steps.append([*pip_install, *DEFAULT_PACKAGES["scrapy"]])
    elif framework in DEFAULT_PACKAGES:
        steps.append([*pip_install, *DEFAULT_PACKAGES[framework]])
    return (bin_dir / "python").exists(), steps


def _node_cached(code_dir: Path, install_dir: Path, extra: str) -> tuple[str, str, bool]:
    """(layout, wanted hash, cached) of a node spider (blocking: stats, hashing, one small read).

    layout: ``"no-package"`` (no package.json: nothing to install), ``"ships-node-modules"`` (the
    code carries its node_modules: npm is not run) or ``"install"``; for the last, ``cached`` says
    whether ``install_dir`` holds node_modules installed for the same ``wanted`` hash.
    """
    if not (code_dir / "package.json").is_file():
        return "no-package", "", False
    shipped = code_dir / "node_modules"
    if shipped.exists() and not shipped.is_symlink():
        return "ships-node-modules", "", False
    wanted = deps_hash(code_dir, _NODE_DEP_FILES, extra)
    cached = _read_marker(install_dir / _MARKER) == wanted and (install_dir / "node_modules").is_dir()
    return "install", wanted, cached


class Dependencies:
    """Installs dependencies for tasks (see module docstring).

    ``base_env`` is the minimal environment installers run with (never the agent's secrets); its
    PATH is also where uv and npm are looked for (uv also at ``uv_path`` and in ``agent_bin``).
    ``timeout`` bounds one installer run (seconds). ``node_root`` holds the Node spiders' installs
    (default: ``venvs_root``'s sibling ``node``); ``nvm_dir`` is nvm's home (default: $NVM_DIR or
    ``~/.nvm``; nvm counts as present when ``nvm.sh`` is there).
    ``run_as``: installers run as that user and the venvs belong to it (``task.run_as_user``).
    """

    def __init__(
        self,
        venvs_root: Path,
        *,
        uv_path: Path | None,
        index: IndexChooser,
        uv_cache_dir: Path | None,
        timeout: float,
        base_env: dict[str, str],
        python: str = sys.executable,
        run_as: RunAs | None = None,
        agent_bin: Path | None = AGENT_BIN,
        node_root: Path | None = None,
        nvm_dir: Path | None = None,
    ) -> None:
        self.venvs_root = venvs_root
        self.node_root = node_root or venvs_root.parent / "node"
        self._run_as = run_as
        self._uv_path = uv_path
        self._agent_bin = agent_bin
        self._index = index
        self._cache_dir = uv_cache_dir
        self._timeout = timeout
        self._base_env = base_env
        self._python = python
        nvm_home = os.environ.get("NVM_DIR") or str(Path.home() / ".nvm")
        self.nvm_dir = nvm_dir if nvm_dir is not None else Path(nvm_home)
        sdk = bundled_sdk_dir()
        self._python_extra = f"{python}\0{sdk}"

    async def prepare(
        self,
        framework: str,
        spider_id: str,
        code_dir: Path,
        output: Callable[[bytes], None],
        *,
        marker: dict[str, str] | None = None,
    ) -> Prepared:
        """Make the spider's dependencies ready; returns PATH additions and env.

        ``output`` receives the installer's output bytes as they come (the task log); ``marker``
        (the task's ``CK_TASK_ID``) is added to the installers' environment so the task's sweep
        finds whatever they leave behind. Raises DepsError. Cancellation stops the installer
        (TERM → 5 s → KILL of its process group) before it propagates.
        """
        started = trio.current_time()
        if framework in PYTHON_FRAMEWORKS:
            prepared = await self._python_env(spider_id, code_dir, framework, output, dict(marker or {}))
        elif framework == "node":
            prepared = await self._node_env(spider_id, code_dir, output, dict(marker or {}))
        else:
            prepared = Prepared()
        prepared.seconds = trio.current_time() - started
        return prepared

    # ------------------------------------------------------------------ python

    async def _python_env(
        self, spider_id: str, code_dir: Path, framework: str, output: Callable[[bytes], None],
        task_env: dict[str, str],
    ) -> Prepared:
        venv = self.venvs_root / safe_name(spider_id)
        bin_dir = venv / "bin"
        prepared = Prepared(path_prefix=[str(bin_dir)], env={"VIRTUAL_ENV": str(venv)})
        extra = f"{framework}\0{self._python_extra}"
        wanted, cached = await trio.to_thread.run_sync(_python_cached, venv, code_dir, extra)
        if cached:
            return prepared
        prepared.cache_hit = False
        uv = await trio.to_thread.run_sync(find_uv, self._uv_path, self._base_env.get("PATH"), self._agent_bin)
        if uv is None:
            raise DepsError(UV_MISSING)
        env = {**self._base_env, **task_env}
        env.update({"VIRTUAL_ENV": str(venv), "UV_PROJECT_ENVIRONMENT": str(venv),
                    "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1"})
        cache_dir = self._cache_dir
        if self._run_as is not None:
            env.update(self._run_as.env())
            # The user owns its venv; uv's cache must be writable by it too (its HOME may be bare).
            cache_dir = cache_dir or self.venvs_root / ".uv-cache"
            await trio.to_thread.run_sync(_give_dirs, self._run_as, [venv, cache_dir])
        if cache_dir is not None:
            env["UV_CACHE_DIR"] = str(cache_dir)
        env["UV_DEFAULT_INDEX"] = await self._index.index_url()
        marker = venv / _MARKER
        await trio.to_thread.run_sync(partial(marker.unlink, missing_ok=True))
        has_venv, steps = await trio.to_thread.run_sync(_python_install_steps, uv, bin_dir, code_dir, framework)
        if not has_venv:
            await self._run([uv, "venv", "--quiet", "--allow-existing", "--python", self._python, str(venv)],
                            code_dir, env, output)
        for argv in steps:
            await self._run(argv, code_dir, env, output)
        await trio.to_thread.run_sync(_install_sdk_pth, venv)
        await trio.to_thread.run_sync(marker.write_text, wanted)
        return prepared

    # ------------------------------------------------------------------ node

    async def _node_env(
        self, spider_id: str, code_dir: Path, output: Callable[[bytes], None], task_env: dict[str, str]
    ) -> Prepared:
        prepared = Prepared()
        spec, source = await trio.to_thread.run_sync(wanted_node, code_dir)
        env = {**self._base_env, **task_env}
        if self._run_as is not None:
            env.update(self._run_as.env())
        if spec is not None:
            await self._select_node(spec, source, env, code_dir, output, prepared)
        install_dir = self.node_root / safe_name(spider_id)
        extra = f"{spec}\0{prepared.path_prefix}"
        layout, wanted, cached = await trio.to_thread.run_sync(_node_cached, code_dir, install_dir, extra)
        if layout == "no-package":
            return prepared
        if layout == "ships-node-modules":
            prepared.notes.append("node_modules ships with the code: npm is not run")
            return prepared
        marker = install_dir / _MARKER
        if not cached:
            prepared.cache_hit = False
            path = os.pathsep.join([*prepared.path_prefix, env.get("PATH", "")])
            npm = shutil.which("npm", path=path)
            if npm is None:
                raise DepsError(NPM_MISSING)
            env["PATH"] = path
            await trio.to_thread.run_sync(_stage_node_manifest, code_dir, install_dir, marker)
            if self._run_as is not None:
                await trio.to_thread.run_sync(_give_dirs, self._run_as, [install_dir])
            lock = await trio.to_thread.run_sync(
                lambda: any((install_dir / name).is_file() for name in ("package-lock.json", "npm-shrinkwrap.json"))
            )
            argv = [npm, "ci" if lock else "install", "--no-audit", "--no-fund", "--no-progress",
                    "--no-update-notifier"]
            await self._run(argv, install_dir, env, output)
            await trio.to_thread.run_sync(_ensure_dir_and_write, install_dir / "node_modules", marker, wanted)
        await trio.to_thread.run_sync(_link_node_modules, code_dir, install_dir / "node_modules")
        return prepared

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
        tail: deque[bytes] = deque(maxlen=64)
        output(f"[ckagent] $ {' '.join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv))}\n".encode())

        def sink(chunk: bytes) -> None:
            tail.append(chunk)
            output(chunk)

        result: subprocess.CompletedProcess[bytes] | None = None
        with trio.move_on_after(self._timeout) as scope:
            async with trio.open_nursery() as nursery:
                process: trio.Process = await nursery.start(
                    partial(
                        trio.run_process, argv, cwd=str(cwd), env=env, stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False,
                        start_new_session=True, **popen_identity(self._run_as),
                        deliver_cancel=lambda p: terminate_group(p.pid, 5.0),
                    )
                )
                assert process.stdout is not None
                while chunk := await process.stdout.receive_some(65536):
                    sink(bytes(chunk))
                result = subprocess.CompletedProcess(argv, await process.wait())
        name = label or " ".join([Path(argv[0]).name, *itertools.takewhile(lambda a: not a.startswith("-"), argv[1:3])])
        if scope.cancelled_caught:
            raise DepsError(
                f"{name} timed out after {self._timeout:g} s and was stopped (the limit is "
                f"deps.uv_sync_timeout / AGENT_UV_SYNC_TIMEOUT); its last output:\n{_tail(tail)}"
            )
        if result is None or result.returncode != 0:
            code = None if result is None else result.returncode
            raise DepsError(f"{name} failed with exit code {code}:\n{_tail(tail)}")


def wanted_node(code_dir: Path) -> tuple[str | None, str]:
    """The node version a spider asks for: (spec, where from) from ``.nvmrc``, else ``engines.node``."""
    nvmrc = code_dir / ".nvmrc"
    if nvmrc.is_file():
        lines = nvmrc.read_text(errors="replace").split()
        if lines:
            return lines[0].strip(), ".nvmrc"
    manifest = code_dir / "package.json"
    if manifest.is_file():
        try:
            engines = json.loads(manifest.read_text(errors="replace")).get("engines") or {}
        except (ValueError, AttributeError):
            return None, ""
        spec = engines.get("node") if isinstance(engines, dict) else None
        if isinstance(spec, str) and spec.strip():
            return spec.strip(), "package.json engines.node"
    return None, ""


def pick_nvm_node(nvm_dir: Path, spec: str) -> tuple[str, Path] | None:
    """The highest nvm-installed node satisfying ``spec``: (version, its bin dir), or None (blocking)."""
    best: tuple[NodeVersion, Path] | None = None
    for version, bin_dir in nvm_node_versions(nvm_dir):
        if satisfies(version, spec) and (best is None or version > best[0]):
            best = (version, bin_dir)
    return None if best is None else (".".join(map(str, best[0])), best[1])


@functools.lru_cache(maxsize=8)
def _node_version_at(path: str, mtime: float) -> NodeVersion | None:
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, timeout=10, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_node_version(proc.stdout.decode(errors="replace").strip())


def system_node_version(path: str) -> NodeVersion | None:
    """Version of the ``node`` found on ``path`` (cached per binary and mtime; blocking on a miss)."""
    node = shutil.which("node", path=path)
    if node is None:
        return None
    return _node_version_at(node, os.stat(node).st_mtime)


def _stage_node_manifest(code_dir: Path, install_dir: Path, marker: Path) -> None:
    """Copy package.json and lockfiles into ``install_dir`` (stale ones removed); forget the old marker."""
    install_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    for name in _NODE_COPIED:
        src, dst = code_dir / name, install_dir / name
        if src.is_file():
            shutil.copyfile(src, dst)
        else:
            dst.unlink(missing_ok=True)


def _ensure_dir_and_write(directory: Path, marker: Path, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    marker.write_text(text)


def _link_node_modules(code_dir: Path, target: Path) -> None:
    """Make ``code_dir/node_modules`` a symlink to ``target`` (replacing a stale link)."""
    link = code_dir / "node_modules"
    if link.is_symlink():
        if os.readlink(link) == str(target):
            return
        link.unlink()
    elif link.exists():
        return
    link.symlink_to(target, target_is_directory=True)


def _give_dirs(run_as: RunAs, paths: list[Path]) -> None:
    """Create ``paths`` if missing and give them (and their contents) to ``run_as`` (blocking)."""
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
        if path.stat().st_uid != run_as.uid:
            run_as.chown_tree(path)


def _tail(chunks: deque[bytes], limit: int = 2000) -> str:
    text = b"".join(chunks).decode("utf-8", errors="replace").strip()
    return text[-limit:]


def _install_sdk_pth(venv: Path) -> None:
    sdk = bundled_sdk_dir()
    for site in (venv / "lib").glob("python*/site-packages"):
        pth = site / _SDK_PTH
        if sdk is None:
            pth.unlink(missing_ok=True)
        else:
            pth.write_text(str(sdk) + "\n")


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
