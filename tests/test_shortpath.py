"""The path of one task stays short: the Trio tasks and thread hops the agent spends per task are
counted (bench._census: a Trio instrument around a real in-process agent, the real dev master, real
``python -c`` spiders) and held at their ceilings, so a change that adds a task or a hop per task
fails here and says where the new one comes from.

The ceilings are what the agent does today; issue 26 (item 7) asks for ≤ 4 tasks and ≤ 6 hops.
Lower them as the path gets shorter; never raise them without saying why in the commit.

The path is held at the level ``auto`` gives this machine and, where that is a cgroup level, at the
``process-group`` level too (what a plain user gets, with the ``proxy`` egress level): each level
costs what its mechanism needs (:data:`LEVEL_HOPS`, :data:`EGRESS_TASKS`) and nothing more.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio
from harness import LEVELS_HERE

import ckagent

REPO = str(Path(ckagent.__file__).resolve().parent.parent)
if REPO not in sys.path:  # bench/ is the repository's, not an installed package
    sys.path.insert(0, REPO)

from bench import _census  # noqa: E402

HELD_TASKS = 4
"""Trio tasks of the agent's own per task, at most (issue 26's target): today 2 — the task's runner (its
phases and its spider's supervision add none: ckagent.task.runner) and its delivery — and room for
what a busy machine adds (a batch in flight of its own)."""
HELD_HOPS = 7
"""Thread hops per task at most, of the sites a task itself sets off (PERIODIC's are not): today 5 —
one per phase of the runner (prepare, spawn, end) and two of its delivery — and room for a batch's
position write on a busy machine."""
HELD_ALL_HOPS = 12
"""Thread hops per task at most, PERIODIC's included: today 5.3-5.7 quiet; the once-a-second disk scan
adds up to ~3 per second a task lasts, so a loaded machine adds several."""
LEVEL_HOPS = {"process-group": 1}
"""Hops a task's containment level adds to the runner's three: at ``process-group`` the end of a
spider is one scan of /proc for what it left (``wait_empty``, which also reaps the orphans that
ended as the agent's zombies: the kill's sweep would only scan again), where a cgroup level is told
its cgroup is empty by the kernel (``cgroup.events``, no hop)."""
EGRESS_TASKS = {"proxy": 1}
"""Trio tasks a task's egress level adds: at ``proxy`` the task's own listener serves in a task of
its own (its port identifies the task: clients that send no proxy credentials, such as Chromium)."""
LEVELS = ["auto", *(["process-group"] if any(level != "process-group" for level in LEVELS_HERE) else [])]
"""``auto`` (the strongest level here), and ``process-group`` where that is a cgroup level."""
PERIODIC = ("delivery.outbox:_disk_loop", "delivery.outbox:_watch_disk", "delivery.capture:refresh",
            "node.intake:", "node.state:_write_positions → save_stream_positions")
"""Hop sites that come with time (the outbox's once-a-second look at the disk and its position
write), not with a task: how many fall in a task's window follows the machine's load."""


@pytest.mark.slow  # a dev master, an agent and a spider's first virtualenv: 4-10 s
@pytest.mark.parametrize("level", LEVELS)
def test_the_path_per_task_does_not_grow(tmp_path: Path, level: str) -> None:
    async def main() -> dict:
        with trio.fail_after(120):
            return await _census.agent_census(tmp_path, 3, AGENT_TASK_CONTAINMENT=level)

    census = trio.run(main)
    shown = _census.census_table(census)
    assert level in ("auto", census["containment"]), shown
    level_hops = LEVEL_HOPS.get(census["containment"], 0)
    assert census["tasks_per_task"] <= HELD_TASKS + EGRESS_TASKS.get(census["egress"], 0), shown
    assert census["hops_per_task"] <= HELD_ALL_HOPS + level_hops, shown
    per_task = sum(n for site, n in census["hop_sites"].items() if not site.startswith(PERIODIC))
    assert per_task <= HELD_HOPS + level_hops, shown
    # The instrument sees the path at all (a broken hook would count nothing and pass).
    assert census["task_names"].get("task") == 1, shown
    assert any(site.startswith("task.runner:_run → spawn") for site in census["hop_sites"]), shown
    # One hop per phase of the runner's (prepare, spawn, end), what the level needs, and no task beside
    # the runner's own.
    for site in ("task.deploy:deploy → _prepare_hop", "task.runner:_run → spawn", "task.runner:finish_run → end_reads"):
        assert census["hop_sites"].get(site) == 1, shown
    if census["containment"] == "process-group":
        assert census["hop_sites"].get("containment.process_group:wait_empty → _find_or_reap") == 1, shown
    runner_hops = sum(n for site, n in census["hop_sites"].items() if site.startswith(("task.", "code.", "containment.")))
    assert runner_hops == 3 + level_hops, shown
    assert not any(name.startswith(("ckagent.task.", "ckagent.containment.", "ckagent.code."))
                   for name in census["task_names"]), shown
