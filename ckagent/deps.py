"""A spider's dependencies: one virtualenv per Python spider (uv), node_modules for Node spiders (npm).

Python spiders (scrapy, python, playwright, selenium) get ``work_dir/venvs/<spiderId>/``, reused
across code versions:

- ``uv.lock`` + ``pyproject.toml`` → ``uv sync --frozen --no-install-project``
- ``pyproject.toml`` → ``uv pip install -r pyproject.toml``
- ``requirements.txt`` → ``uv pip install -r requirements.txt``
- ``scrapy.cfg`` alone → ``uv pip install scrapy`` (a Scrapy project needs Scrapy; documented default)
- nothing → an empty venv

The install is skipped when the hash of the dependency files (and the interpreter) matches the
last successful install — the common case of the same spider running again. The bundled
``crawlerkeeper_sdk`` is made importable through a ``.pth`` file, which Python appends *after*
site-packages: a spider that installs its own SDK version gets its own, and nothing else of the
agent leaks into the spider's import path.

Installer output streams into the task's log as it comes. Exceptions::

    DepsError     the install failed, timed out or the tool is missing; the message says which
                  and carries the tail of the installer's output (task → DEPS_FAILED)
"""

from __future__ import annotations

import hashlib
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

from ckagent.process import terminate_group

log = logging.getLogger(__name__)

PYTHON_FRAMEWORKS = ("scrapy", "python", "playwright", "selenium")
OFFICIAL_INDEX = "https://pypi.org/simple"
_DEP_FILES = ("uv.lock", "pyproject.toml", "requirements.txt", "scrapy.cfg", "package.json",
              "package-lock.json", "npm-shrinkwrap.json")
_MARKER = ".ckagent-deps"
_SDK_PTH = "_crawlerkeeper_sdk_fallback.pth"
UV_MISSING = (
    "uv is not installed: install it with `pip install uv` (or see https://docs.astral.sh/uv/), "
    "or set deps.uv_path / AGENT_UV_PATH to its location"
)


class DepsError(Exception):
    """Installing a spider's dependencies failed; the message is meant for the task's errorMessage."""


@dataclass
class Prepared:
    """The outcome of :meth:`Dependencies.prepare`: what to put first on PATH and extra env vars."""

    path_prefix: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cache_hit: bool = True
    seconds: float = 0.0


def bundled_sdk_dir() -> Path | None:
    """A directory holding only ``crawlerkeeper_sdk/`` (inside the installed agent, or the checkout)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_sdk", here.parent / "sdk" / "python" / "src"):
        if (candidate / "crawlerkeeper_sdk" / "__init__.py").is_file():
            return candidate
    return None


def find_uv(configured: Path | None) -> str | None:
    """uv on PATH, else the configured path, else next to the agent's interpreter (``pip install uv``)."""
    found = shutil.which("uv")
    if found:
        return found
    if configured is not None and configured.is_file():
        return str(configured)
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if beside.is_file() else None


class IndexChooser:
    """Picks the package index once: the configured one, else PyPI if reachable, else the mirror."""

    def __init__(self, configured: str | None, fallback: str, probe_timeout: float = 3.0) -> None:
        self._configured = configured
        self._fallback = fallback
        self._timeout = probe_timeout
        self._chosen: str | None = configured
        self._lock = trio.Lock()

    async def index_url(self) -> str:
        """The index to give uv (probes at most once per agent run)."""
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


def deps_hash(code_dir: Path, framework: str, extra: str = "") -> str:
    """Hash of the dependency files present in ``code_dir`` (plus framework and ``extra``)."""
    digest = hashlib.sha256(f"{framework}\0{extra}\0".encode())
    for name in _DEP_FILES:
        path = code_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


