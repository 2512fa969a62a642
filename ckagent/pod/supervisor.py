"""The agent's life under the supervisor: spawn, forward signals, reap orphans, restart, exit.

=========================================================  ==========================================
what happens                                               what the supervisor does
=========================================================  ==========================================
SIGTERM, SIGINT, SIGHUP or SIGUSR1 while the agent runs    forwards it; when the agent then exits, the
                                                           supervisor exits with the agent's code
                                                           (128 + N for a death by signal N: the
                                                           agent handles TERM and INT, not HUP, USR1)
SIGUSR2 (hand over) while the agent runs                   forwards it; the agent exits leaving its
                                                           crawls running, the next agent starts at
                                                           once and re-adopts them (an in-place restart)
SIGTERM or SIGINT while no agent runs (a restart pending)  crawls still running (children left): starts
                                                           the agent at once, told to act on the signal
                                                           once it re-adopted them (migrate or drain);
                                                           none: exits 0 (HUP, USR1, USR2: ignored)
the agent exits 0 unasked (``ckagent stop``: drain or      exits 0: the pod or Job ends
migrate; ``--exit-when-idle``; ``--max-tasks``)
the agent exits 2 (its configuration)                      exits 2 (a restart would fail the same way)
any other end: a crash, kill -9, the OOM killer, exit 1    starts it again after a backoff: 1 s,
                                                           doubling to 30 s; reset once an agent lived
                                                           60 s. The new agent re-adopts the crawls.
any other child ends (an orphan re-parented to PID 1 —     reaped (``waitpid(-1)``), nothing else: its
e.g. a task's monitor that outlived a dead agent — or to   exit status is no one's business here (the
the supervisor as child subreaper when it is not PID 1)    monitor recorded the spider's in its file)
=========================================================  ==========================================

Exiting: once the last child is gone, or :data:`CHILDREN_TIMEOUT` seconds after the agent's end,
whichever comes first (as PID 1 the kernel then kills what is left of the pod; otherwise it is
re-parented further up); a second SIGTERM or SIGINT exits at once. The agent is started in a session
of its own (a terminal's Ctrl-C reaches the supervisor, which forwards it once) and is signalled only
before it is reaped, so its pid cannot belong to anyone else then.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckagent.pod.fdstore import STORE_ENV, DescriptorStore, Spawned, spawn
from ckagent.pod.livez import UP_AFTER, Health
from ckagent.pod.loop import Loop, Timer

STOP_AT_START_ENV = "CKAGENT_STOP_AT_START"
"""The agent's variable for a stop to act on once it runs (ckagent.node.stopsignals.STOP_AT_START_ENV)."""

log = logging.getLogger("ckagent.pod")

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""Signals passed on to the agent."""
HAND_OVER = signal.SIGUSR2
"""The agent's hand-over signal (ckagent.node.stopsignals.HAND_OVER_SIGNAL): restart in place."""
EXIT_USAGE = 2
"""The agent's exit code for a configuration or usage error (ckagent.node.errors.EXIT_USAGE)."""
CHILDREN_TIMEOUT = 10.0
"""Seconds the supervisor waits, after the agent's end, for its other children before it exits."""
PR_SET_CHILD_SUBREAPER = 36
"""prctl option (linux/prctl.h)."""


@dataclass
class Backoff:
    """Restart delays: ``first`` seconds, doubling up to ``cap``; back to ``first`` after an agent that
    lived ``reset_after`` seconds."""

    first: float = 1.0
    cap: float = 30.0
    reset_after: float = UP_AFTER
    _next: float = field(default=0.0, init=False)

    def next(self, lived: float) -> float:
        """The delay before the next start, for an agent that ended after ``lived`` seconds."""
        if lived >= self.reset_after or not self._next:
            self._next = self.first
        delay = self._next
        self._next = min(self.cap, self._next * 2)
        return delay


