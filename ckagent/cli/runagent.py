"""``ckagent run``'s process around the agent: preflight, the work dir's lock, logging, then Trio.

(:mod:`ckagent.agent` is the agent itself: the root nursery and its shutdown state machine.)
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import trio

from ckagent.agent import Agent
from ckagent.node.config import ConfigError, Settings
from ckagent.node.errors import StartupError
from ckagent.node.hardening import protect_agent_memory, raise_open_files_limit
from ckagent.node.logs import setup_logging
from ckagent.node.preflight import preflight
from ckagent.node.workdir import WorkDirError, WorkDirLock

log = logging.getLogger(__name__)


def run_agent(settings: Settings) -> int:
    """Entry point for ``ckagent run``: set up logging, lock the work dir, run the agent on Trio;
    returns 0 after a clean stop.

    Raises StartupError (exit code 1) when the agent cannot run, ConfigError (exit code 2) when the
    log file cannot be opened or the work dir cannot be created, written or locked (another agent
    uses it). An error raised once logging is set up is logged here first (``logged`` is then True
    when that log line went to stderr, so the CLI does not print it twice).
    """
    problems = preflight(settings, port=False)  # the checks of `config check`
    errors = [p.message for p in problems if p.error]
    if errors:
        raise ConfigError("; ".join(errors))
    token = settings.agent.registration_token
    protect_agent_memory()  # spiders of the same user must not read the secrets in /proc/<pid>/environ
    raise_open_files_limit()  # many tasks' proxied connections and watches must not run it out
    try:
        # Before the log is opened: a second agent on the same work dir is refused on its own stderr,
        # not in the running agent's log file; and before anything touches the work dir (crash
        # recovery would kill another agent's tasks).
        lock = WorkDirLock.acquire(Path(settings.task.work_dir))
    except WorkDirError as exc:
        raise ConfigError(str(exc)) from exc
    try:
        setup_logging(settings.logging.level, settings.logging.file, settings.logging.format,
                      max_bytes=settings.logging.max_bytes, backup_count=settings.logging.backup_count,
                      secrets=[token.reveal()] if token is not None else [])
    except OSError as exc:
        lock.release()
        raise ConfigError(f"logging.file (AGENT_LOG_FILE) {str(settings.logging.file)!r} cannot be opened: "
                          f"{exc.strerror or exc}; point it at a writable file (its directory is created)") from exc
    for problem in problems:
        log.warning("%s", problem.message)
    try:
        try:
            return trio.run(Agent(settings).run)
        except KeyboardInterrupt:  # pragma: no cover - SIGINT is handled inside; a second Ctrl-C race
            return 130
        finally:
            lock.release()
            sys.stderr.flush()
    except StartupError as exc:
        log.error("%s", exc)
        exc.logged = any(isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stderr
                         for h in logging.getLogger().handlers)
        raise
