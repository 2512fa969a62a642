"""Spiders under uids of their own (the ``spider-uids`` identity level, ckagent.node.identity) in tests.

An agent running as root gives each spider a uid of its own when every such uid can reach the work dir
and run the spiders' interpreter. pytest's ``tmp_path`` is root's alone (0700 from /tmp down) and the
suite's interpreter may live under /root (pyenv): :func:`spider_reachable` opens the test's own
directories for searching (o+x, below the temp directory only: nothing of the machine's is changed) and
:func:`spider_python` names an interpreter every uid can run (:func:`spider_writable`: a directory
a spider of any uid may write its report in), so the agents of the tests get the
default level a node would. pytest's own temporary root (``/tmp/pytest-of-root``) is set back to 0700
by every pytest session that starts on the machine — mid-test, for a suite beside another — so a root
session keeps its temporary files below one that stays searchable (:func:`reachable_basetemp`, set by
conftest.py). :func:`process_ids` reads who a process runs as from /proc;
:func:`id_files` writes passwd/group files naming chosen ids.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["DEFAULT_IDENTITY", "NOBODY_UID", "assert_default_identity", "chromium_sandbox_expected", "id_files", "process_ids", "reachable_basetemp", "runs_as",
           "spider_python", "spider_reachable", "spider_uid_env", "spider_writable", "uid_claims_dir"]

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


KEEP_SESSIONS = 3
"""Sessions' temporary dirs kept below :func:`reachable_basetemp`'s root (as pytest keeps 3)."""
_HELD: list[int] = []  # the lock of this session's dir, held (open) for the life of the process


def reachable_basetemp(name: str = "ckagent-tests") -> Path:
    """A fresh temporary root for this pytest session (its ``--basetemp``), searchable by every uid:
    ``<tempdir>/<name>-<uid>/pytest-*/tmp`` (0711 above it, root's: listable by no one else). The session holds a
    lock on it while it runs; older sessions' dirs whose lock no one holds are removed, keeping the
    newest :data:`KEEP_SESSIONS`. Blocking (a few files); raises OSError when the temp dir is not
    writable."""
    root = Path(tempfile.gettempdir()) / f"{name}-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o711)
    st = root.lstat()
    if not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()):  # a squatter's: one of our own instead
        root = Path(tempfile.mkdtemp(prefix=f"{name}-{os.geteuid()}-"))
    root.chmod(0o711)
    session = Path(tempfile.mkdtemp(prefix="pytest-", dir=root))
    session.chmod(0o711)
    fd = os.open(session / ".lock", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _HELD.append(fd)
    older = sorted((p for p in root.iterdir() if p.name.startswith("pytest-") and p != session),
                   key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in older[KEEP_SESSIONS - 1:]:
        _remove_unless_live(stale)
    return session / "tmp"  # (pytest empties and makes the basetemp itself: the lock stays beside it)


def _remove_unless_live(path: Path) -> None:
    """Remove a session's dir unless its session still runs (holds its lock)."""
    try:
        fd = os.open(path / ".lock", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        fd = -1  # no lock file: an interrupted start, or not ours
    try:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(path, ignore_errors=True)
    except BlockingIOError:
        pass
    finally:
        if fd >= 0:
            os.close(fd)


def spider_writable(directory: Path) -> Path:
    """``directory`` (made if missing) where a spider under any uid may create files, as in /tmp (mode
    1777: sticky, so one uid cannot remove another's files); reachable (:func:`spider_reachable`).
    For a test whose spider reports to a file the test reads. Returns ``directory``. Blocking."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o1777)
    return spider_reachable(directory)


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
    suite's interpreter is not every user's; ``task.uid_claims`` a record of claimed uids of this work
    dir's own (:func:`uid_claims_dir`: never the host's). Empty when not root."""
    if os.geteuid() != 0:
        return {}
    spider_reachable(work_dir)
    python = spider_python()
    claims = {"AGENT_TASK_UID_CLAIMS": str(uid_claims_dir(work_dir))}
    return claims if python == sys.executable else {"AGENT_DEPS_PYTHON": python, **claims}


def uid_claims_dir(work_dir: Path) -> Path:
    """The record of claimed uids (``task.uid_claims``) a test agent or exec run with ``work_dir`` uses:
    inside the work dir and its own (nothing beside it: tests check what a run leaves outside its work
    dir), so that neither the host's record nor another run's moves which uids it hands out (tests of
    agents sharing one: tests/test_uidclaims.py)."""
    return work_dir / ".uid-claims"


DEFAULT_IDENTITY = "spider-uids" if os.geteuid() == 0 else "agent-user"
"""The identity level a test agent made by ``harness.agent_settings`` gets: a uid per spider as root
(:func:`spider_uid_env`), the agent's own uid as a plain user."""

_RUNS_AS = re.compile(r"runs as (root|the agent|\S+) \(uid (\d+)(?:, gid (\d+))?; identity ([a-z-]+)\)")


def runs_as(log: str) -> tuple[str, int, str]:
    """``(name, uid, identity level)`` from a task log's line saying whom its spider ran as
    (``runs as ck-61184 (uid 61184, gid 61184; identity spider-uids)``); AssertionError (with the log's
    tail) when the log has no such line, or more than one."""
    found = {m.group(0): m for m in _RUNS_AS.finditer(log)}
    assert len(found) == 1, f"no single 'runs as' line in the task log: {list(found)}\n{log[-2000:]}"
    [match] = found.values()
    return match.group(1), int(match.group(2)), match.group(4)


def assert_default_identity(log: str) -> int:
    """Assert that a task's log says its spider ran at :data:`DEFAULT_IDENTITY` — as root, under a uid of
    its own (``ck-<uid>``, not 0); returns that uid."""
    name, uid, level = runs_as(log)
    assert level == DEFAULT_IDENTITY, (name, uid, level, log[-2000:])
    if os.geteuid() == 0:
        assert uid != 0 and name == f"ck-{uid}", (name, uid, level)
    return uid


@functools.lru_cache(maxsize=1)
def chromium_sandbox_expected() -> bool:
    """Whether a test agent's spiders (:data:`DEFAULT_IDENTITY`) get Chromium's own sandbox here
    (``CK_CHROMIUM_SANDBOX=1``): they are not root and an unprivileged process (``nobody`` as root, this
    user otherwise) may make a user, pid and network namespace — asked of the kernel by util-linux's
    ``unshare``, as the agent asks (ckagent.code.browsers)."""
    unshare = shutil.which("unshare", path="/usr/bin:/bin")
    if DEFAULT_IDENTITY == "root" or unshare is None:
        return False
    ids: dict[str, object] = ({"user": NOBODY_UID, "group": NOBODY_UID, "extra_groups": []}
                              if os.geteuid() == 0 else {})
    done = subprocess.run([unshare, "--user", "--pid", "--net", "--fork", "true"], capture_output=True, timeout=30,
                          check=False, cwd="/", **ids)  # type: ignore[call-overload]
    return done.returncode == 0


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
