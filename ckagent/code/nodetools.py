"""The package manager a Node lock file needs — Yarn 1, Yarn 2+ ("berry"), pnpm — from the node, or
fetched from the npm registry; never by corepack.

A ``yarn.lock`` is installed with yarn (``--frozen-lockfile``; a berry lock, which has ``__metadata:``,
with ``--immutable``), a ``pnpm-lock.yaml`` with pnpm (``--frozen-lockfile``): npm would resolve
package.json's ranges instead. Which version (:func:`wanted_tool`, pure):

- the project's ``packageManager`` (``"yarn@1.22.22"``, ``"pnpm@9.1.0"``, ``"yarn@4.1.0+sha512.…"``)
  when it names that tool with an exact version (:func:`parse_package_manager`); anything else in the
  field (a range, a URL, another tool, shell or path text) is not used, and the task log says so;
- else, for yarn, the release a project's ``.yarnrc.yml`` ``yarnPath`` names
  (``.yarn/releases/yarn-4.1.0.cjs``: that file is the project's and never runs; its version is fetched);
- else the major version the lock's format belongs to (yarn.lock v1 → Yarn 1; a berry lock's
  ``__metadata.version`` 8 → Yarn 4, 4–6 → Yarn 3; pnpm's ``lockfileVersion`` '9.0' → pnpm 9, '6.x' →
  pnpm 8, '5.4' → pnpm 7, '5.3' → pnpm 6).

Where from (:class:`NodeTools`), in order:

1. the node's own command on PATH when its version fits (the pin exactly, else the major) — never a
   corepack shim: corepack downloads from the internet, which a node often cannot reach (that was
   DEPS_FAILED with corepack's stack trace, "cannot download the latest stable version of yarn");
2. the agent's cache of fetched tools: ``envs/.tools/<tool>-<version>-<registry digest>/``, one per
   version and registry, sealed like the environments (ckagent.code.builder.seal: root's where the
   agent is root, no write bit; readable by the builder and everyone);
3. fetched: ``npm install --ignore-scripts <package>@<version or major>`` as the node's builder
   (ckagent.code.builder), in a scratch directory only it may write (``envs/.tools/.fetch-*``), with the
   npm registry the node's npm reaches: npm's own settings, the builder's, ``NPM_CONFIG_REGISTRY`` from
   the task's env or the node's ``task.extra_env`` — never the project's ``.npmrc``, and nothing else of
   the task's env (:meth:`NodeTools.fetch_env`): the cache is every spider's. The package (``yarn`` for Yarn 1, ``@yarnpkg/cli-dist`` for Yarn 2+ — berry's single-file
   release as published on the npm registry — and ``pnpm``: each one bundled file, no dependencies)
   is checked (its name, an exact version that fits, its ``bin`` inside it), sealed and moved into the
   cache under that version. No install script of it runs (Yarn 1's ``preinstall`` only probes corepack).

A hash in ``packageManager`` (``+sha512.…``) is not checked: npm checks the registry's integrity. The
cache entry's name is made by the agent from a version that passed :data:`SEMVER` and a digest, never
from the field's text; the tool runs as ``node <its bin>`` (an argv, no shell). A tool neither found
nor fetched is DEPS_FAILED saying what was tried (PATH, the cache, the package and the registry) and
what to install.

Errors: DepsError (ckagent.node.errors). :meth:`NodeTools.runner` is async (the fetch is an installer
run: cancellation stops it and removes the scratch directory); the rest is pure or blocking (small
reads): call blocking ones through ``trio.to_thread``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import trio

from ckagent.code.builder import remove_tree, seal, sealed_by
from ckagent.code.installer import Installers, Output
from ckagent.code.runtimes import find_npm, find_package_manager, is_corepack_shim
from ckagent.code.stage import ProjectFiles, safe_relative
from ckagent.containment import TaskJail
from ckagent.containment.process import MARKER_VAR
from ckagent.node.errors import DepsError, os_error_text

__all__ = ["NPM_OPTIONS", "SEMVER", "NodeTools", "Runner", "ToolWant", "parse_package_manager", "registry_of",
           "wanted_tool", "yarn_release"]

NPM_OPTIONS = ("--no-audit", "--no-fund", "--no-progress", "--no-update-notifier")

SEMVER = re.compile(r"(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})"
                    r"(?:-[0-9A-Za-z-]{1,32}(?:\.[0-9A-Za-z-]{1,32}){0,8})?")
"""An exact version (``1.22.22``, ``4.0.0-rc.42``): the only text of a ``packageManager`` field or of a
fetched package's manifest that reaches a path or an argv."""
_PIN = re.compile(rf"(yarn|pnpm|npm|bun)@({SEMVER.pattern})(?:\+sha(?:1|224|256|512)\.[0-9a-fA-F]{{20,128}})?")
LOCKS = {"pnpm-lock.yaml": "pnpm", "yarn.lock": "yarn"}
"""Lock file → the tool that honours it (npm's own locks are npm's: ckagent.code.deps_node)."""
_BERRY_META = re.compile(rb"^__metadata:[ \t]*\r?\n(?:[ \t]+[^\n]*\n)*?[ \t]+version:[ \t]*[\"']?([0-9]{1,3})", re.M)
_PNPM_LOCK = re.compile(rb"^lockfileVersion:[ \t]*[\"']?([0-9]{1,3})(?:\.([0-9]{1,3}))?", re.M)
_USERINFO = re.compile(r"//[^/@\s]*@")
"""A URL's user and password (``https://user:token@host/``): masked where the registry is shown."""
STALE_FETCH_SECONDS = 3600.0
"""A scratch directory of a fetch older than this (and than two installer timeouts) is a leftover."""
_CACHE_ENTRY = re.compile(rf"(?P<tool>yarn|pnpm)-(?P<version>{SEMVER.pattern})-(?P<tag>[0-9a-f]{{12}})")


