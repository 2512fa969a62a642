"""Which processes a task's stop signal goes to: the process that does the work, not its launcher.

A spider's main process is often a launcher that does not pass a signal on: ``npm start`` and
``yarn start`` run the script through ``sh -c``, and dash forwards nothing, so a SIGTERM to npm
never reaches node, whose SIGTERM handler (flush, close the browser) never runs. The stop therefore
walks down from the main process through launchers — shells, package-manager script runners — and
signals the first process below them that is not a launcher (every such one, for ``a & b``). The
launchers are left alone: they exit by themselves when their child does, and a launcher killed
first would end the "main process" and get the worker killed as a leftover.

The walk stops at a process that is not a launcher: a Scrapy spider's browser (a child of the
Python process) is never signalled before Scrapy's own graceful close has run; everything is
killed after the grace anyway.

What counts as a launcher (by the process's ``argv[0]``, or ``argv[1]`` when ``argv[0]`` is node)
is :data:`LAUNCHERS`. A launcher that has no child yet (a shell still starting) gets the signal
itself. Reading ``/proc`` uses psutil; a process that vanished during the walk is skipped. Each
target's identity (ckagent.node.procid) is taken in the walk: the signal and the wait go to the
process the walk found, proven by its pidfd, never to a later owner of its pid.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import psutil
import trio

from ckagent.node.procid import ProcessIdentity, ProvenProcess

LAUNCHERS = frozenset({
    # shells running a script or `-c` (dash, busybox sh: no forwarding at all)
    "sh", "dash", "bash", "ash", "zsh", "ksh", "mksh", "busybox",
    # package-manager script runners (they wait for `sh -c <script>`)
    "npm", "npx", "yarn", "yarnpkg", "pnpm", "pnpx", "corepack", "npm-cli.js", "npx-cli.js", "yarn.js",
    "pnpm.cjs", "pnpm.js",
    # wrappers that wait for one child
    "env", "nohup", "setsid", "nice", "ionice", "stdbuf", "time", "xvfb-run",
})
"""Programs a stop walks through (names of ``argv[0]`` or, under node, of ``argv[1]``)."""

_MAX_DEPTH = 8
_MAX_TARGETS = 64


@dataclass(frozen=True)
class StopTarget:
    """A process the stop signal goes to: ``pid``, a short ``command`` (for the task log) and its
    ``identity`` as the walk found it (None: gone already)."""

    pid: int
    command: str
    identity: ProcessIdentity | None = None

    def prove(self) -> ProvenProcess | None:
        """The target proven (ckagent.node.procid), None when it is gone. Blocking but tiny."""
        return None if self.identity is None else self.identity.prove()


def _target(proc: psutil.Process) -> StopTarget:
    return StopTarget(proc.pid, _describe(proc), ProcessIdentity.of(proc.pid))


def _names(proc: psutil.Process) -> tuple[str, str]:
    """(basename of argv[0], basename of argv[1]) of ``proc`` ("" when unknown). Raises psutil.Error."""
    cmdline = proc.cmdline()
    # npm and yarn set their process title ("npm start"): argv[0] may hold words after the name.
    first = os.path.basename(cmdline[0].split(" ")[0]) if cmdline else proc.name()
    second = os.path.basename(cmdline[1]) if len(cmdline) > 1 else ""
    return first, second


def is_launcher(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a launcher the stop walks through (see :data:`LAUNCHERS`). Raises psutil.Error."""
    first, second = _names(proc)
    if first in LAUNCHERS:
        return True
    return first in ("node", "nodejs") and second in LAUNCHERS


def _describe(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        text = " ".join(proc.cmdline()) or proc.name()
        return text if len(text) <= 80 else text[:77] + "..."
    return "?"


def stop_targets(pid: int) -> list[StopTarget]:
    """The processes a stop of the task whose main process is ``pid`` signals (blocking: reads /proc).

    ``[main]`` when the main process is not a launcher (or is gone, or /proc cannot be read); else
    the first non-launcher processes below it (see the module docstring). Never raises.
    """
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return [StopTarget(pid, "?", ProcessIdentity.of(pid))]
    found: list[StopTarget] = []

    def walk(proc: psutil.Process, depth: int) -> None:
        if len(found) >= _MAX_TARGETS:
            return
        try:
            launcher = depth < _MAX_DEPTH and is_launcher(proc)
            children = proc.children() if launcher else []
        except psutil.Error:
            return
        if not children:
            found.append(_target(proc))
            return
        for child in children:
            walk(child, depth + 1)

    walk(root, 0)
    return found or [_target(root)]


def send_stop(pid: int, signum: int) -> list[StopTarget]:
    """Send ``signum`` to :func:`stop_targets` of ``pid`` (blocking: reads /proc); returns the targets
    that got it (empty when none was alive any more): each through its pidfd, proven to be the
    process the walk found. Never raises."""
    sent = []
    for target in stop_targets(pid):
        proven = target.prove()
        if proven is not None:
            with proven:
                if proven.send_signal(signum):
                    sent.append(target)
    return sent


def describe_targets(main_pid: int, targets: list[StopTarget]) -> str:
    """``the main process 12`` or ``node index.js (pid 14), below the launcher 12`` for the task log."""
    if not targets or [t.pid for t in targets] == [main_pid]:
        return f"the main process {main_pid}"
    shown = ", ".join(f"{t.command} (pid {t.pid})" for t in targets[:4])
    more = f" and {len(targets) - 4} more" if len(targets) > 4 else ""
    return f"{shown}{more}, below the launcher {main_pid}"


async def wait_gone(targets: list[StopTarget], deadline: float) -> list[StopTarget]:
    """Wait until every target has exited or trio's clock reaches ``deadline``; returns those still
    running (by pidfd: no polling; a target that cannot be proven any more counts as gone).
    Cancellation closes the pidfds and propagates."""
    fds: dict[int, StopTarget] = {}
    try:
        for target in targets:
            proven = target.prove()
            if proven is not None and proven.fd >= 0 and not proven.exited():
                fds[proven.fd] = target  # (closed below, not by the proven object)
            elif proven is not None:
                proven.close()
        with trio.move_on_at(deadline):
            await trio.lowlevel.checkpoint()
            for fd in list(fds):
                await trio.lowlevel.wait_readable(fd)
                os.close(fd)
                del fds[fd]
        return list(fds.values())
    finally:
        for fd in fds:
            os.close(fd)
