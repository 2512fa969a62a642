"""``ckagent stop [--migrate] [--timeout SECONDS] -c CONFIG``: stop the agent running on that config's
work dir — drain (as SIGTERM does by default) or migrate — and wait for it to exit.

The agent is found and asked as ckagent.node.stoprequest says (the holder of ``<work_dir>/agent.lock``,
proven by the kernel's lock table; a request file, then SIGTERM through its pidfd). The wait is bounded:
by default what the agent itself may take — a migrate ``task.migrate_timeout + task.flush_timeout``, a
drain ``task.drain_timeout + max(task.kill_grace, task.max_stop_grace) + task.flush_timeout`` — plus
:data:`MARGIN` seconds (its last heartbeat, its goodbye, the interpreter's exit).

Exit codes::

    0   the agent exited within the wait, having done what was asked
    1   it did not exit within the wait (it goes on stopping; nothing more is sent), or it cannot be signalled
    2   usage or configuration error
    3   no agent runs on that work dir (nothing to stop)
    4   it exited, but did not take the migrate request: an agent older than `ckagent stop` drains on SIGTERM
"""

from __future__ import annotations

import os
import select
import sys
import time
from pathlib import Path
from typing import Annotated

from cyclopts import Parameter

from ckagent.node.config import load_settings
from ckagent.node.errors import EXIT_FAILURE, EXIT_OK
from ckagent.node.stoprequest import (
    TAKE_TIMEOUT,
    NoAgent,
    StopError,
    StopMode,
    agent_pid,
    process_alive,
    remove_request,
    request_pending,
    request_stop,
)

EXIT_NO_AGENT = 3
EXIT_NOT_TAKEN = 4
MARGIN = 10.0
"""Seconds the wait adds to the agent's own bound (last heartbeat, goodbye, exit)."""


def stop_command(
    *,
    migrate: bool = False,
    timeout: float | None = None,
    config: Annotated[Path | None, Parameter(name=["--config", "-c"])] = None,
) -> int:
    """Stop the agent running on the config's work dir and wait for it to exit.

    Without --migrate it drains, as SIGTERM does by default: no new tasks, running ones may finish
    within task.drain_timeout. With --migrate every running task is checkpointed, stopped and reported
    MIGRATED within task.migrate_timeout, so another node resumes it at once. Exit code: 0 stopped,
    1 not stopped within the wait, 3 no agent runs there, 4 stopped but it drained (an older agent
    that does not know --migrate), 2 usage or config error.

    Parameters
    ----------
    migrate
        Hand the running crawls over to other nodes instead of waiting for them.
    timeout
        Seconds to wait for the agent to exit (default: its own bound for that stop + 10 s).
    config
        The agent's YAML config file (its task.work_dir finds the agent); AGENT_* variables apply.
    """
    settings = load_settings(config, require_token=False)
    work_dir = Path(settings.task.work_dir)
    t = settings.task
    mode = StopMode.MIGRATE if migrate else StopMode.DRAIN
    if timeout is None:
        own = t.migrate_timeout if migrate else t.drain_timeout + max(t.kill_grace, t.max_stop_grace)
        timeout = own + t.flush_timeout + MARGIN
    try:
        pid = agent_pid(work_dir)
        pidfd = _pidfd(pid)
        if agent_pid(work_dir) != pid:  # (proven again now that its descriptor is held)
            raise StopError(f"the agent of {work_dir} changed while it was being asked; run this again")
        try:
            request_stop(work_dir, mode, pid, pidfd)
            _say(f"asked the agent of {work_dir} (pid {pid}) to {mode}; waiting up to {timeout:g} s")
            started = time.monotonic()
            taken = _wait_taken(work_dir, pid, pidfd)
            exited = _wait_exit(pid, pidfd, timeout - (time.monotonic() - started))
        finally:
            if pidfd is not None:
                os.close(pidfd)
    except NoAgent as exc:
        _say(str(exc))
        return EXIT_NO_AGENT
    except StopError as exc:
        _say(str(exc))
        return EXIT_FAILURE
    seconds = time.monotonic() - started
    if not taken:
        remove_request(work_dir)
        _say(f"the agent (pid {pid}) did not take the request: it is older than `ckagent stop` and "
             f"{'drains' if migrate else 'drains, as asked'} on SIGTERM")
    if not exited:
        _say(f"the agent (pid {pid}) did not exit within {timeout:g} s; it goes on stopping (its log says "
             "where it is); stop it harder with SIGINT (terminate)")
        return EXIT_FAILURE
    _say(f"the agent (pid {pid}) exited after {seconds:.1f} s ({'migrated' if migrate else 'drained'}; its log "
         "says what became of each task)")
    return EXIT_NOT_TAKEN if migrate and not taken else EXIT_OK


def _say(text: str) -> None:
    print(f"ckagent stop: {text}", file=sys.stderr)


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (None where the kernel has none: the pid alone is used). Raises NoAgent when
    it is gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise NoAgent(f"the agent (pid {pid}) has just exited") from None
    except (OSError, AttributeError):
        return None


def _wait_exit(pid: int, pidfd: int | None, seconds: float) -> bool:
    """True once the agent has exited, False after ``seconds``: a poll on its pidfd (readable at its
    exit), else a look every 0.2 s."""
    deadline = time.monotonic() + max(0.0, seconds)
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if poller.poll(max(0, int(left * 1000))):
                return True
            if left <= 0:
                return False
    while process_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def _wait_taken(work_dir: Path, pid: int, pidfd: int | None) -> bool:
    """True once the agent removed the request file (it read it), False after TAKE_TIMEOUT seconds or
    when it exited without (an older agent)."""
    deadline = time.monotonic() + TAKE_TIMEOUT
    while request_pending(work_dir):
        if time.monotonic() >= deadline or _wait_exit(pid, pidfd, 0.05):
            return not request_pending(work_dir)
    return True