class Dependencies:
    """Installs dependencies for tasks (see module docstring).

    ``base_env`` is the minimal environment installers run with (never the agent's secrets).
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
    ) -> None:
        self.venvs_root = venvs_root
        self._uv_path = uv_path
        self._index = index
        self._cache_dir = uv_cache_dir
        self._timeout = timeout
        self._base_env = base_env
        self._python = python

    async def prepare(
        self, framework: str, spider_id: str, code_dir: Path, output: Callable[[bytes], None]
    ) -> Prepared:
        """Make the spider's dependencies ready; returns PATH additions and env.

        ``output`` receives the installer's output bytes as they come (the task log). Raises
        DepsError. Cancellation stops the installer (TERM → KILL of its process group).
        """
        started = trio.current_time()
        if framework in PYTHON_FRAMEWORKS:
            prepared = await self._python_env(spider_id, code_dir, framework, output)
        elif framework == "node":
            prepared = await self._node_env(code_dir, output)
        else:
            prepared = Prepared()
        prepared.seconds = trio.current_time() - started
        return prepared

    async def _python_env(
        self, spider_id: str, code_dir: Path, framework: str, output: Callable[[bytes], None]
    ) -> Prepared:
        venv = self.venvs_root / spider_id
        bin_dir = venv / "bin"
        prepared = Prepared(path_prefix=[str(bin_dir)], env={"VIRTUAL_ENV": str(venv)})
        wanted = await trio.to_thread.run_sync(deps_hash, code_dir, framework, self._python)
        marker = venv / _MARKER
        if (bin_dir / "python").exists() and marker.is_file() and marker.read_text() == wanted:
            return prepared
        prepared.cache_hit = False
        uv = find_uv(self._uv_path)
        if uv is None:
            raise DepsError(UV_MISSING)
        env = dict(self._base_env)
        env.update({"VIRTUAL_ENV": str(venv), "UV_PROJECT_ENVIRONMENT": str(venv),
                    "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1"})
        if self._cache_dir is not None:
            env["UV_CACHE_DIR"] = str(self._cache_dir)
        index = await self._index.index_url()
        env["UV_INDEX_URL"] = index
        env["UV_DEFAULT_INDEX"] = index
        marker.unlink(missing_ok=True)
        if not (bin_dir / "python").exists():
            await self._run([uv, "venv", "--quiet", "--python", self._python, str(venv)], code_dir, env, output)
        steps: list[list[str]] = []
        if (code_dir / "uv.lock").is_file() and (code_dir / "pyproject.toml").is_file():
            steps.append([uv, "sync", "--frozen", "--no-install-project"])
        elif (code_dir / "pyproject.toml").is_file():
            steps.append([uv, "pip", "install", "--python", str(bin_dir / "python"), "-r", "pyproject.toml"])
        elif (code_dir / "requirements.txt").is_file():
            steps.append([uv, "pip", "install", "--python", str(bin_dir / "python"), "-r", "requirements.txt"])
        elif (code_dir / "scrapy.cfg").is_file():
            steps.append([uv, "pip", "install", "--python", str(bin_dir / "python"), "scrapy"])
        for argv in steps:
            await self._run(argv, code_dir, env, output)
        await trio.to_thread.run_sync(_install_sdk_pth, venv)
        marker.write_text(wanted)
        return prepared

    async def _node_env(self, code_dir: Path, output: Callable[[bytes], None]) -> Prepared:
        if not (code_dir / "package.json").is_file():
            return Prepared()
        wanted = await trio.to_thread.run_sync(deps_hash, code_dir, "node")
        marker = code_dir / "node_modules" / _MARKER
        if marker.is_file() and marker.read_text() == wanted:
            return Prepared()
        npm = shutil.which("npm", path=self._base_env.get("PATH"))
        if npm is None:
            raise DepsError("npm is not installed on this node; install Node.js (with npm) to run Node spiders")
        lock = (code_dir / "package-lock.json").is_file() or (code_dir / "npm-shrinkwrap.json").is_file()
        argv = [npm, "ci" if lock else "install", "--no-audit", "--no-fund"]
        await self._run(argv, code_dir, dict(self._base_env), output)
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(wanted)
        return Prepared(cache_hit=False)

    async def _run(self, argv: list[str], cwd: Path, env: dict[str, str], output: Callable[[bytes], None]) -> None:
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
                        start_new_session=True,
                        deliver_cancel=lambda p: terminate_group(p.pid, 5.0),
                    )
                )
                assert process.stdout is not None
                while chunk := await process.stdout.receive_some(65536):
                    sink(bytes(chunk))
                result = subprocess.CompletedProcess(argv, await process.wait())
        name = Path(argv[0]).name + " " + argv[1]
        if scope.cancelled_caught:
            raise DepsError(f"{name} timed out after {self._timeout:g} s (deps.uv_sync_timeout)\n{_tail(tail)}")
        if result is None or result.returncode != 0:
            code = None if result is None else result.returncode
            raise DepsError(f"{name} failed with exit code {code}:\n{_tail(tail)}")


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
