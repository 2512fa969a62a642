"""What this node cannot run, said once at start, reported in the runtimes, and kept off the node.

Each runtime of ckagent.code.frameworks names the tool it needs: a Python spider (frameworks
scrapy, python, playwright, selenium) needs ``uv`` for its virtualenv; a Node spider (framework
node) needs ``node`` (and its helper ``npm`` when it has a package.json). Without them such a task
could only fail. The choice made here: **the node does not take them** (uv, node; a
node without npm still takes Node spiders — those without dependencies run — and says so). The poller skips a task this node
cannot run (it was only offered: nothing is claimed, the master keeps it for other nodes) and
excludes that spider from its next polls; a scan that finds the tool again (every few minutes, see
ckagent.agent) lets them in again. At start one WARNING per missing tool says what is missing, what
it costs and how to fix it; ``runtimes.missing`` (registration, heartbeats) says the same to the master.

run.sh installs the uv build named by the release index in ``.ckagent/bin/uv``, so a bare server
with only python3 runs every Python spider; node/npm come from the system (or nvm).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from ckagent.code.frameworks import PYTHON, RUNTIMES, framework, names
from ckagent.code.runtimes import find_npm, find_uv
from ckagent.master.protocol import Task

log = logging.getLogger(__name__)

_COST = {
    "uv": (f"Python spiders ({', '.join(names(PYTHON))}) cannot get their virtualenv, so this node does not "
           "take them (the master keeps them for other nodes)"),
    "node": "Node spiders cannot run, so this node does not take them (the master keeps them for other nodes)",
    "npm": "Node spiders with a package.json cannot get their dependencies (they fail DEPS_FAILED)",
}
_FIX = {
    "uv": ("run.sh installs it from the release index (set AGENT_RELEASE_URL), or `pip install uv` beside the "
           "agent's Python, or set deps.uv_path (AGENT_UV_PATH)"),
    "node": "install Node.js (e.g. apt-get install nodejs npm, or nvm) on this node",
    "npm": "install npm (apt-get install npm) on this node",
}


class Capabilities:
    """The tools the agent looks for (``uv_path``: deps.uv_path). Lookups are a few stat calls (no
    subprocess): cheap enough for the event loop; :meth:`refresh` repeats them."""

    def __init__(self, uv_path: Path | None) -> None:
        self._uv_path = uv_path
        self.missing: dict[str, str] = {}
        """Missing tool → what it costs (as of the last :meth:`refresh`)."""
        self.refresh()

    def refresh(self) -> dict[str, str]:
        """Look for the tools again; returns :attr:`missing`."""
        finders = {"uv": lambda: find_uv(self._uv_path), "node": lambda: shutil.which("node"), "npm": find_npm}
        tools = dict.fromkeys(t for r in RUNTIMES.values() for t in (r.tool, *r.helpers))
        self.missing = {tool: _COST[tool] for tool in tools if finders[tool]() is None}
        return self.missing

    def warn(self) -> None:
        """One WARNING per missing tool: what is missing, what it costs, how to fix it."""
        for tool, cost in self.missing.items():
            log.warning("%s not found on this node: %s; fix: %s", tool, cost, _FIX[tool])

    def cannot_run(self, task: Task) -> str | None:
        """Why this node does not take ``task`` (its framework's tool is missing), or None."""
        tool = framework(task.framework).runtime.tool
        return f"{tool} is missing: {_FIX[tool]}" if tool in self.missing else None
