"""Pid reuse for real: scenarios run in a pid namespace of their own (``unshare --pid --fork
--mount-proc``, as root), where the kernel is made to hand a chosen pid to a stranger by writing
``N-1`` to ``/proc/sys/kernel/ns_last_pid`` just before the fork.

:func:`run_in_pid_namespace` (async, from a test) runs one scenario of this module as the namespace's
init and returns what it printed (one JSON object). The scenarios drive the adoption code path
(ckagent.task.adoption) with a real monitor (ckagent.containment.monitor) and a real stranger:

- ``ended``: a task's monitor records its spider's exit and ends while no agent runs; its pid goes
  to a stranger's session leader; the next agent judges the task and cleans its jail up.
- ``window``: a running task's monitor is judged (proven) by the next agent; then the spider ends,
  the monitor is reaped and its pid goes to a stranger before the agent acts on the task.
- ``proof``: a process identity is taken; the process exits and its pid goes to a stranger before the
  identity is proven: the proof must fail.
- ``jail``: a process-group jail kills a member of its group that has neither the marker nor a
  parent while the group's leader lives; once the leader is reaped and its pid a stranger's, the
  stranger's group is left alone.
- ``scan``: a scan by uid (ckagent.node.uidpool's release, ckagent.code.builder.writers for
  envstore.mark_ready) finds a process; it exits and its pid goes to a stranger of the same uid
  before the kill (procid.kill_each): the stranger lives.
- ``stop-target``: a stop's walk finds its target; the target exits and its pid goes to a stranger
  before the signal: neither the signal nor the wait for its end reaches the stranger.

- ``agent-ended <level>`` / ``agent-window <level>``: the whole agent — a real agent process at a
  containment level, killed with kill -9 while its task runs, the reference master in this process
  (see :func:`_agent_restart`): the monitor ends while no agent runs (``ended``) or after the next
  agent judged it while the master refused its registration (``window``), and its pid goes to a
  stranger before the next agent acts on the task.

Each reports whether the stranger still lives, its oom_score_adj, and what the agent concluded. Every
process a scenario starts dies with the namespace (its init exits: the kernel kills the rest).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import trio

REPO = Path(__file__).resolve().parents[2]

__all__ = ["can_unshare_pid", "run_in_pid_namespace"]


def can_unshare_pid() -> bool:
    """True when this process may make pid namespaces (root with ``unshare`` installed)."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None


async def run_in_pid_namespace(scenario: str, tmp: Path, *args: str, timeout: float = 30) -> dict[str, Any]:  # noqa: ASYNC109
    """Run ``scenario`` (see the module docstring) with ``args`` as init of a new pid namespace, in
    ``tmp``; its JSON report. Raises AssertionError with its output when it fails; trio.TooSlowError
    after ``timeout`` seconds (the namespace is killed then: its init gets SIGKILL, and with it every
    process of the namespace)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    with trio.fail_after(timeout):
        done = await trio.run_process(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-m", "harness.pidreuse",
             scenario, str(tmp), *args], env=env, capture_stdout=True, capture_stderr=True, check=False)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, f"scenario {scenario} exited {done.returncode}:\n{out}\n{err}"
    return dict(json.loads(out.strip().splitlines()[-1]))


# ------------------------------------------------------------------ inside the namespace


def _hand_pid_to_stranger(pid: int, user: int | None = None) -> subprocess.Popen[bytes]:
    """Start a stranger (``sleep``, a session leader of its own) that gets ``pid``, at least one clock
    tick after everything before it started: a start time counts clock ticks (10 ms), and a pid is
    never reused within one in the field (the pid space wraps first); here it would be at once."""
    time.sleep(2 / os.sysconf("SC_CLK_TCK"))
    for _ in range(20):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        ids: dict[str, Any] = {} if user is None else {"user": user, "group": user, "extra_groups": []}
        stranger = subprocess.Popen(["sleep", "300"], start_new_session=True, **ids)
        if stranger.pid == pid:
            return stranger
        stranger.kill()
        stranger.wait()
    raise AssertionError(f"the kernel would not hand pid {pid} to a stranger")


def _oom_score_adj(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/oom_score_adj").read_text())
    except OSError:  # (killed: the stranger's end is the report)
        return None


def _spawn_task(tmp: Path, task_id: str, argv: list[str]) -> tuple[Any, Any]:
    """(record, monitored): a spider behind its monitor, as an agent spawns it, and its state store row."""
    from ckagent.containment.monitor import spawn_monitored
    from ckagent.containment.process_group import ProcessGroupJail
    from ckagent.node.state import TaskRecord
    from harness.fakes import task_json

    task_dir, work = tmp / "tasks" / task_id, tmp / "work" / task_id
    task_dir.mkdir(parents=True)
    work.mkdir(parents=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CK_TASK_ID": task_id}
    mon = spawn_monitored(argv, cwd=work, env=env, task_id=task_id, task_dir=task_dir,
                          output_path=task_dir / "output.log", jail=ProcessGroupJail(task_id), run_as=None,
                          deadline_at=None, work=work, stall_timeout=0.0)
    record = TaskRecord(task_id, "spider-1", task_json(task_id, "spider-1"), task_dir, mon.pid, mon.pid,
                        time.time(), None, False, None, mon.handle.to_json())
    return record, mon


async def _ended(tmp: Path) -> dict[str, Any]:
    from ckagent.task.adoption import adopted_jail, judge

    record, mon = _spawn_task(tmp, "task-ended", ["sh", "-c", "exit 3"])
    mon.popen.wait()  # the monitor recorded the exit and ended; the old agent (this process) reaped it
    stranger = _hand_pid_to_stranger(mon.pid)
    # The next agent:
    adoption, why = judge(record)
    report: dict[str, Any] = {"judged": why, "stranger_pid": stranger.pid, "monitor_pid": mon.pid}
    if adoption is not None:
        report.update(ended=adoption.ended, returncode=adoption.monitored.returncode)
        jail = adopted_jail(None, adoption)
        report["killed"] = await jail.kill_all()
        await adoption.monitored.wait()
        report["returncode_after_wait"] = adoption.monitored.returncode
    report.update(stranger_alive=stranger.poll() is None, stranger_oom=_oom_score_adj(stranger.pid))
    return report


def _spider_of(monitor: int) -> int:
    """The monitor's child once it has forked (no notification tells it: looked for, 5 s at most)."""
    from ckagent.containment.monitor import main_pid

    for _ in range(500):
        if (spider := main_pid(monitor)) is not None:
            return spider
        time.sleep(0.01)
    raise AssertionError(f"monitor {monitor} started no spider")