def parse_package_manager(value: object) -> tuple[str, str] | None:
    """``packageManager``'s (tool, exact version) — ``"pnpm@9.1.0"`` → ``("pnpm", "9.1.0")``, a
    corepack hash suffix allowed and dropped — or None for anything else (not a string, a range, a
    tag, a URL, whitespace, shell or path text)."""
    if not isinstance(value, str) or len(value) > 300:
        return None
    match = _PIN.fullmatch(value)
    return (match.group(1), match.group(2)) if match else None


def _major(version: str) -> int:
    return int(version.split(".", 1)[0])


@dataclass(frozen=True)
class ToolWant:
    """The tool a lock needs: ``tool`` (the command: ``yarn``, ``pnpm``), ``lock`` (its file), ``major``
    and the exact ``version`` pinned by ``packageManager`` (None: any of that major), ``why`` (for the
    log) and ``notes`` (lines for the task log: a pin not used and why)."""

    tool: str
    lock: str
    major: int
    version: str | None
    why: str
    notes: tuple[str, ...] = ()

    @property
    def package(self) -> str:
        """The npm package that carries the command (Yarn 2+ is ``@yarnpkg/cli-dist``)."""
        if self.tool == "yarn":
            return "yarn" if self.major < 2 else "@yarnpkg/cli-dist"
        return self.tool

    @property
    def spec(self) -> str:
        """What npm is asked for: the exact version, else the major (its highest release)."""
        return self.version or str(self.major)

    def describe(self) -> str:
        """``yarn 1.22.22``, ``pnpm 9.x``."""
        return f"{self.tool} {self.version or f'{self.major}.x'}"

    def fits(self, version: str | None) -> bool:
        """Whether a tool of ``version`` (None: unknown) does: the pin exactly, else the major (an
        unknown version does only without a pin)."""
        if version is None:
            return self.version is None
        if self.version is not None:
            return version == self.version
        return _major(version) == self.major

    def install_argv(self, runner: list[str]) -> list[str]:
        """The install that honours the lock, run by ``runner`` (argv of the tool)."""
        if self.tool == "pnpm":
            return [*runner, "install", "--frozen-lockfile", "--ignore-pnpmfile"]
        return [*runner, "install", "--immutable" if self.major >= 2 else "--frozen-lockfile"]

    def env(self, given: Mapping[str, str], home: Path) -> dict[str, str]:
        """Settings for the install: the tool the agent chose is the one to use (Yarn 1's corepack check
        and ``yarnPath``, pnpm's ``packageManager`` strictness off); Yarn 1's cache in the builder's
        ``home`` (as root it would use ``/usr/local/share/.cache/yarn``, the machine's); berry links
        ``node_modules`` (what the agent links into the working copy) unless ``given`` (the installer's
        env) says otherwise."""
        if self.tool == "pnpm":
            return {"npm_config_package_manager_strict": "false", "npm_config_package_manager_strict_version": "false",
                    "COREPACK_ENABLE_STRICT": "0"}
        env = {"SKIP_YARN_COREPACK_CHECK": "1", "YARN_IGNORE_PATH": "1", "COREPACK_ENABLE_STRICT": "0",
               "YARN_CACHE_FOLDER": str(home / ".cache" / "yarn")}
        if self.major >= 2:
            env.update({"YARN_ENABLE_TELEMETRY": "0", "YARN_ENABLE_PROGRESS_BARS": "0"})
            if not any(name.upper() == "YARN_NODE_LINKER" for name in given):
                env["YARN_NODE_LINKER"] = "node-modules"
        return env


