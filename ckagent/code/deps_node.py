"""Node spiders' environments: which node a project asks for, which one runs, its ``node_modules``.

Node spiders (``package.json``) get ``envs/node-<key>/`` (:class:`NodeEnvs`): the manifest, lockfile
and ``.npmrc`` are copied there by the agent (:func:`node_staged`), ``npm ci`` (npm's lock), yarn or
pnpm (their locks: the node's own, else fetched from the npm registry into a per-version cache,
never by corepack: ckagent.code.nodetools) or ``npm install`` runs there as the node's builder
(ckagent.code.builder), the result is sealed read-only, and
the task's working copy gets a ``node_modules`` symlink to it. A version asked for in ``.nvmrc`` or
``engines.node`` is taken from nvm when present (installed with nvm, as the builder, into the work
dir's own nvm tree when missing); otherwise the system node runs, with a warning in the task log if
it does not satisfy it. Code that ships its own ``node_modules`` runs as it is (npm is not run).

**The project's own code never runs as the builder.** npm, yarn and pnpm run the root package's
lifecycle scripts on install (``preinstall``, ``install``, ``postinstall``, ``prepare``, …: a
``tsc`` build, ``patch-package``, anything): the staged ``package.json`` has none of them
(:data:`ROOT_LIFECYCLE`), and the task log says which were left out and that the spider's command is
where such a step belongs. pnpm's ``.pnpmfile.cjs`` (project code pnpm loads) is not staged and
``--ignore-pnpmfile`` is passed; an ``.npmrc``, ``.yarnrc`` or ``.yarnrc.yml`` setting that names a
program, a script or a place (``script-shell``, ``node-options``, ``git``, ``yarnPath``, ``plugins``,
``cache``) is left out of the staged copy. The dependencies' own install scripts still run, as the
builder: that is the supply chain (docs/operations.md). Packages that download a browser when
installed (Puppeteer) put it inside the environment (``PUPPETEER_CACHE_DIR``), read-only and shared
like the rest, and the spider gets the same variable.

The other functions are blocking (small reads, ``node --version`` once per binary): call them through
``trio.to_thread``. Raises DepsError (ckagent.code.installer).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import trio

from ckagent.code.builder import Builder, remove_tree, seal
from ckagent.code.envstore import Checked, EnvStore, Prepared, is_ready, mark_ready, start_build
from ckagent.code.installenv import install_key_env, installer_env, referenced
from ckagent.code.installer import Installers, Output
from ckagent.code.nodestage import CONFIG_FILES, NODE_COPIED, NODE_DEP_FILES, ROOT_LIFECYCLE, node_staged
from ckagent.code.nodetools import NPM_OPTIONS, NodeTools, wanted_tool, yarn_release
from ckagent.code.runtimes import find_npm, nvm_node_versions
from ckagent.code.stage import ProjectFiles, write_staged
from ckagent.containment import TaskJail
from ckagent.node.errors import DepsError
from ckagent.node.noderange import NodeVersion, parse_node_version, satisfies

log = logging.getLogger(__name__)

__all__ = ["CONFIG_FILES", "NODE_COPIED", "NODE_DEP_FILES", "NPM_MISSING", "NPM_OPTIONS", "PUPPETEER_CACHE",
           "ROOT_LIFECYCLE", "NodeEnvs", "NodePlan", "link_node_modules", "node_default_command",
           "node_staged", "npm_install_command", "pick_nvm_node", "system_node_version", "wanted_node"]

NPM_MISSING = "npm is not installed on this node: install Node.js with npm (e.g. `apt-get install nodejs npm`)"

PUPPETEER_CACHE = ".cache/puppeteer"
"""Where, inside a Node environment, a package's install script puts a downloaded browser (Puppeteer)."""


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


def npm_install_command(staged: Mapping[str, bytes], npm: str) -> list[str]:
    """npm's install of the staged files: ``npm ci`` with npm's own lock (``package-lock.json``,
    ``npm-shrinkwrap.json``), else ``npm install``. A yarn or pnpm lock is its own tool's
    (ckagent.code.nodetools)."""
    if "package-lock.json" in staged or "npm-shrinkwrap.json" in staged:
        return [npm, "ci", *NPM_OPTIONS]
    return [npm, "install", *NPM_OPTIONS]


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


