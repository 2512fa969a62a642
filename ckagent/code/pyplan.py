"""What determines a Python spider's environment: the install plan and its key, and the bundled SDK.

:func:`python_plan` reads the dependency files of a project (the task's working copy, through
ckagent.code.stage: regular files only, no link followed) and chooses how the environment is made
(``locked``: uv.lock + pyproject.toml; ``lock``: another lock, ckagent.code.pylocks; ``pyproject``;
``requirements``; ``packages``: the framework's default packages, ckagent.code.frameworks). The agent
reads the requirements itself (ckagent.code.pyreqs): the builder that installs them gets only the
staged files and plain requirement lines, never the project's code. The key is a sha256 over every
project file read, the requirement lines, the interpreter's path and version, the default packages,
the builder's identity (ckagent.code.builder) and, when the project asks for ``crawlerkeeper-sdk`` by
name, the bundled SDK. :func:`sdk_wheel` builds a wheel of the bundled SDK once, for uv to serve that
requirement with. All functions block (small reads, one ``python -c`` per interpreter binary): call
them through ``trio.to_thread``. ckagent.code.deps_python runs the installs.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ckagent.code import eggs
from ckagent.code.frameworks import default_packages
from ckagent.code.installenv import referenced
from ckagent.code.pylocks import find_lock, lock_inputs
from ckagent.code.pyreqs import (
    WHEELS_DIR,
    Requirements,
    project_requirements,
    read_requirements,
    requirement_lines,
)
from ckagent.code.stage import ProjectFiles, safe_relative

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SDK_DISTRIBUTION = "crawlerkeeper-sdk"


class InterpreterError(Exception):
    """The interpreter spiders' venvs are built on cannot run (ckagent.code.deps reports it as DEPS_FAILED)."""


@functools.lru_cache(maxsize=1)
def bundled_sdk_dir() -> Path | None:
    """A directory holding only ``crawlerkeeper_sdk/`` (inside the installed agent, or the checkout).
    Looked for once per agent process (it ships with the agent's own code)."""
    package = Path(__file__).resolve().parent.parent  # ckagent/
    for candidate in (package / "_sdk", package.parent / "sdk" / "python" / "src"):
        if (candidate / "crawlerkeeper_sdk" / "__init__.py").is_file():
            return candidate
    return None


