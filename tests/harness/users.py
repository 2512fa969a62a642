"""Another local user, for tests of what one user's files mean to another's process (as root only)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["NOBODY", "OTHER_USER_PYTHON", "another_user_cannot", "run_as", "world_directory"]

NOBODY = 65534
"""The uid and gid of ``nobody``: an unprivileged user that owns nothing of the tests'."""

OTHER_USER_PYTHON = "/usr/bin/python3"
"""A Python another user can execute (the suite's own may live under root's home)."""

REPO = Path(__file__).resolve().parents[2]


def another_user_cannot() -> str | None:
    """Why :func:`run_as` cannot be used here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (to run a process as another user)"
    if not os.access(OTHER_USER_PYTHON, os.X_OK):
        return f"{OTHER_USER_PYTHON} is missing"
    return None


def run_as(uid: int, code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run Python ``code`` (``sys.argv[1:]`` = ``args``) as ``uid`` (its group the same number),
    with this repository's ``ckagent`` importable (only modules that need the standard library
    alone: that Python has no third-party packages)."""
    prelude = f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
    return subprocess.run([OTHER_USER_PYTHON, "-I", "-S", "-c", prelude + code, *args], user=uid, group=uid,
                          extra_groups=[], capture_output=True, text=True, timeout=timeout, check=False,
                          cwd="/")


@contextlib.contextmanager
def world_directory() -> Iterator[Path]:
    """A fresh directory under /tmp that every user can reach and write in, sticky like /tmp
    (pytest's ``tmp_path`` is root's alone: mode 0700 above it); removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="ck-world-", dir="/tmp"))
    try:
        path.chmod(0o1777)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