@dataclass(frozen=True)
class NodePlan:
    """A Node spider's install: ``layout`` (``no-package``, ``ships-node-modules``, ``install``), the key,
    what is staged (:func:`node_staged`), lines for the task log, variables the staged files name, the
    Yarn release its ``.yarnrc.yml`` names (ckagent.code.nodetools.yarn_release)."""

    layout: str
    key: str = ""
    staged: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)
    notes: tuple[str, ...] = ()
    named: frozenset[str] = frozenset()
    yarn_release: str | None = None


class NodeEnvs:
    """Makes Node spiders' ``node_modules`` ready in ``store`` (see module docstring). ``nvm_dir`` is
    the node's nvm home (nvm counts as present when ``nvm.sh`` is there); versions nvm installs for a
    spider go to ``store.root/.nvm`` (the agent's, read-only to spiders); ``cache_dir`` is npm's
    cache (the builder's)."""

    def __init__(self, store: EnvStore, installers: Installers, nvm_dir: Path, cache_dir: Path) -> None:
        self.store = store
        self._installers = installers
        self.nvm_dir = nvm_dir
        self.cache_dir = cache_dir
        self.own_nvm = store.root / ".nvm"
        """Node versions nvm installed here (root's tree, each version sealed)."""
        self.tools = NodeTools(store.root / ".tools", installers, cache_dir, store.lock)
        """yarn and pnpm for the lock files that need them (ckagent.code.nodetools)."""

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
            path = self._installers.env({}).get("PATH", "")
            plan = self._plan(code_dir, None, path, install_key_env(task_env))
        except (DepsError, OSError) as exc:
            return Checked(error=exc, seconds=time.monotonic() - started)
        if plan.layout != "install":
            return Checked(None, True, plan, time.monotonic() - started)
        install_dir = self.store.path("node", plan.key)
        self.store.acquire(install_dir)
        try:
            ready = is_ready(install_dir, plan.key, self._installers.builder.owner)
            if ready:
                link_node_modules(code_dir, install_dir / "node_modules")
        except OSError as exc:
            self.store.release(install_dir)
            return Checked(error=exc, seconds=time.monotonic() - started)
        except BaseException:
            self.store.release(install_dir)
            raise
        return Checked(install_dir, ready, plan, time.monotonic() - started, store=self.store)

    async def prepare(self, code_dir: Path, output: Output, task_env: dict[str, str],
                      jail: TaskJail | None = None, checked: Checked | None = None) -> Prepared:
        """The node on PATH and the ``node_modules`` link in ``code_dir`` (the working copy), installed
        if its key has none ready (npm and nvm run in ``jail``, the task's, as the builder).
        ``checked``: what :meth:`check` found already (None: looked at here). Raises DepsError;
        cancellation stops the installer."""
        prepared = Prepared()
        marked, ready, spec = False, False, None
        if checked is not None:
            if checked.error is not None:
                raise checked.error
            plan = cast("NodePlan", checked.plan)
            marked, ready = checked.env_dir is not None, checked.ready
            checked.env_dir = None  # the mark is this call's now
        else:
            spec, source = await trio.to_thread.run_sync(wanted_node, code_dir)
            if spec is not None:
                await self._select_node(spec, source, task_env, output, prepared, jail)
        path = os.pathsep.join([*prepared.path_prefix, self._installers.env({}).get("PATH", "")])
        if checked is None:
            plan = await trio.to_thread.run_sync(self._plan, code_dir, spec, path, install_key_env(task_env))
        if plan.layout == "no-package":
            return prepared
        if plan.layout == "ships-node-modules":
            prepared.notes.append("node_modules ships with the code: npm is not run")
            return prepared
        install_dir = self.store.path("node", plan.key)
        with self.store.using(install_dir, prepared, marked=marked):
            if not ready:  # under its key's lock: one build per key; another may have finished it
                async with self.store.lock(plan.key):
                    owner = self._installers.builder.owner
                    if not await trio.to_thread.run_sync(is_ready, install_dir, plan.key, owner):
                        prepared.cache_hit = False
                        with self.store.building(install_dir):
                            await self._build(install_dir, plan, path, task_env, output, jail)
                await trio.to_thread.run_sync(link_node_modules, code_dir, install_dir / "node_modules")
        if (install_dir / PUPPETEER_CACHE).is_dir():  # a browser a package downloaded at install (a stat)
            prepared.env["PUPPETEER_CACHE_DIR"] = str(install_dir / PUPPETEER_CACHE)
        prepared.notes.extend(plan.notes)
        return prepared

    async def _build(self, install_dir: Path, plan: NodePlan, path: str, task_env: dict[str, str],
                     output: Output, jail: TaskJail | None) -> None:
        npm = find_npm(path)
        if npm is None:
            raise DepsError(NPM_MISSING)
        builder = self._installers.builder
        output(f"[ckagent] building environment {install_dir.name} as the node's builder, "
               f"{builder.describe()}\n".encode())
        given = installer_env(task_env, plan.named)
        if (notice := given.notice()) is not None:
            output(f"[ckagent] {notice}\n".encode())
        env = self._installers.env(given.env)
        env.update({"PATH": path, "npm_config_cache": str(self.cache_dir), "npm_config_update_notifier": "false",
                    "npm_config_package_import_method": "copy",
                    "PUPPETEER_CACHE_DIR": str(install_dir / PUPPETEER_CACHE)})
        await trio.to_thread.run_sync(self._start, install_dir, plan)
        want = wanted_tool(plan.staged, plan.yarn_release)
        label = None
        if want is None:
            argv = npm_install_command(plan.staged, npm)
        else:
            for note in want.notes:
                output(f"[ckagent] {note}\n".encode())
            runner = await self.tools.runner(want, path, given.env, output, jail)
            output(f"[ckagent] {want.lock}: installing exactly what it pins with {want.tool} {runner.version or ''} "
                   f"({runner.where}; {want.why})\n".encode())
            argv = want.install_argv(runner.argv)
            label = " ".join(filter(None, [want.tool, runner.version, "install", f"({want.lock})"]))
            env.update(want.env(given.env, builder.home))
        await self._installers.run(argv, install_dir, env, output, label=label, jail=jail)
        size = await trio.to_thread.run_sync(_finish_node_env, install_dir, plan.key, builder)
        log.info("built Node environment %s (%d bytes) as %s", install_dir.name, size, builder.describe())

    def _start(self, install_dir: Path, plan: NodePlan) -> None:
        """A fresh build directory with the staged files, given to the builder. Blocking."""
        start_build(install_dir)
        write_staged(install_dir, plan.staged)  # the agent's files: the builder reads them
        self._installers.builder.give_top(install_dir)

    def _plan(self, code_dir: Path, spec: str | None, path: str, key_env: dict[str, str]) -> NodePlan:
        """The install of a Node spider (blocking: reads without following a link, hashing, ``node
        --version`` once per binary). Raises NotStageable.

        layout: ``"no-package"`` (no package.json: nothing to install), ``"ships-node-modules"`` (the
        code carries its node_modules: npm is not run) or ``"install"``.
        """
        files = ProjectFiles(code_dir)
        if not files.is_file("package.json"):
            return NodePlan("no-package")
        if files.is_dir("node_modules"):
            return NodePlan("ships-node-modules")
        for name in NODE_DEP_FILES:
            files.read(name)
        staged, notes = node_staged(files)
        node = shutil.which("node", path=path)
        version = system_node_version(path)
        source: dict[str, Any] = {"schema": 2, "files": files.digests(), "spec": spec,
                                  "node": node and os.path.realpath(node), "version": version,
                                  "identity": self._installers.identity}
        if key_env:  # only then: environments of spiders without such variables keep their keys
            source["env"] = key_env
        named: set[str] = set()
        for data in staged.values():
            named |= referenced(data.decode(errors="replace"))
        key = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()
        return NodePlan("install", key, staged, tuple(notes), frozenset(named), yarn_release(files.read(".yarnrc.yml")))

    async def _select_node(self, spec: str, source: str, task_env: dict[str, str], output: Output,
                           prepared: Prepared, jail: TaskJail | None) -> None:
        """Put an nvm node satisfying ``spec`` first on PATH (installing it with nvm, as the builder, if
        needed), or warn."""
        nvm_sh = self.nvm_dir / "nvm.sh"
        has_nvm = await trio.to_thread.run_sync(nvm_sh.is_file)
        if has_nvm:
            chosen = await trio.to_thread.run_sync(self._pick, spec)
            if chosen is None:
                await self._nvm_install(spec, task_env, output, jail)
                chosen = await trio.to_thread.run_sync(self._pick, spec)
            if chosen is not None:
                prepared.path_prefix.insert(0, str(chosen[1]))
                prepared.notes.append(f"node {chosen[0]} from nvm ({source} wants {spec!r})")
                return
        env = self._installers.env({})
        system = await trio.to_thread.run_sync(system_node_version, env.get("PATH", ""))
        where = "nvm has none installed" if has_nvm else f"nvm not found ({nvm_sh})"
        if system is None:
            prepared.notes.append(f"warning: {source} wants node {spec!r} but no node is installed ({where})")
        elif satisfies(system, spec) is False:
            prepared.notes.append(
                f"warning: {source} wants node {spec!r} but the system node is v{system} ({where}); "
                "running with it anyway"
            )

    def _pick(self, spec: str) -> tuple[str, Path] | None:
        """The highest node satisfying ``spec`` of the node's nvm and of the versions installed here."""
        found = [c for c in (pick_nvm_node(self.nvm_dir, spec), pick_nvm_node(self.own_nvm, spec)) if c is not None]
        return max(found, key=lambda c: parse_node_version(c[0]) or (0, 0, 0)) if found else None

    async def _nvm_install(self, spec: str, task_env: dict[str, str], output: Output, jail: TaskJail | None) -> None:
        """``nvm install spec`` as the builder, in a scratch nvm home of its own (the node's nvm scripts
        copied in); the version it installed moves to :attr:`own_nvm`, sealed. Raises DepsError."""
        builder = self._installers.builder
        scratch = self.store.root / ".nvm-build"
        await trio.to_thread.run_sync(_nvm_scratch, self.nvm_dir, scratch, builder)
        env = {**self._installers.env(installer_env(task_env).env), "NVM_DIR": str(scratch)}
        # A failed or stopped install leaves the scratch home: the next one starts by removing it.
        await self._installers.run(["bash", "-c", '. "$NVM_DIR/nvm.sh" && nvm install "$1"', "nvm-install", spec],
                                   scratch, env, output, label="nvm install", jail=jail)
        moved = await trio.to_thread.run_sync(_nvm_adopt, scratch, self.own_nvm, builder)
        for version in moved:
            log.info("nvm installed node %s as %s (into %s, sealed)", version, builder.describe(), self.own_nvm)


