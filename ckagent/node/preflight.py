"""Checks of a loaded configuration against this node: users, paths, ports.

Parsing (config.py) knows what a value may look like; whether this node can use it — the user
exists, the directories can be written, the port can be bound — only the node knows. ``ckagent run``
and ``ckagent config check`` run the same checks (:func:`preflight`), so that `config check` passes
exactly what `run` then accepts.

=============  ==========================================================  =========================
check          what                                                        `run`
=============  ==========================================================  =========================
users          task.run_as_user exists; switching users needs root; the     refuses (exit 2)
               user can execute the spiders' interpreter (deps.python)
paths          task.work_dir, logging.file, deps.uv_cache_dir can be        refuses (exit 2)
               created and written (tried: an empty directory is made and
               removed, since os.access says yes to root on /proc and
               /sys); deps.uv_path is an executable file
secrets        the config file holding a token or key is not readable or     warns (a log line)
               writable by every user (nor writable by its group)
ports          agent.bind/agent.ip : agent.port can be bound                refuses (exit 1, when it
                                                                            binds the port)
=============  ==========================================================  =========================

A port in use is a warning for `config check` (the node's own running agent holds it; a restart
frees it) and an error for `run`. Every check is blocking (passwd lookups, stat, bind): call it
before the event loop starts, or through ``trio.to_thread``.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from ckagent.node.config import Settings
from ckagent.node.listen import StatusPortError, bind_socket
from ckagent.node.runas import RunAs

__all__ = ["Problem", "check_paths", "check_port", "check_secret_file", "check_users", "preflight"]


@dataclass(frozen=True)
class Problem:
    """One finding: ``error`` False = a warning (the setting may work once something else changes)."""

    message: str
    error: bool = True


def check_users(settings: Settings) -> list[Problem]:
    """task.run_as_user: the user exists, and the agent runs as root (or as that user)."""
    user = settings.task.run_as_user
    if user is None:
        return []
    try:
        run_as = RunAs.lookup(user)
    except ValueError:
        return [Problem(f"task.run_as_user (AGENT_TASK_RUN_AS_USER): no user {user!r} on this node; "
                        "create the user or unset the setting")]
    if run_as.uid != os.geteuid() and os.geteuid() != 0:
        return [Problem(f"task.run_as_user={user!r} needs the agent to run as root (it runs as uid "
                        f"{os.geteuid()}); unset it or start the agent as root")]
    if run_as.uid != os.geteuid():
        python = str(settings.deps.python) if settings.deps.python is not None else sys.executable
        why = _cannot_exec_as(run_as, python)
        if why is not None:
            return [Problem(f"task.run_as_user (AGENT_TASK_RUN_AS_USER): user {run_as.name!r} cannot execute the "
                            f"spiders' interpreter {python} ({why}); every Python spider's environment is built on "
                            "it. Install the agent where that user can read it (e.g. /opt/ckagent, not under "
                            "/root), or set deps.python (AGENT_DEPS_PYTHON) to an interpreter it can run, e.g. "
                            "/usr/bin/python3")]
    return []


def _cannot_exec_as(run_as: RunAs, python: str) -> str | None:
    """Why ``run_as`` cannot run ``python -c pass`` (None when it can). Blocking: one short process."""
    try:
        done = subprocess.run([python, "-c", "pass"], capture_output=True, timeout=30, check=False,
                              stdin=subprocess.DEVNULL, **run_as.popen_options())
    except subprocess.TimeoutExpired:
        return "it did not finish within 30 s"
    except OSError as exc:
        return exc.strerror or str(exc)
    if done.returncode != 0:
        return f"exit code {done.returncode}: {done.stderr.decode(errors='replace').strip()[-300:]}"
    return None


def _writable_dir(path: Path) -> str | None:
    """Why ``path`` cannot be (created as) a writable directory, or None when it can."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return "no existing parent directory"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user (uid {os.geteuid()})"
    # os.access says yes to root everywhere, also on /proc and /sys where nothing can be created:
    # try it, as the agent will (an empty directory, removed at once).
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ckagent-check-", dir=probe))
    except OSError as exc:
        return f"nothing can be created in {probe}: {exc.strerror or exc}"
    return None


def check_paths(settings: Settings) -> list[Problem]:
    """The directories and files the agent creates or runs can be used by this user."""
    problems: list[Problem] = []
    why: str | None
    for label, directory in (("task.work_dir (AGENT_WORK_DIR)", settings.task.work_dir),
                             ("deps.uv_cache_dir (AGENT_UV_CACHE_DIR)", settings.deps.uv_cache_dir)):
        if directory is None:
            continue
        why = _writable_dir(directory)
        if why:
            problems.append(Problem(f"{label} {str(directory)!r} cannot be used: {why}; point it at a "
                                    "directory this user can create and write"))
    log_file = settings.logging.file
    if log_file is not None:
        if log_file.is_dir():
            why = "it is a directory"
        elif log_file.exists():
            why = None if os.access(log_file, os.W_OK) else "the file is not writable by this user"
        else:
            why = _writable_dir(log_file.parent)
        if why:
            problems.append(Problem(f"logging.file (AGENT_LOG_FILE) {str(log_file)!r} cannot be opened: {why}; "
                                    "point it at a writable file (its directory is created)"))
    uv = settings.deps.uv_path
    if uv is not None and not (uv.is_file() and os.access(uv, os.X_OK)):
        problems.append(Problem(f"deps.uv_path (AGENT_UV_PATH) {str(uv)!r} is not an executable file; "
                                "point it at uv (e.g. the one run.sh installs in .ckagent/bin/uv) or unset it"))
    return problems


def check_secret_file(settings: Settings) -> list[Problem]:
    """A warning when the config file holds a credential and other users may read or change it."""
    path = settings.config_file
    if path is None:
        return []
    try:
        mode = path.stat().st_mode
        if not mode & 0o077:
            return []
        data = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError, yaml.YAMLError):
        return []
    agent = data.get("agent") if isinstance(data, dict) else None
    held = [k for k in ("registration_token", "api_key") if isinstance(agent, dict) and agent.get(k)]
    if not held or not mode & (0o004 | 0o002 | 0o020):  # group-readable (e.g. 0640 root:ckagent) is fine
        return []
    return [Problem(f"{path} holds agent.{' and agent.'.join(held)} and is {'world-readable' if mode & 0o004 else 'writable by others'} "
                    f"(mode {mode & 0o777:04o}): any user of this node can {'read' if mode & 0o004 else 'change'} it; "
                    f"chmod 600 {path} (or pass the token as AGENT_REGISTRATION_TOKEN)", error=False)]


def check_port(settings: Settings) -> list[Problem]:
    """The status/metrics address can be bound now (a port in use is a warning: see the module doc)."""

    host = settings.agent.bind or settings.agent.ip
    try:
        bind_socket(host, settings.agent.port).close()
    except StatusPortError as exc:
        in_use = isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.EADDRINUSE
        return [Problem(f"agent.port: {exc}", error=not in_use)]
    return []


def preflight(settings: Settings, *, port: bool = True) -> list[Problem]:
    """Every check of the module (``port`` False: without the port, which `run` checks by binding it)."""
    problems = check_users(settings) + check_paths(settings) + check_secret_file(settings)
    if port:
        problems += check_port(settings)
    return problems
