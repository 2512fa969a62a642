"""What a task's runner needs from the node's settings (``ckagent.node.config``), in one frozen record,
and the node's identities (whom spiders run as) built from them."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ckagent.code.pyplan import bundled_sdk_dir
from ckagent.code.workcopy import spider_paths
from ckagent.containment import Containment, Limits
from ckagent.containment.egress import Egress
from ckagent.node.config import Settings
from ckagent.node.identity import Identities, open_identities
from ckagent.node.runas import RunAs
from ckagent.node.state import StateStore


@dataclass(frozen=True)
class RunnerConfig:
    """What the runner needs from the settings (seconds; paths absolute)."""

    work_dir: Path
    execute_timeout: float
    kill_grace: float
    agent_secrets: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    identities: Identities | None = None
    """Whom each spider runs as, and its installers (the node's identity level: ckagent.node.identity);
    a spider's directories are given to its identity. None: every one as the agent itself."""
    stall_timeout: float = 0.0
    """Seconds without output, item or stats change before a task is stopped STALLED (0 = off)."""
    containment: Containment | None = None
    """The node's containment level; None = process groups only (no subreaper, no limits)."""
    default_limits: Limits = field(default_factory=Limits)
    """Limits of a task that names none (``task.memory_limit_bytes`` ...)."""
    default_disk_bytes: int | None = None
    """Disk a task that names no ``resources.diskBytes`` may hold (``task.disk_limit_bytes``; None = no limit)."""
    egress: Egress | None = None
    """The node's egress level and policy (None = no network policy)."""
    max_artifact_bytes: int = 100 * 1024**2
    """Most bytes of a task's artifacts shipped to the master (``task.max_artifact_bytes``); over it, kept."""
    checkpoint_interval: float = 60.0
    """Seconds between a task's periodic checkpoints when it names none (``task.checkpoint_interval``; 0 = none:
    ckagent.task.checkpoints)."""
    max_stop_grace: float = math.inf
    """The longest stop grace a task gets (``task.max_stop_grace``; its own ``stopGraceSeconds`` or its
    framework's default is cut to it: ckagent.task.stop.stop_grace)."""
    memory_soft_bytes: int | None = None
    """The soft memory ceiling of a task that names none (``task.memory_soft_bytes``; ckagent.task.memwatch)."""
    migrate_timeout: float = 20.0
    """Seconds a migrate, or a task over its soft memory ceiling, has to checkpoint and stop."""

    def identity_of(self, spider_id: str) -> RunAs | None:
        """The identity ``spider_id``'s processes run as (None: the agent's own). Blocking at the
        ``spider-uids`` level (a spider's first task records its uid). Raises UidsExhausted."""
        return None if self.identities is None else self.identities.for_spider(spider_id)

    @property
    def builder(self) -> RunAs | None:
        """Who runs installers (None: the agent itself)."""
        return None if self.identities is None else self.identities.builder


def node_identities(settings: Settings, store: StateStore, busy: Callable[[], Iterable[str]]) -> Identities:
    """The node's identity level and each spider's identity, from ``settings`` (ckagent.node.identity:
    ``task.run_as_user``, ``task.spider_uids``, ``task.retention``; the interpreter Python spiders'
    environments are built on, ``deps.python``, and the bundled SDK must be reachable by spiders' uids).
    ``busy``: the spiders with a claimed task here (their uids are never released); the uids are claimed
    host-wide in ``task.uid_claims``. Blocking. Raises IdentityError (a ``task.run_as_user`` this node
    cannot use); OSError (a uid claim that cannot be written)."""
    s = settings
    python = str(s.deps.python) if s.deps.python is not None else sys.executable
    work_dir = s.task.work_dir
    return open_identities(s.task.run_as_user, s.task.spider_uids, work_dir, store, python=python,
                           sdk_dir=bundled_sdk_dir(), dirs_of=lambda spider_id: spider_paths(work_dir, spider_id),
                           retention=s.task.retention, busy=busy, claims=s.task.uid_claims, node=s.agent.name)
