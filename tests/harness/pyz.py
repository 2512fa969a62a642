"""The session's ckagent.pyz, built once for every pytest-xdist worker (a frozen copy of the checkout,
under a file lock), and ports on 127.0.0.1 that no other test process claimed."""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

from harness.examples import REPO

BUILD_SCRIPT = REPO / "build" / "build_pyz.py"
_SOURCE_PARTS = ("ckagent", "sdk/python/src", "setup.py", "pyproject.toml", "README.md", "build")
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "lib", "bdist.*", ".cache")


def frozen_source(dest: Path) -> Path:
    """Copy what the pyz is built from (package, SDK, packaging files) to ``dest``: a stable input."""
    for part in _SOURCE_PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=_IGNORED)
        else:
            (dest / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / part)
    return dest


def build_pyz(source: Path, output: Path) -> Path:
    """Run build/build_pyz.py on ``source``; raises AssertionError with its output when it fails."""
    result = subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), "--source", str(source), "--output", str(output),
         "--lock", str(REPO / "build" / "requirements.lock")],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, f"build_pyz failed:\n{result.stdout}\n{result.stderr}"
    return output


def pyz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's ckagent.pyz and its frozen source live: the session's base temp directory,
    or under pytest-xdist the one all workers share (the parent of theirs), so it is built once."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "ckagent-pyz"


def session_pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's ckagent.pyz (built on first use, under a file lock; later calls reuse it)."""
    return session_build(tmp_path_factory, pyz_dir(tmp_path_factory), build_pyz)


def session_build(tmp_path_factory: pytest.TempPathFactory, base: Path,
                  build: Callable[[Path, Path], Path]) -> Path:
    """``base``/ckagent.pyz, made once per session for all pytest-xdist workers: the first caller runs
    ``build(source, output)`` on a fresh frozen copy of the checkout in ``base``/src, under a file lock
    the others wait on (no timeout of its own: ``build`` bounds itself); later callers reuse the file.
    ``base`` must lie in the directory the workers share (:func:`pyz_dir` or a sibling of it)."""
    base.mkdir(exist_ok=True)
    pyz = base / "ckagent.pyz"
    with (base / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not pyz.exists():
            source = base / "src"
            shutil.rmtree(source, ignore_errors=True)
            build(frozen_source(source), pyz)  # build_pyz.py writes it whole or not at all
    return pyz


PORT_CLAIMS = Path(tempfile.gettempdir()) / "ckagent-test-ports"
_claimed: list[IO[str]] = []  # the open claim files of this process: held until it exits


@atexit.register
def _release_claims() -> None:
    """Close the claim files at exit (the flocks go with them), not in the garbage collector: it
    warns for each file still open (ResourceWarning)."""
    while _claimed:
        _claimed.pop().close()


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on, and that no other test process on this machine claimed.

    bind(0) alone hands a port that was just released to the next caller: a test in another pytest-xdist
    worker could start its agent on the port of an agent this test stopped and expects to start again.
    So each port is also claimed with an flock on a file in a directory all test processes share,
    held until this process exits (a worker claims a few dozen)."""
    PORT_CLAIMS.mkdir(exist_ok=True)
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        claim = (PORT_CLAIMS / str(port)).open("w")
        try:
            fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            claim.close()
            continue
        _claimed.append(claim)
        return port
    raise RuntimeError(f"no unclaimed port after 100 tries ({PORT_CLAIMS})")
