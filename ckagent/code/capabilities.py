"""What this node cannot run, said once at start, reported in the runtimes, and kept off the node.

A Python spider (frameworks scrapy, python, playwright, selenium) needs ``uv`` for its virtualenv; a
Node spider (framework node) needs ``node`` (and ``npm`` when it has a package.json). Without them
such a task could only fail. The choice made here: **the node does not take them** (uv, node; a
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

from ckagent.code.deps import PYTHON_FRAMEWORKS
from ckagent.code.runtimes import find_npm, find_uv
from ckagent.master.protocol import Task

log = logging.getLogger(__name__)

NODE_FRAMEWORKS = ("node",)

_COST = {
    "uv": (f"Python spiders ({', '.join(PYTHON_FRAMEWORKS)}) cannot get their virtualenv, so this node does not "
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
        found = {"uv": find_uv(self._uv_path), "node": shutil.which("node"), "npm": find_npm()}
        self.missing = {tool: _COST[tool] for tool, path in found.items() if path is None}
        return self.missing

    def warn(self) -> None:
        """One WARNING per missing tool: what is missing, what it costs, how to fix it."""
        for tool, cost in self.missing.items():
            log.warning("%s not found on this node: %s; fix: %s", tool, cost, _FIX[tool])

    def cannot_run(self, task: Task) -> str | None:
        """Why this node does not take ``task`` (its framework's tool is missing), or None."""
        if task.framework in PYTHON_FRAMEWORKS and "uv" in self.missing:
            return f"uv is missing: {_FIX['uv']}"
        if task.framework in NODE_FRAMEWORKS and "node" in self.missing:
            return f"node is missing: {_FIX['node']}"
        return None
