"""Other CPython versions for the tests that run code on them (the pyz on 3.10–3.13, the SDK on 3.8).

They come from pyenv (``$PYENV_ROOT/versions/3.x.*``, ``/root/.pyenv`` by default: this machine's) or
from ``python3.x`` on ``PATH`` (a distribution's). A version that is not there, or that this user
cannot reach (``/root`` is mode 0700 for everyone else), is skipped with a reason naming it.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

__all__ = ["PYENV_VERSIONS", "find_python", "missing_python", "python_or_skip", "python_versions"]

PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT", "/root/.pyenv")) / "versions"


def _release(path: Path) -> list[int]:
    return [int(x) for x in path.parent.parent.name.split(".") if x.isdigit()]


@functools.cache
def find_python(version: str) -> Path | None:
    """The newest CPython ``version`` (e.g. "3.10") this user can run: pyenv's, else ``python<version>``
    on ``PATH``; None when there is none. Never raises (an unreadable pyenv counts as none). Cached."""
    try:
        found = sorted((p for p in PYENV_VERSIONS.glob(f"{version}.*/bin/python") if os.access(p, os.X_OK)),
                       key=_release)
    except OSError:  # (PermissionError: another user's pyenv)
        found = []
    if found:
        return found[-1]
    on_path = shutil.which(f"python{version}")
    return Path(on_path) if on_path else None


def missing_python(version: str) -> str:
    """Why :func:`find_python` found no ``version``: the skip reason ("NOT TESTED on Python …")."""
    try:
        os.listdir(PYENV_VERSIONS)
        pyenv = f"no {PYENV_VERSIONS}/{version}.*"
    except OSError as exc:
        pyenv = f"{PYENV_VERSIONS} not readable by uid {os.geteuid()} ({exc.strerror})"
    return f"NOT TESTED on Python {version}: {pyenv}, and no python{version} on PATH"


def python_or_skip(version: str) -> Path:
    """:func:`find_python`'s interpreter for ``version``, or skip the test saying why there is none."""
    found = find_python(version)
    if found is None:
        pytest.skip(missing_python(version))
    return found


def python_versions(*versions: str) -> list[Any]:
    """``versions`` as parameters of a test, each skipped with :func:`missing_python`'s reason when
    :func:`find_python` has no interpreter for it (a mark keeps the reason where a skip raised inside
    an async test would lose it)."""
    return [pytest.param(v, marks=pytest.mark.skipif(find_python(v) is None, reason=missing_python(v)))
            for v in versions]
