"""What a task's runner needs from the node's settings (``ckagent.node.config``), in one frozen record."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckagent.containment import Containment, Limits
from ckagent.containment.egress import Egress
from ckagent.node.runas import RunAs


@dataclass(frozen=True)
class RunnerConfig:
    """What the runner needs from the settings (seconds; paths absolute)."""

    work_dir: Path
    execute_timeout: float
    kill_grace: float
    agent_secrets: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    run_as: RunAs | None = None
    """Spiders and installers run as this user (``task.run_as_user``); their directories are given to it."""
    stall_timeout: float = 0.0
    """Seconds without output, item or stats change before a task is stopped STALLED (0 = off)."""
    containment: Containment | None = None
    """The node's containment level; None = process groups only (no subreaper, no limits)."""
    default_limits: Limits = field(default_factory=Limits)
    """Limits of a task that names none (``task.memory_limit_bytes`` ...)."""
    egress: Egress | None = None
    """The node's egress level and policy (None = no network policy)."""
    max_artifact_bytes: int = 100 * 1024**2
    """Most bytes of a task's artifacts shipped to the master (``task.max_artifact_bytes``); over it, kept."""
