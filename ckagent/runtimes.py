"""What this node can run: Python, uv, node, npm, Chromium and chromedriver, with versions.

Reported to the master at registration and in heartbeats (``runtimes``) so it can schedule
accordingly. Detection runs subprocesses (``--version``): call :func:`detect_runtimes` through
``trio.to_thread``. A tool that is missing is simply absent from the answer.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

_VERSION = re.compile(r"(\d+\.\d+(?:\.\d+)*)")

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def _version_of(argv: list[str], timeout: float = 5.0) -> str | None:
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _VERSION.search((proc.stdout or proc.stderr).decode("utf-8", errors="replace"))
    return match.group(1) if match else None


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary on PATH, or None."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def detect_runtimes(uv_path: Path | None = None) -> dict[str, Any]:
    """Scan the node (blocking, a few subprocesses). Keys: python, uv, node, npm, chromium, chromedriver.

    Each value is ``{"version": str, "path": str}``; ``python`` also lists other interpreters
    found on PATH (``python3.X``) under ``versions``.
    """
    from ckagent.deps import find_uv  # local import: deps imports process/trio, keep this module light

    found: dict[str, Any] = {
        "python": {"version": platform.python_version(), "path": sys.executable, "versions": []},
    }
    versions = set()
    for minor in range(8, 15):
        path = shutil.which(f"python3.{minor}")
        if path:
            versions.add(f"3.{minor}")
    found["python"]["versions"] = sorted(versions, key=lambda v: int(v.split(".")[1]))
    tools: dict[str, str | None] = {
        "uv": find_uv(uv_path),
        "node": shutil.which("node"),
        "npm": shutil.which("npm"),
        "chromium": find_chromium(),
        "chromedriver": shutil.which("chromedriver"),
    }
    for name, path in tools.items():
        if path is None:
            continue
        version = _version_of([path, "--version"])
        if version is not None:
            found[name] = {"version": version, "path": path}
    return found
