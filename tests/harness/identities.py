"""Spiders under uids of their own (the ``spider-uids`` identity level, ckagent.node.identity) in tests.

An agent running as root gives each spider a uid of its own when every such uid can reach the work dir
and run the spiders' interpreter. pytest's ``tmp_path`` is root's alone (0700 from /tmp down) and the
suite's interpreter may live under /root (pyenv): :func:`spider_reachable` opens the test's own
directories for searching (o+x, below the temp directory only: nothing of the machine's is changed) and
:func:`spider_python` names an interpreter every uid can run, so the agents of the tests get the
default level a node would. :func:`process_ids` reads who a process runs as from /proc;
:func:`id_files` writes passwd/group files naming chosen ids.
"""

from __future__ import annotations

import functools
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["NOBODY_UID", "id_files", "process_ids", "spider_python", "spider_reachable", "spider_uid_env"]

NOBODY_UID = 65534
"""A uid that owns nothing of the tests': the probe of :func:`spider_python` runs as it."""


def spider_reachable(path: Path) -> Path:
    """``path`` (and every existing directory above it, up to the machine's temp directory) made
    searchable by every user (o+x, not listable), as root; nothing outside the temp directory is
    changed. Returns ``path``. Blocking (a few chmods)."""
    if os.geteuid() != 0:
        return path
    temp = Path(tempfile.gettempdir()).resolve()
    probe = path.resolve() if path.exists() else path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    probe = probe.resolve()
    for directory in (probe, *probe.parents):
        if directory == temp or not directory.is_relative_to(temp):
            break
        mode = directory.stat().st_mode
        if stat.S_ISDIR(mode) and not mode & 0o001:
            directory.chmod(stat.S_IMODE(mode) | 0o001)
    return path


@functools.lru_cache(maxsize=1)
def spider_python() -> str:
    """An interpreter every uid can run: the suite's own when it can (as ``nobody``), else
    /usr/bin/python3 (the suite's may live under /root). Not root: the suite's own."""
    if os.geteuid() != 0:
        return sys.executable
    for candidate in (sys.executable, "/usr/bin/python3"):
        try:
            done = subprocess.run([candidate, "-I", "-S", "-c", "pass"], user=NOBODY_UID, group=NOBODY_UID,
                                  extra_groups=[], capture_output=True, timeout=30, check=False, cwd="/")
        except OSError:
            continue
        if done.returncode == 0:
            return candidate
    return sys.executable


def spider_uid_env(work_dir: Path) -> dict[str, str]:
    """The AGENT_* settings that give an agent with ``work_dir`` the spider-uids level when this
    process is root (``work_dir`` made reachable: :func:`spider_reachable`): ``deps.python`` when the
    suite's interpreter is not every user's. Empty when not root."""
    if os.geteuid() != 0:
        return {}
    spider_reachable(work_dir)
    python = spider_python()
    return {} if python == sys.executable else {"AGENT_DEPS_PYTHON": python}


def process_ids(pid: int) -> tuple[int, int, tuple[int, ...]]:
    """``(real uid, real gid, supplementary groups)`` of a process, from ``/proc/<pid>/status``.
    Raises OSError when it is gone."""
    uid = gid = -1
    groups: tuple[int, ...] = ()
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key == "Uid":
                uid = int(value.split()[0])
            elif key == "Gid":
                gid = int(value.split()[0])
            elif key == "Groups":
                groups = tuple(int(g) for g in value.split())
    return uid, gid, groups


def id_files(directory: Path, uids: list[int], gids: list[int]) -> tuple[Path, Path]:
    """A passwd and a group file (in ``directory``) naming ``uids`` and ``gids`` besides root."""
    passwd, group = directory / "passwd", directory / "group"
    passwd.write_text("root:x:0:0:root:/root:/bin/sh\n" + "".join(
        f"user{uid}:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin\n" for uid in uids))
    group.write_text("root:x:0:\n" + "".join(f"group{gid}:x:{gid}:\n" for gid in gids))
    return passwd, group
