"""What determines a Python spider's environment: the install plan and its key, and the bundled SDK.

:func:`python_plan` reads the dependency files of a code dir and chooses how the environment is
made (``locked``: uv.lock + pyproject.toml; ``pyproject``; ``requirements``; ``packages``: the
framework's default packages, ckagent.code.frameworks) and its key — a sha256 over the files it uses (a requirements file
with the files it includes by ``-r``/``-c``), the interpreter's path and version, the default
packages, the identity the environment runs as and, when the project asks for
``crawlerkeeper-sdk`` by name, the bundled SDK. :func:`sdk_wheel` builds a wheel of the bundled SDK
once, for uv to serve that requirement with. All functions block (small reads, one ``python -c``
per interpreter binary): call them through ``trio.to_thread``. ckagent.code.deps runs the installs.
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
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ckagent.code.frameworks import default_packages
from ckagent.code.pylocks import find_lock

SDK_DISTRIBUTION = "crawlerkeeper-sdk"
_INCLUDE = re.compile(r"^\s*(?:-r|-c|--requirement|--constraint)(?:\s+|=)(\S+)", re.M)


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
        os.replace(tmp_wheel, wheel)
        tmp = out / f".overrides.{os.getpid()}.{id(buffer)}.tmp"
        tmp.write_text(f"{SDK_DISTRIBUTION} @ {wheel.as_uri()}\n")
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


def _requirements_closure(code_dir: Path, name: str, into: dict[str, str], depth: int = 0) -> None:
    """Hash ``name`` and the files it includes by ``-r``/``-c`` (inside the code dir; at most 5 deep)."""
    path = code_dir / name
    if name in into or depth > 5 or not path.is_file():
        return
    data = path.read_bytes()
    into[name] = hashlib.sha256(data).hexdigest()
    for match in _INCLUDE.finditer(data.decode(errors="replace")):
        included = os.path.normpath(os.path.join(os.path.dirname(name), match.group(1)))
        if not included.startswith(".."):
            _requirements_closure(code_dir, included, into, depth + 1)


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

    ``sdk``: a by-name requirement on ``crawlerkeeper-sdk`` is satisfied by the bundled copy (an
    override; for a lock: the lock's registry entry is left out and the ``.pth`` copy serves).
    """

    mode: str  # "locked" (uv.lock), "lock" (another lock: ``lock``), "pyproject", "requirements", "packages"
    files: dict[str, str]
    packages: tuple[str, ...]
    key: str
    sdk: bool = False
    lock: str | None = None


def python_plan(code_dir: Path, framework: str, interpreter: dict[str, str], identity: str, sdk_tag: str,
                key_env: dict[str, str] | None = None) -> PythonPlan:
    """Choose the install from the dependency files in ``code_dir`` and compute the key (blocking: small reads).

    ``sdk_tag`` names the bundled SDK (its version and content hash); it enters the key only when
    the project asks for the SDK by name, so an agent upgrade rebuilds only those environments.
    ``key_env``: the task's variables that change what an install does (ckagent.code.installenv); they
    enter the key only when there are any, so other environments keep their keys.
    """
    files: dict[str, str] = {}
    packages: tuple[str, ...] = ()
    texts: list[str] = []

    def digest(name: str) -> None:
        data = (code_dir / name).read_bytes()
        files[name] = hashlib.sha256(data).hexdigest()
        texts.append(data.decode(errors="replace"))

    if (code_dir / "uv.lock").is_file() and (code_dir / "pyproject.toml").is_file():
        mode = "locked"
        digest("uv.lock")
        digest("pyproject.toml")
        sdk = bool(_LOCKED_SDK.search(texts[0]))
    elif (lock := find_lock(code_dir)) is not None:
        mode = "lock"
        digest(lock)
        if (code_dir / "pyproject.toml").is_file():
            digest("pyproject.toml")
        sdk = False  # the bundled SDK (the .pth) serves a locked crawlerkeeper-sdk: see ckagent.code.deps
    elif (code_dir / "pyproject.toml").is_file():
        mode = "pyproject"
        digest("pyproject.toml")
        sdk = requires_sdk_by_name(texts[0])
    elif (code_dir / "requirements.txt").is_file():
        mode = "requirements"
        _requirements_closure(code_dir, "requirements.txt", files)
        sdk = any(requires_sdk_by_name((code_dir / name).read_text(errors="replace")) for name in files)
    else:
        mode = "packages"
        sdk = False
        packages = default_packages(framework, code_dir)
    key_source = {"schema": 1, "mode": mode, "files": files, "packages": packages, "interpreter": interpreter,
                  "identity": identity, "sdk": sdk_tag if sdk else None, "sdk_dir": str(bundled_sdk_dir())}
    if key_env:
        key_source["env"] = key_env
    key = hashlib.sha256(json.dumps(key_source, sort_keys=True).encode()).hexdigest()
    return PythonPlan(mode, files, packages, key, sdk, lock if mode == "lock" else None)
