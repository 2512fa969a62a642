"""How an environment's installers (uv, npm, nvm) run for a task: as whom, with what, bounded, stopped.

Every installer run streams its output into the task's log as it comes, keeps its last whole lines
for the error message, joins the task's jail before it execs (the jail is passed in, explicitly),
runs in its own process group as the node's builder (ckagent.code.builder: never as a spider, with
the builder's own HOME and TMPDIR), and is bounded by ``deps.uv_sync_timeout``.
It is spawned and supervised as a spider is, behind a monitor, its output on pipes
(ckagent.containment.process.run_supervised): the end of its main process, then the jail's leftovers
killed; a timeout or a cancellation (the task stopped while it
installs, the agent terminating) sends its stop signal, waits the node's ``kill_grace`` and kills
every process of the jail (ckagent.containment.stopping).
Exceptions::

    DepsError     the installer could not start, failed or timed out; the message says which and
                  carries its last whole lines of output (task → DEPS_FAILED)
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from pathlib import Path

import trio

from ckagent.code.builder import Builder
from ckagent.containment import TaskJail
from ckagent.containment.process import MARKER_VAR, run_supervised
from ckagent.containment.process_group import ProcessGroupJail
from ckagent.containment.tails import TailBuffer, last_lines
from ckagent.node.errors import DepsError, os_error_text
from ckagent.node.runas import RunAs

Output = Callable[[bytes], None]
"""Receives an installer's output bytes as they come (the task's log)."""

KILL_GRACE = 10.0
"""Seconds between a stopped installer's stop signal and its kill when none is given (the default of
the node's ``task.kill_grace``)."""


class Installers:
    """Runs a task's installers (see module docstring).

    ``timeout`` bounds one run (seconds); ``base_env`` is the minimal environment they start from
    (never the agent's secrets); ``builder``: whom they run as, with which HOME, and who owns a
    finished environment; ``kill_grace``: seconds from a stopped installer's stop signal to its kill.
    """

    def __init__(self, timeout: float, base_env: dict[str, str], builder: Builder,
                 kill_grace: float = KILL_GRACE) -> None:
        self.timeout = timeout
        self.kill_grace = kill_grace
        self.base_env = base_env
        self.builder = builder

    @property
    def run_as(self) -> RunAs | None:
        """The identity installers run as (None: the agent's own)."""
        return self.builder.run_as

    @property
    def identity(self) -> str:
        """The builder's part of an environment's key (ckagent.code.builder.Builder.identity)."""
        return self.builder.identity

    def env(self, task_env: dict[str, str]) -> dict[str, str]:
        """The base, what of the task's env reaches installers (the caller filtered it:
        ckagent.code.installenv.installer_env), then the builder's HOME, TMPDIR, USER and LOGNAME."""
        env = dict(self.base_env)
        env.update(task_env)
        env.update(self.builder.env())
        return env

    async def run(self, argv: list[str], cwd: Path, env: dict[str, str], output: Output,
                  label: str | None = None, *, jail: TaskJail | None = None) -> None:
        """Run one installer to its end in ``cwd`` with exactly ``env`` (plus the task's marker when it
        has none), in ``jail`` (the task's; None: a process group of its own); ``label`` names it in
        errors (default: the tool and its subcommand). Raises DepsError (see module docstring).
        Cancellation stops it (stop signal → ``kill_grace`` → every process of the jail killed,
        shielded) before it propagates."""
        tail = TailBuffer(16384)
        output(f"[ckagent] $ {' '.join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv))}\n".encode())

        def sink(chunk: bytes) -> None:
            tail.write(chunk)
            output(chunk)

        def notice(text: str) -> None:
            output(f"[ckagent] {text}\n".encode())

        if MARKER_VAR not in env:  # run outside a task (tests, tools): a marker of its own for the sweep
            env = {**env, MARKER_VAR: f"installer-{uuid.uuid4().hex}"}
        task_id = env[MARKER_VAR]
        try:
            outcome = await run_supervised(
                argv, cwd=cwd, env=env, task_id=task_id, output=sink, deadline_seconds=self.timeout,
                grace=self.kill_grace, stop=trio.Event(), notice=notice, run_as=self.run_as,
                jail=jail if jail is not None else ProcessGroupJail(task_id), cancelled_why="installer stopped",
            )
        except OSError as exc:  # not startable: no such file, not executable, no such cwd
            raise DepsError(f"cannot start the installer {argv[0]!r}: {os_error_text(exc)}") from exc
        name = label or " ".join([Path(argv[0]).name, *itertools.takewhile(lambda a: not a.startswith("-"), argv[1:3])])
        if outcome.timed_out:
            raise DepsError(
                f"{name} timed out after {self.timeout:g} s and was stopped (the limit is "
                f"deps.uv_sync_timeout / AGENT_UV_SYNC_TIMEOUT); its last output:\n{last_lines(tail.text())}"
            )
        if outcome.returncode != 0:
            raise DepsError(f"{name} failed with exit code {outcome.returncode}:\n{last_lines(tail.text())}")
