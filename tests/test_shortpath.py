"""The path of one task stays short: the Trio tasks and thread hops the agent spends per task are
counted (bench._census: a Trio instrument around a real in-process agent, the real dev master, real
``python -c`` spiders) and held at their ceilings, so a change that adds a task or a hop per task
fails here and says where the new one comes from.

The ceilings are what the agent does today; issue 26 (item 7) asks for ≤ 4 tasks and ≤ 6 hops.
Lower them as the path gets shorter; never raise them without saying why in the commit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

import ckagent

REPO = str(Path(ckagent.__file__).resolve().parent.parent)
if REPO not in sys.path:  # bench/ is the repository's, not an installed package
    sys.path.insert(0, REPO)

from bench import _census  # noqa: E402

HELD_TASKS = 11
"""Trio tasks of the agent's own per task, at most: today 8 (quiet), +3 for a busy machine (it makes the
node batcher send twice per task: its ``_send`` and a shipper's ``_fly`` count per batch). The task's
runner is one of them: its phases and its spider's supervision add none (ckagent.task.runner)."""
HELD_HOPS = 14
"""Thread hops of the agent's own per task, at most: today 8.3-9 (quiet), and up to ~5 more on a loaded
machine, as the once-a-second disk scan and the batches fall. The runner's are one per phase: prepare,
spawn, end."""


@pytest.mark.slow  # a dev master, an agent and a spider's first virtualenv: 4-10 s
def test_the_path_per_task_does_not_grow(tmp_path: Path) -> None:
    async def main() -> dict:
        with trio.fail_after(120):
            return await _census.agent_census(tmp_path, 3)

    census = trio.run(main)
    shown = _census.census_table(census)
    assert census["tasks_per_task"] <= HELD_TASKS, shown
    assert census["hops_per_task"] <= HELD_HOPS, shown
    # The instrument sees the path at all (a broken hook would count nothing and pass).
    assert census["task_names"].get("task") == 1, shown
    assert any(site.startswith("task.runner:_run → spawn") for site in census["hop_sites"]), shown
    # One hop per phase of the runner's (prepare, spawn, end), and no task beside the runner's own.
    for site in ("task.deploy:deploy → _prepare_hop", "task.runner:_run → spawn", "task.runner:finish_run → end_reads"):
        assert census["hop_sites"].get(site) == 1, shown
    runner_hops = sum(n for site, n in census["hop_sites"].items() if site.startswith(("task.", "code.", "containment.")))
    assert runner_hops == 3, shown
    assert not any(name.startswith(("ckagent.task.", "ckagent.containment.", "ckagent.code."))
                   for name in census["task_names"]), shown
