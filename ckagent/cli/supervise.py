"""``ckagent supervise``: the pod's PID 1 (ckagent.pod). Listed in the CLI's help; its arguments are
parsed by ckagent.pod.command (``python -m ckagent`` and the ``ckagent`` entry point go there directly,
without the CLI's imports: ckagent/__main__.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn


def supervise_main(argv: Sequence[str]) -> NoReturn:
    """Run ``ckagent supervise`` with ``argv`` (its arguments); exits with its code."""
    from ckagent.pod.command import main

    main(argv)


def supervise_command(*agent_args: str, config: str | None = None, live_port: int | None = None,
                      start_timeout: float = 120.0) -> int:
    """Run the agent as a child and keep it up: the container's PID 1 (`supervise [-c CONFIG]
    [--live-port PORT] [--start-timeout S] [-- AGENT_ARGS...]`).

    Restarts an agent that died unasked (it re-adopts the running crawls), forwards stop signals,
    reaps orphans, serves GET /livez; exits with the agent's code when it stopped as asked.

    Parameters
    ----------
    agent_args
        Arguments for `ckagent run` (after --).
    config
        The agent's YAML config file.
    live_port
        Port of GET /livez (default AGENT_LIVE_PORT, else agent.port + 1).
    start_timeout
        Seconds a (re)starting agent may take to answer /healthz before /livez says 503.
    """
    argv = [*(["-c", config] if config else []), *([f"--live-port={live_port}"] if live_port is not None else []),
            f"--start-timeout={start_timeout}", "--", *agent_args]
    supervise_main(argv)
