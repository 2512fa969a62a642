"""The agent in a fleet: one identity per node, and the master's wishes about agent versions.

- **Identity**: ``<work_dir>/node_uid`` holds a random id created on the first start and sent at every
  registration (``nodeUid``). A master that sees a second live agent with the same name and another
  id refuses it (409, the reference master does) instead of handing the node's key back and forth; the
  agent waits for the name (ckagent.master.registration). With ``agent.name_exclusive`` the registration
  says ``nameExclusive``: the orchestrator runs at most one agent with this name, so the master hands the
  name over at once (docs/protocol.md, "Register").
- **Leaving**: an agent that stopped on purpose and left no task running tells the master so (:func:`leave`,
  at most LEAVE_TIMEOUT seconds), which frees its name for a replacement with another id at once.
- **Versions**: the master may answer registration and heartbeats with ``minAgentVersion`` and
  ``desiredAgentVersion`` (PEP 440). Below the minimum the agent takes no tasks — it closes the intake
  gate under "version", keeps heartbeating (with ``pausedReason``), /readyz and the log say why — and
  takes tasks again when the minimum is lowered. With ``agent.auto_upgrade`` on and a desired version
  other than this one, the agent starts ``run.sh upgrade VERSION`` once per process (``run.sh upgrade
  --downgrade VERSION`` when it is older: the master may point back to a good release) (detached, its
  output in ``logs/upgrade.log`` next to run.sh): run.sh downloads and verifies the release, stops
  this agent (SIGTERM: it drains), starts the new one and rolls back when it does not become healthy.
  run.sh tells the agent where it is (``CKAGENT_RUN_SH``); without it there is nothing to upgrade
  with, and the agent says so once. A version that is not PEP 440 is ignored with a warning.

The version an agent reports is ``ckagent.__version__``.
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import trio

from ckagent import __version__
from ckagent.master.protocol import FEATURES, PROTOCOL_VERSION, NodeLeaving, RegisterRequest, VersionPolicy
from ckagent.node.config import AgentSettings
from ckagent.node.intake import IntakeGate
from ckagent.node.secretenv import secrets_fd
from ckagent.node.versions import InvalidVersion, Version

if TYPE_CHECKING:
    from ckagent.master.client import MasterClient
    from ckagent.master.heartbeat import HeartbeatLoop, NodeReport
    from ckagent.node.state import AsyncStateStore

log = logging.getLogger(__name__)

FINAL_BEAT_TIMEOUT = 2.0
"""Seconds the agent's last heartbeat (status STOPPED) may take on its way out."""
LEAVE_TIMEOUT = 2.0
"""Seconds the leaving call may take on the agent's way out (after its last heartbeat)."""


async def final_beat(heartbeat: HeartbeatLoop, store: AsyncStateStore, report: NodeReport) -> None:
    """The agent's last heartbeat (``report``: status STOPPED), at most FINAL_BEAT_TIMEOUT seconds; what
    the state store still holds undelivered is listed as reporting (the master must not hand those tasks
    out again). Never raises for the master's trouble (the heartbeat loop's own). Cancellation: as usual."""
    import dataclasses

    with trio.move_on_after(FINAL_BEAT_TIMEOUT):
        held = [record.task_id for record in await store.pending_delivery()]
        await heartbeat.beat_once(dataclasses.replace(report, reporting_task_ids=held))


async def leave(master: MasterClient, node_uid: str | None, terminated: bool, handed_over: int) -> None:
    """Tell the master this node is leaving (``reason`` ``terminated`` or ``drained``), so its name is
    free for a replacement at once; at most LEAVE_TIMEOUT seconds (the master down or hanging costs that
    and a log line). Sent last, and nothing when a hand-over left ``handed_over`` > 0 tasks running: the
    next agent on the work dir is this node coming back. Never raises; cancellation abandons it."""
    if handed_over:
        return
    with trio.move_on_after(LEAVE_TIMEOUT) as bound:
        await master.leave(NodeLeaving(node_uid=node_uid, reason="terminated" if terminated else "drained"))
    if bound.cancelled_caught:
        log.warning("the master did not answer the leaving call within %g s: this node's name stays "
                    "guarded until the master sees its heartbeats stopped", LEAVE_TIMEOUT)

NODE_UID_FILE = "node_uid"
RUN_SH_ENV = "CKAGENT_RUN_SH"
"""Set by run.sh for the agent it starts: the absolute path of that run.sh."""


def load_node_uid(work_dir: Path) -> str:
    """The node's own id from ``work_dir/node_uid``, created (32 hex digits) when missing or unreadable.

    Blocking (small file I/O). Raises OSError when the file cannot be written.
    """
    path = work_dir / NODE_UID_FILE
    try:
        text = path.read_text(encoding="ascii").strip()
        if len(text) == 32 and all(c in "0123456789abcdef" for c in text):
            return text
    except (OSError, UnicodeDecodeError):
        pass
    uid = uuid.uuid4().hex
    work_dir.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    part.write_text(uid + "\n", encoding="ascii")
    os.chmod(part, 0o600)  # the agent's own file (ckagent.node.workmodes), whatever the umask
    os.replace(part, path)
    return uid


