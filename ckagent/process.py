"""Spawning spiders and making sure nothing they start outlives them.

A spider runs in its own session (so its own process group, pgid == pid). Every kill goes to the
whole group; after the main process has ended, :func:`sweep` kills what is left of the group *and*
processes that escaped it (``setsid``, double fork), found by the task's marker variable
(``CK_TASK_ID=<id>`` in ``/proc/<pid>/environ``), repeating until a pass finds none.

Nothing here raises for "process already gone": ``ProcessLookupError`` is the normal outcome of
signalling a group that has finished.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil
import trio

log = logging.getLogger(__name__)

MARKER_VAR = "CK_TASK_ID"
"""The variable every spider process inherits; the sweep finds escaped processes by it."""


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``. Returns False when the group no longer exists."""
    if pgid <= 1:  # never signal our own group or init by accident
        raise ValueError(f"refusing to signal process group {pgid}")
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("not allowed to signal process group %d", pgid)
        return False
    return True


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` exists (zombies included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def terminate_group(pgid: int, grace: float) -> None:
    """SIGTERM the group, sleep ``grace`` seconds, then SIGKILL the group.

    Meant as trio's ``deliver_cancel``: trio runs it shielded and cancels it as soon as the main
    process has exited, so a spider that stops on TERM is not waited for; whatever else of the
    group survives is then the sweep's job (:func:`sweep`).
    """
    if not signal_group(pgid, signal.SIGTERM):
        return
    await trio.sleep(grace)
    signal_group(pgid, signal.SIGKILL)


def _environ_has_marker(proc: psutil.Process, marker: str) -> bool:
    try:
        with open(f"/proc/{proc.pid}/environ", "rb") as fh:
            data = fh.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return marker.encode() in data.split(b"\0")


def find_marked(task_id: str, pgid: int | None = None, exclude: Iterable[int] = ()) -> list[int]:
    """Pids of live processes of the task: in group ``pgid`` or carrying ``CK_TASK_ID=<task_id>``.

    Blocking (reads /proc): call it through ``trio.to_thread``. Zombies are ignored (they hold no
    resources and vanish when reaped).
    """
    marker = f"{MARKER_VAR}={task_id}"
    me = os.getpid()
    skip = {me, *exclude}
    found: list[int] = []
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.pid in skip or proc.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        try:
            in_group = pgid is not None and os.getpgid(proc.pid) == pgid
        except (ProcessLookupError, PermissionError):
            continue
        if in_group or _environ_has_marker(proc, marker):
            found.append(proc.pid)
    return found


def _kill_pids(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


async def sweep(task_id: str, pgid: int | None, *, max_passes: int = 20) -> int:
    """SIGKILL the task's group and every marked process, repeating until a pass finds none.

    Returns how many processes were killed (0 when the task left nothing behind). Each pass reads
    /proc in a worker thread. Cancellation stops between passes; callers run it shielded when it
    must complete. Gives up (with a warning) after ``max_passes`` passes.
    """
    killed = 0
    for _ in range(max_passes):
        if pgid is not None and pgid > 1:
            signal_group(pgid, signal.SIGKILL)
        pids = await trio.to_thread.run_sync(find_marked, task_id, pgid)
        if not pids:
            return killed
        log.info("task %s: killing %d leftover process(es): %s", task_id, len(pids), pids)
        _kill_pids(pids)
        killed += len(pids)
        await trio.sleep(0.05)
    log.warning("task %s: processes still appear after %d sweep passes", task_id, max_passes)
    return killed


DRAIN_WINDOW = 2.0
"""Seconds leftovers may keep writing to the spider's pipes after its main process exited."""


@dataclass
class ProcessOutcome:
    """How a supervised process ended.

    ``returncode`` is the main process's exit status (negative = killed by that signal);
    ``timed_out``/``stopped`` say whether the agent ended it (deadline / stop request);
    ``killed_leftovers`` counts processes the final sweep had to kill.
    """

    returncode: int
    timed_out: bool = False
    stopped: bool = False
    killed_leftovers: int = 0
    started_at: float = 0.0


Notice = Callable[[str], None]


async def run_supervised(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    task_id: str,
    output: Callable[[bytes], None],
    deadline_seconds: float | None,
    grace: float,
    stop: trio.Event,
    notice: Notice,
    on_started: Callable[[int], Awaitable[None]] | None = None,
    drain_window: float = DRAIN_WINDOW,
) -> ProcessOutcome:
    """Run ``argv`` as a spider: own session, pipes copied to ``output``, killed as a group.

    The task ends when the main process exits, when ``deadline_seconds`` pass (None = never), or
    when ``stop`` is set: then the group gets SIGTERM, ``grace`` seconds, SIGKILL. After the main
    process has exited, leftovers get ``drain_window`` seconds to finish writing, then the sweep
    kills every process of the group or carrying the task's marker. ``notice(text)`` receives
    one-line notes of what the agent did (they go into the task log).

    Raises OSError when the command cannot be started (e.g. not found). Cancellation from outside
    (agent termination) still ends the process: TERM → grace → KILL and the sweep run shielded.
    """
    proc = await trio.lowlevel.open_process(
        argv, cwd=str(cwd), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
    )
    pgid = proc.pid
    outcome = ProcessOutcome(returncode=0, started_at=trio.current_time())
    try:
        if on_started is not None:
            await on_started(proc.pid)
        async with trio.open_nursery() as nursery:
            pumps_done = trio.Event()
            pump_scope = trio.CancelScope()

            async def pumps() -> None:
                with pump_scope:
                    async with trio.open_nursery() as inner:
                        for stream in (proc.stdout, proc.stderr):
                            if stream is not None:
                                inner.start_soon(_copy, stream, output)
                pumps_done.set()

            nursery.start_soon(pumps)
            with trio.move_on_after(deadline_seconds or math.inf) as deadline:
                async with trio.open_nursery() as first:

                    async def until_exit() -> None:
                        await proc.wait()
                        first.cancel_scope.cancel()

                    async def until_stop() -> None:
                        await stop.wait()
                        first.cancel_scope.cancel()

                    first.start_soon(until_exit)
                    first.start_soon(until_stop)
            if proc.returncode is None:
                outcome.timed_out = deadline.cancelled_caught
                outcome.stopped = not outcome.timed_out
                why = f"timeout after {deadline_seconds:g} s" if outcome.timed_out else "stop requested"
                await _terminate(proc, pgid, grace, notice, why)
            outcome.returncode = proc.returncode if proc.returncode is not None else -9
            with trio.move_on_after(drain_window):
                await pumps_done.wait()
            outcome.killed_leftovers = await sweep(task_id, pgid)
            if outcome.killed_leftovers:
                notice(f"killed {outcome.killed_leftovers} leftover process(es) of the task")
            with trio.move_on_after(1.0):
                await pumps_done.wait()
            pump_scope.cancel()
    finally:
        if proc.returncode is None:
            # Cancelled from outside (the agent is terminating): the process must still go.
            with trio.CancelScope(shield=True):
                await _terminate(proc, pgid, grace, notice, "agent terminating")
                await sweep(task_id, pgid)
    return outcome


async def _terminate(proc: trio.Process, pgid: int, grace: float, notice: Notice, why: str) -> None:
    notice(f"{why}: sending SIGTERM to process group {pgid}, SIGKILL after {grace:g} s")
    signal_group(pgid, signal.SIGTERM)
    with trio.move_on_after(grace):
        await proc.wait()
    if proc.returncode is None:
        notice(f"process group {pgid} still running after {grace:g} s: sending SIGKILL")
        signal_group(pgid, signal.SIGKILL)
        await proc.wait()


async def _copy(stream: trio.abc.ReceiveStream, output: Callable[[bytes], None]) -> None:
    """Copy a pipe into ``output`` until EOF."""
    while True:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return
        output(bytes(chunk))
