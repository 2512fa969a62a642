"""The reference master's retry decision: after an attempt's final result, does the task run again, when,
and does that attempt count against ``retry.maxAttempts`` (docs/protocol.md, "Causes and retries").

Pure (no clock, no store): :func:`decide` reads the policy, how the attempt ended and what came before.
The rules, first match wins::

    SUCCESS, CANCELLED, a cancel asked          → final
    retryable false                             → final (BAD_TASK, LOG_BUDGET, an unknown code, ...)
    class disruption                            → again at once, not counted   (AGENT_LOST, MIGRATED, NODE_LOST...)
    MEMORY_LIMIT with a checkpoint of its own   → again at once, not counted   (it resumes; nothing is lost)
    otherwise the attempt counts; again when fewer than maxAttempts counted attempts were made and
    its class is in ``on`` or it is EXIT_NONZERO with an exit code in ``exitCodes``; after
    backoffSeconds × factor^(n−1) seconds (n: the counted attempts so far, this one included)

An uncounted attempt runs again only while fewer than :data:`MAX_UNCOUNTED_IN_A_ROW` uncounted attempts
ended in a row (this one included): a node that loses every task, or an agent that calls every
failure a disruption, cannot keep a task going for ever.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_BACKOFF_SECONDS", "MAX_UNCOUNTED_IN_A_ROW", "Decision", "Ending", "Policy", "decide"]

MAX_UNCOUNTED_IN_A_ROW = 25
"""Most uncounted attempts (disruptions, a MEMORY_LIMIT that resumes) that end in a row before the task
is final anyway."""
MAX_BACKOFF_SECONDS = 7 * 24 * 3600.0
"""The longest wait before a retry (a large factor would otherwise overflow)."""


@dataclass(frozen=True)
class Policy:
    """A task's ``retry`` (the wire's RetryPolicy, as stored); the defaults retry nothing counted."""

    max_attempts: int = 1
    backoff_seconds: float = 30.0
    factor: float = 2.0
    on: frozenset[str] = field(default_factory=frozenset)
    """Cause classes (``disruption``, ``resource``, ``spider``, ``setup``) that are retried."""
    exit_codes: frozenset[int] = field(default_factory=frozenset)
    """Exit codes of EXIT_NONZERO that are retried, whatever ``on`` says."""

    @classmethod
    def from_stored(cls, obj: Mapping[str, Any] | None) -> Policy:
        """The policy of a stored ``retry`` object (validated on the way in; None or {} = the defaults)."""
        if not obj:
            return cls()
        backoff = obj.get("backoffSeconds")
        return cls(
            max_attempts=int(obj.get("maxAttempts") or 1),
            backoff_seconds=30.0 if backoff is None else float(backoff),
            factor=float(obj.get("factor") or 2.0),
            on=frozenset(str(c) for c in obj.get("on") or ()),
            exit_codes=frozenset(int(c) for c in obj.get("exitCodes") or ()),
        )


@dataclass(frozen=True)
class Ending:
    """How one attempt ended: its final result as the master stored it."""

    status: str
    """SUCCESS, FAILED or CANCELLED."""
    error_code: str | None = None
    exit_code: int | None = None
    cause_class: str | None = None
    retryable: bool = False
    checkpointed: bool = False
    """The attempt shipped a checkpoint of its own (newer than the one it resumed from)."""
    cancel_requested: bool = False
    """An operator asked to cancel the task."""


@dataclass(frozen=True)
class Decision:
    """What follows an attempt: ``again`` (a new attempt after ``delay_seconds``) or final; whether the
    attempt ``counted`` against maxAttempts; ``why`` in words (shown with the attempt)."""

    again: bool
    counted: bool
    delay_seconds: float
    why: str


def decide(policy: Policy, ending: Ending, *, counted_before: int, uncounted_in_a_row: int) -> Decision:
    """The decision after ``ending`` (see the module doc). ``counted_before``: counted attempts before this
    one; ``uncounted_in_a_row``: uncounted attempts that ended right before this one. Pure; never raises."""
    if ending.status == "SUCCESS":
        return Decision(False, True, 0.0, "succeeded")
    if ending.status == "CANCELLED" or ending.cancel_requested:
        return Decision(False, True, 0.0, "cancelled")
    if not ending.retryable:
        return Decision(False, True, 0.0, f"{ending.error_code or ending.status} is not retryable")
    resumes = ending.error_code == "MEMORY_LIMIT" and ending.checkpointed
    if ending.cause_class == "disruption" or resumes:
        run = uncounted_in_a_row + 1
        what = "a disruption" if ending.cause_class == "disruption" else "MEMORY_LIMIT after a checkpoint"
        if run >= MAX_UNCOUNTED_IN_A_ROW:
            return Decision(False, False, 0.0,
                            f"{what}, but {run} uncounted attempts ended in a row (at most {MAX_UNCOUNTED_IN_A_ROW})")
        return Decision(True, False, 0.0, f"{what}: again at once, not counted")
    counted = counted_before + 1
    wanted = ending.cause_class is not None and ending.cause_class in policy.on
    by_exit = (ending.error_code == "EXIT_NONZERO" and ending.exit_code is not None
               and ending.exit_code in policy.exit_codes)
    if not (wanted or by_exit):
        return Decision(False, True, 0.0, f"retry.on has no {ending.cause_class or 'class'}"
                        + (f" and retry.exitCodes no {ending.exit_code}" if ending.error_code == "EXIT_NONZERO" else ""))
    if counted >= policy.max_attempts:
        return Decision(False, True, 0.0, f"{counted} of retry.maxAttempts {policy.max_attempts} made")
    try:
        delay = policy.backoff_seconds * policy.factor ** (counted - 1)
    except OverflowError:
        delay = MAX_BACKOFF_SECONDS
    delay = MAX_BACKOFF_SECONDS if not math.isfinite(delay) else min(max(delay, 0.0), MAX_BACKOFF_SECONDS)
    return Decision(True, True, delay, f"attempt {counted} of {policy.max_attempts}: again after {delay:g} s")
