"""An agent process run by a user without root (the ``agent-user`` identity level) from a root suite: the
system's python3 with the session's ckagent.pyz, as a developer without root runs it
(:func:`user_agent_process`; :func:`harness.demo.user_demo` does the same for ``ckagent demo``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from harness.core import AgentProcess
from harness.demo import demo_environ
from harness.procs import STRAY_ROOTS
from harness.users import SystemUser

__all__ = ["UserAgentProcess", "user_agent_process"]

SYSTEM_PYTHON = Path("/usr/bin/python3")


class UserAgentProcess(AgentProcess):
    """`python3 ckagent.pyz run -c <config>` as ``user`` (its uid and gid, no root group): tools (the pyz,
    uv) in ``bin`` beside the agent's directory, on PATH."""

    def __init__(self, user: SystemUser, pyz: Path, directory: Path, base_url: str, registration_token: str,
                 **settings: Any) -> None:
        super().__init__(directory, base_url, registration_token,
                         **{"deps__uv_index_url": "http://127.0.0.1:9/simple", **settings})
        self.user = user
        self.tools = directory.parent / "bin"
        self.pyz = self.tools / pyz.name
        self._give()

    def _give(self) -> None:
        os.chown(self.directory, self.user.uid, self.user.gid)
        os.chown(self.config_path, self.user.uid, self.user.gid)  # the agent's own: it makes it 0600

    async def start(self, extra_env: dict[str, str] | None = None) -> None:
        """Launch the agent process as the user (does not wait for registration)."""
        env = self.user.environ(demo_environ(PATH=f"{self.tools}:/usr/bin:/bin", **(extra_env or {})))
        with self.log_path.open("ab") as log:
            self.process = await trio.lowlevel.open_process(
                [str(SYSTEM_PYTHON), str(self.pyz), "run", "-c", str(self.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd=str(self.directory),
                **self.user.popen_options())  # type: ignore[arg-type]


def user_agent_process(user: SystemUser, pyz: Path, base_url: str, registration_token: str,
                       **settings: Any) -> UserAgentProcess:
    """A :class:`UserAgentProcess` in ``user.reach/node`` (the report dir beside it is
    ``user.reach``'s); skips without /usr/bin/python3 or uv. Blocking (copies the pyz and uv)."""
    if not SYSTEM_PYTHON.is_file():
        pytest.skip("the user runs the agent with the system's /usr/bin/python3, which this machine lacks")
    beside = Path(sys.executable).parent / "uv"
    uv = beside if beside.is_file() else Path(shutil.which("uv") or "/nonexistent/uv")
    if not uv.is_file():
        pytest.skip("no uv to give the user")
    tools = user.reach / "bin"
    tools.mkdir(mode=0o755, exist_ok=True)
    for tool in (pyz, uv):
        shutil.copy(tool, tools / tool.name)
        (tools / tool.name).chmod(0o755)
    directory = user.reach / "node"
    directory.mkdir(exist_ok=True)
    STRAY_ROOTS.append(user.reach)
    return UserAgentProcess(user, pyz, directory, base_url, registration_token, **settings)
