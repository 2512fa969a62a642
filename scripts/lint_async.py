"""flake8-async (Trio's rules beyond ruff's subset; .flake8 says which) over ckagent/ and tests/,
again only on the files that changed since it last found them clean.

flake8-async parses every file with libcst and walks each tree seven times: ~80 s of CPU for the
whole repository, which ``./scripts/test`` used to spend on every run beside pytest. Its checks
look at one file at a time, so a file it found clean stays clean until its bytes, its path (the
per-file ignores) or the rules change: the verdicts are kept in ``.lint-async-clean`` (one sha256
of path + bytes per line), under a key made of .flake8, the versions of flake8, flake8-async and
libcst, and the Python version; any change of the key checks everything again.

Usage: ``python scripts/lint_async.py`` from anywhere; prints flake8's findings and exits with its
code (0: every file clean). ``--all`` ignores the kept verdicts (and renews them).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOTS = ("ckagent", "tests")
CACHE = ROOT / ".lint-async-clean"


def rules_key() -> str:
    """What the verdicts depend on besides the file: the configuration and the tools' versions."""
    digest = hashlib.sha256((ROOT / ".flake8").read_bytes())
    for dist in ("flake8", "flake8-async", "libcst"):
        digest.update(f"\0{dist}={version(dist)}".encode())
    digest.update(f"\0{sys.version}".encode())
    return digest.hexdigest()


def file_digest(relative: str) -> str:
    """sha256 of a file's path (relative to the repository) and bytes."""
    return hashlib.sha256(relative.encode() + b"\0" + (ROOT / relative).read_bytes()).hexdigest()


def load_clean(key: str) -> set[str]:
    """The digests found clean under ``key`` (none when the file is missing or has another key)."""
    try:
        lines = CACHE.read_text().split()
    except OSError:
        return set()
    return set(lines[1:]) if lines[:1] == [key] else set()


def save_clean(key: str, clean: set[str]) -> None:
    partial = CACHE.with_name(CACHE.name + f".{os.getpid()}")
    partial.write_text("\n".join([key, *sorted(clean)]) + "\n")
    partial.replace(CACHE)


def main(argv: list[str]) -> int:
    key = rules_key()
    files = sorted(str(path.relative_to(ROOT)) for top in ROOTS for path in (ROOT / top).rglob("*.py")
                   if "__pycache__" not in path.parts)
    digests = {name: file_digest(name) for name in files}
    known = set() if "--all" in argv else load_clean(key)
    todo = [name for name in files if digests[name] not in known]
    if not todo:
        return 0
    done = subprocess.run([sys.executable, "-m", "flake8", *todo], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode in (0, 1):  # 1: findings; anything else: flake8 itself failed, nothing is noted
        flagged = {line.split(":", 1)[0] for line in done.stdout.splitlines() if ":" in line}
        still = {digests[name] for name in files} & known
        save_clean(key, still | {digests[name] for name in todo if name not in flagged})
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