@dataclass(frozen=True)
class AgentCommand:
    """How to start the agent: ``argv``, its environment (no secrets), the descriptors it inherits:
    ``pass_fds`` at their numbers, ``fd_vars`` (variable, descriptor) at numbers the start picks (the
    variable says which; ckagent.pod.fdstore.spawn)."""

    argv: Sequence[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    fd_vars: tuple[tuple[str, int], ...] = ()


def set_child_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (orphans re-parent to it, as to PID 1);
    True when set. Never raises."""
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def describe_status(code: int) -> str:
    """``exit code N`` or ``killed by SIGNAME`` for a ``waitstatus_to_exitcode`` value."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


class Supervisor:
    """Keeps one agent running by the rules of the module docstring; :meth:`run` returns the exit code."""

    def __init__(self, loop: Loop, command: AgentCommand, health: Health, *, backoff: Backoff | None = None,
                 children_timeout: float = CHILDREN_TIMEOUT, fdstore: DescriptorStore | None = None) -> None:
        self.loop = loop
        self.fdstore = fdstore
        """The agents' proxy listeners, kept across their restarts (ckagent.pod.fdstore); None: none."""
        self.command = command
        self.health = health
        self.backoff = backoff or Backoff()
        self.children_timeout = children_timeout
        self.agent: Spawned | None = None
        self.agent_started = 0.0
        self.starts = 0
        self.reaped = 0
        """Children reaped that were not the agent (orphans)."""
        self.exit_code: int | None = None
        self._stop_signal: int | None = None
        self._handing_over = False
        self._restart: Timer | None = None
        self._finishing: int | None = None
        health.check = self._reap

    def run(self) -> int:
        """Start the agent, then serve the loop until the supervisor's exit; returns its exit code."""
        self.loop.on_signals([*FORWARDED, signal.SIGCHLD], self._signal)
        self._spawn()
        self._reap()  # (a child that ended before SIGCHLD had a handler)
        while self.exit_code is None:
            try:
                self.loop.run_once()
            except Exception:  # a bug here must not end PID 1 (and the pod's crawls with it)
                log.exception("unexpected error (going on)")
                time.sleep(0.1)  # (not a busy loop of the same error)
        if self.fdstore is not None:
            self.fdstore.close()
        return self.exit_code

    def _spawn(self, extra_env: dict[str, str] | None = None) -> None:
        self._restart = None
        self._stop_signal, self._handing_over = None, False
        env, fds = dict(self.command.env), list[int]()
        if self.fdstore is not None:
            more, fds = self.fdstore.for_agent()
            env = {k: v for k, v in env.items() if k not in STORE_ENV}
            env.update(more)
        try:
            self.agent = spawn(self.command.argv, {**env, **(extra_env or {})}, fds, self.command.pass_fds,
                               dict(self.command.fd_vars))
        except (OSError, ValueError) as exc:
            log.error("cannot start the agent (%s): %s", self.command.argv[0], getattr(exc, "strerror", None) or exc)
            self._finish(1)
            return
        finally:
            if self.fdstore is not None:
                self.fdstore.spawned()
        self.agent_started = self.loop.now()
        self.starts += 1
        self.health.spawned()
        log.info("agent started (pid %d%s)", self.agent.pid,
                 "" if self.starts == 1 else f", start {self.starts}")

    def _signal(self, signum: int) -> None:
        if signum == signal.SIGCHLD:
            self._reap()
            return
        name = _name(signum)
        if self._finishing is not None:
            if signum in (signal.SIGTERM, signal.SIGINT):
                log.info("%s while waiting for the last children: exiting now", name)
                self.exit_code = self._finishing
            return
        if self.agent is None:
            if signum in (signal.SIGTERM, signal.SIGINT) and self._restart is not None and _children():
                # crawls outlived the dead agent: the next one starts now, re-adopts them and then acts on
                # the stop itself (ckagent.node.stopsignals.stop_at_start) — exiting would end them with the pod
                log.info("%s while no agent runs and crawls are still running: starting the agent now to "
                         "stop them as asked", name)
                self._restart.cancel()
                self._spawn({STOP_AT_START_ENV: name})
                self._stop_signal = signum
            elif signum in (signal.SIGTERM, signal.SIGINT):
                log.info("%s while no agent runs: exiting", name)
                self._finish(0)
            else:
                log.info("%s while no agent runs: ignored", name)
            return
        with contextlib.suppress(ProcessLookupError):  # (a zombie not reaped yet: its end comes next)
            os.kill(self.agent.pid, signum)
        if signum == HAND_OVER:
            self._handing_over = True
        else:
            self._stop_signal = signum
        log.info("%s forwarded to the agent (pid %d)", name, self.agent.pid)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # no child left at all
                if self._finishing is not None:
                    self.exit_code = self._finishing
                return
            if pid == 0:
                return
            if self.agent is not None and pid == self.agent.pid:
                self._agent_ended(os.waitstatus_to_exitcode(status))
            else:
                self.reaped += 1
                log.debug("reaped orphan %d (%s)", pid, describe_status(os.waitstatus_to_exitcode(status)))

    def _agent_ended(self, code: int) -> None:
        assert self.agent is not None
        self.agent.returncode = code
        pid, self.agent = self.agent.pid, None
        if self.fdstore is not None:
            self.fdstore.agent_ended()
        lived = self.loop.now() - self.agent_started
        self.health.exited()
        how = describe_status(code)
        if self._stop_signal is not None:
            log.info("the agent (pid %d) stopped after %s: %s", pid, _name(self._stop_signal), how)
            self._finish(128 - code if code < 0 else code)
        elif code == EXIT_USAGE:
            log.error("the agent (pid %d) refused its configuration or its arguments (exit code 2): not "
                      "restarting; fix what its log names (the config file, an AGENT_* variable or a flag "
                      "after `--`), then restart the pod", pid)
            self._finish(EXIT_USAGE)
        elif self._handing_over:
            log.info("the agent (pid %d) handed its crawls over (%s): starting the next one now", pid, how)
            self._spawn()
        elif code == 0:
            log.info("the agent (pid %d) stopped by itself (exit code 0): exiting", pid)
            self._finish(0)
        else:
            delay = self.backoff.next(lived)
            log.warning("the agent (pid %d) ended unasked after %.0f s (%s): restarting it in %g s; "
                        "it re-adopts the running crawls", pid, lived, how, delay)
            self._restart = self.loop.call_later(delay, self._spawn)

    def _finish(self, code: int) -> None:
        if self._finishing is not None:
            return
        self._finishing = code
        self.health.stopping = True
        if self._restart is not None:
            self._restart.cancel()
        self.loop.call_later(self.children_timeout, self._give_up_waiting)
        self._reap()

    def _give_up_waiting(self) -> None:
        if self.exit_code is None and self._finishing is not None:
            left = _children()
            log.warning("exiting with %d process(es) of the pod still running (%s)", len(left),
                        " ".join(map(str, left[:20])))
            self.exit_code = self._finishing


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _children() -> list[int]:
    """This process's children (from /proc; [] when it cannot be read)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as fh:
                found += [int(p) for p in fh.read().split()]
    return found
