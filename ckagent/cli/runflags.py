"""``ckagent run``'s own flags: ``--exit-when-idle SECONDS`` and ``--max-tasks N`` (an ephemeral worker,
ckagent.node.ephemeral), checked before anything starts and laid over the settings they name."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ckagent.node import configvalues as v
from ckagent.node.config import Settings


@dataclass(frozen=True)
class RunFlags:
    """The flags given (None: not given; the settings' value stays)."""

    exit_when_idle: float | None = None
    max_tasks: int | None = None

    @classmethod
    def parse(cls, exit_when_idle: str | None, max_tasks: str | None) -> RunFlags:
        """Check the flags' text. Raises ValueError with a one-line reason: a flag must name a limit (0,
        a negative number, a fraction of a task or a word is a mistake, not "no limit": leave the flag out,
        or set agent.exit_when_idle / agent.max_tasks to 0)."""
        idle = tasks = None
        if exit_when_idle is not None:
            try:
                idle = v.seconds()(exit_when_idle.strip())
            except v.Invalid as exc:
                raise ValueError(f"--exit-when-idle {exit_when_idle!r}: {exc.problem} (leave the flag out to "
                                 "keep agent.exit_when_idle)") from None
        if max_tasks is not None:
            try:
                tasks = v.integer(1)(max_tasks.strip())
            except v.Invalid as exc:
                raise ValueError(f"--max-tasks {max_tasks!r}: {exc.problem} (leave the flag out to run "
                                 "without a limit)") from None
        return cls(idle, tasks)

    def apply(self, settings: Settings) -> Settings:
        """``settings`` with the flags given laid over ``agent.exit_when_idle`` / ``agent.max_tasks``."""
        agent = settings.agent
        return dataclasses.replace(settings, agent=dataclasses.replace(
            agent, exit_when_idle=agent.exit_when_idle if self.exit_when_idle is None else self.exit_when_idle,
            max_tasks=agent.max_tasks if self.max_tasks is None else self.max_tasks))
