"""What of a Node project an install gets: its manifest, lockfiles and settings, copied by the agent.

An install (``npm ci``, ``yarn``, ``pnpm``: ckagent.code.deps_node) runs as the node's builder in the
environment's own directory, on copies of :data:`NODE_COPIED` the agent read from the task's working
copy without following a link (ckagent.code.stage) — never on the project's code, and never running
it: npm, yarn and pnpm run the root package's lifecycle scripts when they install it, so the staged
``package.json`` has none of :data:`ROOT_LIFECYCLE`; an ``.npmrc``, ``.yarnrc`` or ``.yarnrc.yml``
setting that names a program, a script or a place (those ckagent.code.installenv.withheld keeps from
an installer as variables: ``script-shell``, ``node-options``, ``git``, ``yarnPath``, ``plugins``,
``cacheFolder``) is left out of the copy; pnpm's ``.pnpmfile.cjs`` is not copied at all. Each is said
in the task log.

Blocking (small reads): the task's prepare hop.
"""

from __future__ import annotations

import json
import re

from ckagent.code.installenv import withheld
from ckagent.code.stage import ProjectFiles

__all__ = ["CONFIG_FILES", "NODE_COPIED", "NODE_DEP_FILES", "ROOT_LIFECYCLE", "node_staged"]

NODE_COPIED = ("package.json", "package-lock.json", "npm-shrinkwrap.json", ".npmrc", "yarn.lock", ".yarnrc",
               ".yarnrc.yml", "pnpm-lock.yaml", "pnpm-workspace.yaml")
"""What an install needs from the code: copied (:func:`node_staged`) into the environment's directory
before npm runs."""
NODE_DEP_FILES = (*NODE_COPIED, ".pnpmfile.cjs", ".nvmrc")
"""The files that determine a Node environment (hashed into its key)."""
ROOT_LIFECYCLE = ("preinstall", "install", "postinstall", "prepublish", "preprepare", "prepare", "postprepare",
                  "dependencies")
"""Scripts of the root package that npm, yarn or pnpm run when they install it: never in the staged copy."""
CONFIG_FILES = (".npmrc", ".yarnrc", ".yarnrc.yml")
"""Staged settings files: removed from the environment before it is sealed (they may hold a token)."""


def node_staged(files: ProjectFiles) -> tuple[dict[str, bytes], list[str]]:
    """What a Node install gets of the project (see module docstring): ``{name: bytes}`` of
    :data:`NODE_COPIED` that it has — package.json without the root's lifecycle scripts, the settings
    files without the settings that name a program, a script or a place — and lines for the task log
    saying what was left out. Raises NotStageable (a link). Blocking: small reads."""
    staged: dict[str, bytes] = {}
    notes: list[str] = []
    for name in NODE_COPIED:
        data = files.read(name)
        if data is None:
            continue
        if name == "package.json":
            data = _without_lifecycle(data, notes)
        elif name in (".npmrc", ".yarnrc"):
            data = _without_settings(name, data, notes, yaml=False)
        elif name == ".yarnrc.yml":
            data = _without_settings(name, data, notes, yaml=True)
        staged[name] = data
    if files.is_file(".pnpmfile.cjs"):
        notes.append(".pnpmfile.cjs is not run (pnpm would load it as the node's builder, which never runs a "
                     "spider's code): pnpm installs with --ignore-pnpmfile")
    return staged, notes


def _without_lifecycle(data: bytes, notes: list[str]) -> bytes:
    """package.json without the root package's install lifecycle scripts (:data:`ROOT_LIFECYCLE`)."""
    try:
        manifest = json.loads(data)
    except ValueError:
        return data  # npm says what is wrong with it
    scripts = manifest.get("scripts") if isinstance(manifest, dict) else None
    if not isinstance(scripts, dict):
        return data
    dropped = [name for name in ROOT_LIFECYCLE if name in scripts]
    if not dropped:
        return data
    for name in dropped:
        del scripts[name]
    notes.append(f"package.json scripts {', '.join(dropped)} are not run at install: installs run as the node's "
                 "builder, which never runs a spider's code; a build step belongs in the spider's command "
                 "(e.g. \"start\": \"npm run build && node dist/main.js\"), and node_modules is read-only to it")
    return json.dumps(manifest, indent=2).encode() + b"\n"


def _without_settings(name: str, data: bytes, notes: list[str], *, yaml: bool) -> bytes:
    """An .npmrc / .yarnrc (``key=value`` / ``key value``) or .yarnrc.yml (top-level ``key: value`` and its
    indented block) without the settings :func:`~ckagent.code.installenv.withheld` would keep from an
    installer as variables (``script-shell``, ``node-options``, ``yarnPath``, ``plugins``, ``cacheFolder``)."""
    kept: list[str] = []
    dropped: list[str] = []
    skipping = False
    for line in data.decode(errors="replace").splitlines():
        if yaml and skipping and (line.startswith((" ", "\t", "-")) or not line.strip()):
            continue
        skipping = False
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", ";")) and not line.startswith((" ", "\t")):
            key = re.split(r"[:=\s]", stripped, maxsplit=1)[0].strip("\"'")
            variable = "NPM_CONFIG_" + re.sub(r"(?<=[a-z])(?=[A-Z])", "_", key).replace("-", "_").upper()
            if key and not key.startswith("//") and withheld(variable):
                dropped.append(key)
                skipping = yaml
                continue
        kept.append(line)
    if not dropped:
        return data
    notes.append(f"{name}: {', '.join(dropped)} left out (a setting that names a program, a script or a place: "
                 "installs run as the node's builder, which runs only its own)")
    return ("\n".join(kept) + "\n").encode()
