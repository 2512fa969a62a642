"""Keep httpx's own command-line client out of the agent's start-up.

``import httpx`` imports ``httpx._main`` (the ``httpx`` command), which imports rich, click and
pygments whenever they are installed — and rich is (cyclopts needs it). The agent never runs that
command, yet those imports were about a fifth of its start-up imports (``python -X importtime``),
paid before a restarted agent can re-attach its tasks. :func:`defer_httpx_cli` puts a stand-in
module in its place before httpx is first imported; its ``main`` imports the real client on the
first call, so ``httpx.main`` still works for whoever calls it.
"""

from __future__ import annotations

import sys
import types
from typing import Any

MODULE = "httpx._main"


def defer_httpx_cli() -> bool:
    """Install the stand-in (before the first ``import httpx``). Returns False, doing nothing, when
    httpx (or its client) is imported already. Never raises."""
    if "httpx" in sys.modules or MODULE in sys.modules:
        return False
    stand_in = types.ModuleType(MODULE, "httpx's command-line client, imported on first use (ckagent.node.lazycli)")

    def main(*args: Any, **kwargs: Any) -> Any:
        if sys.modules.get(MODULE) is stand_in:
            del sys.modules[MODULE]
        import importlib

        return importlib.import_module(MODULE).main(*args, **kwargs)

    stand_in.main = main  # type: ignore[attr-defined]
    sys.modules[MODULE] = stand_in
    return True