def _lock_major(tool: str, data: bytes) -> tuple[int, str]:
    """The major version of ``tool`` a lock's format belongs to, and its format in words."""
    head = data[:8192]
    if tool == "yarn":
        if b"__metadata:" not in head:
            return 1, "yarn.lock v1"
        meta = _BERRY_META.search(head)
        version = int(meta.group(1)) if meta else 8
        return (3 if 4 <= version <= 6 else 4), f"a Yarn 2+ yarn.lock (__metadata version {version})"
    found = _PNPM_LOCK.search(head)
    if found is None:
        return 9, "pnpm-lock.yaml"
    major, minor = int(found.group(1)), int(found.group(2) or 0)
    pnpm = 9 if major >= 9 else 8 if major == 6 else 7 if (major, minor) >= (5, 4) else 6
    return pnpm, f"pnpm-lock.yaml lockfileVersion {major}.{minor}"


_YARN_RELEASE = re.compile(rb"^yarnPath:[ \t]*[\"']?[^\n\"']*/yarn-(" + SEMVER.pattern.encode() + rb")\.c?js[\"']?[ \t]*\r?$",
                           re.M)


def yarn_release(yarnrc: bytes | None) -> str | None:
    """The version of the Yarn release a project's ``.yarnrc.yml`` runs (``yarnPath:
    .yarn/releases/yarn-4.1.0.cjs`` → ``4.1.0``), or None. The file itself is never run (it is the
    project's code: ckagent.code.nodestage leaves ``yarnPath`` out); that version is fetched. Pure."""
    found = _YARN_RELEASE.search(yarnrc[:65536]) if yarnrc else None
    return found.group(1).decode() if found else None


