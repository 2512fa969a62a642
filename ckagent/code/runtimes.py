"""What this node can run: Python versions, uv, node versions (system and nvm), npm, Chromium, chromedriver.

Reported to the master at registration and in heartbeats (``runtimes``) so it can schedule
accordingly; rescanned every few minutes. Detection runs subprocesses (``--version``): call
:func:`detect_runtimes` through ``trio.to_thread``. A tool that is missing is simply absent::

    {"python": {"version": "3.11.7", "path": "...", "versions": ["3.10.14", "3.11.7", "3.12.3"]},
     "uv": {"version": "0.5.1", "path": "..."},
     "node": {"version": "20.11.0", "path": "/usr/bin/node", "versions": ["18.19.0", "20.11.0"],
              "nvm": ["18.19.0"]},
     "npm": {...}, "chromium": {...}, "chromedriver": {...}}

Tool discovery lives here, once: :func:`find_uv`, :func:`find_npm`, :func:`find_package_manager`
(yarn, pnpm: never corepack's shims), :func:`find_chromium`, :func:`find_chromedriver` (ckagent.code.deps asks these; this module imports nothing of the agent's but
the pure ckagent.node.noderange).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckagent.node.noderange import NodeVersion, parse_node_version

log = logging.getLogger(__name__)

_VERSION = re.compile(r"(\d+\.\d+(?:\.\d+)*)")

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
CHROMEDRIVER_NAMES = ("chromedriver",)


def _version_of(argv: list[str], timeout: float = 10.0) -> str | None:
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    match = _VERSION.search((proc.stdout or proc.stderr).decode("utf-8", errors="replace"))
    return match.group(1) if match else None


def _package_version(command: str, names: tuple[str, ...]) -> str | None:
    """The version in the package.json of the npm package whose ``bin/`` script ``command`` runs (after
    its links), when that package is one of ``names``; else None. Blocking: one small read."""
    cli = Path(os.path.realpath(command))
    try:
        package = json.loads((cli.parent.parent / "package.json").read_text("utf-8"))
    except (OSError, ValueError):
        package = None
    if (isinstance(package, dict) and package.get("name") in names and cli.parent.name == "bin"
            and isinstance(package.get("version"), str)):
        match = _VERSION.fullmatch(package["version"].split("-", 1)[0])
        if match:
            return match.group(1)
    return None


def _npm_version(npm: str) -> str | None:
    """npm's version, read from the package.json of the package its command runs (``bin/npm-cli.js``
    in an ``npm`` package: Debian's, nvm's and npm's own installs); else by running ``npm --version``,
    which starts Node and loads npm: ~0.15 s of CPU at every agent start for one line."""
    return _package_version(npm, ("npm",)) or _version_of([npm, "--version"])


PACKAGE_MANAGER_PACKAGES = {"yarn": ("yarn", "@yarnpkg/cli-dist"), "pnpm": ("pnpm",)}
"""The npm packages that carry each package manager's command (Yarn 1: ``yarn``; Yarn 2+: ``@yarnpkg/cli-dist``)."""


def is_corepack_shim(command: str) -> bool:
    """Whether ``command`` (a path) is one of corepack's shims: run, it downloads its tool from the
    internet (``corepack enable`` links ``yarn`` and ``pnpm`` to them)."""
    return "corepack" in Path(os.path.realpath(command)).parts


def find_package_manager(name: str, path: str | None = None) -> tuple[str, str | None] | None:
    """``yarn`` or ``pnpm`` on ``path`` (default: the agent's PATH): (its path, its version or None when
    it cannot be told), or None when absent — a corepack shim counts as absent (it downloads the tool
    when run; ckagent.code.nodetools fetches it from the npm registry instead). Blocking: a small read,
    or one ``--version`` run when the command is not an npm package's script."""
    found = shutil.which(name, path=path)
    if found is None or is_corepack_shim(found):
        return None
    version = _package_version(found, PACKAGE_MANAGER_PACKAGES.get(name, (name,)))
    return found, version or _version_of([found, "--version"])


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary on PATH, or None."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def find_chromedriver() -> str | None:
    """Path of chromedriver on PATH, or None."""
    return shutil.which("chromedriver")


AGENT_BIN = Path(sys.executable).parent
"""The agent interpreter's bin dir: ``pip install uv`` next to the agent puts uv there."""


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


def find_npm(path: str | None = None) -> str | None:
    """npm on ``path`` (default: the agent's PATH), or None."""
    return shutil.which("npm", path=path)


def nvm_node_versions(nvm_dir: Path) -> list[tuple[NodeVersion, Path]]:
    """Node versions installed by nvm under ``nvm_dir/versions/node/v*/`` with their bin dirs (blocking)."""
    base = nvm_dir / "versions" / "node"
    found: list[tuple[NodeVersion, Path]] = []
    if not base.is_dir():
        return found
    for entry in base.iterdir():
        version = parse_node_version(entry.name)
        if version is not None and (entry / "bin" / "node").is_file():
            found.append((version, entry / "bin"))
    return sorted(found)


