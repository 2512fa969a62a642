"""Python lock files other than ``uv.lock``, honoured through uv's own installer.

What a crawler project ships, and what the agent does with it (first match wins; ``uv.lock`` with
``pyproject.toml`` comes before all of these, see ckagent.code.pyplan):

=================  ===========================================================================
``pylock.toml``    PEP 751, read by uv itself: ``uv pip sync pylock.toml``.
``poetry.lock``    with ``pyproject.toml``: the lock's versions become constraints
                   (``name==version``) of ``uv pip install`` of the project's top-level
                   dependencies (``[project.dependencies]``, else ``[tool.poetry.dependencies]``;
                   the main group, no dev groups): the packages the project needs on this
                   platform, each at the version the lock pins.
``pdm.lock``       with ``pyproject.toml``: the same (``[project.dependencies]``).
``Pipfile.lock``   its ``default`` section (exact versions, markers, extras) is the complete set:
                   ``uv pip sync`` of those requirements.
=================  ===========================================================================

A lock the agent cannot honour fails the install (DEPS_FAILED) with a message naming the file and
what in it could not be used (a package from a git/path source, a file that is not TOML/JSON of
the expected shape); the agent never falls back to the newest versions in the ranges silently.
A git source of a Pipfile.lock or poetry.lock entry is honoured as ``name @ git+url@commit``.

Blocking functions (small reads): call them through ``trio.to_thread``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from ckagent.code.stage import ProjectFiles

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

LOCK_FILES = ("pylock.toml", "poetry.lock", "pdm.lock", "Pipfile.lock")
"""The lock files this module honours, in the order they are looked for."""
NEEDS_PYPROJECT = ("poetry.lock", "pdm.lock")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class LockError(Exception):
    """A lock file that cannot be honoured; the message names the file and says what is wrong."""


def find_lock(code: Path | ProjectFiles) -> str | None:
    """The lock file of the project ``code`` (its directory, or its files) this module honours (see
    the table), or None."""
    files = code if isinstance(code, ProjectFiles) else ProjectFiles(code)
    for name in LOCK_FILES:
        if files.is_file(name) and (name not in NEEDS_PYPROJECT or files.is_file("pyproject.toml")):
            return name
    return None


def _text(files: ProjectFiles, name: str) -> str:
    try:
        data = files.read(name)
    except OSError as exc:
        raise LockError(f"{name} cannot be read: {exc}") from exc
    if data is None:
        raise LockError(f"{name} is missing")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LockError(f"{name} is not UTF-8: {exc}") from exc


def _toml(files: ProjectFiles, name: str) -> dict[str, Any]:
    try:
        return tomllib.loads(_text(files, name))
    except tomllib.TOMLDecodeError as exc:
        raise LockError(f"{name} cannot be read as TOML: {exc}") from exc


def _pin(lock: str, name: Any, version: Any, source: Any = None) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise LockError(f"{lock} has a package whose name is not valid: {name!r}")
    if isinstance(source, dict) and source.get("type") not in (None, "legacy", "pypi"):
        kind = source.get("type")
        if kind == "git" and isinstance(source.get("url"), str):
            ref = source.get("resolved_reference") or source.get("reference") or ""
            return f"{name} @ git+{source['url']}" + (f"@{ref}" if ref else "")
        raise LockError(f"{lock} pins {name} from a {kind} source ({source.get('url')}), which the agent cannot "
                        "install from the lock; publish it to an index or use a git source")
    if not isinstance(version, str) or not version:
        raise LockError(f"{lock} has no version for {name}")
    return f"{name}=={version}"


def _poetry_requirements(pyproject: dict[str, Any]) -> list[str]:
    """Top-level requirements by name (with extras) of a Poetry project (versions come from the lock)."""
    project = pyproject.get("project")
    if isinstance(project, dict) and isinstance(project.get("dependencies"), list):
        return [str(r) for r in project["dependencies"]]
    deps = ((pyproject.get("tool") or {}).get("poetry") or {}).get("dependencies") or {}
    if not isinstance(deps, dict):
        raise LockError("pyproject.toml [tool.poetry.dependencies] is not a table")
    out = []
    for name, spec in deps.items():
        if name.lower() == "python":
            continue
        extras = spec.get("extras") if isinstance(spec, dict) else None
        optional = isinstance(spec, dict) and spec.get("optional")
        if optional:
            continue
        out.append(name + (f"[{','.join(extras)}]" if extras else ""))
    return out


def _pylock_local(data: dict[str, Any]) -> None:
    """Refuse a pylock.toml that installs from a directory or a local archive (the project's own code,
    which the builder never builds). Raises LockError."""
    packages = data.get("packages")
    for package in packages if isinstance(packages, list) else []:
        if isinstance(package, dict) and ("directory" in package or (isinstance(package.get("archive"), dict)
                                                                     and "path" in package["archive"])):
            raise LockError(f"pylock.toml installs {package.get('name')!r} from a local directory or archive, which "
                            "the agent does not build (installs run as the node's builder, which never runs a "
                            "spider's code); publish it to an index, or ship it as a wheel")


def _main_group(package: dict[str, Any]) -> bool:
    """Whether a poetry.lock / pdm.lock package belongs to the main dependencies (not dev only)."""
    groups = package.get("groups")
    if isinstance(groups, list) and groups:
        return "main" in groups or "default" in groups
    category = package.get("category")
    return category in (None, "main")


def lock_inputs(code: Path | ProjectFiles, lock: str) -> tuple[str, list[str], list[str]]:
    """How to install ``lock`` of the project ``code`` (its directory, or its files): (uv mode,
    requirements, constraints) — mode ``sync-file`` (uv reads the lock itself: requirements is
    ``[lock]``), ``sync`` (requirements are the complete set) or ``install`` (requirements are the
    top-level ones, constraints pin them). Raises LockError."""
    files = code if isinstance(code, ProjectFiles) else ProjectFiles(code)
    if lock == "pylock.toml":
        _pylock_local(_toml(files, lock))  # fail with a clear message before uv does
        return "sync-file", [lock], []
    if lock == "Pipfile.lock":
        try:
            data = json.loads(_text(files, lock))
        except ValueError as exc:
            raise LockError(f"Pipfile.lock cannot be read as JSON: {exc}") from exc
        default = data.get("default") if isinstance(data, dict) else None
        if not isinstance(default, dict):
            raise LockError("Pipfile.lock has no \"default\" section of packages")
        reqs = []
        for name, entry in default.items():
            if not isinstance(entry, dict):
                raise LockError(f"Pipfile.lock entry {name!r} is not an object")
            extras = entry.get("extras")
            head = name + (f"[{','.join(extras)}]" if isinstance(extras, list) and extras else "")
            if "git" in entry:
                pin = f"{head} @ git+{entry['git']}" + (f"@{entry['ref']}" if entry.get("ref") else "")
            elif "path" in entry or "file" in entry:
                raise LockError(f"Pipfile.lock pins {name} from a local path or file, which the agent cannot "
                                "install from the lock; publish it to an index")
            else:
                version = entry.get("version")
                if not isinstance(version, str) or not version.startswith("=="):
                    raise LockError(f"Pipfile.lock has no exact version for {name}")
                pin = head + version
            markers = entry.get("markers")
            reqs.append(pin + (f" ; {markers}" if isinstance(markers, str) and markers else ""))
        return "sync", reqs, []
    data = _toml(files, lock)
    packages = data.get("package")
    if not isinstance(packages, list):
        raise LockError(f"{lock} has no [[package]] entries")
    constraints = []
    for package in packages:
        if not isinstance(package, dict):
            raise LockError(f"{lock} has a [[package]] entry that is not a table")
        if _main_group(package):
            constraints.append(_pin(lock, package.get("name"), package.get("version"), package.get("source")))
    pyproject = _toml(files, "pyproject.toml")
    if lock == "poetry.lock":
        top = _poetry_requirements(pyproject)
    else:
        project = pyproject.get("project")
        top = [str(r) for r in (project or {}).get("dependencies", [])] if isinstance(project, dict) else []
    return "install", top, constraints
