"""What a Python project requires, read by the agent without running a line of the project.

An installer that builds the project itself — ``uv pip install -r pyproject.toml`` of a project whose
dependencies are dynamic, ``-e .`` or ``.`` in a requirements file, a workspace member of a
``uv.lock`` — runs the project's own code (its ``setup.py``, an in-tree build backend, a hatch hook)
as whoever installs. Installers run as the node's builder, which must never run a spider's code
(ckagent.code.builder), so the agent reads the requirements itself and gives uv plain requirement
lines (:func:`read_requirements`, :func:`project_requirements`):

- ``[project].dependencies`` of pyproject.toml when static; when ``dynamic``, the files
  ``[tool.setuptools.dynamic].dependencies`` names; a Poetry project's ``[tool.poetry.dependencies]``
  (its ``^``/``~`` constraints as PEP 440 ranges);
- ``[options] install_requires`` of setup.cfg; ``install_requires=[...]`` of ``setup()`` in setup.py
  when it is a literal (read from the syntax tree, never executed);
- a requirements file, its ``-r``/``-c`` includes read from the project (inside it only).

A requirement that names the project's own code (``.``, ``-e .``, ``./libs/x``, ``file:…``) is not
installed: the directory goes on the spider's ``PYTHONPATH`` (its ``src/`` when it has one), as an
editable install would put it, and what that directory declares (read as above) is installed instead;
a ``.whl`` file of the project is staged and installed (a wheel runs nothing when installed); another
local file (an sdist, a path outside the project) is left out. An editable VCS requirement
(``-e git+https://…#egg=x``) is installed as a plain one (``x @ git+https://…``): the builder's
checkout is not the spider's to import from. Each of these leaves a line in the task log
(:attr:`Requirements.notes`) saying what happened and how to declare it so that it installs.

Blocking (small reads through ckagent.code.stage.ProjectFiles).
"""

from __future__ import annotations

import ast
import configparser
import re
import sys
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from ckagent.code.stage import ProjectFiles, safe_relative

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["WHEELS_DIR", "Requirements", "literal_install_requires", "poetry_constraint", "poetry_requirement",
           "project_requirements", "read_requirements", "requirement_lines"]

WHEELS_DIR = "wheels"
"""Where a project's own wheel files are staged, below the build's staging directory."""
_INCLUDE_DEPTH = 5
_REMOTE = re.compile(r"^(?:[a-z0-9+.-]+\+)?(?:https?|ftp|ssh|git|hg|svn|bzr)(?:\+[a-z]+)?://", re.I)
_VCS = re.compile(r"^(?:git|hg|svn|bzr)\+", re.I)
_EGG = re.compile(r"[#&]egg=([A-Za-z0-9][A-Za-z0-9._-]*)")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*@\s*(\S.*?)\s*$")
_OPTION = re.compile(r"^(-[A-Za-z]|--[a-z][a-z-]*)(?:[ =]\s*(.*))?$")
_EXTRAS = re.compile(r"^(.*?)(\[[^\]]*\])?$")
_PEP440_CLAUSE = re.compile(r"^(===|==|!=|>=|<=|~=|>|<)(.+)$")


@dataclass
class Requirements:
    """What a project asks to install: ``lines`` (requirements and their options, in order),
    ``constraints`` (lines of ``-c`` files), ``wheels`` (the project's own wheel files to stage: relative
    path → staged name), ``python_path`` (directories of the project that go on the spider's
    PYTHONPATH, relative), ``notes`` (lines for the task log), ``unread``: why the requirements of
    some of the project's own code could not be read without running it (empty when all were)."""

    lines: list[str] = field(default_factory=list)
    constraints: list[str] = field(default_factory=list)
    wheels: dict[str, str] = field(default_factory=dict)
    python_path: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)

    def extend(self, other: Requirements) -> None:
        """Add ``other``'s (lines, constraints, wheels, paths and notes) to this one's."""
        self.lines += other.lines
        self.constraints += other.constraints
        self.wheels.update(other.wheels)
        self.python_path += [p for p in other.python_path if p not in self.python_path]
        self.notes += other.notes
        self.unread += other.unread


