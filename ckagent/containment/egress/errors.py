"""The egress package's exception (its own module: :mod:`.kernel` raises it too)."""

from __future__ import annotations

from ckagent.node.levels import LevelError


class EgressError(LevelError):
    """A forced egress level is not available here, or a task's rules cannot be added. ``blocker``
    says why a level is not available in a word (:class:`ckagent.node.levels.Blocker`)."""
