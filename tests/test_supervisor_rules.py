"""The supervisor's rules, row by row (ckagent.pod.supervisor's table), in about a second each.

The real Supervisor (harness.bare_supervisor: a child subreaper, not PID 1) runs a shell script in the
agent's place, so each exit code and signal can be had on purpose: exit 1 → restarted with the backoff,
exit 2 → 2, exit 0 → 0, a forwarded SIGTERM the script obeys → its code, a forwarded SIGHUP it dies of →
129, SIGUSR2 → the next agent at once; an orphan re-parented to the supervisor is reaped, and one that
does not end holds the exit back at most the children timeout. (The real agent under it:
tests/test_supervisor.py.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import trio
from harness import bare_supervisor, eventually, process_table

STARTS = 'n=$(cat "$0.count" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "$0.count"; '
"""Counts the agent's starts in ``<script>.count`` (``$0``: the script's path)."""
OBEYS_TERM = "trap 'exit 0' TERM; while :; do sleep 0.05; done"
"""Runs until SIGTERM, then exits 0."""


async def _start(tmp_path: Path, script: str, **options: float) -> tuple[trio.Process, Path, Path]:
    path = tmp_path / "agent.sh"
    path.write_text(STARTS + script)
    log = tmp_path / "supervise.log"
    with log.open("ab") as out:
        process = await trio.lowlevel.open_process(bare_supervisor(["sh", str(path)], **options),
                                                   stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    return process, path.with_name("agent.sh.count"), log


async def _starts(count: Path) -> int:
    try:
        return int((await trio.Path(count).read_text()).strip() or 0)
    except FileNotFoundError:
        return 0


async def _exit(process: trio.Process, bound: float = 15) -> int:
    with trio.fail_after(bound):
        return await process.wait()


def _children(pid: int) -> dict[int, str]:
    return {child: state for child, (parent, state) in process_table().items() if parent == pid}


async def test_exit_1_restarts_with_backoff_then_a_forwarded_sigterm_ends_it_with_the_agents_code(tmp_path: Path) -> None:
    process, count, log = await _start(tmp_path, f'[ "$n" -lt 3 ] && exit 1; {OBEYS_TERM}', backoff=0.2)
    try:
        await eventually(lambda: _at_least(count, 3), 10, "three starts")
        process.send_signal(signal.SIGTERM)
        assert await _exit(process) == 0
    finally:
        process.kill()
    text = log.read_text()
    assert text.count("ended unasked") == 2 and "restarting it in 0.2 s" in text and "in 0.4 s" in text, text
    assert "SIGTERM forwarded" in text and "stopped after SIGTERM: exit code 0" in text


async def _at_least(count: Path, n: int) -> bool:
    return await _starts(count) >= n


async def test_exit_2_and_exit_0_end_it_with_their_code_without_a_restart(tmp_path: Path) -> None:
    for code in (2, 0):
        directory = tmp_path / str(code)
        directory.mkdir()
        process, count, _log = await _start(directory, f"exit {code}")
        assert await _exit(process) == code
        assert await _starts(count) == 1


async def test_a_forwarded_signal_the_agent_dies_of_gives_128_plus_n(tmp_path: Path) -> None:
    process, count, log = await _start(tmp_path, "while :; do sleep 0.05; done")
    try:
        await eventually(lambda: _at_least(count, 1), 10, "started")
        process.send_signal(signal.SIGHUP)
        assert await _exit(process) == 128 + signal.SIGHUP
    finally:
        process.kill()
    assert "killed by SIGHUP" in log.read_text()


async def test_sigusr2_starts_the_next_agent_at_once(tmp_path: Path) -> None:
    process, count, log = await _start(tmp_path, "while :; do sleep 0.05; done", backoff=30)
    try:
        await eventually(lambda: _at_least(count, 1), 10, "started")
        process.send_signal(signal.SIGUSR2)  # the shell dies of it; the next one starts without the 30 s backoff
        await eventually(lambda: _at_least(count, 2), 5, "the next agent")
        assert "handed its crawls over" in log.read_text()
        process.send_signal(signal.SIGINT)
        assert await _exit(process) == 128 + signal.SIGINT
    finally:
        process.kill()


async def test_orphans_are_reaped_and_one_that_lives_on_holds_the_exit_at_most_the_children_timeout(tmp_path: Path) -> None:
    # The agent leaves two orphans (re-parented to the supervisor, its child subreaper): one that ends at
    # once (must not stay a zombie), one that sleeps 30 s (the exit waits for it at most 1 s).
    script = "(sleep 0.1 &); (sleep 30 &); sleep 0.5; exit 0"
    process, _count, log = await _start(tmp_path, script, children_timeout=1.0)
    held: list[int] = []  # pidfds of the long sleeper: killed at the end, whoever its parent is then
    try:
        async def orphaned() -> bool:
            children = await trio.to_thread.run_sync(_children, process.pid)
            for pid in children:
                if _cmdline(pid) == b"sleep\x0030\x00" and not held:
                    held.append(os.pidfd_open(pid))
            short = [pid for pid in children if _cmdline(pid) == b"sleep\x000.1\x00"]
            return bool(held) and not short and "Z" not in children.values()  # (the short one ended, reaped)

        await eventually(orphaned, 10, "an orphan of the supervisor, and no zombie")
        with trio.fail_after(10):
            started = trio.current_time()
            assert await process.wait() == 0
            assert 0.3 <= trio.current_time() - started < 5
    finally:
        process.kill()
        for pidfd in held:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
    assert "still running" in log.read_text()


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""