async def _window(tmp: Path) -> dict[str, Any]:
    from ckagent.task.adoption import adopted_jail, judge

    record, mon = _spawn_task(tmp, "task-window", ["sleep", "300"])  # (no shell: nothing is left in its group)
    spider = _spider_of(mon.pid)
    # The next agent judges the task (the old agent is gone: it will not act on it again)...
    adoption, why = judge(record)
    report: dict[str, Any] = {"judged": why, "monitor_pid": mon.pid}
    assert adoption is not None and not adoption.ended, why
    # ...then, while it waits for the master, the spider ends, its monitor is reaped, its pid reused.
    os.kill(spider, signal.SIGKILL)
    mon.popen.wait()
    stranger = _hand_pid_to_stranger(mon.pid)
    report["stranger_pid"] = stranger.pid
    jail = adopted_jail(None, adoption)
    report["main_pid"] = adoption.monitored.main_pid()
    with trio.fail_after(5):
        await adoption.monitored.wait()
    report["returncode"] = adoption.monitored.returncode
    report["killed"] = await jail.kill_all()
    report.update(stranger_alive=stranger.poll() is None, stranger_oom=_oom_score_adj(stranger.pid))
    return report


async def _jail(tmp: Path) -> dict[str, Any]:
    from ckagent.containment.process_group import ProcessGroupJail

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CK_TASK_ID": "task-jail"}
    # A leader that lives, and a member of its group without the marker whose parent is gone:
    # only the group (its leader proven alive) finds it.
    jail = ProcessGroupJail("task-jail")
    leader = subprocess.Popen(["sh", "-c", "(env -i sleep 300 &); exec sleep 300"], env=env,  # noqa: ASYNC220
                              start_new_session=True)
    jail.watch(leader.pid)
    member = _orphan_in_group(leader.pid)
    killed_live = await jail.kill_all()
    member_alive = _state(member) not in ("gone", psutil.STATUS_ZOMBIE)
    leader.wait()
    jail.close()
    # A leader reaped, its pid handed to a stranger: the stranger's group is not the task's.
    jail = ProcessGroupJail("task-jail")
    gone = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)  # noqa: ASYNC220
    jail.watch(gone.pid)
    gone.kill()
    gone.wait()
    stranger = _hand_pid_to_stranger(gone.pid)
    killed_after = await jail.kill_all()
    jail.close()
    return {"killed_live": killed_live, "member_alive": member_alive, "killed_after": killed_after,
            "stranger_pid": stranger.pid, "gone_pid": gone.pid, "stranger_alive": stranger.poll() is None}


def _state(pid: int) -> str:
    """psutil's status of ``pid`` ("zombie", "sleeping", ...); "gone" when there is none."""
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return "gone"


