"""A task's own ``/tmp``, ``/dev/shm`` and ``/proc``: what systemd's ``PrivateTmp=`` and
``ProtectProc=invisible`` give a service, given to each spider's task.

Every task gets a temporary directory of its own, ``<task dir>/tmp`` (the spider's, mode 0700), on the
work dir's disk (counted by the disk watch like the rest of the task's files, never the node's memory),
removed at the task's end (:func:`make_task_tmp`, :func:`remove_task_tmp`). Where the agent may, the
spider (behind its monitor) also runs in a mount namespace of its own — the levels, strongest first
(:class:`PrivacyLevel`, decided once at start by :func:`open_privacy`, which proves the level with a
real child before any task; ``task.private_tmp`` may name one):

=================  ===================================================================================
level              the task's processes get
=================  ===================================================================================
mount-namespace    the agent is root: a mount and an IPC namespace per task; ``/tmp`` and ``/var/tmp``
                   are the task's own temporary directory (bind mounts: ``TMPDIR=/tmp``), ``/dev/shm``
                   a fresh tmpfs (mode 1777, nosuid, nodev: Chromium's shared memory works), gone with
                   the task's last process; and, on Linux ≥ 5.8, a ``/proc`` of its own mounted
                   ``hidepid=invisible``: a spider sees only its own uid's processes — not other
                   spiders', not the agent's (their pids, cmdline, environ, fds)
user-namespace     the agent is not root and unprivileged user namespaces are allowed: a user
                   namespace mapping the agent's uid (and gid) to itself, holding a mount and an IPC
                   namespace with the same mounts; ``/proc`` stays the host's (a new one needs a pid
                   namespace; spiders run as the agent's uid here, which hidepid would not hide)
tmpdir             neither: ``TMPDIR=<task dir>/tmp`` alone; ``/tmp`` and ``/dev/shm`` are the host's,
                   shared with every process of the node (a program that ignores ``TMPDIR`` writes
                   there); a deep work dir makes long paths in it (a Unix socket's path is at most
                   107 bytes: Chromium's singleton socket lives in ``TMPDIR``)
=================  ===================================================================================

``TMPDIR``, ``TMP`` and ``TEMP`` are ``/tmp`` in a namespace (short: the same directory as
``<task dir>/tmp``), else ``<task dir>/tmp`` (:meth:`Privacy.tmp_env`). What a task must still see under
``/tmp`` or ``/var/tmp`` — the work dir itself when it lies there, the spiders' interpreter, the
agent's own code (the bundled SDK), ``task.private_tmp_shared`` — is attached again at the same place
in the namespace (a detached copy of the mount, taken before the cover: ``open_tree``/``move_mount``,
Linux ≥ 5.2).

How (ckagent.containment.monitor spawns the spider): at ``mount-namespace`` the monitor's child, forked
by the agent (root), runs :meth:`Privacy.preexec` before its exec: it joins the task's cgroups (fds the
agent opened), raises its oom_score_adj, unshares, mounts, and only then drops to the spider's
identity (setgroups, setresgid, setresuid: credentials changed, it is not dumpable until its exec, so
no spider can read the agent's memory it was forked with). At ``user-namespace`` the monitor is
started through a small helper run by the agent's interpreter (:data:`USERNS_HELPER`: a fresh image
holding nothing of the agent's memory) that joins the cgroups, unshares, maps, mounts and execs the
monitor. A re-adopted task keeps the namespace it was started in.

Errors: a level that cannot be had is not an error (``open_privacy`` says why in one log line); a task
whose namespace cannot be made at its spawn fails to start (OSError from the spawn: the message names
the step), since the node's level promised it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from ckagent.containment.base import SPIDER_OOM_SCORE_ADJ, ContainmentError
from ckagent.node import beneath
from ckagent.node.levels import Blocker
from ckagent.node.runas import RunAs

log = logging.getLogger(__name__)

__all__ = ["TMP_DIR", "Privacy", "PrivacyLevel", "make_task_tmp", "needed_paths", "open_privacy", "remove_task_tmp",
           "task_tmp_env"]

TMP_DIR = "tmp"
"""The task's own temporary directory, in its task dir (``TMPDIR``)."""
TMP_TARGETS = ("/tmp", "/var/tmp")
"""Where a task at a namespace level gets its own temporary directory (each that exists as a directory)."""
SHM_TARGET = "/dev/shm"
"""Where a task at a namespace level gets a fresh tmpfs."""
SHM_OPTIONS = "mode=1777"
PROBE_TIMEOUT = 20.0


