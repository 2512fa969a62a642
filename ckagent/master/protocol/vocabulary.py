"""The protocol's fixed words: statuses, error codes and the outcome table, features, frameworks, times.

Everything here is a constant of docs/protocol.md (a test holds ERROR_CODES against its outcome table)
or the one way the protocol writes a time: ISO-8601 UTC with milliseconds ("2026-11-29T16:03:50.123Z").
"""

from __future__ import annotations

import enum
from datetime import datetime, timezone

TASK_STATUSES = ("RUNNING", "SUCCESS", "FAILED", "CANCELLED")
"""Statuses an agent reports. RUNNING is the claim; the other three are final."""
FINAL_STATUSES = ("SUCCESS", "FAILED", "CANCELLED")
ERROR_CODES = (
    "TIMEOUT",
    "CANCELLED",
    "EXIT_NONZERO",
    "SIGNALED",
    "STALLED",
    "OOM_KILLED",
    "LOG_BUDGET",
    "DEPLOY_FAILED",
    "DEPS_FAILED",
    "AGENT_LOST",
    "AGENT_ERROR",
    "BAD_TASK",
    "DISK_FULL",
    "MIGRATED",
    "MEMORY_LIMIT",
    "NODE_LOST",
)
"""Every errorCode of a result: the outcome table of docs/protocol.md lists exactly these (a test checks)."""
OUTCOME_STATUS: dict[str, str] = {
    "SUCCESS": "SUCCESS",
    "EXIT_NONZERO": "FAILED",
    "SIGNALED": "FAILED",
    "TIMEOUT": "FAILED",
    "CANCELLED": "CANCELLED",
    "STALLED": "FAILED",
    "OOM_KILLED": "FAILED",
    "LOG_BUDGET": "SUCCESS",
    "DEPLOY_FAILED": "FAILED",
    "DEPS_FAILED": "FAILED",
    "AGENT_LOST": "FAILED",
    "AGENT_ERROR": "FAILED",
    "BAD_TASK": "FAILED",
    "DISK_FULL": "FAILED",
    "MIGRATED": "FAILED",
    "MEMORY_LIMIT": "FAILED",
    "NODE_LOST": "FAILED",
}
"""The outcome table: ``SUCCESS`` (no errorCode) and every errorCode → the status it goes with."""


class CauseClass(str, enum.Enum):
    """Why an attempt ended, as a retry policy reads it (a result's ``causeClass``; docs/protocol.md,
    "Causes and retries"): a ``disruption`` of the node (never counted against ``maxAttempts``), a
    ``resource`` limit, the ``spider`` itself, or its ``setup`` (code, dependencies, the task)."""

    DISRUPTION = "disruption"
    RESOURCE = "resource"
    SPIDER = "spider"
    SETUP = "setup"


class ResumeMode(str, enum.Enum):
    """A task's ``resume``: what a new attempt of a spider that cannot persist its state does with the
    earlier attempts' items — ``restart-replace`` drops them, ``restart-keep`` keeps them (the master
    applies it; the agent says it in the task's log)."""

    RESTART_REPLACE = "restart-replace"
    RESTART_KEEP = "restart-keep"


CAUSE_CLASSES = tuple(c.value for c in CauseClass)
"""The values of :class:`CauseClass`, in the order of docs/protocol.md."""
RESUME_MODES = tuple(m.value for m in ResumeMode)
"""The values of :class:`ResumeMode` (the first is the default)."""
_CAUSES: dict[str, CauseClass] = {
    "AGENT_LOST": CauseClass.DISRUPTION,
    "AGENT_ERROR": CauseClass.DISRUPTION,
    "MIGRATED": CauseClass.DISRUPTION,
    "NODE_LOST": CauseClass.DISRUPTION,
    "OOM_KILLED": CauseClass.RESOURCE,
    "MEMORY_LIMIT": CauseClass.RESOURCE,
    "TIMEOUT": CauseClass.RESOURCE,
    "STALLED": CauseClass.RESOURCE,
    "EXIT_NONZERO": CauseClass.SPIDER,
    "SIGNALED": CauseClass.SPIDER,
    "DEPLOY_FAILED": CauseClass.SETUP,
    "DEPS_FAILED": CauseClass.SETUP,
    "BAD_TASK": CauseClass.SETUP,
}


def cause_of(error_code: str | None, *, disk_culprit: bool = True) -> tuple[CauseClass | None, bool]:
    """``(causeClass, retryable)`` of a result with ``error_code`` (None or ``SUCCESS``: a success).

    DISK_FULL is ``resource`` when the task itself filled the disk (``disk_culprit``), else a
    ``disruption`` (another task did). Not retryable: BAD_TASK (class ``setup``), CANCELLED (no class),
    a success and LOG_BUDGET (no class). An unknown code (a newer master's) → (None, False). Pure."""
    if error_code is None or error_code in ("SUCCESS", "LOG_BUDGET", "CANCELLED"):
        return None, False
    if error_code == "DISK_FULL":
        return (CauseClass.RESOURCE if disk_culprit else CauseClass.DISRUPTION), True
    cause = _CAUSES.get(error_code)
    if cause is None:
        return None, False
    return cause, error_code != "BAD_TASK"


FRAMEWORKS = ("scrapy", "python", "node", "playwright", "selenium")
NODE_STATUSES = ("RUNNING", "DRAINING", "TERMINATING", "STOPPING", "STOPPED")
"""A heartbeat's ``status``: the agent's state as it is (docs/protocol.md, Heartbeat)."""
PROTOCOL_VERSION = 1
"""The version of docs/protocol.md this agent speaks (sent at registration as ``protocolVersion``)."""
CLAIM_IN_POLL = "claim-in-poll"
"""Feature: the poll answer carries the claim (docs/protocol.md, "Claims in the poll answer"). A master
that implements it names it in its registration answer's ``features``; the agent then asks for it."""
FEATURES = ("long-poll", "exclude-spider-ids", "log-item-seq", "paused-reason", "node-uid", "agent-version-policy",
            "claim-release", CLAIM_IN_POLL)
"""What this agent supports beyond protocol version 1's core (sent at registration as ``features``)."""
POLL_FOLLOWS_RESULTS = "poll-follows-results"
"""A master feature (registration answer's ``features``): a poll's ``runningSpiderIds`` stay excluded only
while the node has a RUNNING task of theirs; a held poll is re-evaluated when the node's final result
arrives (docs/protocol.md, "A held poll follows the node's results"). The agent then keeps its held
poll across a spider finishing instead of abandoning it."""
NODE_BATCHES = "node-batches"
"""A master feature (registration answer's ``features``): ``POST /api/nodes/{id}/batches`` takes
several tasks' log and item batches in one request (docs/protocol.md, "Node batches")."""

MAX_SENDABLE_ID_CHARS = 8192
"""Longest id of a refused task the agent still reports BAD_TASK for (longer ones are only logged)."""

TIMEOUT_MESSAGE = "执行超时"
"""errorMessage of a task that hit its timeout: what the existing CrawlerKeeper backend expects."""


def utc_iso(moment: datetime) -> str:
    """Format an aware or naive-UTC datetime as the protocol's ISO-8601 UTC string (millisecond precision)."""
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def utc_now_iso() -> str:
    """The current wall-clock time as a protocol timestamp."""
    return utc_iso(datetime.now(timezone.utc))