def _orphan_in_group(pgid: int) -> int:
    """The process of group ``pgid`` whose parent is init (5 s at most)."""
    for _ in range(500):
        for proc in psutil.process_iter(["ppid", "status"]):
            if proc.pid in (1, pgid) or proc.info["ppid"] != 1 or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            try:
                if os.getpgid(proc.pid) == pgid:
                    return proc.pid
            except OSError:
                continue
        time.sleep(0.01)
    raise AssertionError(f"no orphan appeared in group {pgid}")


async def _stop_target(tmp: Path) -> dict[str, Any]:
    from ckagent.containment.stoptarget import stop_targets, wait_gone

    judged = subprocess.Popen(["sleep", "300"], start_new_session=True)  # noqa: ASYNC220 - a quick spawn
    [target] = stop_targets(judged.pid)  # the walk of a stop...
    judged.kill()
    judged.wait()
    stranger = _hand_pid_to_stranger(target.pid)  # ...and its pid someone else's before the signal
    with trio.fail_after(5):
        left = await wait_gone([target], trio.current_time() + 60)  # not the stranger's end
    return {"target_pid": target.pid, "stranger_pid": stranger.pid, "proven": target.prove() is not None,
            "left": [t.pid for t in left], "stranger_alive": stranger.poll() is None}


async def _proof(tmp: Path) -> dict[str, Any]:
    from ckagent.node.procid import ProcessIdentity

    judged = subprocess.Popen(["sleep", "300"], start_new_session=True)  # noqa: ASYNC220 - a quick spawn
    identity = ProcessIdentity.of(judged.pid)
    assert identity is not None
    alive_before = identity.alive()
    judged.kill()
    judged.wait()
    stranger = _hand_pid_to_stranger(identity.pid)
    proven = identity.prove()
    from ckagent.containment.process_group import _kill_proven
    swept = _kill_proven([identity])  # a sweep's find, its pid someone else's before the kill
    stranger_identity = ProcessIdentity.of(stranger.pid)
    assert stranger_identity is not None
    mine = stranger_identity.prove()  # the stranger's own identity is proven, and may be signalled
    own_signal = mine is not None and mine.send_signal(0)
    if mine is not None:
        mine.close()
    return {"alive_before": alive_before, "alive_after": identity.alive(), "proven": proven is not None,
            "stranger_pid": stranger.pid, "judged_pid": identity.pid, "own_signal": own_signal,
            "swept": len(swept), "stranger_alive": stranger.poll() is None}


SCAN_UID = 3_210_000_977
"""A uid no one has (the ``scan`` scenario's processes run as it)."""


async def _scan(tmp: Path) -> dict[str, Any]:
    owned = Path(tempfile.mkdtemp(prefix="ckagent-scan-"))  # (the test's tmp is not the uid's to reach)
    try:
        return await _scan_in(owned)
    finally:
        shutil.rmtree(owned, ignore_errors=True)


async def _scan_in(owned: Path) -> dict[str, Any]:
    from ckagent.code.builder import writers
    from ckagent.node.procid import kill_each
    from ckagent.node.uidpool import uids_of_processes

    os.chown(owned, SCAN_UID, SCAN_UID)
    holder = subprocess.Popen(  # noqa: ASYNC220 - a quick spawn
        ["/usr/bin/python3", "-I", "-c", "import sys, time\nf = open(sys.argv[1], 'w')\nprint('open', flush=True)\n"
         "time.sleep(300)\n", str(owned / "late.py")], stdout=subprocess.PIPE, user=SCAN_UID, group=SCAN_UID,
        extra_groups=[])
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"open"
    by_uid = uids_of_processes().get(SCAN_UID, [])  # what uidpool._release's scan finds...
    writing = writers(owned, SCAN_UID)  # ...and envstore.mark_ready's
    holder.kill()
    holder.wait()
    # Its pid goes to a stranger of the same uid (the scan would find it too: only the proof tells).
    stranger = _hand_pid_to_stranger(holder.pid, user=SCAN_UID)
    killed = kill_each([*by_uid, *writing])
    return {"holder_pid": holder.pid, "stranger_pid": stranger.pid, "found": [i.pid for i in by_uid],
            "writing": [i.pid for i in writing], "killed": [i.pid for i in killed],
            "stranger_alive": stranger.poll() is None,
            "found_again": [i.pid for i in uids_of_processes().get(SCAN_UID, [])]}


WAITER = (
    "import os, sys, time\n"
    "print('ready', os.getpid(), flush=True)\n"
    "go = os.path.join(os.environ['CK_TASK_DIR'], 'go')\n"
    "for _ in range(1200):  # bounded: at most a minute\n"
    "    if os.path.exists(go):\n"
    "        print('exiting 3', flush=True)\n"
    "        sys.exit(3)\n"
    "    time.sleep(0.05)\n"
)
"""A spider that prints its pid, then exits 3 once ``$CK_TASK_DIR/go`` exists."""