def _logical_lines(text: str) -> list[str]:
    """The lines of a requirements file: continuations joined, comments and blanks dropped."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            out.append(line)
    if pending.strip():
        out.append(pending.strip())
    return out


def _join(base: PurePosixPath, target: str) -> str | None:
    """``target`` (relative to the directory ``base`` of the including file) inside the project, or None."""
    joined = safe_relative(str(base / target) if str(base) != "." else target)
    return None if joined is None else str(joined)


def read_requirements(files: ProjectFiles, name: str, *, constraint: bool = False, depth: int = 0,
                      seen: set[str] | None = None) -> Requirements:
    """The requirements file ``name`` of the project (see module docstring): its lines with the
    project's own code left out, ``-r`` includes inlined, ``-c`` includes as constraints. Raises
    NotStageable (ckagent.code.stage) for a file that is a link or not regular."""
    seen = set() if seen is None else seen
    out = Requirements()
    text = files.text(name)
    if text is None or name in seen or depth > _INCLUDE_DEPTH:
        if text is None and depth:
            out.notes.append(f"{name} is included but is not a file of the project: left out")
        return out
    seen.add(name)
    base = PurePosixPath(name).parent
    target = out.constraints if constraint else out.lines
    for line in _logical_lines(text):
        option = _OPTION.match(line) if line.startswith("-") else None
        if option is not None:
            flag, value = option.group(1), (option.group(2) or "").strip()
            if flag in ("-r", "--requirement", "-c", "--constraint"):
                included = _join(base, value)
                if included is None:
                    out.notes.append(f"{name}: {line!r} names a file outside the project: left out")
                    continue
                inner = read_requirements(files, included, constraint=constraint or flag in ("-c", "--constraint"),
                                          depth=depth + 1, seen=seen)
                out.extend(inner)
                continue
            if flag in ("-e", "--editable"):
                _requirement(files, name, base, value, out, target, editable=True)
                continue
            if flag in ("-f", "--find-links"):
                _find_links(files, name, base, value, out)
                continue
            if flag in ("-i", "--index-url", "--extra-index-url") and value.lower().startswith("file:"):
                out.notes.append(f"{name}: {line!r} is an index on this node's disk: left out (the builder reads "
                                 "packages from a URL, never from a path a spider may write)")
                continue
            target.append(line)
            continue
        _requirement(files, name, base, line, out, target, editable=False)
    return out


def requirement_lines(files: ProjectFiles, source: str, lines: list[str]) -> Requirements:
    """Requirement ``lines`` from ``source`` (a lock's top-level requirements, pyproject's list) with the
    project's own code left out as in a requirements file (no includes)."""
    out = Requirements()
    for line in lines:
        _requirement(files, source, PurePosixPath("."), line.strip(), out, out.lines, editable=False)
    return out


def _find_links(files: ProjectFiles, name: str, base: PurePosixPath, value: str, out: Requirements) -> None:
    if _REMOTE.match(value):
        out.lines.append(f"--find-links {value}")
        return
    local = value[len("file:"):].lstrip("/") if value.lower().startswith("file:") and not value.startswith("file:///") \
        else value
    rel = _join(base, local) if not local.startswith("/") else None
    if rel is None or not files.is_dir(rel):
        out.notes.append(f"{name}: --find-links {value} is not a directory of the project: left out")
        return
    wheels = [entry for entry in files.list_dir(rel) if entry.endswith(".whl")]
    for wheel in wheels:
        path = f"{rel}/{wheel}" if rel != "." else wheel
        if files.is_file(path):
            out.wheels[path] = wheel
    out.lines.append(f"--find-links {WHEELS_DIR}")
    others = len(files.list_dir(rel)) - len(wheels)
    if others:
        out.notes.append(f"{name}: --find-links {value}: {len(wheels)} wheel(s) of the project staged; its other "
                         f"{others} file(s) (sdists: they would run their setup.py as the builder) are not")


