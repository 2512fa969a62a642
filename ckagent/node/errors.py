"""The agent's own exception tree: why it cannot start, and why one task could not be set up or run.

Exception tree::

    Exception
    └── AgentError              the root of every error the agent raises on purpose
        ├── StartupError        exit_code 1: the agent cannot run (state store unusable, status port in
        │   │                   use, registration refused); ``str()`` says what is wrong and how to fix it
        │   └── ConfigError     exit_code 2: the configuration is unusable (ckagent.node.config)
        └── TaskError           one task cannot go on; ``error_code`` is its result's protocol errorCode,
            │                   ``str()`` its errorMessage (with the errno text and the path of an OSError)
            ├── DeployError     DEPLOY_FAILED: the code cannot be deployed or copied (bad package, failed
            │                   download, a rule the code breaks, a file system error) — ckagent.code.workspace
            ├── DepsError       DEPS_FAILED: the dependencies cannot be installed (installer failed, timed
            │                   out or cannot be started) — ckagent.code.deps
            ├── JailError       AGENT_ERROR: the node cannot contain the task (its cgroup cannot be made)
            │                   — translated from ckagent.containment's ContainmentError
            └── SpawnError      EXIT_NONZERO (exitCode null): the spider's command cannot be started

StartupError is translated into the process's exit status once, by ``ckagent.cli.main`` (``run_agent``
logs it first, so it is in the agent's log too).

A TaskError is raised where a lower layer fails (file system, installer, cgroup, spawn, master), always
``raise ... from exc``. Trio nurseries wrap what leaves them in exception groups; the task runner
collapses them once (:func:`collapsed_groups`), so it ends in one ``except TaskError``. Any other
exception out of a task is a bug of the agent: that task is reported FAILED with :data:`AGENT_ERROR`
(never BAD_TASK, which means the master sent a task this agent cannot take), and the agent goes on.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

if sys.version_info < (3, 11):  # pragma: no cover - the backport trio depends on there
    from exceptiongroup import BaseExceptionGroup

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

AGENT_ERROR = "AGENT_ERROR"
"""errorCode of a task that failed through the agent's own fault (containment unavailable, a bug)."""


class AgentError(Exception):
    """Root of the agent's own errors (see the module docstring for the tree)."""


class StartupError(AgentError):
    """The agent cannot start or go on running. ``exit_code``: the process's exit status (1 here).

    ``logged`` is True once the message went to the agent's log (the CLI then does not print it again).
    """

    exit_code: int = EXIT_FAILURE
    label: str = "cannot run"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.logged = False


class TaskError(AgentError):
    """One task cannot go on. ``error_code``: the protocol errorCode its FAILED result carries;
    ``str()``: the errorMessage (what failed, with the errno text and the path where there is one)."""

    error_code: str = AGENT_ERROR


class DeployError(TaskError):
    """The spider's code cannot be deployed (bad package, failed download, broken rule, file system)."""

    error_code = "DEPLOY_FAILED"


class DepsError(TaskError):
    """Installing a spider's dependencies failed; the message is meant for the task's errorMessage."""

    error_code = "DEPS_FAILED"


class JailError(TaskError):
    """The task's containment (its cgroup) cannot be made: the node's fault, not the task's."""

    error_code = AGENT_ERROR


class SpawnError(TaskError):
    """The spider's command cannot be started (no such file, not executable): no process, no exit code."""

    error_code = "EXIT_NONZERO"


def os_error_text(exc: OSError) -> str:
    """An OSError as a person reads it: the errno text and the path(s), e.g. ``Permission denied:
    '/srv/x'`` (``str(exc)`` without the ``[Errno N]`` prefix; the bare message when it has no errno)."""
    if exc.strerror is None:
        return str(exc) or type(exc).__name__
    paths = [repr(p) for p in (exc.filename, exc.filename2) if p is not None]
    return exc.strerror + (f": {' -> '.join(paths)}" if paths else "")


def describe_fault(exc: BaseException) -> str:
    """An unexpected exception as the errorMessage of an AGENT_ERROR: ``agent error: <type>: <text>``
    (an OSError's errno text and path kept; a group's members one after the other)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe_fault(inner) for inner in _leaves(exc))
    detail = os_error_text(exc) if isinstance(exc, OSError) else str(exc)
    return f"agent error: {type(exc).__name__}: {detail}" if detail else f"agent error: {type(exc).__name__}"


def collapse(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception a nursery's exception group stands for: its leaf when it holds only one,
    else its first TaskError; the group itself when it holds a cancellation or an interrupt (these go
    on up untouched, for the cancel scopes) or several unrelated errors."""
    leaves = list(_leaves(group))
    if any(not isinstance(leaf, Exception) for leaf in leaves):  # trio.Cancelled, KeyboardInterrupt
        return group
    if len(leaves) == 1:
        return leaves[0]
    task_errors = [leaf for leaf in leaves if isinstance(leaf, TaskError)]
    return task_errors[0] if task_errors else group


@contextlib.contextmanager
def collapsed_groups() -> Iterator[None]:
    """Re-raise an exception group leaving the block as :func:`collapse` says (its traceback kept)."""
    try:
        yield
    except BaseExceptionGroup as group:
        one = collapse(group)
        if one is group:
            raise
    else:
        return
    raise one  # outside the except clause: its own __cause__/__context__ stay as they were


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc
