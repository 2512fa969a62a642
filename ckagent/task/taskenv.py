"""A spider's environment and the files of its task dir it is handed: what every task's process gets.

The variables (docs/protocol.md, "Running a task"): the node's base environment, its identity's HOME,
USER and LOGNAME, the dependencies' (``PATH`` …), its private ``TMPDIR``, the node's ``extra_env``, the
task's own ``env``, the egress level's proxy variables, then the agent's ``CK_*`` — the task's ids, its
files (``CK_ITEMS_FILE``, ``CK_STATS_FILE``, ``CK_TASK_DIR``, ``CK_DATA_DIR``), its ``CK_PARAMS``, and
the resume channel of issue 38:

==========================  =====================================  ===================================
variable                    path                                   who writes it
==========================  =====================================  ===================================
``CK_STATE_DIR``            ``<task_dir>/state``                   the spider (restored from the
                                                                   attempt's checkpoint before the
                                                                   spawn, else empty)
``CK_CONTROL_FILE``         ``<task_dir>/control.jsonl``           the agent appends, the spider reads
``CK_CONTROL_ACK_FILE``     ``<task_dir>/control-ack.jsonl``       the spider appends, the agent reads
``CK_SNAPSHOT_DIR``         ``<task_dir>/snapshots``               the spider (``N.tmp`` → ``N``)
``CK_ATTEMPT``              —                                      the attempt's number (1, 2, …)
==========================  =====================================  ===================================

:func:`make_resume_files` makes them in the spawn hop: the state and snapshot dirs and the ack file
are the spider's (its uid, like the task dir), the control file is the agent's (mode 0644: the spider
reads it, only the agent appends; the agent never follows a link the spider put in its place:
ckagent.node.beneath). ckagent.task.checkpoints is the agent's side of the channel.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckagent.code.deps import Prepared, spider_base_env
from ckagent.containment.private import task_tmp_env
from ckagent.containment.process import MARKER_VAR
from ckagent.delivery.crawlstats import STATS_FILE
from ckagent.master.ids import safe_name
from ckagent.node import beneath
from ckagent.task.admission import RunningTask
from ckagent.task.outcome import Notice
from ckagent.task.runconfig import RunnerConfig

__all__ = ["CONTROL_ACK_FILE", "CONTROL_FILE", "SNAPSHOTS_DIR", "STATE_DIR", "make_resume_files", "spider_env"]

STATE_DIR = "state"
"""``CK_STATE_DIR``: the task's state, below its task dir (packed into its checkpoints)."""
CONTROL_FILE = "control.jsonl"
"""``CK_CONTROL_FILE``: the agent's requests (persistState, migrating), one JSON object a line."""
CONTROL_ACK_FILE = "control-ack.jsonl"
"""``CK_CONTROL_ACK_FILE``: the spider's answers, one JSON object a line."""
SNAPSHOTS_DIR = "snapshots"
"""``CK_SNAPSHOT_DIR``: the spider's copies of its state dir, one per answered request (``N``)."""
CONTROL_FILE_MODE = 0o644
"""The control file: the agent's, readable by the spider (its task dir is the spider's, 0700)."""


def spider_env(config: RunnerConfig, rt: RunningTask, task_dir: Path, prepared: Prepared,
               notice: Notice) -> dict[str, str]:
    """The environment of ``rt``'s spider (see the module docstring for the order of its layers).
    Never blocks; raises nothing of its own."""
    task = rt.task
    env = spider_base_env(prepared.path_prefix)
    if rt.run_as is not None:  # HOME, USER, LOGNAME of its identity (a spider's own uid has no passwd entry)
        env.update(rt.run_as.env())
    env["HOME"] = str(config.work_dir / "spider-home" / safe_name(task.spider_id))
    env.update(prepared.env)
    privacy = config.containment.privacy if config.containment is not None else None
    env.update(task_tmp_env(task_dir, privacy))  # its own TMPDIR (a task's env may still name another)
    env.update(config.extra_env)
    env.update(task.env)
    if config.egress is not None:  # the proxy variables of the advisory level ({} otherwise)
        env.update(config.egress.task_env(rt.egress, env, notice))
    env.update(
        {
            MARKER_VAR: task.id,
            "CK_SPIDER_ID": task.spider_id,
            "CK_SPIDER_NAME": task.spider_name,
            "CK_ITEMS_FILE": str(task_dir / "items.jsonl"),
            "CK_STATS_FILE": str(task_dir / STATS_FILE),
            "CK_TASK_DIR": str(task_dir),
            "CK_DATA_DIR": str(config.work_dir / "spider-data" / safe_name(task.spider_id)),
            "CK_PARAMS": json.dumps(task.params, ensure_ascii=False),
            "CK_STATE_DIR": str(task_dir / STATE_DIR),
            "CK_CONTROL_FILE": str(task_dir / CONTROL_FILE),
            "CK_CONTROL_ACK_FILE": str(task_dir / CONTROL_ACK_FILE),
            "CK_SNAPSHOT_DIR": str(task_dir / SNAPSHOTS_DIR),
            "CK_ATTEMPT": str(task_attempt(rt)),
        }
    )
    return env


def task_attempt(rt: RunningTask) -> int:
    """The attempt ``rt`` runs (``Task.attempt``; 1 for a master that does not number attempts)."""
    attempt = getattr(rt.task, "attempt", 1)
    return attempt if isinstance(attempt, int) and attempt >= 1 else 1


def make_resume_files(task_dir: Path) -> None:
    """Make the state dir, the snapshot dir and the ack file (the task dir's owner's: the spider's) and
    the control file (the agent's, :data:`CONTROL_FILE_MODE`) below ``task_dir``; what is there already
    (a restored state dir, a re-run's files) is kept. Blocking (a few system calls: the spawn hop).
    Raises OSError (a full disk), NotBeneath (a link the spider planted at one of the names)."""
    for name in (STATE_DIR, SNAPSHOTS_DIR):
        os.close(beneath.open_dir(task_dir, name, create=True))  # given to the task dir's owner
    owner = os.stat(task_dir, follow_symlinks=False)
    fd = beneath.open_file(task_dir, CONTROL_ACK_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        if os.geteuid() == 0 and (os.fstat(fd).st_uid, os.fstat(fd).st_gid) != (owner.st_uid, owner.st_gid):
            os.fchown(fd, owner.st_uid, owner.st_gid)
    finally:
        os.close(fd)
    os.close(beneath.open_file(task_dir, CONTROL_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, CONTROL_FILE_MODE))
