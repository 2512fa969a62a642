"""Ephemeral workers in tests: a fake node for the watch's rules on the autojump clock
(tests/test_ephemeral_watch.py) and the helpers of the real agents' tests (tests/test_ephemeral.py)."""

from __future__ import annotations

from ckagent.node.broadcast import Broadcast
from ckagent.node.ephemeral import Activity
from ckagent.node.intake import IntakeGate


class FakeNode:
    """What an :class:`~ckagent.node.ephemeral.EphemeralWatch` reads of an agent, set by the test.

    ``answer_in_hand``: the poller holds an answer when the watch lets it settle — settling admits its task
    (``running`` becomes True). ``settle_calls`` counts the watch's settles; ``closed_while_settling`` the
    gate's closed causes at each; ``stopped`` the reasons the watch stopped the agent with.
    """

    def __init__(self) -> None:
        self.gate = IntakeGate()
        self.running = False
        self.delivering = False
        self.answer_in_hand = False
        self.settle_calls = 0
        self.closed_while_settling: list[str] = []
        self.stopped: list[str] = []
        self._changes = Broadcast()

    def set(self, *, running: bool | None = None, delivering: bool | None = None) -> None:
        """Change what the node does (wakes the watch)."""
        if running is not None:
            self.running = running
        if delivering is not None:
            self.delivering = delivering
        self._changes.set()

    def stop(self, reason: str) -> None:
        """The agent's stop (a drain in the real one)."""
        self.stopped.append(reason)

    async def _changed(self, seen: int) -> None:
        if self._changes.count == seen:
            await self._changes.wait()

    async def _settled(self) -> None:
        self.settle_calls += 1
        self.closed_while_settling.extend(k for k in ("exit-when-idle", "max-tasks") if self.gate.is_closed(k))
        if self.answer_in_hand:
            self.answer_in_hand = False
            self.set(running=True)

    def activity(self) -> Activity:
        """The node as the watch reads it."""
        return Activity(working=lambda: self.running, delivering=lambda: self.delivering,
                        mark=lambda: self._changes.count, changed=self._changed, settled=self._settled)
