"""Directories in the machine's temp directory that one user's test processes share across runs.

The temp directory is shared by every user: a fixed name there (``/tmp/ckagent-x``) made by root's
suite is unwritable for another user's, and one another user made first is not to be trusted. So each
user gets a directory of its own, made private; one that is not this user's private directory (a
squatter's, a symlink) is left alone and a fresh one is used instead.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["user_temp_dir"]


def user_temp_dir(name: str) -> Path:
    """``<tempdir>/<name>-<uid>``, made mode 0700 if missing, when it is a directory (not a symlink)
    owned by this user and reachable by no one else; else a new private ``<name>-<uid>-*`` directory
    (``tempfile.mkdtemp``: this process's only). Blocking (a few system calls); raises OSError only
    when the temp directory is not writable."""
    uid = os.geteuid()
    path = Path(tempfile.gettempdir()) / f"{name}-{uid}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
        return path
    return Path(tempfile.mkdtemp(prefix=f"{name}-{uid}-"))