def _requirement(files: ProjectFiles, name: str, base: PurePosixPath, spec: str, out: Requirements,
                 target: list[str], *, editable: bool) -> None:
    """One requirement line (``spec``, after ``-e`` when ``editable``): kept, rewritten or left out."""
    head, _, options = spec.partition(" --")
    options = f" --{options}" if options else ""
    head = head.strip()
    named = _NAME.match(head)
    location = named.group(3) if named else head
    location = location.split(";", 1)[0].strip()
    if _REMOTE.match(location) or (named is None and _VCS.match(location)):
        if editable:
            egg = _EGG.search(location)
            clean = _EGG.sub("", location).rstrip("#&")
            dist = named.group(1) + (named.group(2) or "") if named else (egg.group(1) if egg else None)
            if dist is None:
                out.notes.append(f"{name}: -e {spec} has no #egg=NAME: left out (name it, e.g. NAME @ {clean})")
                return
            target.append(f"{dist} @ {clean}{options}")
            out.notes.append(f"{name}: -e {spec} is installed as {dist} @ {clean} (not editable: the builder's "
                             "checkout is not the spider's to change)")
            return
        target.append(spec)
        return
    if named is None and not editable and not _looks_local(location):
        target.append(spec)  # a plain requirement: name, extras, version, markers
        return
    _local(files, name, base, location, out, editable=editable, spec=spec)


def _looks_local(location: str) -> bool:
    lowered = location.lower()
    return (location.startswith((".", "/", "~")) or lowered.startswith("file:") or "/" in location
            or lowered.endswith((".whl", ".tar.gz", ".zip", ".tar.bz2", ".tgz")))


def _local(files: ProjectFiles, name: str, base: PurePosixPath, location: str, out: Requirements, *,
           editable: bool, spec: str) -> None:
    """A requirement naming a path: the project's own directory (its PYTHONPATH and its own requirements),
    a wheel of the project (staged), or left out."""
    path = location
    if path.lower().startswith("file:"):
        path = path[len("file:"):]
        path = path[2:] if path.startswith("//") else path
    extras = _EXTRAS.match(path)
    path = extras.group(1) if extras else path
    rel = None if path.startswith(("/", "~")) else _join(base, path)
    shown = f"-e {spec}" if editable else spec
    if rel is None:
        out.notes.append(f"{name}: {shown} names a path outside the project: left out (the builder installs "
                         "packages from an index, a URL or the project's own wheel files)")
        return
    if rel.endswith(".whl") and files.is_file(rel):
        staged = PurePosixPath(rel).name
        out.wheels[rel] = staged
        out.lines.append(f"./{WHEELS_DIR}/{staged}")
        return
    if files.is_dir(rel):
        own = project_requirements(files, rel)
        where = "the project itself" if rel == "." else f"the project's own {rel}"
        importable = f"{rel}/src" if files.is_dir(f"{rel}/src") else rel
        if importable not in out.python_path:
            out.python_path.append(importable)
        out.extend(own)
        declared = f"; its requirements ({(own.lines and ', '.join(own.lines[:6])) or 'none'}) are installed" \
            if not own.unread else ""
        out.notes.append(f"{name}: {shown} is {where}: not built or installed (installs run as the node's builder, "
                         f"which never runs a spider's code); {importable} goes on the spider's PYTHONPATH instead"
                         f"{declared} — console scripts and entry points it declares are not made")
        return
    out.notes.append(f"{name}: {shown} is not a directory or a wheel of the project: left out (a local sdist "
                     "would run its setup.py as the builder)")


