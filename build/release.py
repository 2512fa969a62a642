#!/usr/bin/env python3
"""Build, check and publish a release of the agent (``ckagent``) or the spider SDK (``crawlerkeeper-sdk``).

Called by ``build/publish.sh`` (agent) and ``sdk/python/publish.sh`` (SDK)::

    release.py --project agent|sdk (--dry-run | --publish) [--repository-url URL] [--gate-file FILE] [--pyz FILE]

Steps, each stopping the release when it fails:

1. build into ``dist/<project>/`` (or ``--dist DIR``; emptied first): sdist + wheel (``uv build``); for the agent also
   ``ckagent.pyz`` (build/build_pyz.py, or ``--pyz FILE``) and the release index for run.sh in
   ``dist/agent/release/`` (``ckagent-<version>.pyz``, ``uv-<uv version>-linux-x86_64`` — ``--uv FILE``,
   default the dev venv's uv —, ``<version>.json``, ``latest.json``);
2. check the artifacts: readable archives, one version everywhere (the package's ``__version__``),
   the wheel holds only its package (and, for the agent, the bundled SDK);
3. brand-word gate: no word listed in the gate file (default ``build/brand_words.txt``, or
   ``RELEASE_GATE_FILE``) occurs, case-insensitively, in any file name or content of any artifact;
0. ``--publish`` only (checked first): credentials, ``PYPI_TOKEN``, else the file ``PYPI_TOKEN_FILE`` (default
   ``~/.pypi_token``); it must look like a PyPI API token (``pypi-…``) when uploading to PyPI. A dry run
   needs no token;
4. ``--publish`` only: ``uv publish`` with the token in its environment (never on a command line).

The token is never printed, logged or put in an error message. Exit codes: 0 ok (dry run passed or
published), 1 a step failed (the message says which and how to fix it), 2 usage.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_GATE = REPO / "build" / "brand_words.txt"


class ReleaseError(Exception):
    """A release step failed; the message is for the person releasing (never holds the token)."""


@dataclass(frozen=True)
class Project:
    """What one releasable project is: where its source and version live, what its wheel may hold."""

    name: str
    source: Path
    version_file: Path
    wheel_roots: tuple[str, ...]


PROJECTS = {
    "agent": Project("ckagent", REPO, REPO / "ckagent" / "__init__.py", ("ckagent",)),
    "sdk": Project("crawlerkeeper-sdk", REPO / "sdk" / "python",
                   REPO / "sdk" / "python" / "src" / "crawlerkeeper_sdk" / "__init__.py", ("crawlerkeeper_sdk",)),
}


def say(message: str) -> None:
    """One progress line on stdout."""
    print(f"release: {message}", flush=True)


def read_version(path: Path) -> str:
    """The ``__version__ = "..."`` of ``path``. Raises ReleaseError."""
    match = re.search(r'^__version__ = "([^"]+)"$', path.read_text(encoding="utf-8"), re.M)
    if not match:
        raise ReleaseError(f"no __version__ line in {path}")
    return match.group(1)


def find_uv() -> str:
    """uv beside this interpreter (the dev venv) or on PATH. Raises ReleaseError."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.is_file() else shutil.which("uv")
    if not found:
        raise ReleaseError("uv not found: pip install uv (it is in the dev extras)")
    return found


def run(argv: list[str], env: dict[str, str] | None = None) -> None:
    """Run a build/publish tool; raises ReleaseError with its output (which never holds the token)."""
    result = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise ReleaseError(f"{Path(argv[0]).name} {argv[1]} failed ({result.returncode}):\n"
                           f"{result.stdout}{result.stderr}".rstrip())


# ----------------------------------------------------------------------------------------- build


def build(project: Project, dist: Path, pyz: Path | None) -> list[Path]:
    """Build the project's artifacts into ``dist`` (emptied first). Returns the artifact paths."""
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    run([find_uv(), "build", "--sdist", "--wheel", "--quiet", "-o", str(dist), str(project.source)])
    for leftover in [project.source / "build" / "lib", *(project.source / "build").glob("bdist.*")]:
        shutil.rmtree(leftover, ignore_errors=True)  # setuptools' in-tree build output
    with contextlib.suppress(OSError):
        (project.source / "build").rmdir()  # only when empty (the SDK's; the agent's holds these scripts)
    artifacts = sorted(dist.glob("*.whl")) + sorted(dist.glob("*.tar.gz"))
    if project.name == "ckagent":
        target = dist / "ckagent.pyz"
        if pyz is not None:
            shutil.copyfile(pyz, target)
        else:
            run([sys.executable, str(REPO / "build" / "build_pyz.py"), "--output", str(target)])
        artifacts.append(target)
    return artifacts


def uv_version(uv: Path) -> str:
    """The version a uv executable reports (``uv 0.9.2 (...)`` → "0.9.2"). Raises ReleaseError."""
    result = subprocess.run([str(uv), "--version"], capture_output=True, text=True, check=False, timeout=30)
    match = re.match(r"uv (\S+)", result.stdout)
    if result.returncode != 0 or not match:
        raise ReleaseError(f"{uv} --version did not name a uv version: {result.stdout}{result.stderr}".strip())
    return match.group(1)


def write_release_index(pyz: Path, version: str, directory: Path, uv: Path | None = None) -> None:
    """``ckagent-<version>.pyz``, ``<version>.json`` and ``latest.json`` for run.sh (docs/deploy.md);
    with ``uv``, also ``uv-<uv version>-linux-x86_64`` and its entry (run.sh installs it beside the pyz)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"ckagent-{version}.pyz"
    shutil.copyfile(pyz, directory / name)
    data = pyz.read_bytes()
    entry: dict[str, object] = {"version": version, "url": name, "sha256": hashlib.sha256(data).hexdigest(),
                                "sizeBytes": len(data), "python": ">=3.10,<3.14", "platform": "linux-x86_64"}
    if uv is not None:
        uv_ver = uv_version(uv)
        uv_name = f"uv-{uv_ver}-linux-x86_64"
        shutil.copyfile(uv, directory / uv_name)
        (directory / uv_name).chmod(0o755)
        uv_data = (directory / uv_name).read_bytes()
        entry["uv"] = {"version": uv_ver, "url": uv_name, "sha256": hashlib.sha256(uv_data).hexdigest(),
                       "sizeBytes": len(uv_data)}
    text = json.dumps(entry, indent=2) + "\n"
    (directory / f"{version}.json").write_text(text)
    (directory / "latest.json").write_text(text)


# ----------------------------------------------------------------------------------------- check


def members(artifact: Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every file inside a wheel, pyz (zip) or sdist (tar.gz). Raises ReleaseError."""
    try:
        if artifact.name.endswith(".tar.gz"):
            with tarfile.open(artifact) as tar:
                for info in tar.getmembers():
                    if info.isfile():
                        handle = tar.extractfile(info)
                        yield info.name, handle.read() if handle else b""
        else:
            with zipfile.ZipFile(artifact) as archive:
                for info in archive.infolist():
                    if not info.is_dir():
                        yield info.filename, archive.read(info)
    except (OSError, zipfile.BadZipFile, tarfile.TarError) as exc:
        raise ReleaseError(f"{artifact.name} is not a readable archive: {exc}") from exc


def check_artifacts(project: Project, artifacts: list[Path], version: str) -> None:
    """Each artifact carries ``version`` and holds what it should. Raises ReleaseError naming the problem."""
    dist_name = project.name.replace("-", "_")
    wheels = [a for a in artifacts if a.suffix == ".whl"]
    sdists = [a for a in artifacts if a.name.endswith(".tar.gz")]
    if len(wheels) != 1 or len(sdists) != 1:
        raise ReleaseError(f"expected one wheel and one sdist, got {[a.name for a in artifacts]}")
    for artifact in (*wheels, *sdists):
        if not artifact.name.startswith(f"{dist_name}-{version}"):
            raise ReleaseError(f"{artifact.name}: expected version {version} (from {project.version_file.name})")
    names = dict(members(wheels[0]))
    info = f"{dist_name}-{version}.dist-info/"
    metadata = names.get(info + "METADATA", b"").decode(errors="replace")
    if f"\nVersion: {version}\n" not in metadata:
        raise ReleaseError(f"{wheels[0].name}: METADATA does not say Version: {version}")
    strays = sorted({n.split("/")[0] for n in names if not n.startswith(info)} - set(project.wheel_roots))
    if strays:
        raise ReleaseError(f"{wheels[0].name} holds more than {project.wheel_roots}: {strays}")
    if project.name == "ckagent" and "ckagent/_sdk/crawlerkeeper_sdk/__init__.py" not in names:
        raise ReleaseError(f"{wheels[0].name} lacks the bundled SDK (ckagent/_sdk/crawlerkeeper_sdk)")
    if not any(n.endswith("/PKG-INFO") for n, _ in members(sdists[0])):
        raise ReleaseError(f"{sdists[0].name} has no PKG-INFO")
    for pyz in (a for a in artifacts if a.suffix == ".pyz"):
        pyz_names = dict(members(pyz))
        init = pyz_names.get("site-packages/ckagent/__init__.py", b"").decode()
        if f'__version__ = "{version}"' not in init or "environment.json" not in pyz_names:
            raise ReleaseError(f"{pyz.name} is not a ckagent {version} pyz")


def gate_words(gate_file: Path) -> list[str]:
    """The words of the gate file: one per line, blank lines and ``#`` comments ignored. Raises ReleaseError."""
    try:
        lines = gate_file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ReleaseError(f"cannot read the brand-word gate file {gate_file}: {exc}") from exc
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def brand_gate(artifacts: list[Path], words: list[str]) -> None:
    """Raise ReleaseError listing every (artifact, file, word) where a gate word occurs (case-insensitive)."""
    needles = [(word, word.lower().encode()) for word in words]
    hits: list[str] = []
    for artifact in artifacts:
        for name, data in members(artifact):
            haystack = name.lower().encode() + b"\0" + data.lower()
            hits += [f"{artifact.name}: {name}: {word!r}" for word, needle in needles if needle in haystack]
    if hits:
        shown = "\n  ".join(hits[:20]) + (f"\n  … and {len(hits) - 20} more" if len(hits) > 20 else "")
        raise ReleaseError(f"brand-word gate: {len(hits)} forbidden word occurrence(s); release stopped:\n  {shown}")