def _sdk_files(sdk_dir: Path) -> list[tuple[str, bytes]]:
    """The SDK package's files (relative name, bytes), sorted; no caches."""
    package = sdk_dir / "crawlerkeeper_sdk"
    return [(path.relative_to(sdk_dir).as_posix(), path.read_bytes())
            for path in sorted(package.rglob("*"))
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"]


@functools.lru_cache(maxsize=4)
def _sdk_identity(sdk_dir: Path) -> tuple[list[tuple[str, bytes]], str, str]:
    """The SDK's files, its content hash (16 hex digits) and its version: read and hashed once per
    agent process (the bundled SDK ships with the agent's own code; a new one comes with a new agent)."""
    files = _sdk_files(sdk_dir)
    digest = hashlib.sha256()
    for name, data in files:
        digest.update(name.encode() + b"\0" + data + b"\0")
    init = dict(files).get("crawlerkeeper_sdk/__init__.py", b"").decode(errors="replace")
    match = re.search(r'^__version__ = "([^"]+)"', init, re.M)
    return files, digest.hexdigest()[:16], match.group(1) if match else "0"


def sdk_wheel(root: Path) -> tuple[str, Path] | None:
    """Build (once) a wheel of the bundled SDK under ``root/.sdk/<hash>/``: (its tag, the overrides file).

    The overrides file maps ``crawlerkeeper-sdk`` to that wheel for uv (``--override``). None when the
    agent bundles no SDK. Blocking (a few small files).
    """
    sdk_dir = bundled_sdk_dir()
    if sdk_dir is None:
        return None
    files, tag, version = _sdk_identity(sdk_dir)
    out = root / ".sdk" / tag
    wheel = out / f"crawlerkeeper_sdk-{version}-py3-none-any.whl"
    overrides = out / "overrides.txt"
    if not overrides.is_file():
        out.mkdir(parents=True, exist_ok=True)
        for made in (out.parent, out):  # the builder reads it, whatever the agent's umask
            os.chmod(made, 0o755)
        dist = f"crawlerkeeper_sdk-{version}.dist-info"
        members = [*files,
                   (f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {SDK_DISTRIBUTION}\nVersion: {version}\n".encode()),
                   (f"{dist}/WHEEL", b"Wheel-Version: 1.0\nGenerator: ckagent\nRoot-Is-Purelib: true\nTag: py3-none-any\n")]
        record = []
        for name, data in members:
            sha = hashlib.sha256(data).digest()
            record.append(f"{name},sha256={base64.urlsafe_b64encode(sha).rstrip(b'=').decode()},{len(data)}")
        record.append(f"{dist}/RECORD,,")
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in [*members, (f"{dist}/RECORD", ("\n".join(record) + "\n").encode())]:
                zf.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), data)
        # Written aside and renamed: a uv run of another task may be reading the wheel already.
        tmp_wheel = out / f".{wheel.name}.{os.getpid()}.{id(buffer)}.tmp"
        tmp_wheel.write_bytes(buffer.getvalue())
        os.chmod(tmp_wheel, 0o644)
        os.replace(tmp_wheel, wheel)
        tmp = out / f".overrides.{os.getpid()}.{id(buffer)}.tmp"
        tmp.write_text(f"{SDK_DISTRIBUTION} @ {wheel.as_uri()}\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, overrides)
    return f"{version}+{tag}", overrides


@functools.lru_cache(maxsize=16)
def _interpreter_version(path: str, mtime: float) -> str:
    try:
        proc = subprocess.run([path, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                              timeout=30, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InterpreterError(f"the spiders' interpreter {path} cannot run: {exc}") from exc
    if proc.returncode != 0:
        raise InterpreterError(f"the spiders' interpreter {path} cannot run: {proc.stderr.decode(errors='replace')[-500:]}")
    return proc.stdout.decode().strip()


def interpreter_identity(python: str) -> dict[str, str]:
    """The interpreter's real path and version (``python --version`` once per binary; blocking)."""
    found = python if "/" in python else shutil.which(python)
    if found is None:
        raise InterpreterError(f"the spiders' interpreter {python!r} is not on PATH")
    real = os.path.realpath(found)
    try:
        mtime = os.stat(real).st_mtime
    except OSError as exc:
        raise InterpreterError(f"the spiders' interpreter {python} is missing: {exc}") from exc
    return {"path": python, "realpath": real, "version": _interpreter_version(real, mtime)}


_SDK_NAME = re.compile(r"(?i)(?<![\w./-])crawlerkeeper[-_.]sdk(?![\w.-])\s*(@)?")
_LOCKED_SDK = re.compile(r'(?s)name = "crawlerkeeper-sdk"\nversion = "[^"]*"\nsource = \{ registry')


def requires_sdk_by_name(text: str) -> bool:
    """Whether requirement text (requirements.txt, pyproject.toml) asks for ``crawlerkeeper-sdk`` by
    name — to be found on an index — rather than by a path or URL of its own (``./x.whl``, ``name @ url``)."""
    for line in text.splitlines():
        stripped = line.split("#", 1)[0].strip().strip("\"',")
        match = _SDK_NAME.search(stripped)
        if match and not match.group(1) and not stripped.startswith((".", "/", "file:", "http", "git+", "-e")):
            return True
    return False


@dataclass(frozen=True)
class PythonPlan:
    """How a Python spider's environment is made, and its key (sha256 hex).

    ``mode``: ``locked`` (uv.lock), ``lock`` (another lock: ``lock``; ``how`` is
    ckagent.code.pylocks.lock_inputs's mode), ``pyproject``, ``requirements``, ``packages``. ``files``:
    the sha256 of every project file read; ``staged``: what the build's staging directory gets (the
    files uv reads, the project's own wheels: relative path → bytes; the project's code never);
    ``requirements``/``constraints``: the lines the agent read (ckagent.code.pyreqs) for uv to install;
    ``python_path``: the project's own directories a requirement named (``-e .``): on the spider's
    PYTHONPATH; ``notes``: lines for the task log; ``named``: variables the staged files reference
    (``${NAME}``). ``sdk``: a by-name requirement on ``crawlerkeeper-sdk`` is satisfied by the bundled
    copy (an override; for a lock: the lock's registry entry is left out and the ``.pth`` copy serves).
    """

    mode: str
    files: dict[str, str]
    packages: tuple[str, ...]
    key: str
    sdk: bool = False
    lock: str | None = None
    how: str = ""
    requirements: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()
    staged: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)
    python_path: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    named: frozenset[str] = frozenset()


def _declares(files: ProjectFiles) -> bool:
    """Whether pyproject.toml declares requirements at all ([project], or Poetry's dependencies): one
    that only configures tools leaves the choice to requirements.txt or the framework's packages."""
    text = files.text("pyproject.toml")
    if text is None:
        return False
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return True  # uv's own message then says what is wrong with it
    poetry = (data.get("tool") or {}).get("poetry") if isinstance(data.get("tool"), dict) else None
    return isinstance(data.get("project"), dict) or (isinstance(poetry, dict) and "dependencies" in poetry)


def _distribution(line: str) -> str:
    """The normalised distribution name a requirement line starts with (``""`` for an option or a URL)."""
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line.strip())
    return re.sub(r"[-_.]+", "-", m.group()).lower() if m else ""


def _not_sdk(line: str) -> bool:
    """A requirement line that is not ``crawlerkeeper-sdk`` (the bundled SDK, the ``.pth``, serves it)."""
    return re.split(r"[\s=<>!~;@\[]", line.strip(), maxsplit=1)[0].lower().replace("_", "-") != SDK_DISTRIBUTION


def _uv_lock_locals(text: str) -> list[tuple[str, str]]:
    """The packages of a uv.lock installed from the project's own directories (workspace members,
    path dependencies; the root project itself left out): (name, relative directory)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return []
    found = []
    for package in data.get("package") or []:
        source = package.get("source") if isinstance(package, dict) else None
        if not isinstance(source, dict):
            continue
        for kind in ("editable", "directory", "path"):
            where = source.get(kind)
            if isinstance(where, str) and where not in (".", "./"):
                found.append((str(package.get("name")), where))
    return found


def python_plan(code_dir: Path | ProjectFiles, framework: str, interpreter: dict[str, str], identity: str,
                sdk_tag: str, key_env: dict[str, str] | None = None) -> PythonPlan:
    """Choose the install from the dependency files of the project ``code_dir`` (its directory, or its
    files read without following a link: ckagent.code.stage) and compute the key (blocking: small reads).

    ``sdk_tag`` names the bundled SDK (its version and content hash); it enters the key only when
    the project asks for the SDK by name, so an agent upgrade rebuilds only those environments.
    ``key_env``: the task's variables that change what an install does (ckagent.code.installenv); they
    enter the key only when there are any, so other environments keep their keys. Raises LockError
    (a lock that cannot be honoured), NotStageable (a dependency file that is a link).
    """
    files = code_dir if isinstance(code_dir, ProjectFiles) else ProjectFiles(code_dir)
    packages: tuple[str, ...] = ()
    reqs = Requirements()
    lock: str | None = None
    how = ""
    staged: dict[str, bytes] = {}

    def stage(name: str) -> str:
        data = files.read(name)
        assert data is not None
        staged[name] = data
        return data.decode(errors="replace")

    if files.is_file("uv.lock") and files.is_file("pyproject.toml"):
        mode = "locked"
        locked = stage("uv.lock")
        stage("pyproject.toml")
        sdk = bool(_LOCKED_SDK.search(locked))
        for dist, where in _uv_lock_locals(locked):
            rel = safe_relative(where)
            if rel is not None and str(rel).endswith(".whl") and (wheel := files.read(str(rel))) is not None:
                staged[str(rel)] = wheel  # a wheel of the project's: installed as it is (a wheel runs nothing)
                continue
            if rel is None or not files.is_dir(str(rel)):
                reqs.notes.append(f"uv.lock: {dist} comes from {where}, outside the project: not installed")
                continue
            importable = f"{rel}/src" if files.is_dir(f"{rel}/src") else str(rel)
            reqs.python_path.append(importable)
            reqs.notes.append(f"uv.lock: {dist} is the project's own {rel}: not built or installed (installs run as "
                              f"the node's builder, which never runs a spider's code); {importable} goes on the "
                              "spider's PYTHONPATH instead, its locked requirements are installed")
    elif (lock := find_lock(files)) is not None:
        mode = "lock"
        how, top, pins = lock_inputs(files, lock)
        if how == "sync-file":
            stage(lock)
        else:
            reqs = requirement_lines(files, lock, [line for line in top if _not_sdk(line)])
            reqs.constraints = [line for line in pins if _not_sdk(line)]
        sdk = False  # the bundled SDK (the .pth) serves a locked crawlerkeeper-sdk: see ckagent.code.deps
    elif files.is_file("pyproject.toml") and _declares(files):
        mode = "pyproject"
        reqs = project_requirements(files)
        if reqs.unread and files.is_file("requirements.txt"):
            mode = "requirements"
            unread = reqs.unread
            reqs = read_requirements(files, "requirements.txt")
            reqs.notes.insert(0, f"{'; '.join(unread)}: not read (that would run the project's code as the builder); "
                                 "requirements.txt is installed instead")
        elif reqs.unread:
            reqs.notes.append(f"{'; '.join(reqs.unread)}: not read (that would run the project's code as the "
                              "node's builder), so nothing of it is installed — declare them in [project] "
                              "dependencies or in requirements.txt")
        sdk = requires_sdk_by_name("\n".join(reqs.lines))
    elif files.is_file("requirements.txt"):
        mode = "requirements"
        reqs = read_requirements(files, "requirements.txt")
        sdk = requires_sdk_by_name("\n".join(reqs.lines))
    elif files.is_file(eggs.REQUIRES) and files.is_dir(eggs.EGG_INFO):
        mode = "requirements"  # a Scrapyd egg's install_requires; Scrapy is Scrapyd's own, so added when unnamed
        lines = eggs.requires_lines(files.text(eggs.REQUIRES) or "")
        if not any(_distribution(line) == "scrapy" for line in lines):
            lines.append("scrapy")
        reqs = requirement_lines(files, eggs.REQUIRES, lines)
        sdk = requires_sdk_by_name("\n".join(reqs.lines))
    else:
        mode = "packages"
        sdk = False
        packages = default_packages(framework, Path(files.top))
    for wheel_path, staged_name in reqs.wheels.items():
        data = files.read(wheel_path)
        if data is not None:
            staged[f"{WHEELS_DIR}/{staged_name}"] = data
    named: set[str] = set()
    for data in staged.values():
        named |= referenced(data.decode(errors="replace"))
    for line in (*reqs.lines, *reqs.constraints):
        named |= referenced(line)
    digests = files.digests()
    key_source = {"schema": 2, "mode": mode, "files": digests, "packages": packages, "interpreter": interpreter,
                  "identity": identity, "sdk": sdk_tag if sdk else None, "sdk_dir": str(bundled_sdk_dir()),
                  "requirements": reqs.lines, "constraints": reqs.constraints, "python_path": reqs.python_path}
    if key_env:
        key_source["env"] = key_env
    key = hashlib.sha256(json.dumps(key_source, sort_keys=True).encode()).hexdigest()
    return PythonPlan(mode, digests, packages, key, sdk, lock, how, tuple(reqs.lines), tuple(reqs.constraints),
                      staged, tuple(reqs.python_path), tuple(reqs.notes), frozenset(named))
