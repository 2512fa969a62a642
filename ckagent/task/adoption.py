"""Re-adoption at start: a task whose spider outlived the previous agent is carried on, not killed.

At start, before crash recovery (ckagent.task.recovery), every task of the state store without a final
result is judged by its handle (ckagent.containment.monitor.Handle, stored when its spider was spawned):

=====================================================  ==========================================
what is found                                          what the agent does
=====================================================  ==========================================
the monitor runs, proven (its pidfd opened, then the   re-adopt: follow output.log from where the
same boot, pid *and* start time checked:               journal stopped, enforce the original
ckagent.node.procid), the task's marker in its         deadline, honour cancels, stall watchdog;
environment, and at a cgroup level the task's cgroup   every later signal, watch and group kill
names it                                               goes through that pidfd
the monitor has ended and recorded the exit status     re-adopt an ended task: the true outcome
                                                       with its exit code; leftovers killed by
                                                       cgroup or marker, never by its recorded pid
                                                       (a stranger may have it now)
no handle (the spider had not started), another        not proven to be the same task: killed and
boot, a recycled pid, no marker, no recorded status    reported AGENT_LOST with the reason (as before)
=====================================================  ==========================================

The lines and items the master has are not sent again: the shippers resume from the positions the
state store holds (acknowledged by the master), and the journal from what it recorded. The task log
gets one note; the master sees nothing else of the restart (heartbeats list the task as running).

Errors: :func:`judge` never raises (a handle of the wrong shape is "not proven"); :func:`run_adopted`
never raises for task trouble (like ``Supervisor.run_task``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from ckagent.code.deps import spider_base_env
from ckagent.code.workcopy import remove_tree
from ckagent.containment import Containment, ContainmentError, Limits, TaskJail
from ckagent.containment.egress import EgressError, report_refusals
from ckagent.containment.hierarchy import task_cgroup_name
from ckagent.containment.monitor import Handle, Monitored, read_status
from ckagent.containment.process_group import MARKER_VAR, ProcessGroupJail
from ckagent.delivery.lifecycle import TaskFinished
from ckagent.master.ids import safe_name
from ckagent.master.protocol import Task
from ckagent.node.errors import AGENT_ERROR, describe_fault
from ckagent.node.procid import boot_id
from ckagent.node.runas import RunAs, task_uid
from ckagent.node.state import TaskRecord
from ckagent.task.checkpoints import checkpoints_for
from ckagent.task.stop import StopReason, stopped_outcome

if TYPE_CHECKING:
    from ckagent.task.supervisor import RunningTask, Supervisor

log = logging.getLogger(__name__)


@dataclass
class Adoption:
    """A task of the state store this agent carries on: its record, task, handle and spider."""

    record: TaskRecord
    task: Task
    handle: Handle
    monitored: Monitored
    ended: bool
    """True when the spider ended while no agent ran (its exit status is recorded)."""
    release_env: Callable[[], None] | None = None
    """Set by :func:`admit_adopted` when the spider runs with a dependency environment: ends its use."""


def _cgroup_names(text: bytes | None, name: str) -> bool:
    return text is not None and any(line.endswith(b"/" + name.encode()) for line in text.splitlines())


def judge(record: TaskRecord) -> tuple[Adoption | None, str]:
    """Can ``record`` (a task without a final result) be re-adopted? ``(adoption, "")`` or
    ``(None, why not)``. Blocking (reads /proc and the status file): call it in a worker thread."""
    if record.handle is None:
        return None, "its spider had not started, or an agent without re-adoption ran it"
    try:
        handle = Handle.from_json(record.handle)
        task = Task.from_json(record.task_json)
    except ValueError as exc:
        return None, f"its stored state cannot be read ({exc})"
    if handle.boot_id != boot_id():
        return None, "the node restarted since its spider started (another boot)"
    proven = handle.identity().prove()  # its pidfd opened, then its start time checked: ours for good
    if proven is not None and not proven.exited():
        pid = handle.monitor_pid
        environ = proven.read_proc("environ")
        if environ is None or f"{MARKER_VAR}={record.task_id}".encode() not in environ.split(b"\0"):
            proven.close()
            return None, f"process {pid} does not carry the task's marker"
        if (handle.level is not None and handle.level.has_cgroup
                and not _cgroup_names(proven.read_proc("cgroup"), task_cgroup_name(record.task_id))):
            proven.close()
            return None, f"process {pid} is not in the task's cgroup"
        return Adoption(record, task, handle, Monitored(handle, proven=proven), ended=False), ""
    if proven is not None:  # a zombie of ours: ended (its status file says how)
        proven.close()
    # Ended while no agent ran: reported from its recorded exit, never reached by its pid again.
    code = read_status(Path(handle.status_file))
    if code is None:
        return None, "its spider's monitor is gone and recorded no exit status"
    monitored = Monitored(handle)
    monitored.exited, monitored.returncode = True, code
    return Adoption(record, task, handle, monitored, ended=True), ""


async def find_adoptable(records: list[TaskRecord]) -> tuple[list[Adoption], dict[str, str]]:
    """Judge every task without a final result (one thread hop): ``(adoptions, {task id: why not})``."""
    def judge_all() -> tuple[list[Adoption], dict[str, str]]:
        found, refused = [], {}
        for record in records:
            if record.result is not None:
                continue
            adoption, why = judge(record)
            if adoption is not None:
                found.append(adoption)
            else:
                refused[record.task_id] = why
        return found, refused

    return await trio.to_thread.run_sync(judge_all)


def adopted_jail(containment: Containment | None, adoption: Adoption) -> TaskJail:
    """The task's jail again: its cgroup (at the level it was spawned at), or its process group
    (through its proven monitor, while that lives) and marker; a task that ended while no agent ran
    is held by its cgroup or marker alone, never by its recorded pid. Blocking but quick. Raises
    ContainmentError when the cgroup cannot be opened."""
    handle = adoption.handle
    if containment is not None and containment.level is handle.level and containment.level.has_cgroup:
        jail = containment.jail(adoption.record.task_id, Limits())  # the cgroup exists: its limits stay
    else:
        jail = ProcessGroupJail(adoption.record.task_id)
    _adopt_monitor(jail, adoption)
    return jail


def _adopt_monitor(jail: TaskJail, adoption: Adoption) -> None:
    if adoption.monitored.proven is not None:
        jail.adopt(adoption.monitored.proven)


async def run_adopted(supervisor: Supervisor, rt: RunningTask, adoption: Adoption) -> None:
    """The rest of an adopted task's life: supervise it to its end (or at once for one that ended
    while no agent ran), report the outcome, remove its working copy and jail. Never raises for
    task trouble. Cancellation: as ``Supervisor.run_task`` (a hand-over leaves it running again)."""
    from ckagent.task.outcome import TaskOutcome
    from ckagent.task.outcome import task_result as _result

    task, record, handle = adoption.task, adoption.record, adoption.handle
    outbox = supervisor.outbox
    lock = supervisor.spider_lock(task.spider_id)
    took_slot = False
    with contextlib.suppress(trio.WouldBlock):
        supervisor.capacity.acquire_nowait()
        took_slot = True
    outcome: TaskOutcome | None = None
    jail: TaskJail | None = None
    try:
        async with lock:
            delivery = await outbox.open_task(task, record.task_dir, claimed_at=record.claimed_at)
            rt.delivery = delivery
            delivery.on_superseded = rt.mark_superseded
            sink = delivery.sink
            assert sink is not None

            def notice(text: str) -> None:
                stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
                sink.write_line(f"[ckagent {stamp}] {text}\n".encode())

            downtime = "" if not adoption.ended else "; it ended while no agent ran"
            notice(f"re-adopted after an agent restart: spider behind monitor {handle.monitor_pid}, started at "
                   f"{datetime.fromtimestamp(handle.spawned_at, timezone.utc):%H:%M:%S} UTC{downtime}")
            log.info("task %s: re-adopted (monitor %d%s)", task.id, handle.monitor_pid, downtime)
            try:
                jail = await trio.to_thread.run_sync(adopted_jail, supervisor.config.containment, adoption)
            except (ContainmentError, OSError) as exc:  # its process group and marker still hold it
                log.warning("task %s: cannot open its cgroup again (%s); using its process group", task.id, exc)
                jail = ProcessGroupJail(task.id)
                _adopt_monitor(jail, adoption)
            rt.jail = jail
            await _egress_again(supervisor, rt, jail, notice, handle.proxy_port)
            delivery.watch_item_files(Path(handle.work))  # its declared JSON Lines files stream on
            # Its checkpoints go on (numbered after the previous agent's; an upload it left is finished).
            await checkpoints_for(supervisor.config, supervisor.master, rt, record.task_dir, notice).adopt()
            timeout = 0.0 if handle.deadline_at is None else handle.deadline_at - handle.spawned_at
            try:
                outcome = await supervisor.finish_run(rt, adoption.monitored, jail, sink, notice, timeout)
            except Exception as exc:  # a bug of ours must fail the task, not the agent (never BAD_TASK)
                log.exception("task %s: internal error", task.id)
                outcome = TaskOutcome("FAILED", AGENT_ERROR, describe_fault(exc)[:4000])
            finally:
                if outcome is None and not rt.handed_over:
                    with trio.CancelScope(shield=True):
                        rt.stop.request(StopReason.TERMINATING)
                        await delivery.finish(_result(rt, TaskOutcome(*stopped_outcome(rt.stop)), record.claimed_at))
            egress = supervisor.config.egress
            if outcome is not None and outcome.egress_refused is None and rt.egress is not None and egress is not None:
                outcome.egress_refused = await trio.to_thread.run_sync(egress.refusals, rt.egress)
                report_refusals(task.id, outcome.egress_refused, notice)
            blamed = rt.stop.reason is StopReason.DISK_FULL  # its working copy is scratch (ckagent.delivery.diskwatch)
            if outcome is not None and not rt.handed_over and not blamed:  # its files → items, artifacts or kept ones
                await supervisor.collect_outputs(rt, record.task_dir, Path(handle.work), None, notice)
            result = _result(rt, outcome, record.claimed_at)
            supervisor.lifecycle.emit(TaskFinished(task.id, result))
            await delivery.finish(result)
            await supervisor.runner.reclaim_if_blamed(rt)
    finally:
        with trio.CancelScope(shield=True):  # noqa: ASYNC912 - shielded cleanup
            if not rt.handed_over:
                if jail is not None:
                    await jail.kill_all()
                    detach = supervisor.egress_detach(rt)
                    if detach is not None:  # after the kill, before the cgroup goes
                        await trio.to_thread.run_sync(detach)
                    jail.close()
                await trio.to_thread.run_sync(remove_tree, Path(handle.work))
                release_listeners(supervisor, [handle.proxy_port], keep=False)  # (one never opened again)
            elif rt.delivery is not None and rt.delivery.sink is not None:
                rt.delivery.sink.close()
            adoption.monitored.close()  # (handed over: the next agent proves it anew)
        if took_slot:
            supervisor.capacity.release()
        if adoption.release_env is not None:  # (handed over again: the next agent counts it anew)
            adoption.release_env()
            adoption.release_env = None
        supervisor.task_left(task.id)


async def _egress_again(supervisor: Supervisor, rt: RunningTask, jail: TaskJail,
                        notice: Callable[[str], None], proxy_port: int) -> None:
    """Put an adopted task under its network policy again: the previous agent left its table in place
    when it handed over, and this agent's start made the table afresh (ckagent.containment.egress); at
    the proxy level the task's listener opens again on ``proxy_port``, the port its proxy variables
    name, with its own proxies chained as before. A task whose rules cannot be added again is
    stopped: it must not crawl unprotected."""
    egress = supervisor.config.egress
    if egress is None or not egress.level.has_policy:
        return
    try:
        rt.egress = await trio.to_thread.run_sync(partial(egress.attach, jail, rt.task.id, rt.task.egress,
                                                          proxy_port=proxy_port,
                                                          uid=task_uid(rt.run_as)))
    except EgressError as exc:
        log.warning("task %s: %s; stopping it", rt.task.id, exc)
        notice(f"{exc}; the task is stopped (it must not run without its network policy)")
        rt.stop.request(StopReason.EGRESS_LOST,
                        f"egress: cannot apply the task's network policy again after the restart ({exc})")
        return
    notice(f"egress ({egress.level}): {egress.effective(rt.task.egress).describe()}")
    egress.chain(rt.egress, {**spider_base_env(), **supervisor.config.extra_env, **rt.task.env}, notice)


def release_listeners(supervisor: Supervisor, ports: list[int], *, keep: bool) -> None:
    """At the proxy level under a descriptor store (ckagent.containment.egress.proxy.fdstore): close the
    inherited listeners of ``ports`` not taken (``keep=False``), or every inherited listener but those
    of ``ports`` (``keep=True``: the adopted tasks' ports, after the adoption). Never raises."""
    egress = supervisor.config.egress
    server = egress.server if egress is not None else None
    if server is not None:
        if keep:
            server.fdstore.release_unclaimed(ports)
        else:
            server.fdstore.release(ports)


def admit_adopted(supervisor: Supervisor, adoption: Adoption) -> RunningTask:
    """Record an adopted task as running here (before the first poll: its slot is taken), and its
    dependency environment as in use (environment collection never removes it under the spider)."""
    rt = supervisor.admit(adoption.task, adopted=True)  # (agent.max_tasks counted it when it was claimed)
    if adoption.handle.env_dir and adoption.release_env is None:
        adoption.release_env = supervisor.adopt_environment(Path(adoption.handle.env_dir))
    rt.claimed_at = adoption.record.claimed_at
    rt.started_at = adoption.handle.spawned_at
    if adoption.handle.uid >= 0:  # it keeps the identity it was started as (whatever the level is now)
        home = supervisor.config.work_dir / "spider-home" / safe_name(adoption.task.spider_id)
        rt.run_as = RunAs.recorded(adoption.handle.uid, adoption.handle.gid, str(home))
    rt.pid = adoption.handle.monitor_pid
    rt.phase = "running"
    if adoption.handle.deadline_at is not None and adoption.handle.deadline_at <= time.time():
        log.info("task %s: its deadline passed while no agent ran", adoption.task.id)
    return rt
