"""A small fleet on one machine (issue 39, item 6; harness.fleet): 6 real agents against one reference
master, 200 short tasks and 6 long resumable ones; then half the fleet stopped while 30 more short tasks
and the long crawls run — two nodes by ``ckagent stop --migrate``, one lost (everything of it SIGKILLed,
its work dir deleted). Every task ends SUCCESS exactly once: a short task one item, run once before the
stop; a long crawl's steps 0..n-1 each once across its attempts, ending on a node that stayed. The
benchmark (bench/fleet.py) runs the same scenario at the issue's size and reports the figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from harness.fleet import Scenario, fleet

pytestmark = pytest.mark.slow

SMALL = Scenario(agents=6, short_tasks=200, long_tasks=6, short_during_stop=30, max_workers=4, short_spiders=4,
                 long_spiders=6, long_poll_wait=5.0, step_seconds=0.25, min_steps=8, checkpoint_interval=1.0,
                 node_lost_after=3.0, submitters=4)


async def test_a_fleet_runs_every_task_once_and_survives_losing_half(tmp_path: Path) -> None:
    with trio.fail_after(300):
        async with fleet(tmp_path / "fleet", SMALL) as running:
            figures = await running.run()
    print(f"fleet figures: {figures}")
    assert not figures.problems, "\n".join(figures.problems[:20])
    assert figures.attempts["short"] == 0, figures.attempts  # before the stop: each short task ran once
    assert figures.migrate_codes == [(0, 0)] * 2, figures.migrate_codes
    assert min(figures.spread) > 0, figures.per_node  # every node took a share of the short tasks
    # the nodes stopped ran long crawls; each ended on a node that stayed (problems), resumed there
    assert figures.moved.get("MIGRATED", 0) >= 1 and figures.moved.get("NODE_LOST", 0) >= 1, figures.moved
    assert figures.long_resumed == sum(figures.long_on_stopped.values()), figures