class PrivacyLevel(str, Enum):
    """How private a task's ``/tmp``, ``/dev/shm`` and ``/proc`` are (see module docstring), strongest first."""

    MOUNT_NAMESPACE = "mount-namespace"
    USER_NAMESPACE = "user-namespace"
    TMPDIR = "tmpdir"

    def __str__(self) -> str:
        return self.value


def task_tmp_env(task_dir: Path, privacy: Privacy | None = None) -> dict[str, str]:
    """``TMPDIR``, ``TMP`` and ``TEMP`` of a task: ``/tmp`` in a namespace (its own), else its
    ``<task dir>/tmp``."""
    inside = privacy is not None and privacy.level is not PrivacyLevel.TMPDIR
    path = "/tmp" if inside else str(task_dir / TMP_DIR)
    return {"TMPDIR": path, "TMP": path, "TEMP": path}


def make_task_tmp(task_dir: Path, run_as: RunAs | None) -> Path:
    """Make the task's temporary directory (mode 0700, given to ``run_as`` when set). Blocking. Raises
    OSError (NotBeneath when the spider planted a link or a file at its name: never followed)."""
    fd = beneath.open_dir(task_dir)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(TMP_DIR, 0o700, dir_fd=fd)
        made = beneath.open_dir(fd, TMP_DIR)
        try:
            if run_as is not None:
                os.fchown(made, run_as.uid, run_as.gid)
            os.fchmod(made, 0o700)
        finally:
            os.close(made)
    finally:
        os.close(fd)
    return task_dir / TMP_DIR


def remove_task_tmp(task_dir: Path) -> None:
    """Remove the task's temporary directory and everything in it, by descriptors (no link followed).
    Never raises (logged)."""
    try:
        beneath.remove(task_dir, TMP_DIR)
    except OSError as exc:
        log.warning("%s: cannot remove its temporary directory: %s", task_dir.name, exc)


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        parts = platform.release().split(".")
        return (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)) >= (major, minor)
    except (IndexError, ValueError):
        return False


NS_CODE = r"""
import ctypes, os
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
AT_FDCWD, AT_RECURSIVE, OPEN_TREE_CLONE, MOVE_MOUNT_F_EMPTY_PATH = -100, 0x8000, 1, 4
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429


def ns_fail(step):
    code = ctypes.get_errno()
    return OSError(code, "private namespace: %s: %s" % (step, os.strerror(code)))


def ns_unshare(flags):
    if _libc.unshare(flags) != 0:
        raise ns_fail("unshare")


def ns_map_self(uid, gid):
    for name, text in (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as fh:
            fh.write(text)


def ns_mount(source, target, fstype, flags, data):
    if _libc.mount(source, target.encode(), fstype, flags, data) != 0:
        raise ns_fail("mount " + target)


def ns_clone(path):
    fd = _libc.syscall(SYS_OPEN_TREE, ctypes.c_int(AT_FDCWD), path.encode(),
                       ctypes.c_uint(OPEN_TREE_CLONE | os.O_CLOEXEC | AT_RECURSIVE))
    if fd < 0:
        raise ns_fail("open_tree " + path)
    return fd


def ns_attach(fd, path):
    if os.path.isdir("/proc/self/fd/%d" % fd):
        os.makedirs(path, 0o755, exist_ok=True)
    else:  # a file (a socket): its place is an empty file
        os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    if _libc.syscall(SYS_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(AT_FDCWD), path.encode(),
                     ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)) != 0:
        raise ns_fail("move_mount " + path)
    os.close(fd)


def ns_private_mounts(tmp, tmp_targets, shm, keep, shm_options, hidepid):
    # Nothing propagates back. Each of tmp_targets becomes the task's own ``tmp`` dir and ``shm`` a
    # fresh tmpfs; the paths of ``keep`` under a target are attached again at the same place (detached
    # copies taken before the cover: open_tree, then move_mount); /proc with hidepid when asked.
    ns_mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    covered = set()
    plan = []
    for target in (*tmp_targets, shm):
        real = os.path.realpath(target)
        if not os.path.isdir(target) or real in covered:
            continue
        covered.add(real)
        under = [k for k in keep if k == real or k.startswith(real.rstrip("/") + "/")]
        if real in under:
            continue  # the whole of it must stay seen
        source = ns_clone(tmp) if target != shm else None
        plan.append((real, source, [(ns_clone(k), k) for k in under if os.path.lexists(k)]))
    for real, source, copies in plan:
        if source is None:
            ns_mount(b"tmpfs", real, b"tmpfs", MS_NOSUID | MS_NODEV, shm_options.encode())
        elif _libc.syscall(SYS_MOVE_MOUNT, ctypes.c_int(source), b"", ctypes.c_int(AT_FDCWD), real.encode(),
                           ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)) != 0:
            raise ns_fail("move_mount " + real)
        else:
            os.close(source)
        for fd, path in copies:
            ns_attach(fd, path)
    if hidepid:
        ns_mount(b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=invisible")
"""
"""The namespace steps, as source: run in the agent's forked child (:meth:`Privacy.preexec`, compiled
once here) and in :data:`USERNS_HELPER` (a fresh interpreter). Standard library only."""

