#!/usr/bin/env python3
"""Build ``dist/ckagent.pyz``: one reproducible, compressed zipapp (shiv) for CPython 3.10–3.13 on Linux x86_64.

Usage::

    .venv/bin/python build/build_pyz.py [--output dist/ckagent.pyz] [--relock]

How one file serves four Python versions: the dependencies are pinned once in
``build/requirements.lock`` (a universal lock with one version per package, hashes required), then
installed once per target version with uv's cross-install flags (``--python-version X
--python-platform x86_64-manylinux_2_17``, no interpreter of that version needed) into separate
directories, which are merged into one site-packages. Pure-Python files are identical across the
versions (the merge checks it); compiled modules carry the version in their file name
(``_yaml.cpython-310-x86_64-linux-gnu.so`` … ``-313-``; psutil ships one ``abi3`` module), so each
interpreter finds its own. Packages whose lock entry applies to some versions only (``exceptiongroup``,
``tomli``, ``taskgroup`` on 3.10) are present for all and imported only where needed.

Reproducible: same source tree + same lock + same uv/shiv versions → the same bytes. Files are added
in sorted order with a fixed timestamp (``SOURCE_DATE_EPOCH``, default shiv's constant), file modes
are normalised (0644, or 0755 where any execute bit was set), and install-time records that name
temporary paths (``direct_url.json``) are dropped. The lock is the input that pins dependencies:
``--relock`` refreshes it from pyproject.toml (the build refuses a lock whose recorded dependency
list no longer matches pyproject.toml).

Exit codes: 0 built; 1 a step failed (its output is shown); 2 usage error.
Requires: uv (``.venv/bin/uv`` or on PATH); shiv (the dev extra, else uv fetches the pinned version).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON_VERSIONS = ("3.10", "3.11", "3.12", "3.13")
PLATFORM = "x86_64-manylinux_2_17"
SHEBANG = "/usr/bin/env python3"
ENTRY_POINT = "ckagent.__main__:main"
SHIV_VERSION = "1.0.8"  # the bootstrap code inside the pyz comes from shiv: pinned for reproducibility
LOCK_MARKER = "# ckagent-dependencies-sha256: "
# Files whose content legitimately differs between the per-version installs of one package: merged.
_MERGEABLE = re.compile(r"[^/]+\.dist-info/(RECORD|WHEEL)")
# Install-time files that name the build machine's temporary paths: dropped.
_DROPPED = re.compile(r"\.lock|[^/]+\.dist-info/(direct_url\.json|uv_cache\.json|REQUESTED)")


class BuildError(Exception):
    """A build step failed; the message says which and how to fix it."""


def find_uv() -> str:
    """The uv executable: next to this interpreter (the dev venv), else on PATH. Raises BuildError."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.is_file() else shutil.which("uv")
    if not found:
        raise BuildError("uv not found: `pip install uv` (it is in the dev extras: pip install -e '.[dev]')")
    return found


def shiv_command(uv: str) -> list[str]:
    """shiv from this interpreter (the dev extra) when it is the pinned version, else the pinned one via uv."""
    try:
        from shiv import __version__ as installed
    except ImportError:
        installed = None
    if installed == SHIV_VERSION:
        return [sys.executable, "-m", "shiv"]
    return [uv, "tool", "run", "--quiet", "--from", f"shiv=={SHIV_VERSION}", "shiv"]


def run(argv: list[str], **kwargs: object) -> str:
    """Run ``argv``; returns stdout. Raises BuildError with the output when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise BuildError(f"{' '.join(argv[:3])} … failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return str(result.stdout)


def dependencies_digest(pyproject: Path) -> str:
    """SHA-256 of the ``[project] dependencies`` array text in ``pyproject`` (what the lock must match)."""
    text = pyproject.read_text(encoding="utf-8")
    match = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
    if not match:
        raise BuildError(f"{pyproject}: no [project] dependencies array found")
    entries = sorted(re.findall(r'"([^"]+)"', match.group(1)))
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()


def relock(uv: str, source: Path, lock: Path) -> None:
    """Resolve pyproject.toml's dependencies into ``lock`` (universal, one version per package, hashes)."""
    body = run([uv, "pip", "compile", str(source / "pyproject.toml"), "--universal", "--fork-strategy", "fewest",
                "--python-version", PYTHON_VERSIONS[0], "--generate-hashes", "--no-header", "--quiet"],
               cwd=source)
    header = (
        "# Dependencies of ckagent.pyz, pinned for every Python it supports (one version per package).\n"
        "# Regenerate with: .venv/bin/python build/build_pyz.py --relock\n"
        f"{LOCK_MARKER}{dependencies_digest(source / 'pyproject.toml')}\n"
    )
    lock.write_text(header + body, encoding="utf-8")


def check_lock(source: Path, lock: Path) -> None:
    """Raise BuildError if ``lock`` is missing or was made for another dependency list."""
    if not lock.is_file():
        raise BuildError(f"{lock} is missing: run build/build_pyz.py --relock")
    recorded = next((line[len(LOCK_MARKER):].strip() for line in lock.read_text().splitlines()
                     if line.startswith(LOCK_MARKER)), None)
    if recorded != dependencies_digest(source / "pyproject.toml"):
        raise BuildError(f"{lock} does not match pyproject.toml's dependencies: run build/build_pyz.py --relock")


