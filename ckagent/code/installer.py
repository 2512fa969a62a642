"""How an environment's installers (uv, npm, nvm) run for a task: as whom, with what, bounded, stopped.

Every installer run streams its output into the task's log as it comes, keeps its last whole lines
for the error message, joins the task's jail before it execs (the jail's spawn, see :data:`SPAWN`),
runs in its own process group as the task's ``run_as`` user, and is bounded by ``deps.uv_sync_timeout``.
Exceptions::

    DepsError     the installer could not start, failed or timed out; the message says which and
                  carries its last whole lines of output (task → DEPS_FAILED)
"""

from __future__ import annotations

import contextvars
import itertools
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ckagent.containment.process import SPAWNED, terminate_group
from ckagent.containment.tails import TailBuffer, last_lines
from ckagent.node.errors import DepsError, os_error_text
from ckagent.node.runas import RunAs, popen_identity

Output = Callable[[bytes], None]
"""Receives an installer's output bytes as they come (the task's log)."""
Spawn = Callable[..., tuple[list[str], dict[str, Any]]]
"""``spawn(argv, env, forking=bool) -> (argv, Popen kwargs)``: how a task's process starts in its jail."""

SPAWN: contextvars.ContextVar[Spawn | None] = contextvars.ContextVar("ckagent_installer_spawn", default=None)
"""The jail spawn of the task being prepared (set by Dependencies.prepare, read by each installer run)."""


class Installers:
    """Runs a task's installers (see module docstring).

    ``timeout`` bounds one run (seconds); ``base_env`` is the minimal environment they start from
    (never the agent's secrets); ``run_as``: they run as that user (``task.run_as_user``), else as the agent.
    """

    def __init__(self, timeout: float, base_env: dict[str, str], run_as: RunAs | None) -> None:
        self.timeout = timeout
        self.base_env = base_env
        self.run_as = run_as
        self.identity = "agent" if run_as is None else f"uid={run_as.uid},gid={run_as.gid}"
        """Who the environments belong to (hashed into their keys)."""

    def env(self, task_env: dict[str, str]) -> dict[str, str]:
        """The base, the run-as identity (USER, LOGNAME; HOME unless the task's is given), the task's env."""
        env = dict(self.base_env)
        if self.run_as is not None:
            env.update(self.run_as.env())
        env.update(task_env)
        return env

    def give_dirs(self, paths: list[Path]) -> None:
        """Create ``paths`` if missing and give them (and their contents) to the run-as user (blocking;
        nothing to do without one)."""
        run_as = self.run_as
        if run_as is None:
            return
        for path in paths:
            path.mkdir(parents=True, exist_ok=True)
            if path.stat().st_uid != run_as.uid:
                run_as.chown_tree(path)

    async def run(self, argv: list[str], cwd: Path, env: dict[str, str], output: Output,
                  label: str | None = None) -> None:
        """Run one installer to its end in ``cwd`` with exactly ``env``; ``label`` names it in errors
        (default: the tool and its subcommand). Raises DepsError (see module docstring). Cancellation
        stops it (TERM → 5 s → KILL of its process group) before it propagates."""
        tail = TailBuffer(16384)
        output(f"[ckagent] $ {' '.join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv))}\n".encode())

        def sink(chunk: bytes) -> None:
            tail.write(chunk)
            output(chunk)

        result: subprocess.CompletedProcess[bytes] | None = None
        spawn = SPAWN.get()
        spawn_argv, spawn_options = (argv, {}) if spawn is None else spawn(argv, env, forking=self.run_as is not None)
        spawned: list[int] = []
        try:
            with trio.move_on_after(self.timeout) as scope:
                async with trio.open_nursery() as nursery:
                    try:
                        process: trio.Process = await nursery.start(
                            partial(
                                trio.run_process, spawn_argv, cwd=str(cwd), env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False,
                                start_new_session=True, **popen_identity(self.run_as), **spawn_options,
                                deliver_cancel=lambda p: terminate_group(p.pid, 5.0),
                            )
                        )
                    except OSError as exc:  # not startable: no such file, not executable, no such cwd
                        raise DepsError(f"cannot start the installer {argv[0]!r}: {os_error_text(exc)}") from exc
                    spawned.append(process.pid)
                    SPAWNED.add(process.pid)  # trio reaps it; the subreaper's reaper must not
                    assert process.stdout is not None
                    while chunk := await process.stdout.receive_some(65536):
                        sink(bytes(chunk))
                    result = subprocess.CompletedProcess(argv, await process.wait())
        finally:  # run_process has reaped it by now
            SPAWNED.difference_update(spawned)
        name = label or " ".join([Path(argv[0]).name, *itertools.takewhile(lambda a: not a.startswith("-"), argv[1:3])])
        if scope.cancelled_caught:
            raise DepsError(
                f"{name} timed out after {self.timeout:g} s and was stopped (the limit is "
                f"deps.uv_sync_timeout / AGENT_UV_SYNC_TIMEOUT); its last output:\n{last_lines(tail.text())}"
            )
        if result is None or result.returncode != 0:
            code = None if result is None else result.returncode
            raise DepsError(f"{name} failed with exit code {code}:\n{last_lines(tail.text())}")
