"""Other local users (as root only): ``nobody`` and a Python it can run, for tests of what one user's
files mean to another's process (:func:`run_as`, :func:`world_directory`); and a throwaway system user
with a home of its own for one test (:func:`throwaway_user`): a non-root node, a spider under
``task.run_as_user`` — or, for a test that needs only some user without root, the suite's own user
when it is not root (:func:`unprivileged_user`). useradd/userdel lock /etc/passwd and /etc/group: two at once fail, so a fixture
that makes a user belongs to conftest.py's SERIAL_GROUPS "system-users".
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

__all__ = ["NOBODY", "OTHER_USER_PYTHON", "SystemUser", "another_user_cannot", "other_user_prelude", "run_as", "searchable_directory",
           "throwaway_user", "unprivileged_user", "world_directory"]

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


_PSUTIL_DIR = str(Path(psutil.__file__).parent.parent)


def other_user_prelude() -> str:
    """The first line of a script :data:`OTHER_USER_PYTHON` runs: this repository's ``ckagent`` and the
    suite's psutil importable (see :func:`run_as`)."""
    return f"import sys; sys.path.insert(0, {str(REPO)!r}); sys.path.append({_PSUTIL_DIR!r})\n"


def run_as(uid: int, code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run Python ``code`` (``sys.argv[1:]`` = ``args``) as ``uid`` (its group the same number),
    with this repository's ``ckagent`` importable (only modules that need the standard library
    and psutil alone: that Python has no third-party packages; psutil comes from the suite's own
    environment, an abi3 build that any CPython 3 loads)."""
    prelude = other_user_prelude()
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


@contextlib.contextmanager
def searchable_directory() -> Iterator[Path]:
    """A fresh directory of root's under /tmp that every user can enter but not list (0711), removed at
    the end: a work dir other uids must reach. pytest's ``tmp_path`` is not one even made searchable:
    every pytest session that starts on the machine sets ``/tmp/pytest-of-<user>`` back to 0700."""
    path = Path(tempfile.mkdtemp(prefix="ck-reach-", dir="/tmp"))
    try:
        path.chmod(0o711)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class SystemUser:
    """A user made for one test: name, uid, gid, home directory, and ``reach``: a directory of root's
    that the user can read and enter (0755; pytest's tmp_path is 0700 root)."""

    name: str
    uid: int
    gid: int
    home: Path
    reach: Path
    current: bool = False
    """The user this process runs as (not root): commands run as it need no change of identity."""

    def popen_options(self) -> dict[str, object]:
        """Keyword arguments for subprocess/trio process functions that run a command as this user
        (its own uid and gid, no supplementary groups of root's; nothing for the current user)."""
        if self.current:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the user's HOME, USER and LOGNAME."""
        return {**base, "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name}


@contextlib.contextmanager
def throwaway_user(prefix: str = "ck") -> Iterator[SystemUser]:
    """A new system user with a home directory, removed (home and ``reach`` too) afterwards. Skips the
    test when this process is not root or useradd is missing or fails (blocking)."""
    if os.geteuid() != 0:
        pytest.skip(f"making a throwaway user needs root; this test runs as uid {os.geteuid()}")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel not available to create a throwaway user")
    name = prefix + uuid.uuid4().hex[:10]
    created = subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], capture_output=True, text=True, check=False)
    if created.returncode != 0:
        pytest.skip(f"useradd failed: {created.stderr.strip()}")
    reach = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    try:
        reach.chmod(0o755)
        pw = pwd.getpwnam(name)
        yield SystemUser(name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir), reach)
    finally:
        shutil.rmtree(reach, ignore_errors=True)
        subprocess.run(["userdel", "-r", name], capture_output=True, check=False)


@contextlib.contextmanager
def unprivileged_user(prefix: str = "ck") -> Iterator[SystemUser]:
    """A user without root: as root a :func:`throwaway_user`; otherwise the user this process runs as
    (already what the test needs), with a fresh ``reach`` directory removed afterwards (blocking)."""
    if os.geteuid() == 0:
        with throwaway_user(prefix) as user:
            yield user
        return
    pw = pwd.getpwuid(os.geteuid())
    reach = Path(tempfile.mkdtemp(prefix=f"{pw.pw_name}-"))
    try:
        reach.chmod(0o755)
        yield SystemUser(pw.pw_name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir), reach, current=True)
    finally:
        shutil.rmtree(reach, ignore_errors=True)
