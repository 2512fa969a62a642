"""The kernel's limits on a command line and environment, checked before a spider is started.

Linux refuses an ``execve`` whose strings are too large with E2BIG ("Argument list too long"):

- each argument and each ``NAME=value`` environment string may be at most ``MAX_ARG_STRLEN`` bytes,
  its terminating NUL included (32 pages: 131072 bytes with 4 KiB pages, so 131071 bytes of text);
- all of them together — every string with its NUL, plus one pointer per string — may use at most a
  quarter of the stack limit (``ARG_MAX`` as ``sysconf(_SC_ARG_MAX)`` says it: 2 MiB with the usual
  8 MiB stack).

A task whose own fields (``command``, ``args``, ``env``, ``params`` as ``CK_PARAMS``, its spider's
name as ``CK_SPIDER_NAME``) break either limit is the master's mistake, not a spider's failure: the
agent reports it FAILED/BAD_TASK naming the field and the limit (:func:`check_exec_size`), before
anything is started, instead of a spawn's EXIT_NONZERO. :data:`EXEC_RESERVE_BYTES` of the total are
kept for the spider's monitor (its shell script, the namespace helper's words).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ckagent.node.errors import TaskError

__all__ = ["EXEC_RESERVE_BYTES", "BadTaskError", "arg_max", "check_exec_size", "max_arg_strlen"]

EXEC_RESERVE_BYTES = 16 * 1024
"""Bytes of ARG_MAX kept for what the monitor adds in front of the spider's command (its script)."""
POINTER_BYTES = 8
"""What each string costs beside its bytes: its pointer in argv or envp (64-bit)."""


class BadTaskError(TaskError):
    """The task's own fields cannot be carried out as given (e.g. over the kernel's exec limits)."""

    error_code = "BAD_TASK"


def max_arg_strlen() -> int:
    """The kernel's ``MAX_ARG_STRLEN`` (bytes, NUL included): 32 pages."""
    return 32 * (os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096)


def arg_max() -> int:
    """``sysconf(_SC_ARG_MAX)``: bytes all arguments and environment strings (and their pointers) may
    use together in one exec, for this process's stack limit now (a child inherits it)."""
    try:
        value = os.sysconf("SC_ARG_MAX")
    except (OSError, ValueError):
        value = -1
    return value if value > 0 else 128 * 1024


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape")) + 1


def _kib(n: int) -> str:
    return f"{n} bytes ({n / 1024:.1f} KiB)" if n < 1024 * 1024 else f"{n} bytes ({n / 1024 / 1024:.2f} MiB)"


def _task_fields(task: Any) -> tuple[dict[str, str], dict[str, str]]:
    """The task's fields as they reach the exec: (argument text → field name), (env name → field name)."""
    arguments: dict[str, str] = {}
    for i, value in enumerate(task.command or ()):
        arguments.setdefault(value, f"command[{i}]")
    for i, value in enumerate(task.args):
        arguments.setdefault(value, f"args[{i}]")
    names = {name: f"env.{name}" for name in task.env}
    names["CK_PARAMS"] = "params"
    names["CK_SPIDER_NAME"] = "spiderName"
    return arguments, names


def check_exec_size(task: Any, argv: Sequence[str], env: Mapping[str, str], *, limit: int | None = None,
                    strlen: int | None = None) -> None:
    """Raise :class:`BadTaskError` when ``argv`` and ``env`` (what the spider of ``task``, a
    :class:`ckagent.master.protocol.Task`, is started with) break the kernel's exec limits because of
    the task's own fields; the message names the field, its size and the limit. ``limit`` and
    ``strlen`` default to :func:`arg_max` and :func:`max_arg_strlen` (bytes).

    When the strings are too large but no task field is among them (a node's own ``task.extra_env``),
    raises a plain :class:`TaskError` (AGENT_ERROR: the node's settings). Pure but for sysconf; no I/O.
    """
    limit = arg_max() if limit is None else limit
    strlen = max_arg_strlen() if strlen is None else strlen
    arguments, names = _task_fields(task)
    sizes: list[tuple[int, str | None, str]] = []  # (bytes with NUL, task field or None, what it is)
    for i, value in enumerate(argv):
        sizes.append((_size(value), arguments.get(value) if i else None, f"argument {i}"))
    for name, value in env.items():
        sizes.append((_size(f"{name}={value}"), names.get(name), f"environment variable {name}"))
    for size, field, what in sizes:
        if size > strlen:
            text = (f"{field} is {_kib(size - 1)}: over the kernel's limit for one argument or environment "
                    f"string, MAX_ARG_STRLEN = {strlen - 1} bytes (docs/protocol.md, \"Size limits of a task\")")
            if field is None:
                raise TaskError(f"{what} of the spider's command is {_kib(size - 1)}: over MAX_ARG_STRLEN = "
                                f"{strlen - 1} bytes (the node's settings)")
            raise BadTaskError(text)
    total = sum(size + POINTER_BYTES for size, _, _ in sizes) + 2 * POINTER_BYTES
    room = limit - EXEC_RESERVE_BYTES
    if total <= room:
        return
    by_field: dict[str, int] = {}
    for size, field, _ in sizes:
        if field is not None:
            top = field.split("[", 1)[0] if field.startswith(("args[", "command[")) else field
            by_field[top] = by_field.get(top, 0) + size + POINTER_BYTES
    if not by_field:
        raise TaskError(f"the spider's command line and environment come to {_kib(total)}: over the kernel's "
                        f"ARG_MAX = {limit} bytes (less {EXEC_RESERVE_BYTES} kept for the monitor; the node's settings)")
    largest = sorted(by_field.items(), key=lambda kv: kv[1], reverse=True)
    shown = ", ".join(f"{field} {_kib(size)}" for field, size in largest[:3])
    raise BadTaskError(
        f"{largest[0][0]} makes the command line and environment {_kib(total)}: over the kernel's total for "
        f"one exec, ARG_MAX = {limit} bytes less {EXEC_RESERVE_BYTES} kept for the monitor (the task's largest "
        f"fields: {shown}; docs/protocol.md, \"Size limits of a task\")")