# ----------------------------------------------------------------------------------------- token


def load_token(repository_url: str | None) -> tuple[str, str]:
    """(token, where it came from). Raises ReleaseError (which never contains the token)."""
    token = os.environ.get("PYPI_TOKEN", "").strip()
    source = "the PYPI_TOKEN environment variable"
    if not token:
        path = Path(os.environ.get("PYPI_TOKEN_FILE") or Path.home() / ".pypi_token").expanduser()
        source = f"the file {path}"
        try:
            token = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            raise ReleaseError(f"no PyPI token: set PYPI_TOKEN, or put the token in {path} "
                               "(or point PYPI_TOKEN_FILE at a file holding it)") from None
        except OSError as exc:
            raise ReleaseError(f"cannot read the PyPI token file {path}: {exc.strerror}") from None
        if path.stat().st_mode & 0o077:
            print(f"release: warning: {path} is readable by others; chmod 600 it", file=sys.stderr)
    if not token:
        raise ReleaseError(f"the PyPI token from {source} is empty")
    if any(ch.isspace() for ch in token):
        raise ReleaseError(f"the PyPI token from {source} contains whitespace; it must be one line")
    if (repository_url is None or "pypi" in repository_url) and not token.startswith("pypi-"):
        raise ReleaseError(f"the token from {source} does not look like a PyPI API token (they start with "
                           "'pypi-'); create an API token in your PyPI account settings")
    return token, source


# ----------------------------------------------------------------------------------------- main


def release(project_key: str, publish: bool, repository_url: str | None, gate_file: Path, pyz: Path | None,
            dist: Path | None = None, uv: Path | None = None) -> None:
    """Run the release steps (module docstring) with artifacts in ``dist``. Raises ReleaseError."""
    project = PROJECTS[project_key]
    version = read_version(project.version_file)
    token = ""
    if publish:
        token, source = load_token(repository_url)
        say(f"credentials: PyPI token found in {source}")
    else:
        say("credentials: not needed for a dry run (--publish reads PYPI_TOKEN or ~/.pypi_token)")
    dist = dist or REPO / "dist" / project_key
    say(f"{project.name} {version}: building into {dist}")
    artifacts = build(project, dist, pyz)
    check_artifacts(project, artifacts, version)
    say("artifacts: " + ", ".join(f"{a.name} ({a.stat().st_size} bytes)" for a in artifacts))
    words = gate_words(gate_file)
    brand_gate(artifacts, words)
    say(f"brand-word gate passed ({len(words)} word(s) from {gate_file})")
    uploads = [a for a in artifacts if a.suffix != ".pyz"]
    pyz_artifact = next((a for a in artifacts if a.suffix == ".pyz"), None)
    if pyz_artifact is not None:
        write_release_index(pyz_artifact, version, dist / "release", uv or Path(find_uv()))
        say(f"run.sh release index in {dist / 'release'}: copy it to the host behind AGENT_RELEASE_URL")
    if not publish:
        say(f"dry run passed: would upload {', '.join(a.name for a in uploads)} to {repository_url or 'PyPI'}")
        return
    env = {**os.environ, "UV_PUBLISH_TOKEN": token}
    env.pop("PYPI_TOKEN", None)
    target = ["--publish-url", repository_url] if repository_url else []
    run([find_uv(), "publish", *target, *map(str, uploads)], env=env)
    say(f"published {project.name} {version} to {repository_url or 'PyPI'}")


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="publish.sh", description="Build, check and publish a release.")
    parser.add_argument("--project", choices=sorted(PROJECTS), required=True)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dry-run", action="store_true", help="build and check everything, upload nothing")
    mode.add_argument("--publish", action="store_true", help="build, check and upload")
    parser.add_argument("--repository-url", default=os.environ.get("PYPI_REPOSITORY_URL") or None,
                        help="upload endpoint (default: PyPI)")
    parser.add_argument("--gate-file", type=Path, default=Path(os.environ.get("RELEASE_GATE_FILE", DEFAULT_GATE)))
    parser.add_argument("--pyz", type=Path, default=None, help="agent: use this ckagent.pyz instead of building")
    parser.add_argument("--dist", type=Path, default=None, help="output directory (default: dist/<project>)")
    parser.add_argument("--uv", type=Path, default=None,
                        help="agent: the uv executable (linux-x86_64) the release index names (default: the dev venv's)")
    args = parser.parse_args(argv)
    try:
        release(args.project, args.publish, args.repository_url, args.gate_file, args.pyz, args.dist, args.uv)
    except ReleaseError as exc:
        print(f"release: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

