"""The one start-up error type: why the agent cannot start (or go on), and the exit code that says so.

Exception tree::

    Exception
    └── StartupError        exit_code 1: the agent cannot run (state store unusable, status port in
        │                   use, registration refused); ``str()`` says what is wrong and how to fix it
        └── ConfigError     exit_code 2: the configuration is unusable (ckagent.config)

Raised anywhere on the way up; translated into the process's exit status once, by ``ckagent.cli.main``
(``run_agent`` logs it first, so it is in the agent's log too).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class StartupError(Exception):
    """The agent cannot start or go on running. ``exit_code``: the process's exit status (1 here).

    ``logged`` is True once the message went to the agent's log (the CLI then does not print it again).
    """

    exit_code: int = EXIT_FAILURE
    label: str = "cannot run"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.logged = False