def register_request(agent: AgentSettings, *, port: int, max_workers: int, runtimes: dict[str, Any],
                     node_uid: str | None, containment: dict[str, Any], egress: dict[str, Any]) -> RegisterRequest:
    """What this node says of itself at registration: its name, address and labels (``agent``), the
    status ``port`` it listens on, this machine and agent (system, CPUs, memory bytes, versions,
    protocol features), ``max_workers``, the ``runtimes`` scan, its ``node_uid`` and the
    ``containment``/``egress`` levels in force. Reads psutil (fast, never blocks for long)."""
    return RegisterRequest(
        name=agent.name, ip=agent.ip, port=port, version=__version__, os=platform.system().lower(),
        arch=platform.machine(), python=platform.python_version(), cpu_count=psutil.cpu_count() or 1,
        memory_total_bytes=psutil.virtual_memory().total, max_workers=max_workers, runtimes=runtimes,
        labels=dict(agent.labels), node_uid=node_uid, protocol_version=PROTOCOL_VERSION,
        features=list(FEATURES), containment=containment, egress=egress, name_exclusive=agent.name_exclusive)


class VersionWatch:
    """Applies the master's :class:`VersionPolicy` to this agent (see the module docstring).

    ``apply`` is called with every register and heartbeat answer; it logs only changes. The upgrade
    it asks for runs in :meth:`run`, which the agent's root nursery runs for the agent's life.
    """

    def __init__(self, gate: IntakeGate, *, auto_upgrade: bool, version: str = __version__,
                 run_sh: str | None = None, log_dir: Path | None = None) -> None:
        self._gate = gate
        self._auto_upgrade = auto_upgrade
        self._wanted = trio.Event()
        """Set once :meth:`apply` asked for an upgrade (to ``upgrade_requested``): :meth:`run` starts it."""
        self._downgrade = False
        self.version = version
        self._current = Version(version)
        self.run_sh = run_sh if run_sh is not None else os.environ.get(RUN_SH_ENV) or None
        self._log_dir = log_dir
        self.policy = VersionPolicy()
        self.upgrade_requested: str | None = None
        """The desired version this process has started `run.sh upgrade` for (once per process)."""
        self._warned: set[tuple[str, str]] = set()

    def _parse(self, field: str, text: str | None) -> Version | None:
        if text is None:
            return None
        try:
            return Version(text)
        except InvalidVersion:
            if (field, text) not in self._warned:
                self._warned.add((field, text))
                log.warning("the master's %s %r is not a PEP 440 version: ignored", field, text)
            return None

    def apply(self, policy: VersionPolicy) -> None:
        """Take a policy from the master: gate on the minimum, maybe start an upgrade to the desired one."""
        changed = policy != self.policy
        self.policy = policy
        minimum = self._parse("minAgentVersion", policy.min_agent_version)
        if minimum is not None and self._current < minimum:
            reason = (f"this agent is version {self.version}, older than the master's minimum {minimum}: "
                      "taking no tasks until it is upgraded (./run.sh upgrade, or agent.auto_upgrade on)")
            if not self._gate.is_closed("version"):
                log.warning("%s", reason)
            self._gate.close("version", reason)
        elif self._gate.is_closed("version"):
            log.info("the master's minimum agent version is now %s: taking tasks again",
                     policy.min_agent_version or "unset")
            self._gate.open("version")
        desired = self._parse("desiredAgentVersion", policy.desired_agent_version)
        if desired is None or desired == self._current:
            return
        if not self._auto_upgrade:
            if changed:
                log.info("the master would like agent version %s (this is %s); agent.auto_upgrade is off: "
                         "upgrade with ./run.sh upgrade %s", desired, self.version, desired)
            return
        if self.upgrade_requested is not None:
            return
        self.upgrade_requested = str(desired)
        if self.run_sh is None:
            log.warning("the master would like agent version %s and agent.auto_upgrade is on, but this agent "
                        "was not started by run.sh (%s unset): upgrade it the way it was installed",
                        desired, RUN_SH_ENV)
            return
        self._downgrade = desired < self._current
        self._wanted.set()

    async def run(self) -> None:
        """Wait for the upgrade :meth:`apply` asks for (at most one per process) and run it; returns
        once ``run.sh upgrade`` has exited (it stops this agent first when it works). Cancellation
        (the agent stops) leaves run.sh running: it is detached, in its own session."""
        await self._wanted.wait()
        assert self.upgrade_requested is not None
        await self._upgrade(self.upgrade_requested, self._downgrade)

    async def _upgrade(self, version: str, downgrade: bool = False) -> None:
        """Run ``run.sh upgrade [--downgrade] VERSION`` detached (its own session: it outlives this agent,
        which it stops); ``--downgrade`` when the master's desired version is older than this one."""
        assert self.run_sh is not None
        log_dir = self._log_dir or Path(self.run_sh).parent / "logs"
        words = ["upgrade", *(["--downgrade"] if downgrade else []), version]
        log.warning("%s to agent version %s as the master asks: running %s %s (log: %s); "
                    "this agent drains when run.sh stops it", "downgrading" if downgrade else "upgrading",
                    version, self.run_sh, " ".join(words), log_dir / "upgrade.log")
        env = {**os.environ, "AGENT_UPGRADE_AUTO": "on"}
        fd = secrets_fd()  # the credentials travel in their memory file, never in run.sh's environment
        try:
            await trio.to_thread.run_sync(lambda: log_dir.mkdir(parents=True, exist_ok=True))
            with open(log_dir / "upgrade.log", "ab") as out:  # noqa: ASYNC230 - opening a log file is quick
                process = await trio.lowlevel.open_process(
                    ["bash", self.run_sh, *words], stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                    pass_fds=() if fd is None else (fd,))
        except OSError as exc:
            log.error("cannot start %s upgrade %s: %s", self.run_sh, version, exc)
            return
        code = await process.wait()  # cancelled when run.sh stops this agent: the process lives on
        if code != 0:
            log.error("%s upgrade %s exited with %d (nothing changed, or rolled back): see %s",
                      self.run_sh, version, code, log_dir / "upgrade.log")
