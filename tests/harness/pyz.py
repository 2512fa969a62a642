"""The session's ckagent.pyz, built once for every pytest-xdist worker (a frozen copy of the checkout,
under a file lock), and ports on 127.0.0.1 that no other test process claimed."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

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
"""The directory of port claims every test process on this machine shares, whoever runs it: mode 1777
(sticky, as /tmp: a claim file can be removed only by its owner), each claim a file named by the port,
mode 0444, flocked through a read-only descriptor (so any user can lock a file another user made)."""
_claimed: list[int] = []  # the claim files' descriptors of this process: held (with their flocks) until it exits


@atexit.register
def _release_claims() -> None:
    """Close the claim files at exit (the flocks go with them)."""
    while _claimed:
        os.close(_claimed.pop())


@functools.cache
def claims_dir() -> Path:
    """Where this process claims ports: :data:`PORT_CLAIMS`, made mode 1777 by the first test process
    that needs it, when it can be trusted: a real directory (not a symlink), mode 1777 and owned by
    root or this user (made so when this user owns it). Else (another user made it, or made it without
    the sticky bit, as older suites did) a directory of this user's own beside it: its claims then guard
    only against this user's test processes, and this says so on stderr (shown with a failing test)."""
    uid = os.geteuid()
    with contextlib.suppress(FileExistsError):
        PORT_CLAIMS.mkdir(mode=0o700)  # (its mode is set below: mkdir's is cut by the umask)
    st = PORT_CLAIMS.lstat()
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) != 0o1777:
        PORT_CLAIMS.chmod(0o1777)
        st = PORT_CLAIMS.lstat()
    shared = stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o1777 and st.st_uid in (uid, 0)
    if shared:
        return PORT_CLAIMS
    own = PORT_CLAIMS.with_name(f"{PORT_CLAIMS.name}-{uid}")
    own.mkdir(mode=0o700, exist_ok=True)
    print(f"port claims: {PORT_CLAIMS} is not a sticky directory of root's or ours; claiming in {own}",
          file=sys.stderr)
    return own


def _claim(directory: Path, port: int) -> int | None:
    """An flocked descriptor of ``directory``/``port`` (made mode 0444 when missing), or None when
    another process holds it or it cannot be opened (another user's file this one may not read, a
    symlink)."""
    path, flags = directory / str(port), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        try:  # (not O_CREAT on a file that exists: protected_regular refuses it for another user's file)
            fd = os.open(path, flags)
        except FileNotFoundError:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o444)
    except OSError:  # (EEXIST: another process made it just now, and holds it)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # (a FIFO or device someone planted: not a claim)
            raise OSError(f"{path} is not a regular file")
        if st.st_uid == os.geteuid():
            os.fchmod(fd, 0o444)  # (whatever this process's umask made of it: other users must open it)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on, and that no other test process on this machine claimed.

    bind(0) alone hands a port that was just released to the next caller: a test in another pytest-xdist
    worker (or another user's suite) could start its agent on the port of an agent this test stopped and
    expects to start again. So each port is also claimed with an flock on a file in a directory all test
    processes share (:func:`claims_dir`), held until this process exits (a worker claims a few dozen)."""
    directory = claims_dir()
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        fd = _claim(directory, port)
        if fd is None:
            continue
        _claimed.append(fd)
        return port
    raise RuntimeError(f"no unclaimed port after 100 tries ({directory})")
