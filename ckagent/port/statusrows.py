"""The rows of the status page's node table (``ckagent.port.statuspage``), made from the /status JSON
(``ckagent.port.status``): plain text (label, value) pairs that the page escapes, and the cells of its task
tables (a task's attempt, last checkpoint, the cause of a finished attempt). Every function takes
whatever the JSON holds — a missing field or one of another type is shown as "—", "none" or
"unknown", never an exception.
"""

from __future__ import annotations

from typing import Any


def identity_rows(identity: object) -> list[tuple[str, str]]:
    """The node table's rows for the identity level (``/status``'s ``identity``): the level in force with
    its details, then each stronger level not had, with why and what would give it."""
    if not isinstance(identity, dict):
        return [("identity", "—")]
    rows = [("identity", f"{identity.get('level')}: {identity.get('details')}")]
    for passed in identity.get("passedOver") or ():
        if isinstance(passed, dict) and passed.get("blocker") != "run-as-user":
            rows.append((f"identity: not {passed.get('level')}",
                         f"{passed.get('message')}; to get it: {passed.get('remedy')}"))
    return rows


def duration_text(seconds: Any) -> str:
    """``seconds`` as ``2 d 3 h``, ``3 h 4 min``, ``4 min 5 s`` or ``5 s``; "—" for anything else."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
        return "—"
    s = int(seconds)
    days, hours, minutes = s // 86400, s % 86400 // 3600, s % 3600 // 60
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {s % 60} s" if minutes else f"{s} s"


def ids_text(ids: Any, count: Any, limit: int = 10) -> str:
    """``count`` and the first ``limit`` of ``ids`` (``3: a, b, c``; ``none``)."""
    shown = [str(i) for i in ids] if isinstance(ids, list) else []
    total = count if isinstance(count, int) and not isinstance(count, bool) else len(shown)
    if not total:
        return "none"
    more = f" (+{total - min(limit, len(shown))} more)" if total > min(limit, len(shown)) else ""
    return f"{total}: " + ", ".join(shown[:limit]) + more


def level_row(name: str, level: object) -> tuple[str, str]:
    """The node table's row of a level (``/status``'s ``egress``): ``level: details`` (policy)."""
    if not isinstance(level, dict):
        return (name, "—")
    text = f"{level.get('level')}"
    if level.get("details"):
        text += f": {level.get('details')}"
    if level.get("policy"):
        text += f" (policy: {level.get('policy')})"
    return (name, text)


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def node_history_rows(status: dict[str, Any]) -> list[tuple[str, str]]:
    """The node table's rows of the agent's history (from ``/status``): up since, the tasks found at the
    start (re-adopted, or not and reported AGENT_LOST), a hand-over's tasks, the last upgrade or
    rollback and the failed versions (run.sh's records: "unknown (why)" when they cannot be read),
    and the last full disk's culprit. Plain text: the caller escapes."""
    rows = [("up since", f"{status.get('startedAt') or '—'} UTC ({duration_text(status.get('uptimeSeconds'))})")]
    start = _obj(status.get("tasksAtStart"))
    readopted = _obj(start.get("readopted"))
    rows.append(("re-adopted at start", ids_text(readopted.get("ids"), readopted.get("count"))))
    lost = _obj(start.get("notReadopted"))
    lost_tasks = [t for t in lost.get("tasks") or () if isinstance(t, dict)]
    if lost.get("count"):
        rows.append(("not re-adopted (AGENT_LOST)", ids_text(
            [f"{t.get('id')} ({t.get('why')})" for t in lost_tasks], lost.get("count"))))
    handed = _obj(status.get("handedOver"))
    if handed.get("count"):
        rows.append(("handed over to the next agent", ids_text(handed.get("ids"), handed.get("count"))))
    upgrades = _obj(status.get("upgrades"))
    change = upgrades.get("lastChange")
    if isinstance(change, dict):
        text = (f"{change.get('action') or '?'} {change.get('from') or '?'} → {change.get('to') or '?'}: "
                f"{change.get('outcome') or 'outcome unknown'}, at {change.get('at') or 'an unknown time'}")
        if change.get("reason"):
            text += f" ({change['reason']})"
    else:
        text = f"unknown ({upgrades.get('lastChangeUnknown') or 'not read'})"
    rows.append(("last upgrade / rollback", text))
    failed = upgrades.get("failedVersions")
    if isinstance(failed, list):
        rows.append(("failed versions", ids_text(failed, upgrades.get("failedVersionsCount"), 20)))
    else:
        rows.append(("failed versions", f"unknown ({upgrades.get('failedVersionsUnknown') or 'not read'})"))
    culprit = status.get("diskCulprit")
    if isinstance(culprit, dict):
        rows.append(("full disk: culprit", f"task {culprit.get('taskId')}, {size_text(culprit.get('usedBytes'))} "
                                           f"at {culprit.get('at') or '—'}: {culprit.get('reason') or '—'}"))
    else:
        rows.append(("full disk: culprit", "none"))
    return rows


def backlog_text(outbox: dict[str, Any]) -> str:
    """The node row of what waits for the master: lines, items, bytes, the oldest wait."""
    lines, items = outbox.get("logLines", 0), outbox.get("items", 0)
    if not lines and not items:
        return "nothing"
    return (f"{lines} log lines, {items} items (≈ {size_text(outbox.get('bytes'))}), the oldest for "
            f"{outbox.get('oldestSeconds', 0):.1f} s")


def size_text(n: Any) -> str:
    if not isinstance(n, int | float):
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def checkpoint_text(checkpoint: Any) -> str:
    """A task's last checkpoint (``/status``'s ``checkpoint``): ``1-4, 12 s ago, 5.1 MiB, items 0–449
    (interval)``; ``none yet``."""
    if not isinstance(checkpoint, dict):
        return "none yet"
    items = _count(checkpoint.get("itemSeq"))
    held = "—" if items is None else ("no items" if items == 0 else f"items 0–{items - 1}")
    reason = checkpoint.get("reason")
    return (f"{checkpoint.get('id')}, {duration_text(checkpoint.get('ageSeconds'))} ago, "
            f"{size_text(checkpoint.get('sizeBytes'))}, {held}" + (f" ({reason})" if isinstance(reason, str) else ""))


def cause_text(result: Any) -> str:
    """Why a finished attempt ended, as a retry policy reads it (a result's ``causeClass`` and
    ``retryable``): ``disruption, retryable``, ``spider, not retryable``; ``—`` (a success, or none said)."""
    if not isinstance(result, dict) or not isinstance(result.get("causeClass"), str):
        return "—"
    retryable = result.get("retryable")
    said = "" if not isinstance(retryable, bool) else (", retryable" if retryable else ", not retryable")
    return f"{result['causeClass']}{said}"


def attempt_text(value: Any) -> str:
    """An attempt number (``1`` when absent, as the protocol reads it)."""
    return str(_count(value) or 1)