def _python_versions(pool: ThreadPoolExecutor) -> list[str]:
    """Python 3 versions on this node: python3.X on PATH (by running them), pyenv's installed versions
    (by their directory names: its shims are slow to run and fail for versions not selected), the agent's."""
    versions = {platform.python_version()}
    paths: dict[str, str] = {}
    for minor in range(8, 16):
        path = shutil.which(f"python3.{minor}")
        if path is not None and f"{os.sep}shims{os.sep}" not in path:
            paths.setdefault(os.path.realpath(path), path)
    for version in pool.map(lambda path: _version_of([path, "--version"]), paths.values()):
        if version is not None:
            versions.add(version)
    versions.update(_pyenv_versions())
    return sorted(versions, key=_sort_key)


def _pyenv_versions() -> list[str]:
    """pyenv's installed Python 3 versions (``$PYENV_ROOT``, else ``~/.pyenv``). A root this user cannot
    read (a non-root agent that inherited root's ``PYENV_ROOT``) is skipped with one warning."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    try:
        if not (root / "versions").is_dir():
            return []
        return [entry.name for entry in (root / "versions").iterdir()
                if re.fullmatch(r"3\.\d+\.\d+", entry.name) and (entry / "bin" / "python3").exists()]
    except OSError as exc:
        if str(root) not in _WARNED_PYENV:
            _WARNED_PYENV.add(str(root))
            log.warning("pyenv root %s cannot be read by this user (uid %d: %s): its Python versions are "
                        "ignored; unset PYENV_ROOT or point it at a readable pyenv", root, os.geteuid(),
                        exc.strerror or exc)
        return []


_WARNED_PYENV: set[str] = set()


def _sort_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def _tool_version(tool: tuple[str, str]) -> str | None:
    """The version of a tool found by :func:`detect_runtimes` (name, path)."""
    name, path = tool
    return _npm_version(path) if name == "npm" else _version_of([path, "--version"])


def detect_runtimes(uv_path: Path | None = None, nvm_dir: Path | None = None) -> dict[str, Any]:
    """Scan the node (blocking, a few subprocesses; about a second). See the module docstring for the shape.

    ``nvm_dir`` defaults to $NVM_DIR, else ``~/.nvm``. Never raises for a missing or broken tool.
    """
    tools: dict[str, str | None] = {
        "uv": find_uv(uv_path),
        "node": shutil.which("node"),
        "npm": find_npm(),
        "chromium": find_chromium(),
        "chromedriver": find_chromedriver(),
    }
    present = {name: path for name, path in tools.items() if path is not None}
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="runtimes") as pool:  # shims are slow: in parallel
        pythons = pool.submit(_python_versions, pool)
        versions = dict(zip(present, pool.map(_tool_version, present.items()), strict=True))
        found: dict[str, Any] = {
            "python": {"version": platform.python_version(), "path": sys.executable, "versions": pythons.result()},
        }
    for name, path in present.items():
        if versions[name] is not None:
            found[name] = {"version": versions[name], "path": path}
    nvm_home = nvm_dir or Path(os.environ.get("NVM_DIR") or Path.home() / ".nvm")
    nvm = [".".join(map(str, v)) for v, _ in nvm_node_versions(nvm_home)] if (nvm_home / "nvm.sh").is_file() else []
    if nvm or "node" in found:
        node = found.setdefault("node", {})
        node["nvm"] = nvm
        system = [node["version"]] if "version" in node else []
        node["versions"] = sorted(set(system + nvm), key=_sort_key)
    return found


BROWSER_VARS = {"chromium": "CK_CHROMIUM_PATH", "chromedriver": "CK_CHROMEDRIVER_PATH"}
"""Runtime → the variable that hands its path to every spider (docs/protocol.md, the SDK README)."""


def browser_env(runtimes: dict[str, Any]) -> dict[str, str]:
    """``{"CK_CHROMIUM_PATH": ..., "CK_CHROMEDRIVER_PATH": ...}`` for the browsers a scan found.

    Falls back to a PATH lookup (:func:`find_chromium`, :func:`find_chromedriver`) for a runtime the
    scan has not reported (e.g. before the first scan).
    """
    found = {"chromium": find_chromium, "chromedriver": find_chromedriver}
    env: dict[str, str] = {}
    for runtime, variable in BROWSER_VARS.items():
        entry = runtimes.get(runtime)
        path = entry.get("path") if isinstance(entry, dict) else None
        path = path if isinstance(path, str) and path else found[runtime]()
        if path:
            env[variable] = path
    return env


RUNTIMES_CACHE = "runtimes.json"


def load_cached_runtimes(path: Path) -> dict[str, Any]:
    """The last runtime scan saved in the work dir, or {} (first start, unreadable file)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_runtimes_cache(path: Path, runtimes: dict[str, Any]) -> None:
    """Save a runtime scan (atomically: write a temp file, then rename)."""
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(runtimes, sort_keys=True))
        os.chmod(tmp, 0o600)  # the agent's own file (ckagent.node.workmodes), whatever the umask
        os.replace(tmp, path)
    except OSError as exc:
        log.debug("cannot cache the runtime scan in %s: %s", path, exc)
