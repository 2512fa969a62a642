"""``python -m bench.flood --quick`` runs in the suite: 50,000 lines through a real agent to a dev master
that keeps up (``--discard-logs``: count and SHA-256) and to one that stores them; both hold every line.
Figures are not asserted (the machine is noisy); the loss checks are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ckagent

REPO = Path(ckagent.__file__).resolve().parent.parent


def test_quick_log_flood_runs_and_loses_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "bench.flood", "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "| master: keeps up (acknowledges without storing) | master: reference master (SQLite) |" in done.stdout
    assert done.stdout.count("50,000 all, once, in order") == 2, done.stdout
