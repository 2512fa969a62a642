"""Node spiders' environments: which node a project asks for, which one runs, its ``node_modules``.

Node spiders (``package.json``) get ``envs/node-<key>/`` (:class:`NodeEnvs`): the manifest, lockfile
and ``.npmrc`` are copied there, ``npm ci`` (lockfile) or ``npm install`` runs there, and the task's
working copy gets a ``node_modules`` symlink to it. A version asked for in ``.nvmrc`` or
``engines.node`` is taken from nvm when present (installed with nvm when missing); otherwise the
system node runs, with a warning in the task log if it does not satisfy it. Code that ships its own
``node_modules`` runs as it is (npm is not run).

The other functions are blocking (small reads, ``node --version`` once per binary): call them through
``trio.to_thread``. Raises DepsError (ckagent.code.installer).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import trio

from ckagent.code.envstore import Checked, EnvStore, Prepared, is_ready, mark_ready, start_build
from ckagent.code.installenv import install_key_env
from ckagent.code.installer import Installers, Output
from ckagent.code.runtimes import find_npm, nvm_node_versions
from ckagent.containment import TaskJail
from ckagent.node.errors import DepsError
from ckagent.node.noderange import NodeVersion, parse_node_version, satisfies

NPM_MISSING = "npm is not installed on this node: install Node.js with npm (e.g. `apt-get install nodejs npm`)"

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


class NodeEnvs:
    """Makes Node spiders' ``node_modules`` ready in ``store`` (see module docstring); ``nvm_dir`` is
    nvm's home (nvm counts as present when ``nvm.sh`` is there)."""

    def __init__(self, store: EnvStore, installers: Installers, nvm_dir: Path) -> None:
        self.store = store
        self._installers = installers
        self.nvm_dir = nvm_dir

    def check(self, code_dir: Path, task_env: dict[str, str]) -> Checked | None:
        """What :meth:`prepare` begins with, blocking (the task's prepare hop): the layout and key, the
        environment marked in use and whether it is ready (then linked into ``code_dir`` already).
        None when the project asks for a node version (nvm's choice is :meth:`prepare`'s). Never
        raises for the look: its error is in the result."""
        started = time.monotonic()
        try:
            spec, _source = wanted_node(code_dir)
            if spec is not None:
                return None
            path = self._installers.env(task_env).get("PATH", "")
            layout, key = self._plan(code_dir, None, path, install_key_env(task_env))
        except (DepsError, OSError) as exc:
            return Checked(error=exc, seconds=time.monotonic() - started)
        if layout != "install":
            return Checked(None, True, (layout, key), time.monotonic() - started)
        install_dir = self.store.path("node", key)
        self.store.acquire(install_dir)
        try:
            ready = is_ready(install_dir, key)
            if ready:
                link_node_modules(code_dir, install_dir / "node_modules")
        except OSError as exc:
            self.store.release(install_dir)
            return Checked(error=exc, seconds=time.monotonic() - started)
        except BaseException:
            self.store.release(install_dir)
            raise
        return Checked(install_dir, ready, (layout, key), time.monotonic() - started, store=self.store)

    async def prepare(self, code_dir: Path, output: Output, task_env: dict[str, str],
                      jail: TaskJail | None = None, checked: Checked | None = None) -> Prepared:
        """The node on PATH and the ``node_modules`` link in ``code_dir`` (the working copy), installed
        if its key has none ready (npm and nvm run in ``jail``, the task's). ``checked``: what
        :meth:`check` found already (None: looked at here). Raises DepsError; cancellation stops the
        installer."""
        prepared = Prepared()
        env = self._installers.env(task_env)
        marked, ready, spec = False, False, None
        if checked is not None:
            if checked.error is not None:
                raise checked.error
            layout, key = cast("tuple[str, str]", checked.plan)
            marked, ready = checked.env_dir is not None, checked.ready
            checked.env_dir = None  # the mark is this call's now
        else:
            spec, source = await trio.to_thread.run_sync(wanted_node, code_dir)
            if spec is not None:
                await self._select_node(spec, source, env, code_dir, output, prepared, jail)
        path = os.pathsep.join([*prepared.path_prefix, env.get("PATH", "")])
        if checked is None:
            layout, key = await trio.to_thread.run_sync(self._plan, code_dir, spec, path, install_key_env(task_env))
        if layout == "no-package":
            return prepared
        if layout == "ships-node-modules":
            prepared.notes.append("node_modules ships with the code: npm is not run")
            return prepared
        install_dir = self.store.path("node", key)
        with self.store.using(install_dir, prepared, marked=marked):
            if not ready:  # under its key's lock: one build per key; another may have finished it
                async with self.store.lock(key):
                    if not await trio.to_thread.run_sync(is_ready, install_dir, key):
                        prepared.cache_hit = False
                        with self.store.building(install_dir):
                            await self._build(install_dir, key, code_dir, path, env, output, jail)
                await trio.to_thread.run_sync(link_node_modules, code_dir, install_dir / "node_modules")
        return prepared

    async def _build(self, install_dir: Path, key: str, code_dir: Path, path: str, env: dict[str, str],
                     output: Output, jail: TaskJail | None) -> None:
        npm = find_npm(path)
        if npm is None:
            raise DepsError(NPM_MISSING)
        env["PATH"] = path
        await trio.to_thread.run_sync(start_build, install_dir)
        await trio.to_thread.run_sync(stage_node_manifest, code_dir, install_dir)
        await trio.to_thread.run_sync(self._installers.give_dirs, [install_dir])
        argv, note = await trio.to_thread.run_sync(node_install_command, install_dir, npm, path)
        if note is not None:
            output(f"[ckagent] {note}\n".encode())
        env.setdefault("COREPACK_ENABLE_DOWNLOAD_PROMPT", "0")
        await self._installers.run(argv, install_dir, env, output, jail=jail)
        await trio.to_thread.run_sync(_finish_node_env, install_dir, key)

    def _plan(self, code_dir: Path, spec: str | None, path: str, key_env: dict[str, str]) -> tuple[str, str]:
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
                                  "version": version, "identity": self._installers.identity}
        if key_env:  # only then: environments of spiders without such variables keep their keys
            source["env"] = key_env
        return "install", hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()

    async def _select_node(self, spec: str, source: str, env: dict[str, str], code_dir: Path,
                           output: Output, prepared: Prepared, jail: TaskJail | None) -> None:
        """Put an nvm node satisfying ``spec`` first on PATH (installing it with nvm if needed), or warn."""
        nvm_sh = self.nvm_dir / "nvm.sh"
        has_nvm = await trio.to_thread.run_sync(nvm_sh.is_file)
        if has_nvm:
            chosen = await trio.to_thread.run_sync(pick_nvm_node, self.nvm_dir, spec)
            if chosen is None:
                nvm_env = {**env, "NVM_DIR": str(self.nvm_dir)}
                await self._installers.run(["bash", "-c", '. "$NVM_DIR/nvm.sh" && nvm install "$1"', "nvm-install",
                                            spec], code_dir, nvm_env, output, label="nvm install", jail=jail)
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


def _finish_node_env(install_dir: Path, key: str) -> None:
    (install_dir / "node_modules").mkdir(exist_ok=True)
    mark_ready(install_dir, key, "node")
