"""A node lost at once: its agent, the monitors and every process of its tasks SIGKILLed, their cgroups
killed, its work dir deleted — and nothing of any other node touched (issue 38's "node A lost").

What belongs to a node is found from /proc, proven per process before it is signalled (a pidfd opened,
then the process checked again through it: a pid reused meanwhile is another process, left alone):

- the agent (its pid, known to the test) and every descendant of it (monitors, installers, spiders
  while the agent lives: the agent is their parent or their subreaper);
- every process whose ``CK_TASK_DIR`` lies below the node's work dir (a spider that escaped its
  group: the monitor's children after the agent died belong to init), or whose working directory does;
- at the cgroup levels, the node's task cgroups: ``<agent's cgroup>/ckagent-<hash of its work dir>/``
  in every hierarchy (ckagent.containment.hierarchy.agent_group_name), killed with ``cgroup.kill``
  where the unified tree has it, and removed once empty.

Another node's processes have another work dir (and the same ``CK_TASK_ID`` when they run the same
task: the marker variable is no way to tell nodes apart).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ckagent.containment.hierarchy import AGENT_LEAF, agent_group_name, own_dirs
from ckagent.node import beneath

__all__ = ["KilledNode", "kill_node", "node_cgroups", "node_pids"]

KILL_BOUND = 15.0
"""Seconds :func:`kill_node` keeps killing before it fails the test (a process in state D)."""


@dataclass
class KilledNode:
    """What :func:`kill_node` did: the node's pids it found and killed (signalled, or killed with their
    cgroup), the cgroups it killed and removed."""

    pids: set[int] = field(default_factory=set)
    cgroups: list[Path] = field(default_factory=list)
    died_at: float = 0.0
    """When (epoch seconds) the first round of kills was sent: the moment the node died."""


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every live process (zombies left out). Blocking."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    state, parent = fh.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            if state not in ("Z", "X"):  # (a zombie is dead: its parent reaps it)
                found[int(entry)] = int(parent)
    return found


def _below(path: str | bytes, root: Path) -> bool:
    text = os.fsdecode(path)
    return text == str(root) or text.startswith(str(root) + os.sep)


def _of_node(pid: int, work_dir: Path) -> bool:
    """Whether ``pid`` is a task process of the node with ``work_dir`` (its CK_TASK_DIR or cwd below it)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            environ = fh.read().split(b"\0")
    except OSError:
        environ = []
    if any(v.startswith(b"CK_TASK_DIR=") and _below(v[len(b"CK_TASK_DIR="):], work_dir) for v in environ):
        return True
    try:
        return _below(os.readlink(f"/proc/{pid}/cwd"), work_dir)
    except OSError:
        return False


def node_pids(agent_pid: int | None, work_dir: Path) -> set[int]:
    """The live processes of the node (module docstring): the agent, its descendants, the processes of
    its tasks. Blocking (reads /proc)."""
    parents = _parents()
    found = {agent_pid} if agent_pid is not None and agent_pid in parents else set()
    grown = True
    while grown:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grown = bool(more)
    found |= {pid for pid in parents if pid not in found and _of_node(pid, work_dir)}
    found.discard(os.getpid())
    return found


def node_cgroups(agent_pid: int | None, work_dir: Path) -> list[Path]:
    """The node's task cgroup group in every hierarchy (``ckagent-<hash>``: module docstring), where it
    exists, read from where the agent (else this process: the agent's parent) sits. Blocking."""
    dirs = own_dirs(str(agent_pid)) if agent_pid is not None else {}
    dirs = dirs or own_dirs()
    name = agent_group_name(work_dir)
    found = []
    for directory in dirs.values():
        base = directory.parent if directory.name == AGENT_LEAF else directory
        if (base / name).is_dir():
            found.append(base / name)
    return found


def _kill_proven(pid: int, agent_pid: int | None, work_dir: Path, family: set[int]) -> bool:
    """SIGKILL ``pid`` through a pidfd once it is proven, through that pidfd's process, to be the node's:
    the agent (this test's unreaped child), a task process of the node, or a child of one; True when
    signalled."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False  # gone
    try:
        if pid == agent_pid or _of_node(pid, work_dir) or _parent_in(pid, family):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            return True
        return False  # the pid names another process now
    except OSError:
        return False
    finally:
        os.close(pidfd)


def _parent_in(pid: int, known: set[int]) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1]) in known
    except (OSError, ValueError, IndexError):
        return False


def _kill_cgroups(groups: list[Path]) -> None:
    for group in groups:
        with contextlib.suppress(OSError):
            (group / "cgroup.kill").write_text("1")  # the whole subtree (unified tree, Linux ≥ 5.14)


def _remove_cgroups(groups: list[Path]) -> None:
    for group in groups:
        if not group.is_dir():
            continue
        for directory in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                directory.rmdir()
        with contextlib.suppress(OSError):
            group.rmdir()


async def kill_node(agent: trio.Process | None, work_dir: Path, *, delete: bool = True) -> KilledNode:
    """Lose the node whose agent is ``agent`` (a process this test started) and whose work dir is
    ``work_dir``: its cgroups killed, every process of it SIGKILLed (again until none is left), the
    agent reaped, its cgroups removed and (``delete``) its work dir deleted. Returns what it killed.
    Raises AssertionError when a process of the node still lives after :data:`KILL_BOUND` seconds."""
    agent_pid = agent.pid if agent is not None and agent.returncode is None else None
    killed = KilledNode()
    killed.cgroups = await trio.to_thread.run_sync(node_cgroups, agent_pid, work_dir)
    with trio.move_on_after(KILL_BOUND):
        while True:
            pids = await trio.to_thread.run_sync(node_pids, agent_pid, work_dir)
            if agent_pid is not None and agent is not None and agent.returncode is not None:
                pids.discard(agent_pid)
            if not pids:
                break
            _kill_cgroups(killed.cgroups)
            for pid in pids:
                _kill_proven(pid, agent_pid, work_dir, pids)  # (one the cgroup's kill got first is gone: no proof)
            killed.pids |= pids  # (all dead at the end, or the test fails below)
            killed.died_at = killed.died_at or time.time()
            if agent is not None and agent.returncode is None:
                with trio.move_on_after(2):
                    await agent.wait()
            await trio.sleep(0.05)  # (zombies of other parents are reaped by them)
    left = await trio.to_thread.run_sync(node_pids, None, work_dir)
    assert not left, f"processes of the node still alive after {KILL_BOUND} s: {sorted(left)}"
    if agent is not None:
        with trio.fail_after(KILL_BOUND):
            await agent.wait()
    for _ in range(100):  # ≤ 5 s: a cgroup is removable once its last process has finished exiting
        await trio.to_thread.run_sync(_remove_cgroups, killed.cgroups)
        if not any(group.exists() for group in killed.cgroups):
            break
        await trio.sleep(0.05)
    if delete:
        # beneath.remove, not shutil.rmtree: as a plain user the work dir holds read-only folders of our own
        # uid (the code cache, a spider's 0555 dirs) that only a removal which gives them back u+rwx empties
        await trio.to_thread.run_sync(beneath.remove, work_dir.parent, work_dir.name)
    return killed