def merge_tree(src: Path, dest: Path) -> None:
    """Copy ``src`` into ``dest``; identical files are fine, RECORD/WHEEL are merged, anything else clashing fails."""
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src).as_posix()
        if path.is_dir() or "__pycache__" in rel or _DROPPED.fullmatch(rel) or rel.startswith("bin/"):
            continue
        target = dest / rel
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            continue
        new, old = path.read_bytes(), target.read_bytes()
        if new == old:
            continue
        if _MERGEABLE.fullmatch(rel):
            lines = old.decode().splitlines()
            lines += [line for line in new.decode().splitlines() if line not in lines]
            if rel.endswith("RECORD"):
                lines = sorted(lines)
            target.write_text("\n".join(lines) + "\n")
            continue
        raise BuildError(f"{rel} differs between the per-version installs: the lock must pin one version "
                         "of each package (run --relock; check for a package that forks by Python version)")


def remove_setuptools_output(source: Path) -> None:
    """Remove what setuptools leaves in ``source/build`` (lib/, bdist.*/) after a wheel build."""
    for leftover in [source / "build" / "lib", *(source / "build").glob("bdist.*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def clean_records(site: Path) -> None:
    """Drop RECORD lines of files the merge left out, and check there is one dist-info per project."""
    projects: dict[str, str] = {}
    for info in sorted(site.glob("*.dist-info")):
        name = info.name.rsplit("-", 1)[0].lower().replace("_", "-")
        if name in projects:
            raise BuildError(f"two versions of {name} in the pyz ({projects[name]}, {info.name}): run --relock")
        projects[name] = info.name
        record = info / "RECORD"
        if record.is_file():
            keep = [line for line in record.read_text().splitlines()
                    if line and (site / line.split(",", 1)[0]).is_file()]
            record.write_text("\n".join(sorted(set(keep))) + "\n")


def normalise_modes(site: Path) -> None:
    """0644 for files (0755 if any execute bit), 0755 for directories: the zip records modes."""
    for path in site.rglob("*"):
        mode = path.stat().st_mode
        if path.is_dir():
            path.chmod(0o755)
        else:
            path.chmod(0o755 if mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH) else 0o644)


def build(source: Path, output: Path, lock: Path, versions: tuple[str, ...], platform: str) -> Path:
    """Build the pyz from ``source`` (a checkout) into ``output``. Returns ``output``. Raises BuildError."""
    uv = find_uv()
    check_lock(source, lock)
    with tempfile.TemporaryDirectory(prefix="ckagent-pyz-") as tmp:
        work = Path(tmp)
        site = work / "site-packages"
        site.mkdir()
        for version in versions:
            target = work / f"deps-{version}"
            run([uv, "pip", "install", "--quiet", "--target", str(target), "--python-version", version,
                 "--python-platform", platform, "--no-deps", "--no-build", "--require-hashes",
                 "--no-compile", "-r", str(lock)])
            merge_tree(target, site)
        # ckagent itself, through its wheel, so the pyz holds exactly what `pip install .` installs.
        wheels = work / "wheel"
        run([uv, "build", "--wheel", "--quiet", "-o", str(wheels), str(source)])
        remove_setuptools_output(source)
        (wheel,) = wheels.glob("ckagent-*.whl")
        run([uv, "pip", "install", "--quiet", "--target", str(work / "ckagent"), "--no-deps", "--no-compile",
             "--python-version", versions[0], "--python-platform", platform, str(wheel)])
        merge_tree(work / "ckagent", site)
        clean_records(site)
        normalise_modes(site)
        output.parent.mkdir(parents=True, exist_ok=True)
        partial = output.with_name(output.name + ".part")
        run([*shiv_command(uv), "--site-packages", str(site), "--entry-point", ENTRY_POINT, "--output-file", str(partial),
             "--python", SHEBANG, "--compressed", "--reproducible",
             "--preamble", str(Path(__file__).resolve().parent / "pyz_preamble.py")])
        partial.replace(output)
    return output


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--source", type=Path, default=REPO, help="checkout to build from (default: this one)")
    parser.add_argument("--output", "-o", type=Path, default=None, help="default: <source>/dist/ckagent.pyz")
    parser.add_argument("--lock", type=Path, default=REPO / "build" / "requirements.lock")
    parser.add_argument("--relock", action="store_true", help="re-resolve the lock from pyproject.toml first")
    parser.add_argument("--python-versions", default=",".join(PYTHON_VERSIONS))
    parser.add_argument("--platform", default=PLATFORM)
    args = parser.parse_args(argv)
    source = args.source.resolve()
    output = (args.output or source / "dist" / "ckagent.pyz").resolve()
    try:
        if args.relock:
            relock(find_uv(), source, args.lock)
            print(f"locked: {args.lock}")
        built = build(source, output, args.lock, tuple(args.python_versions.split(",")), args.platform)
    except BuildError as exc:
        print(f"build_pyz: {exc}", file=sys.stderr)
        return 1
    digest = hashlib.sha256(built.read_bytes()).hexdigest()
    print(f"built {built} ({built.stat().st_size} bytes, sha256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
