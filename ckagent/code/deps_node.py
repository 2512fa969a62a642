"""Node spiders' helpers: which node a project asks for, which one to run, the manifest an install needs.

Blocking functions (small reads, ``node --version`` once per binary): call them through
``trio.to_thread``. The installs themselves are in ckagent.code.deps.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

from ckagent.code.runtimes import nvm_node_versions
from ckagent.node.noderange import NodeVersion, parse_node_version, satisfies

NODE_COPIED = ("package.json", "package-lock.json", "npm-shrinkwrap.json", ".npmrc", "yarn.lock", ".yarnrc",
               ".yarnrc.yml", "pnpm-lock.yaml", "pnpm-workspace.yaml", ".pnpmfile.cjs")
"""What an install needs from the code: copied into the environment's directory before npm runs."""
NODE_DEP_FILES = (*NODE_COPIED, ".nvmrc")
"""The files that determine a Node environment (hashed into its key)."""


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


def stage_node_manifest(code_dir: Path, install_dir: Path) -> bool:
    """Copy package.json, lockfiles and .npmrc into ``install_dir`` (which exists); True when a lockfile came."""
    for name in NODE_COPIED:
        src, dst = code_dir / name, install_dir / name
        if src.is_file():
            shutil.copyfile(src, dst)
        else:
            dst.unlink(missing_ok=True)
    return any((install_dir / name).is_file() for name in ("package-lock.json", "npm-shrinkwrap.json"))


NPM_OPTIONS = ("--no-audit", "--no-fund", "--no-progress", "--no-update-notifier")


def node_install_command(install_dir: Path, npm: str, path: str) -> tuple[list[str], str | None]:
    """The install that honours the lock staged in ``install_dir``: (argv, a note for the task log).

    ``package-lock.json``/``npm-shrinkwrap.json`` → ``npm ci``; ``pnpm-lock.yaml`` → ``pnpm install
    --frozen-lockfile``; ``yarn.lock`` → ``yarn install --frozen-lockfile`` (Yarn 1) or ``--immutable``
    (Yarn 2+, whose lock has ``__metadata``). pnpm and yarn are taken from ``path``, else run through
    corepack (which fetches the version ``packageManager`` names). Without either, the documented
    fallback: ``npm install`` from package.json's ranges, with a note saying the lock was not
    honoured and how to make it be. No lock → ``npm install``. Blocking: a few stats and one small read.
    """
    corepack = shutil.which("corepack", path=path)

    def tool(name: str) -> list[str] | None:
        found = shutil.which(name, path=path)
        if found is not None:
            return [found]
        return [corepack, name] if corepack is not None else None

    if any((install_dir / name).is_file() for name in ("package-lock.json", "npm-shrinkwrap.json")):
        return [npm, "ci", *NPM_OPTIONS], None
    for lock, name in (("pnpm-lock.yaml", "pnpm"), ("yarn.lock", "yarn")):
        if not (install_dir / lock).is_file():
            continue
        runner = tool(name)
        if runner is None:
            return [npm, "install", *NPM_OPTIONS], (
                f"warning: {lock} is not honoured: neither {name} nor corepack is on this node, so npm install "
                f"resolves package.json's ranges instead; install {name} (or Node.js with corepack) to honour it")
        if name == "pnpm":
            return [*runner, "install", "--frozen-lockfile"], f"{lock}: installing exactly what it pins with pnpm"
        with open(install_dir / lock, "rb") as fh:
            berry = b"__metadata:" in fh.read(4096)
        flag = "--immutable" if berry else "--frozen-lockfile"
        return [*runner, "install", flag], f"{lock}: installing exactly what it pins with yarn ({flag})"
    return [npm, "install", *NPM_OPTIONS], None


def link_node_modules(code_dir: Path, target: Path) -> None:
    """Make ``code_dir/node_modules`` a symlink to ``target`` (replacing a stale link)."""
    link = code_dir / "node_modules"
    if link.is_symlink():
        if os.readlink(link) == str(target):
            return
        link.unlink()
    elif link.exists():
        return
    link.symlink_to(target, target_is_directory=True)


def node_default_command(code_dir: Path) -> tuple[list[str] | None, str]:
    """The command a Node spider runs by default, from its package.json (blocking: one small read).

    ``scripts.start`` (run through ``npm start``, as its author does), else ``main`` (``node <main>``),
    else ``index.js`` when present. Returns (argv, what it followed) or (None, where it looked).
    """
    manifest = code_dir / "package.json"
    data: object = None
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text(errors="replace"))
        except ValueError:
            data = None
    if isinstance(data, dict):
        scripts = data.get("scripts")
        if isinstance(scripts, dict) and isinstance(scripts.get("start"), str) and scripts["start"].strip():
            return ["npm", "start", "--silent"], "package.json scripts.start"
        main = data.get("main")
        if isinstance(main, str) and main.strip() and (code_dir / main.strip()).is_file():
            return ["node", main.strip()], "package.json main"
    if (code_dir / "index.js").is_file():
        return ["node", "index.js"], "index.js"
    looked = "package.json scripts.start, package.json main, index.js" if manifest.is_file() else \
        "package.json (absent), index.js"
    return None, looked