def project_requirements(files: ProjectFiles, rel: str = ".") -> Requirements:
    """What the project directory ``rel`` declares it requires, read without running it (see module
    docstring). ``unread`` says why when its requirements are computed by code (a dynamic pyproject
    without a file, a setup.py whose install_requires is not a literal)."""
    out = Requirements()
    prefix = "" if rel == "." else f"{rel}/"
    where = "the project" if rel == "." else rel
    pyproject = _toml(files, f"{prefix}pyproject.toml")
    project = pyproject.get("project") if isinstance(pyproject.get("project"), dict) else None
    if project is not None:
        dynamic = project.get("dynamic") if isinstance(project.get("dynamic"), list) else []
        if "dependencies" not in dynamic:
            out.lines += [str(r) for r in project.get("dependencies") or [] if isinstance(r, str)]
            return _without_self(out, project.get("name"))
        source = (((pyproject.get("tool") or {}).get("setuptools") or {}).get("dynamic") or {}).get("dependencies")
        names = source.get("file") if isinstance(source, dict) else None
        if isinstance(names, str):
            names = [names]
        if isinstance(names, list) and names:
            for each in names:
                if isinstance(each, str) and (joined := _join(PurePosixPath(rel), each)) is not None:
                    out.extend(read_requirements(files, joined))
            return _without_self(out, project.get("name"))
        out.unread.append(f"{where}'s pyproject.toml declares its dependencies dynamic (its build backend "
                          "computes them)")
        return out
    poetry = ((pyproject.get("tool") or {}).get("poetry") or {}) if pyproject else {}
    if isinstance(poetry, dict) and isinstance(poetry.get("dependencies"), dict):
        for dist, constraint in poetry["dependencies"].items():
            if str(dist).lower() == "python":
                continue
            for line in poetry_requirement(str(dist), constraint, out.notes):
                out.lines.append(line)
        return out
    cfg = files.text(f"{prefix}setup.cfg")
    if cfg is not None:
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read_string(cfg)
            value = parser.get("options", "install_requires", fallback=None)
        except configparser.Error:
            value = None
        if value is not None:
            if value.strip().startswith("file:"):
                for each in value.strip()[len("file:"):].split(","):
                    if (joined := _join(PurePosixPath(rel), each.strip())) is not None:
                        out.extend(read_requirements(files, joined))
            else:
                out.lines += _logical_lines(value)
            return out
    setup_py = files.text(f"{prefix}setup.py")
    if setup_py is not None:
        found = literal_install_requires(setup_py)
        if found is None:
            out.unread.append(f"{where}'s setup.py computes install_requires (it is not a literal list)")
        else:
            out.lines += found
    return out


def _without_self(out: Requirements, name: Any) -> Requirements:
    """Leave out a requirement on the project itself (``name[extra]`` of its own extras)."""
    if isinstance(name, str):
        own = re.sub(r"[-_.]+", "-", name).lower()

        def other(line: str) -> bool:
            match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
            return match is None or re.sub(r"[-_.]+", "-", match.group(1)).lower() != own

        out.lines = [line for line in out.lines if other(line)]
    return out


def _toml(files: ProjectFiles, rel: str) -> dict[str, Any]:
    text = files.text(rel)
    if text is None:
        return {}
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return {}