def wanted_tool(staged: Mapping[str, bytes], release: str | None = None) -> ToolWant | None:
    """The tool the staged files' lock needs (see module docstring), or None (npm's own lock, or no
    lock: npm installs). ``staged``: file name → bytes (ckagent.code.nodestage.node_staged);
    ``release``: the Yarn release the project's ``.yarnrc.yml`` names (:func:`yarn_release`), its
    pin when ``packageManager`` gives none. Pure."""
    if "package-lock.json" in staged or "npm-shrinkwrap.json" in staged:
        return None
    locks = [lock for lock in LOCKS if lock in staged]
    if not locks:
        return None
    field: object = None
    try:
        manifest = json.loads(staged.get("package.json", b"{}"))
        field = manifest.get("packageManager") if isinstance(manifest, dict) else None
    except ValueError:
        pass  # the tool says what is wrong with it
    pin = parse_package_manager(field)
    notes: list[str] = []
    lock = next((lk for lk in locks if pin is not None and LOCKS[lk] == pin[0]), locks[0])
    tool = LOCKS[lock]
    major, form = _lock_major(tool, staged[lock])
    if field is not None and pin is None:
        shown = json.dumps(field, ensure_ascii=True)[:80] if isinstance(field, str) else type(field).__name__
        notes.append(f"warning: package.json packageManager {shown} is not <tool>@<exact version> "
                     f"(e.g. \"{tool}@{major}.0.0\"): not used; {lock} is installed with {tool} {major}.x ({form})")
    elif pin is not None and pin[0] != tool:
        notes.append(f"warning: package.json packageManager names {pin[0]} but the lock is {lock}: "
                     f"installed with {tool} {major}.x ({form})")
    elif pin is not None:
        return ToolWant(tool, lock, _major(pin[1]), pin[1], f"package.json packageManager {tool}@{pin[1]}")
    if tool == "yarn" and release is not None and SEMVER.fullmatch(release):
        return ToolWant(tool, lock, _major(release), release, f".yarnrc.yml yarnPath names yarn-{release} (the "
                        "committed release is not run: the same version is fetched)", tuple(notes))
    return ToolWant(tool, lock, major, None, f"{form}, no packageManager pin", tuple(notes))


def registry_of(env: Mapping[str, str]) -> str | None:
    """The npm registry ``env`` (the installer's) sets (``NPM_CONFIG_REGISTRY``, any case), or None:
    npm's own settings on this node decide."""
    values = [value for name, value in env.items() if name.lower() == "npm_config_registry" and value]
    return values[-1] if values else None


@dataclass(frozen=True)
class Runner:
    """How to run the tool: ``argv`` (its command), its ``version`` and ``where`` (for the log)."""

    argv: list[str]
    version: str | None
    where: str