_NS: dict[str, Any] = {}
exec(compile(NS_CODE, "<ckagent.containment.private NS_CODE>", "exec"), _NS)  # (our own constant)


@dataclass(frozen=True)
class Privacy:
    """The node's level (see module docstring): ``level``, ``hidepid`` (a ``/proc`` of the task's own
    with ``hidepid=invisible``), ``details`` one line for the log and /status, ``passed_over`` why a
    stronger level is not had ("" when none is), ``keep`` (below)."""

    level: PrivacyLevel
    hidepid: bool = False
    details: str = ""
    passed_over: str = ""
    keep: tuple[str, ...] = ()
    """Paths under a tmpfs target the tasks need (the work dir in /tmp): attached again at the same place."""

    def to_json(self) -> dict[str, object]:
        """``{"level", "hidepid", "details"}`` for /status and registration."""
        return {"level": self.level.value, "hidepid": self.hidepid, "details": self.details}

    def tmp_env(self, task_dir: Path) -> dict[str, str]:
        """``TMPDIR``, ``TMP`` and ``TEMP`` of a task at this level (:func:`task_tmp_env`)."""
        return task_tmp_env(task_dir, self)

    def preexec(self, join_fds: list[int], run_as: RunAs | None, tmp: Path,
                oom_score_adj: int | None = SPIDER_OOM_SCORE_ADJ) -> Callable[[], None]:
        """The ``preexec_fn`` of a spider's monitor at ``mount-namespace`` (the agent is root; Popen is
        given no ``user``/``group``: this drops to ``run_as`` itself, last). Runs in the forked child:
        join the task's cgroups, raise oom_score_adj, unshare a mount and an IPC namespace, mount (``tmp``
        the task's own temporary directory), drop privileges. Raises OSError naming the step (the spawn
        fails)."""
        hidepid, keep, source = self.hidepid, list(self.keep), str(tmp)
        groups = list(run_as.groups) if run_as is not None else None
        ids = (run_as.uid, run_as.gid) if run_as is not None else None
        unshare, mounts = _NS["ns_unshare"], _NS["ns_private_mounts"]
        flags = _NS["CLONE_NEWNS"] | _NS["CLONE_NEWIPC"]

        def preexec() -> None:
            for fd in join_fds:
                os.write(fd, b"0")
            if oom_score_adj is not None:
                with contextlib.suppress(OSError):
                    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
                    try:
                        os.write(fd, str(oom_score_adj).encode())
                    finally:
                        os.close(fd)
            unshare(flags)
            mounts(source, TMP_TARGETS, SHM_TARGET, keep, SHM_OPTIONS, hidepid)
            if ids is not None:
                uid, gid = ids
                os.setgroups(groups or [])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)

        return preexec

    def wrap(self, argv: list[str], join: list[Path], tmp: Path, oom_score_adj: int = SPIDER_OOM_SCORE_ADJ
             ) -> list[str]:
        """``argv`` started through :data:`USERNS_HELPER` at ``user-namespace``: it joins ``join`` (the
        task's ``cgroup.procs`` files), raises oom_score_adj, makes the namespaces (``tmp`` the task's own
        temporary directory) and execs ``argv``."""
        config = json.dumps({"join": [str(p) for p in join], "oom": oom_score_adj, "tmp": str(tmp),
                             "targets": list(TMP_TARGETS), "shm": SHM_TARGET, "options": SHM_OPTIONS,
                             "keep": list(self.keep)})
        return [sys.executable, "-I", "-S", "-c", USERNS_HELPER, config, *argv]