def literal_install_requires(source: str) -> list[str] | None:
    """``install_requires`` of the ``setup(...)`` call in setup.py ``source`` when it is a literal list
    (or a name bound to one at module level), read from the syntax tree; [] when there is no such
    keyword; None when it is computed (or the file does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    assigned: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned[node.targets[0].id] = node.value
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if called != "setup":
            continue
        for keyword in call.keywords:
            if keyword.arg != "install_requires":
                continue
            value = keyword.value
            if isinstance(value, ast.Name) and value.id in assigned:
                value = assigned[value.id]
            try:
                literal = ast.literal_eval(value)
            except (ValueError, SyntaxError, TypeError):
                return None
            if isinstance(literal, (list, tuple)) and all(isinstance(x, str) for x in literal):
                return [str(x) for x in literal]
            return None
        return []
    return []


_POETRY_CLAUSE = re.compile(r"^\s*(\^|~=|~|==|!=|>=|<=|>|<|=)?\s*([0-9][0-9A-Za-z.*+!-]*)\s*$")


def _caret(version: str) -> str:
    parts = [int(p) if p.isdigit() else 0 for p in version.split(".")[:3]]
    given = len(parts)
    while len(parts) < 3:
        parts.append(0)
    for i, part in enumerate(parts[:given]):
        if part != 0 or i == given - 1:
            upper = parts[:i] + [part + 1] + [0] * (2 - i)
            return f">={version},<{'.'.join(map(str, upper))}"
    return f">={version}"  # pragma: no cover - the loop always returns


def _tilde(version: str) -> str:
    parts = [int(p) if p.isdigit() else 0 for p in version.split(".")[:3]]
    upper = [parts[0] + 1] if len(parts) == 1 else [*parts[:1], parts[1] + 1]
    return f">={version},<{'.'.join(map(str, upper))}"


def poetry_constraint(text: str) -> str | None:
    """A Poetry version constraint (``^1.2``, ``~1.2.3``, ``>=1,<2``, ``1.2.*``, ``*``) as a PEP 440
    specifier (``>=1.2,<2``; empty for any); None when it cannot be one (``||``: either of two)."""
    text = text.strip()
    if text in ("", "*"):
        return ""
    if "||" in text or "|" in text:
        return None
    out: list[str] = []
    for clause in re.split(r"\s*,\s*|\s+(?=[<>=!^~])", text):
        if not clause:
            continue
        match = _POETRY_CLAUSE.match(clause)
        if match is None:
            return None
        op, version = match.group(1) or "", match.group(2)
        if op == "^":
            out.append(_caret(version))
        elif op == "~":
            out.append(_tilde(version))
        elif op in ("", "="):
            out.append(f"=={version}")
        else:
            out.append(f"{op}{version}")
    return ",".join(out)


def poetry_requirement(name: str, spec: Any, notes: list[str]) -> list[str]:
    """``[tool.poetry.dependencies]``'s entry ``name = spec`` as PEP 508 lines (a list of constraints
    gives one line each); optional ones, path ones (the project's own code) and those that cannot be
    expressed are left out with a note."""
    if isinstance(spec, list):
        return [line for each in spec for line in poetry_requirement(name, each, notes)]
    if isinstance(spec, str):
        spec = {"version": spec}
    if not isinstance(spec, dict) or spec.get("optional"):
        return []
    extras = spec.get("extras")
    head = name + (f"[{','.join(map(str, extras))}]" if isinstance(extras, list) and extras else "")
    markers = []
    if isinstance(spec.get("markers"), str):
        markers.append(f"({spec['markers']})")
    if isinstance(spec.get("python"), str):
        python = poetry_constraint(spec["python"])
        clauses = [_PEP440_CLAUSE.match(clause) for clause in (python or "").split(",") if clause]
        if clauses and all(clauses):
            markers.append(" and ".join(f'python_full_version {m.group(1)} "{m.group(2)}"' for m in clauses if m))
    if isinstance(spec.get("platform"), str):
        markers.append(f'sys_platform == "{spec["platform"]}"')
    tail = f" ; {' and '.join(markers)}" if markers else ""
    if "path" in spec:
        notes.append(f"pyproject.toml [tool.poetry.dependencies] {name} is a path ({spec['path']}): not built or "
                     "installed (installs run as the node's builder, which never runs a spider's code)")
        return []
    if isinstance(spec.get("git"), str):
        ref = spec.get("rev") or spec.get("tag") or spec.get("branch")
        url = spec["git"] if "://" in spec["git"] or spec["git"].startswith("git@") else f"https://{spec['git']}"
        return [f"{head} @ git+{url}" + (f"@{ref}" if ref else "") + tail]
    if isinstance(spec.get("url"), str):
        return [f"{head} @ {spec['url']}{tail}"]
    version = poetry_constraint(str(spec.get("version", "*")))
    if version is None:
        notes.append(f"pyproject.toml [tool.poetry.dependencies] {name} = {spec.get('version')!r}: an either-or "
                     "constraint PEP 440 cannot say; installed without a version constraint")
        version = ""
    return [f"{head}{version}{tail}"]
