"""Who may reach what in the agent's work dir: the agent's own files unreadable to every spider.

A spider reaches only its own directories below the work dir (each its uid's, mode 0700: its task dir,
working copy, data and home dirs). So where spiders run under uids of their own (the agent is root and
``task.run_as_user`` is not root), the work dir and the folders holding the spiders' dirs are
**traversable only** (0711: a spider may pass through them to its own dir, not list them); everything
else the agent keeps there is its own — its state store (``state.db`` and its WAL), the egress
proxy's key, its lock, its node id, its caches — mode 0600 (files) or 0700 (folders). Where spiders
run as the agent's own uid (a plain user's agent, ``task.run_as_user: root``) no mode can keep them
out (docs/operations.md, "Who a spider runs as"): the work dir is 0700, the agent's alone.

======================  ====================================  =====================================
entry                   spiders under uids of their own       spiders as the agent's uid
======================  ====================================  =====================================
work dir                0711                                  0700
tasks/ spider-data/     0711                                  0700
spider-home/ spiders/
spiders/.runs/
a task's, a spider's    0700 (its owner's: the spider's)      0700
dir in them
spiders/<spider>/       0700 (code versions: the agent's)     0700
envs/ builder-home/     left as ckagent.code.builder makes them (environments: root's, a-w; caches and
                        the builder's home: the builder's, 0700)
any other file          0600                                  0600
any other folder        0700                                  0700
the config file         0600 when the agent owns it (it may hold the registration token); else a
                        warning (ckagent.node.preflight)
======================  ====================================  =====================================

:func:`seal_work_dir` applies it at every start (a node upgraded from an agent that left 0755 folders
and 0644 files is fixed once, one log line saying what changed), making the folders of ``REACHED`` and
``spiders/.runs`` when missing (a fresh node's: made later, they had the umask's 0755); the dirs made in them
later are made 0700 where they are made (:data:`PRIVATE_DIR_MODE`). Nothing is followed (every change by
descriptor, symlinks left alone) and nothing is removed. Blocking (a few syscalls); never raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from ckagent.node import beneath

__all__ = ["AGENT_OWN_MODES", "PRIVATE_DIR_MODE", "REACHED", "seal_work_dir", "spiders_apart"]

log = logging.getLogger(__name__)

REACHED = ("tasks", "spider-data", "spider-home", "spiders")
"""The work dir's folders that hold the spiders' own dirs (traversable where spiders have their own uid)."""
RUNS = ".runs"
"""The folder of working copies in ``spiders/`` (traversable too)."""
LEFT = ("envs", "builder-home")
"""The builder's (ckagent.code.builder): left as it makes them."""
AGENT_OWN_MODES = (0o600, 0o700)
"""(file, folder) modes of the agent's own entries."""
PRIVATE_DIR_MODE = 0o700
"""The mode a task's, a spider's or a working copy's dir (and a spider's code versions' folder) is made with:
its owner's alone from the start, whatever the umask (the start's seal fixes only what exists then)."""


def spiders_apart(euid: int, run_as_user: str | None) -> bool:
    """Spiders run under a uid other than the agent's: the agent is root and ``task.run_as_user`` is
    unset (a uid per spider) or names another user than root."""
    return euid == 0 and run_as_user not in ("root", "0")


