"""One proven process identity (ckagent.node.procid): pid reuse for real, in pid namespaces of the
tests' own, through the adoption code path (ckagent.task.adoption) with real monitors and strangers."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import trio
from harness import LEVELS_HERE
from harness.pidreuse import can_unshare_pid, run_in_pid_namespace

from ckagent.containment.base import kill_pids
from ckagent.node.procid import ProcessIdentity, boot_id, is_zombie, start_ticks

needs_pidns = pytest.mark.skipif(not can_unshare_pid(), reason="needs root and unshare (a pid namespace)")


@needs_pidns
async def test_a_task_that_ended_while_no_agent_ran_is_reported_and_its_reused_pid_is_left_alone(
    tmp_path: Path,
) -> None:
    report = await run_in_pid_namespace("ended", tmp_path)
    assert report["stranger_pid"] == report["monitor_pid"]  # the kernel handed the monitor's pid on
    assert report["judged"] == "" and report["ended"] is True
    assert report["returncode"] == 3 and report["returncode_after_wait"] == 3  # its true exit
    assert report["stranger_alive"] is True, report  # never killed by the recorded pid...
    assert report["stranger_oom"] == 0, report  # ...nor made the OOM killer's first pick


@needs_pidns
async def test_a_monitor_whose_pid_is_reused_after_its_judgement_is_never_followed(tmp_path: Path) -> None:
    report = await run_in_pid_namespace("window", tmp_path)
    assert report["judged"] == "" and report["stranger_pid"] == report["monitor_pid"]
    assert report["main_pid"] is None  # the stranger's children are not taken for the spider
    assert report["returncode"] == -signal.SIGKILL  # the monitor's record, not the stranger's life
    assert report["stranger_alive"] is True and report["stranger_oom"] == 0, report


@needs_pidns
async def test_the_proof_fails_when_the_pid_is_reused_between_judgement_and_pidfd(tmp_path: Path) -> None:
    report = await run_in_pid_namespace("proof", tmp_path)
    assert report["stranger_pid"] == report["judged_pid"]
    assert report["alive_before"] is True and report["alive_after"] is False
    assert report["proven"] is False  # the pidfd opened names the stranger: closed again, "gone"
    assert report["swept"] == 0  # a sweep's kill of that find reaches no one
    assert report["own_signal"] is True and report["stranger_alive"] is True


@needs_pidns
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ended", "window"])
@pytest.mark.parametrize("level", LEVELS_HERE)
async def test_a_whole_agent_restart_leaves_the_stranger_with_the_tasks_pid_alive_and_reports_the_true_exit(
    tmp_path: Path, level: str, variant: str,
) -> None:
    """kill -9 of a real agent; the task's monitor ends (while no agent runs, or after the next agent
    judged it while the master refused it); its pid goes to a stranger's session leader; the next
    agent runs on: the stranger lives, untouched, and the master gets the task's true exit, once."""
    report = await run_in_pid_namespace(f"agent-{variant}", tmp_path, level, timeout=180)
    assert report["monitor_status"] == 3  # the monitor's own exit: the spider's $?
    assert report["stranger_pid"] == report["monitor_pid"], report  # the kernel handed the pid on
    assert report["task"] == {"status": "FAILED", "errorCode": "EXIT_NONZERO", "exitCode": 3}, report
    assert report["finals"] == [[200, 3]], report  # reported once, from the monitor's record
    assert report["stranger_alive"] is True and report["stranger_alive_at_end"] is True, report
    assert report["stranger_oom"] == 0, report  # not made the OOM killer's first pick either
    assert report["agent_exit"] == 0 and report["kills"] == [], report  # nothing of the task was left to kill


@needs_pidns
async def test_a_process_found_by_a_uid_scan_is_killed_only_once_proven(tmp_path: Path) -> None:
    report = await run_in_pid_namespace("scan", tmp_path)
    assert report["found"] == [report["holder_pid"]] and report["writing"] == [report["holder_pid"]], report
    assert report["stranger_pid"] == report["holder_pid"]  # the same pid, the same uid: a scan sees it again
    assert report["found_again"] == [report["stranger_pid"]]
    assert report["killed"] == [] and report["stranger_alive"] is True, report


@needs_pidns
async def test_a_stop_target_whose_pid_is_reused_is_neither_signalled_nor_waited_for(tmp_path: Path) -> None:
    report = await run_in_pid_namespace("stop-target", tmp_path)
    assert report["stranger_pid"] == report["target_pid"]
    assert report["proven"] is False and report["left"] == [] and report["stranger_alive"] is True


@needs_pidns
async def test_a_group_is_killed_by_its_number_only_while_its_leader_lives(tmp_path: Path) -> None:
    report = await run_in_pid_namespace("jail", tmp_path)
    assert report["killed_live"] >= 1 and report["member_alive"] is False, report
    assert report["stranger_pid"] == report["gone_pid"]
    assert report["stranger_alive"] is True and report["killed_after"] == 0, report


async def test_a_proven_child_is_signalled_through_its_pidfd_and_its_exit_is_seen() -> None:
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)  # noqa: ASYNC220 - a quick spawn
    try:
        identity = ProcessIdentity.of(child.pid)
        assert identity is not None and identity.boot == boot_id() and identity.alive()
        assert start_ticks(child.pid) == identity.start and not is_zombie(child.pid)
        proven = identity.prove()
        assert proven is not None and not proven.exited()
        with proven:
            assert proven.set_oom_score_adj(700)
            assert Path(f"/proc/{child.pid}/oom_score_adj").read_text().strip() == "700"  # noqa: ASYNC240
            # (Popen returns once the exec closed its error pipe, before the kernel set the new
            # image's arguments: for a moment after, cmdline reads empty — measured here, 82 of 300.)
            with trio.fail_after(5):
                while True:  # (no event says it)
                    await trio.sleep(0.001)
                    if b"sleep" in (proven.read_proc("cmdline") or b""):
                        break
            assert proven.signal_group(signal.SIGTERM)
            with trio.fail_after(10):
                await proven.wait()
            assert proven.exited()
            assert not proven.send_signal(signal.SIGKILL) or True  # (a zombie takes signals quietly)
            assert not proven.signal_group(signal.SIGKILL) and not proven.set_oom_score_adj(0)
            assert proven.read_proc("environ") is None
        assert proven.exited() and not proven.send_signal(0)  # closed: acts on nothing
    finally:
        child.kill()
        child.wait()
    assert identity.prove() is None and not identity.alive()


def test_another_boots_identity_is_never_proven() -> None:
    me = ProcessIdentity.of(os.getpid())
    assert me is not None
    assert ProcessIdentity(me.pid, me.start, "another-boot").prove() is None
    assert ProcessIdentity(me.pid, me.start + 1, me.boot).prove() is None


def test_a_cgroup_kill_signals_a_pid_it_read_only_while_the_cgroup_still_lists_it() -> None:
    """containment.base.kill_pids: the pidfd opened first, then the cgroup's members read again — a pid
    the first read saw that the second does not list (its process ended, the number someone else's)
    is not signalled."""
    member = subprocess.Popen(["sleep", "60"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert kill_pids([member.pid, other.pid], lambda: [member.pid]) == 1
        assert member.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for proc in (member, other):
            proc.kill()
            proc.wait()
