"""The protocol's fixed words: statuses, error codes and the outcome table, features, frameworks, times.

Everything here is a constant of docs/protocol.md (a test holds ERROR_CODES against its outcome table)
or the one way the protocol writes a time: ISO-8601 UTC with milliseconds ("2026-11-29T16:03:50.123Z").
"""

from __future__ import annotations

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
}
"""The outcome table: ``SUCCESS`` (no errorCode) and every errorCode → the status it goes with."""
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