USERNS_HELPER = NS_CODE + r"""
import json, sys
config = json.loads(sys.argv[1])
for path in config["join"]:
    try:
        with open(path, "w") as fh:
            fh.write("0")
    except OSError as exc:
        sys.stderr.write("ckagent: cannot join the task cgroup %s: %s\n" % (os.path.dirname(path), exc))
        sys.exit(126)
try:
    with open("/proc/self/oom_score_adj", "w") as fh:
        fh.write(str(config["oom"]))
except OSError:
    pass
try:
    uid, gid = os.getuid(), os.getgid()
    ns_unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC)
    ns_map_self(uid, gid)
    ns_private_mounts(config["tmp"], config["targets"], config["shm"], config["keep"], config["options"], False)
except OSError as exc:
    sys.stderr.write("ckagent: cannot make the task's private namespace: %s\n" % exc)
    sys.exit(126)
os.execv(sys.argv[2], sys.argv[2:])
"""
"""The helper that starts a monitor at ``user-namespace`` (run as ``python -I -S -c``; a fresh image)."""


_PROBE = ('cat /proc/self/mounts; [ -e /tmp/.ckagent-probe ] || echo "MISSING the task\'s /tmp"; '
          'for d in "$@"; do [ -e "$d" ] || echo "MISSING $d"; done')