def _nvm_scratch(nvm_dir: Path, scratch: Path, builder: Builder) -> None:
    """A scratch nvm home for the builder: the node's nvm scripts (top-level regular files) copied in,
    ``versions/node`` and ``.cache`` its own. Blocking."""
    remove_tree(scratch)
    scratch.mkdir(parents=True)
    files = ProjectFiles(nvm_dir)
    copied = {name: data for name in files.list_dir(".") if (data := files.read(name)) is not None}
    write_staged(scratch, copied)
    for name in copied:
        os.chmod(scratch / name, 0o755 if name in ("nvm-exec", "nvm.sh") else 0o644)
    (scratch / "versions" / "node").mkdir(parents=True)
    if builder.run_as is not None:
        builder.run_as.chown_tree(scratch)


def _nvm_adopt(scratch: Path, own: Path, builder: Builder) -> list[str]:
    """Move the versions nvm installed in ``scratch`` into ``own`` (the agent's tree, 0755), each sealed;
    remove the scratch home. Returns the versions moved. Blocking."""
    moved = []
    target = own / "versions" / "node"
    target.mkdir(parents=True, exist_ok=True)
    for made in (own, own / "versions", target):
        os.chmod(made, 0o755)
    with contextlib.suppress(OSError):
        for entry in (scratch / "versions" / "node").iterdir():
            if entry.is_symlink() or not entry.is_dir() or parse_node_version(entry.name) is None:
                continue
            if (target / entry.name).exists():
                continue
            seal(entry, builder.owner)
            os.rename(entry, target / entry.name)
            moved.append(entry.name)
    remove_tree(scratch)
    return moved


def _finish_node_env(install_dir: Path, key: str, builder: Builder) -> int:
    """The install is done: its settings files removed (they may hold a token), the environment sealed
    and marked ready. Returns its size in bytes. Blocking."""
    for name in CONFIG_FILES:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(install_dir / name)
    (install_dir / "node_modules").mkdir(exist_ok=True)
    return mark_ready(install_dir, key, "node", owner=builder.owner, builder=builder.identity,
                      builder_uid=builder.own_uid)