class NodeTools:
    """The tools of :func:`wanted_tool` (see module docstring): found on PATH, in the cache at ``root``
    (``envs/.tools``), or fetched with npm (``cache_dir``: npm's cache, the builder's) as ``installers``'
    builder. ``lock``: the per-key lock of the environment store (one fetch per tool and registry)."""

    def __init__(self, root: Path, installers: Installers, cache_dir: Path,
                 lock: Callable[[str], trio.Lock]) -> None:
        self.root = root
        self._installers = installers
        self.cache_dir = cache_dir
        self._lock = lock

    async def runner(self, want: ToolWant, path: str, given: dict[str, str], output: Output,
                     jail: TaskJail | None) -> Runner:
        """The tool ``want`` names, on ``path`` (the install's PATH), cached or fetched (in ``jail``,
        with ``given``: what of the task's env reaches installers). Raises DepsError saying what was
        tried and what to install; cancellation stops a fetch and removes its scratch directory."""
        found = await trio.to_thread.run_sync(find_package_manager, want.tool, path)
        if found is not None and want.fits(found[1]):
            return Runner([found[0]], found[1], f"the node's, {found[0]}")
        on_path = await trio.to_thread.run_sync(self._on_path, want, path, found)
        registry = registry_of(given)
        tag = hashlib.sha256((registry or "npm's own setting").encode()).hexdigest()[:12]
        node = shutil.which("node", path=path)
        async with self._lock(f"tool:{want.tool}:{want.spec}:{tag}"):
            cached = await trio.to_thread.run_sync(self._cached, want, tag)
            if cached is None:
                await self._fetch(want, path, given, registry, tag, output, jail, on_path)
                cached = await trio.to_thread.run_sync(self._cached, want, tag)
            if cached is None:  # fetched, checked and moved: only a vanished entry gets here
                raise DepsError(f"{want.describe()} was fetched into {self.root} but is not there now")
        version, script = cached
        return Runner([node, str(script)] if node else [str(script)], version, f"fetched from the npm registry, {script}")

    @staticmethod
    def _on_path(want: ToolWant, path: str, found: tuple[str, str | None] | None) -> str:
        """What PATH had, in words, when it had no fitting tool."""
        if found is not None:
            return f"{found[0]} on PATH is {want.tool} {found[1] or 'of an unknown version'}, not {want.describe()}"
        shim = shutil.which(want.tool, path=path)
        if shim is not None and is_corepack_shim(shim):
            return f"{want.tool} on PATH is corepack's shim ({shim}: it downloads from the internet), not used"
        return f"no {want.tool} on PATH"

    def _cached(self, want: ToolWant, tag: str) -> tuple[str, Path] | None:
        """The highest cached version fitting ``want`` fetched from the registry ``tag`` names: (version,
        its bin script), or None. Only a sealed entry counts. Blocking: a listing and small reads."""
        best: tuple[tuple[int, ...], str, Path] | None = None
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.root):
                match = _CACHE_ENTRY.fullmatch(entry.name)
                if match is None or match["tool"] != want.tool or match["tag"] != tag:
                    continue
                version = match["version"]
                if not want.fits(version) or not sealed_by(Path(entry.path), self._installers.builder.owner):
                    continue
                order = tuple(int(p) for p in version.split("-", 1)[0].split("."))
                if best is not None and order <= best[0]:
                    continue
                checked = self._script(Path(entry.path), want, version)
                if checked is not None:
                    best = (order, version, checked[1])
        return None if best is None else (best[1], best[2])

    @staticmethod
    def _script(top: Path, want: ToolWant, version: str | None) -> tuple[str, Path] | None:
        """The tool's version and bin script in the npm prefix ``top`` after the checks of the module
        docstring (its package's name, an exact version fitting ``want`` — ``version`` when given — and a
        ``bin`` for the command inside the package), or None. Blocking: small reads, no link followed."""
        files = ProjectFiles(top)
        base = f"node_modules/{want.package}"
        try:
            manifest = json.loads(files.read(f"{base}/package.json") or b"null")
        except (ValueError, DepsError, OSError):
            return None
        if not isinstance(manifest, dict) or manifest.get("name") != want.package:
            return None
        got = manifest.get("version")
        if not isinstance(got, str) or SEMVER.fullmatch(got) is None or not want.fits(got):
            return None
        if version is not None and got != version:
            return None
        bins = manifest.get("bin")
        rel = bins.get(want.tool) if isinstance(bins, dict) else bins
        inside = safe_relative(rel) if isinstance(rel, str) else None
        if inside is None or str(inside) == ".":
            return None
        try:
            if not files.is_file(f"{base}/{inside}"):
                return None
        except (DepsError, OSError):
            return None
        return got, top / base / inside

    async def _fetch(self, want: ToolWant, path: str, given: dict[str, str], registry: str | None, tag: str,
                     output: Output, jail: TaskJail | None, on_path: str) -> None:
        """``npm install`` of the tool's package as the builder into a scratch directory, then checked,
        sealed and moved into the cache. Raises DepsError (see :meth:`runner`)."""
        npm = find_npm(path)
        spec = f"{want.package}@{want.spec}"
        where = _USERINFO.sub("//***@", registry) if registry else "the registry npm is set to on this node (`npm config get registry`; by default " \
                            "https://registry.npmjs.org/)"
        output(f"[ckagent] {want.lock} needs {want.describe()} ({want.why}); {on_path}: fetching {spec} from "
               f"{where} as the node's builder (not corepack)\n".encode())
        scratch = self.root / f".fetch-{uuid.uuid4().hex}"
        try:
            await trio.to_thread.run_sync(self._scratch, scratch)
            env = self.fetch_env(given, path)
            argv = [npm or "npm", "install", f"--prefix={scratch}", "--ignore-scripts", "--no-save",
                    "--no-package-lock", *NPM_OPTIONS, spec]
            try:
                await self._installers.run(argv, scratch, env, output, label=f"npm install {spec}", jail=jail)
                version = await trio.to_thread.run_sync(self._adopt, scratch, want, tag)
            except DepsError as exc:
                raise DepsError(
                    f"{want.lock} is installed with {want.describe()} ({want.why}), which this node lacks: "
                    f"{on_path}; none fetched before in {self.root}; fetching it failed — `npm install {spec}` "
                    f"from {where}, as the node's builder: {exc}\nInstall {want.tool} on the node where every "
                    f"user can run it (`npm install -g {spec}` as root), or let the node's npm reach a registry "
                    f"that has {want.package} (`npm config set registry URL` globally, or NPM_CONFIG_REGISTRY in "
                    "task.extra_env); corepack is not used: it downloads from the internet") from exc
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(remove_tree, scratch)
        output(f"[ckagent] {want.tool} {version} fetched into {self.root} (sealed, read-only; reused for every "
               f"spider whose lock needs it)\n".encode())

    def fetch_env(self, given: Mapping[str, str], path: str) -> dict[str, str]:
        """The fetch's environment: the installers' base (the node's PATH ``path``, proxies and CA
        settings, the builder's HOME) with npm's cache, and of the task's env (``given``) only its npm
        registry (:func:`registry_of`, the cache entry's tag) and its marker: the cached tool is every
        spider's, so no setting of one spider's may shape it (``npm_config_strict_ssl``, a scoped
        registry, a proxy, ``NODE_TLS_REJECT_UNAUTHORIZED`` would let it hand the others its own)."""
        env = {**self._installers.env({}), "PATH": path, "npm_config_cache": str(self.cache_dir),
               "npm_config_update_notifier": "false"}
        registry = registry_of(given)
        if registry is not None:
            env["npm_config_registry"] = registry
        if MARKER_VAR in given:
            env[MARKER_VAR] = given[MARKER_VAR]
        return env

    def _scratch(self, scratch: Path) -> None:
        """The cache root (0755, the agent's) and a scratch npm prefix in it, given to the builder (0700);
        scratch directories of fetches older than :data:`STALE_FETCH_SECONDS` (an agent stopped
        mid-fetch) removed. Blocking."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        stale = time.time() - max(STALE_FETCH_SECONDS, 2 * self._installers.timeout)
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.root):
                if entry.name.startswith(".fetch-") and entry.stat(follow_symlinks=False).st_mtime < stale:
                    remove_tree(Path(entry.path))
        scratch.mkdir()
        (scratch / "package.json").write_text('{"private": true}\n')
        builder = self._installers.builder
        if builder.run_as is not None:
            builder.run_as.chown_tree(scratch)
        os.chmod(scratch, 0o700)

    def _adopt(self, scratch: Path, want: ToolWant, tag: str) -> str:
        """Check the fetched package (see :meth:`_script`), seal the scratch prefix and move it into the
        cache as ``<tool>-<version>-<tag>``. Returns the version. Raises DepsError. Blocking."""
        checked = self._script(scratch, want, None)
        if checked is None:
            raise DepsError(f"npm installed no {want.package} of {want.describe()} with a `{want.tool}` command "
                            "inside it (its name, version or bin did not check out)")
        version = checked[0]
        try:
            seal(scratch, self._installers.builder.owner)
            target = self.root / f"{want.tool}-{version}-{tag}"
            if target.exists():  # another agent on this work dir fetched it meanwhile
                return version
            os.rename(scratch, target)
        except OSError as exc:
            raise DepsError(f"cannot keep the fetched {want.tool} in {self.root}: {os_error_text(exc)}") from exc
        return version