def seal_work_dir(work_dir: Path, *, apart: bool, config_file: Path | None = None) -> list[str]:
    """Give the work dir and what lies in it the modes of the module docstring's table (``apart``:
    spiders run under uids of their own), and the agent's own config file 0600. Returns what changed
    ("path mode→mode"), also said in one log line. Never raises (what cannot be changed is logged)."""
    reached = 0o711 if apart else 0o700
    changed: list[str] = []

    def give(fd: int, name: str, shown: str, mode: int) -> None:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) or stat.S_IMODE(st.st_mode) == mode:
                return
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                try:
                    os.fchmod(sub, mode)
                finally:
                    os.close(sub)
            elif stat.S_ISREG(st.st_mode):
                _fchmod_file(fd, name, mode)
            else:
                return
            changed.append(f"{shown} {stat.S_IMODE(st.st_mode):04o}→{mode:04o}")
        except OSError as exc:
            log.warning("work dir: cannot set %s to mode %04o: %s", shown, mode, exc.strerror or exc)

    try:
        top = beneath.open_top(work_dir)
    except OSError as exc:
        log.warning("work dir: cannot look at %s: %s", work_dir, exc.strerror or exc)
        return changed
    try:
        mode = stat.S_IMODE(os.fstat(top).st_mode)
        if mode != reached:
            os.fchmod(top, reached)
            changed.append(f"{work_dir} {mode:04o}→{reached:04o}")
        _make_reached(top, reached)
        with os.scandir(top) as entries:
            names = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
        for name, is_dir in names:
            if name in LEFT:
                continue
            if name in REACHED and is_dir:
                give(top, name, name, reached)
            else:
                give(top, name, name, AGENT_OWN_MODES[1] if is_dir else AGENT_OWN_MODES[0])
        for folder in REACHED:  # what lies in them: each task's, each spider's, each working copy's dir
            with contextlib.suppress(OSError):
                fd = beneath.open_dir(top, folder)
                try:
                    with os.scandir(fd) as entries:
                        found = [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]
                    for name in found:
                        give(fd, name, f"{folder}/{name}", reached if (folder, name) == ("spiders", RUNS) else 0o700)
                    if folder == "spiders" and RUNS in found:
                        runs = beneath.open_dir(fd, RUNS)
                        try:
                            with os.scandir(runs) as entries:
                                copies = [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]
                            for name in copies:
                                give(runs, name, f"spiders/{RUNS}/{name}", 0o700)
                        finally:
                            os.close(runs)
                finally:
                    os.close(fd)
    finally:
        os.close(top)
    if config_file is not None:
        _seal_config(config_file, changed)
    if changed:
        shown = "; ".join(changed[:20]) + (f"; and {len(changed) - 20} more" if len(changed) > 20 else "")
        log.info("work dir: the agent's own files made unreadable to spiders (%s): %s",
                 "spiders have uids of their own: folders they pass through are 0711" if apart
                 else "spiders run as the agent's uid: the work dir is the agent's alone", shown)
    return changed


def _make_reached(top: int, mode: int) -> None:
    """Make the folders of :data:`REACHED` and ``spiders/.runs`` that are missing, with ``mode`` (the
    umask's 0755 otherwise: a fresh node's ``tasks/`` was listable by every spider). Never raises."""
    for name in REACHED:
        with contextlib.suppress(OSError):  # (there already; the umask only takes bits away: give() sets them)
            os.mkdir(name, mode, dir_fd=top)
    with contextlib.suppress(OSError):
        fd = beneath.open_dir(top, "spiders")
        try:
            with contextlib.suppress(OSError):
                os.mkdir(RUNS, mode, dir_fd=fd)
        finally:
            os.close(fd)


def _fchmod_file(fd: int, name: str, mode: int) -> None:
    """chmod a regular file by descriptor (Linux has no lchmod; opened O_NOFOLLOW, non-blocking)."""
    sub = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=fd)
    try:
        if stat.S_ISREG(os.fstat(sub).st_mode):
            os.fchmod(sub, mode)
    finally:
        os.close(sub)


def _seal_config(path: Path, changed: list[str]) -> None:
    """The config file 0600 when this process owns it and others may read it (it may hold the token)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if st.st_uid != os.geteuid() or not stat.S_IMODE(st.st_mode) & 0o077 or not stat.S_ISREG(st.st_mode):
        return
    try:
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
        changed.append(f"{path} {stat.S_IMODE(st.st_mode):04o}→{stat.S_IMODE(st.st_mode) & 0o700:04o}")
    except OSError as exc:
        log.warning("work dir: cannot make the config file %s the agent's alone: %s", path, exc.strerror or exc)
