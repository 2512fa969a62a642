"""``agent.max_tasks``: how many tasks the agent may still claim in its life, kept on disk across restarts.

A one-task Kubernetes Job (``ckagent run --max-tasks 1``) must run one task, not one per agent process:
the pod's supervisor restarts a crashed or OOM-killed agent in place, on the same work dir, and that
restart must not reset the count. So every task this life claims is written to
``<work_dir>/max-tasks.json`` (``{"claimed": [task ids], "since": ISO time}``; a temporary file renamed
over it, no fsync: a killed process loses nothing the kernel has, and a crashed machine takes a pod's
disk with it) at its admission, before its spider can start. The next agent on the work dir reads it
back and goes on counting.

A life ends with a deliberate stop (a drain, a terminate, an ephemeral exit that delivered everything),
also of an agent without ``max_tasks`` (a count a crashed life left must not carry over into a later
one): :meth:`TaskBudget.end_life` removes the file (ckagent.task.lifespan), so the next start counts from 0. A crash, ``kill -9``, the
OOM killer and a hand-over (SIGUSR2: the next agent re-adopts the running spiders) keep it.

What counts: a claim the master answered (or a task a poll answer claimed for this node) that the node
admitted. A claim on the wire when the agent was killed is not counted (the master's reconciliation takes
it back: the node never ran it); a task re-adopted after a restart counts only when this life claimed it
(it is in the file already), so a task an agent without ``max_tasks`` left running is finished but not
counted. Tasks the node cannot take because the budget is spent are never claimed: the poller asks for at
most :attr:`TaskBudget.left` (with its free slots), and refuses what a master hands out beyond it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

BUDGET_FILE = "max-tasks.json"


class TaskBudget:
    """At most ``limit`` (>= 1) tasks claimed in the agent's life, counted in ``work_dir``'s
    :data:`BUDGET_FILE`. Build it with :meth:`load` (reads the file: blocking, small). Use from one thread."""

    def __init__(self, limit: int, path: Path, claimed: list[str]) -> None:
        if limit < 1:
            raise ValueError(f"max_tasks must be >= 1, got {limit}")
        self.limit = limit
        self.path = path
        self.claimed: list[str] = claimed
        """Task ids this life claimed, oldest first."""
        self._write_failed = False

    @classmethod
    def load(cls, limit: int, work_dir: Path) -> TaskBudget:
        """The budget of ``work_dir``'s life so far (a fresh one when no file is there). A file that cannot
        be read or parsed is said in the log and the count starts over (it is only ever replaced whole,
        so only a hand-edited file gets there). Blocking (one small read)."""
        path = work_dir / BUDGET_FILE
        claimed: list[str] = []
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            claimed = [str(task_id) for task_id in data["claimed"]]
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("max-tasks: cannot read %s (%s); counting from 0", path, exc)
        budget = cls(limit, path, list(dict.fromkeys(claimed)))
        if claimed:
            log.info("max-tasks: %d of %d task(s) claimed before this start (a restart of the same life: %s)",
                     len(budget.claimed), limit, path)
        return budget

    @property
    def left(self) -> int:
        """Tasks that may still be claimed (0 once spent)."""
        return max(0, self.limit - len(self.claimed))

    @property
    def spent(self) -> bool:
        """True once ``limit`` tasks were claimed."""
        return self.left == 0

    def describe(self) -> str:
        """``1 of 1`` (claimed of the limit), for the log and /status."""
        return f"{len(self.claimed)} of {self.limit}"

    def take(self, task_id: str) -> None:
        """Count ``task_id`` (claimed, about to be admitted) and write the file before returning (one small
        write and a rename, on the caller's thread: it must be on disk before the task's spider starts).
        Counted once (a task already counted: nothing). A write that fails is logged once; the count
        in memory still holds for this process."""
        if task_id in self.claimed:
            return
        self.claimed.append(task_id)
        payload = json.dumps({"claimed": self.claimed, "limit": self.limit,
                              "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        tmp = self.path.with_name(f".{BUDGET_FILE}.tmp")
        try:
            tmp.write_text(payload, encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            if not self._write_failed:
                log.error("max-tasks: cannot write %s (%s); a restart of this agent would count from 0",
                          self.path, exc)
            self._write_failed = True

    def end_life(self) -> None:
        """The agent stops on purpose (not a crash, not a hand-over): the next start counts from 0. Blocking
        (one unlink); errors other than a missing file are logged."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("max-tasks: cannot remove %s (%s); the next start goes on counting", self.path, exc)
