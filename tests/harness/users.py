"""Throwaway system users, for what a non-root node or a spider under ``task.run_as_user`` does.

useradd/userdel lock /etc/passwd and /etc/group: two at once fail, so a fixture that makes a user
belongs to conftest.py's SERIAL_GROUPS "system-users".
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class SystemUser:
    """A user made for one test: name, uid, gid, home directory, and ``reach``: a directory of root's
    that the user can read and enter (0755; pytest's tmp_path is 0700 root)."""

    name: str
    uid: int
    gid: int
    home: Path
    reach: Path

    def popen_options(self) -> dict[str, object]:
        """Keyword arguments for subprocess/trio process functions that run a command as this user
        (its own uid and gid, no supplementary groups of root's)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the user's HOME, USER and LOGNAME."""
        return {**base, "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name}


@contextmanager
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
