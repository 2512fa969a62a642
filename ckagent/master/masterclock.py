"""The master's clock, as its answers' ``Date`` headers tell it.

Timestamps the master stores (``startedAt``, ``finishedAt``), deadlines it computes and TLS
certificates' validity all assume the two clocks agree. :class:`MasterClock` compares each answer's
``Date`` (RFC 9110, one-second resolution) with this node's clock when the answer arrived — at most
once every :data:`CHECK_INTERVAL_SECONDS` — and raises an operator notice ("master-clock",
ckagent.node.notices: one log line, ``/status`` ``warnings``, the status page) while they differ by more
than :data:`MAX_SKEW_SECONDS`; a later answer within the bound ends it (one info line).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime

from ckagent.node.notices import Notices

MAX_SKEW_SECONDS = 300.0
"""Largest difference (seconds) between the master's clock and this node's that passes without a notice."""
CHECK_INTERVAL_SECONDS = 10.0
"""Seconds between two looks at a ``Date`` header (parsing every answer of an item flood is waste)."""
NOTICE_KEY = "master-clock"


class MasterClock:
    """Watches the master's ``Date`` headers (see the module docstring). ``skew_seconds``: the last
    difference seen (master minus node, seconds), None before the first; ``clock`` (epoch seconds) is for tests."""

    def __init__(self, notices: Notices, *, clock: Callable[[], float] = time.time) -> None:
        self._notices = notices
        self._clock = clock
        self._checked_at = float("-inf")
        self.skew_seconds: float | None = None

    def observe(self, date_header: str | None) -> None:
        """Look at one answer's ``Date`` header (None or unparsable: nothing). Never raises."""
        if not date_header:
            return
        local = self._clock()
        if local - self._checked_at < CHECK_INTERVAL_SECONDS:
            return
        try:
            master = parsedate_to_datetime(date_header).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return
        self._checked_at = local
        skew = self.skew_seconds = master - local
        if abs(skew) > MAX_SKEW_SECONDS:
            self._notices.set(NOTICE_KEY, (
                f"the master's clock is {_span(abs(skew))} {'ahead of' if skew > 0 else 'behind'} this node's "
                f"(its Date header: {date_header}; more than {MAX_SKEW_SECONDS:g} s): task timestamps, "
                "deadlines and certificate checks depend on both; sync both clocks with NTP"))
        else:
            self._notices.clear(NOTICE_KEY, f"the master's clock agrees with this node's again ({skew:+.0f} s)")


def _span(seconds: float) -> str:
    if seconds >= 7200:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"