async def _agent_restart(tmp: Path, variant: str, level: str) -> dict[str, Any]:
    """A real agent (a process, at containment ``level``) behind a fault proxy to a real reference
    master (in this process) runs :data:`WAITER`; the agent is killed (kill -9); then:

    - ``ended``: the spider exits 3, its monitor records it and ends while no agent runs; init (this
      process) reaps the monitor and its pid goes to a stranger's session leader; the next agent starts.
    - ``window``: the next agent starts while the master refuses registration (503): it judges the
      task (the monitor proven, its pidfd held) and then waits for the master; meanwhile the spider
      exits 3, the monitor ends, is reaped and its pid goes to a stranger; then the master answers.

    Reports the task at the master, every final result it received, the stranger's life and
    oom_score_adj, and what the next agent logged of kills."""
    from faultproxy import FaultProxy

    from harness.agentproc import agent_process, wait_exit, wait_registered
    from harness.core import eventually, submit
    from harness.recording import serve_recording_master

    report: dict[str, Any] = {}
    async with serve_recording_master(tmp) as master, trio.open_nursery() as nursery:
        proxy = FaultProxy(int(master.base_url.rsplit(":", 1)[1]))
        port = await nursery.start(proxy.serve)
        agent = agent_process(tmp, f"http://127.0.0.1:{port}", master.registration_token,
                              task__containment=level, server__max_backoff_interval=1)
        spool = tmp / "node" / "data" / "tasks"
        async with agent:
            await agent.start()
            await wait_registered(master.admin, agent)
            task_id = await submit(master.admin, "exit-3", {"main.py": WAITER})
            output = spool / task_id / "output.log"

            async def ready() -> int | None:
                text = output.read_text() if output.exists() else ""
                return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("ready ")), None)

            spider = await eventually(ready, 60, "the spider runs")
            monitor = psutil.Process(spider).ppid()
            await agent.kill()  # kill -9: the monitor is re-parented to init, this process
            if variant == "window":
                proxy.set("503", ["register"])
                await agent.start()

                async def refused() -> bool:
                    return proxy.faulted("register") >= 1  # (it judged its tasks before it registers)

                await eventually(refused, 60, "the next agent asks to register")
            (output.parent / "go").touch()
            with trio.fail_after(30):
                while True:  # (init's child: no notification of its end but a SIGCHLD)
                    await trio.sleep(0.01)
                    if psutil.Process(monitor).status() == psutil.STATUS_ZOMBIE:
                        break
            if variant == "window":  # (paused while the pid changes hands: a thread it starts would take pids)
                agent.signal(signal.SIGSTOP)
            report["monitor_status"] = os.waitstatus_to_exitcode(os.waitpid(monitor, 0)[1])  # noqa: ASYNC222 - a zombie
            stranger = _hand_pid_to_stranger(monitor)
            report.update(monitor_pid=monitor, stranger_pid=stranger.pid, spider_pid=spider)
            if variant == "window":
                agent.signal(signal.SIGCONT)
                proxy.heal()
            else:
                await agent.start()
            task = await master.admin.wait_task_final(task_id, 60)

            async def recorded() -> bool:  # (the recorder notes a result once the master has answered it)
                return bool(master.finals(task_id))

            await eventually(recorded, 10, "the master's record of the final result")
            report.update(task={k: task.get(k) for k in ("status", "errorCode", "exitCode")},
                          finals=[[status, body.get("exitCode")] for status, body in master.finals(task_id)],
                          stranger_alive=stranger.poll() is None, stranger_oom=_oom_score_adj(stranger.pid))
            agent.signal(signal.SIGTERM)
            report["agent_exit"] = await wait_exit(agent, 30)
            report["kills"] = [line for line in agent.log_text().splitlines()
                               if "kill" in line.lower() and task_id in line]
            report["stranger_alive_at_end"] = stranger.poll() is None
        nursery.cancel_scope.cancel()
    return report


async def _agent_ended(tmp: Path, level: str) -> dict[str, Any]:
    return await _agent_restart(tmp, "ended", level)


async def _agent_window(tmp: Path, level: str) -> dict[str, Any]:
    return await _agent_restart(tmp, "window", level)


SCENARIOS = {"agent-ended": _agent_ended, "agent-window": _agent_window, "scan": _scan, "ended": _ended, "window": _window, "proof": _proof, "stop-target": _stop_target, "jail": _jail}


def main() -> None:
    """``python -m harness.pidreuse <scenario> <tmp>``: run it (as init of a pid namespace)."""
    scenario, tmp, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    assert os.getpid() == 1, "run it as init of a pid namespace of its own (run_in_pid_namespace)"
    report = trio.run(SCENARIOS[scenario], tmp, *args)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