def _probe(privacy: Privacy, scratch: Path) -> str | None:
    """Start one child as a task's monitor would be at ``privacy``'s level, with a temporary directory
    made in ``scratch``; None when it worked (its /tmp is that directory, its /dev/shm a tmpfs — and
    its /proc hidepid when asked —, the ``keep`` paths still there), else why not. Blocking."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".private-probe-", dir=scratch))
    except OSError as exc:
        return f"cannot make a directory in {scratch}: {exc.strerror or exc}"
    try:
        (tmp / ".ckagent-probe").touch()
        argv = ["/bin/sh", "-c", _PROBE, "probe", *privacy.keep]
        options: dict[str, object] = {}
        if privacy.level is PrivacyLevel.MOUNT_NAMESPACE:
            options["preexec_fn"] = privacy.preexec([], None, tmp, None)
        else:
            argv = privacy.wrap(argv, [], tmp)
        try:
            done = subprocess.run(argv, capture_output=True, timeout=PROBE_TIMEOUT, check=False,
                                  stdin=subprocess.DEVNULL, cwd="/", env={"PATH": "/usr/bin:/bin"},
                                  **options)  # type: ignore[call-overload]
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return tail[0][:300]
    mounts: dict[str, tuple[str, str]] = {}
    for line in done.stdout.decode(errors="replace").splitlines():
        if line.startswith("MISSING "):
            return f"{line[8:]} is not seen in the namespace"
        fields = line.split()
        if len(fields) >= 4:
            mounts[fields[1]] = (fields[2], fields[3])
    real = os.path.realpath(SHM_TARGET)
    if os.path.isdir(SHM_TARGET) and real not in privacy.keep and mounts.get(real, ("", ""))[0] != "tmpfs":
        return f"{SHM_TARGET} is not the namespace's tmpfs"
    options_of_proc = mounts.get("/proc", ("", ""))[1].split(",")
    if privacy.hidepid and not {"hidepid=invisible", "hidepid=2"} & set(options_of_proc):
        return "/proc is not mounted with hidepid=invisible"
    return None


def _user_namespaces_allowed() -> str | None:
    """Why unprivileged user namespaces cannot be had here (None: they may)."""
    for path, bad in (("/proc/sys/user/max_user_namespaces", "0"),
                      ("/proc/sys/kernel/unprivileged_userns_clone", "0")):
        with contextlib.suppress(OSError):
            if Path(path).read_text().strip() == bad:
                return f"{path} is {bad}"
    return None


def needed_paths(work_dir: Path, python: str | Path) -> tuple[Path, ...]:
    """What every spider needs to see, wherever it lies (for :func:`open_privacy`'s ``keep``): the work
    dir, the prefix of the spiders' interpreter (its venvs link to it), the agent's own code (the
    bundled SDK their .pth names lies in it). Blocking (resolves paths)."""
    prefix = Path(os.path.realpath(python)).parent.parent
    return (work_dir, prefix, Path(__file__).resolve().parents[2])


def open_privacy(scratch: Path, keep: tuple[Path, ...] = (), setting: str = "auto", euid: int | None = None) -> Privacy:
    """The node's privacy level (``setting``: ``task.private_tmp``, ``auto`` or a level's text), proven
    by one child each (see module docstring); one log line says which, and why a stronger one is not
    had. ``scratch``: a directory of the agent's where the proof makes a temporary directory (the work
    dir). ``keep``: the paths tasks need that may lie under a covered target (the work dir, the spiders'
    interpreter, ``task.private_tmp_shared``; each resolved, missing ones left out): they stay the
    host's in the namespace. Blocking (a few short processes). Raises ContainmentError (blocker
    FAILED) when a named level cannot be had here; ``auto`` never raises."""
    euid = os.geteuid() if euid is None else euid
    kept = tuple(sorted({os.path.realpath(path) for path in keep if os.path.exists(path)}))
    forced = None if setting == "auto" else PrivacyLevel(setting)
    why: list[str] = []
    candidates: list[Privacy] = []
    if euid == 0:
        if _kernel_at_least(5, 8):
            candidates.append(Privacy(PrivacyLevel.MOUNT_NAMESPACE, True, keep=kept))
        else:
            why.append(f"hidepid: Linux {platform.release()} has no per-mount /proc options (5.8 and later do)")
        candidates.append(Privacy(PrivacyLevel.MOUNT_NAMESPACE, False, keep=kept))
    else:
        why.append("mount-namespace: the agent is not root")
        blocked = _user_namespaces_allowed()
        if blocked is None:
            candidates.append(Privacy(PrivacyLevel.USER_NAMESPACE, keep=kept))
        else:
            why.append(f"user-namespace: {blocked}")
    if forced is not None:
        why.append(f"task.private_tmp is {forced}")
        candidates = [c for c in candidates if c.level is forced]
    for candidate in candidates:
        problem = _probe(candidate, scratch)
        if problem is None:
            found = Privacy(candidate.level, candidate.hidepid, _details(candidate), "; ".join(why), kept)
            _log(found)
            return found
        why.append(f"{candidate.level}{' with hidepid' if candidate.hidepid else ''}: {problem}")
    if forced not in (None, PrivacyLevel.TMPDIR):
        raise ContainmentError(f"task.private_tmp is {forced}, which this node cannot give: {'; '.join(why)}; "
                               "set it to auto (or tmpdir)", Blocker.FAILED)
    found = Privacy(PrivacyLevel.TMPDIR, False, _details(Privacy(PrivacyLevel.TMPDIR)), "; ".join(why))
    _log(found)
    return found


def _details(privacy: Privacy) -> str:
    if privacy.level is PrivacyLevel.TMPDIR:
        return ("each task its own TMPDIR; /tmp, /var/tmp and /dev/shm are the host's, shared by every task "
                "(a program that ignores TMPDIR writes there)")
    proc = ("a /proc of its own with hidepid=invisible (a spider sees its own uid's processes only)"
            if privacy.hidepid else "the host's /proc")
    how = "a mount namespace" if privacy.level is PrivacyLevel.MOUNT_NAMESPACE else "a user and mount namespace"
    return f"each task in {how} of its own: its own tmpfs on /tmp, /var/tmp and /dev/shm, {proc}"


def _log(privacy: Privacy) -> None:
    log.info("private tmp: %s — %s", privacy.level, privacy.details)
    if privacy.passed_over:
        log.info("private tmp: not stronger because %s", privacy.passed_over)

