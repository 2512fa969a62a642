"""The deploy phase of a task: its code version, its command, its private working copy, its jail and
egress rules — and, at its end, what it wrote in the copy (items, artifacts or kept files).

Each task runs in a private working copy of its code version (ckagent.code.workcopy), with its
spider's ``CK_DATA_DIR`` and ``HOME``; the copy is removed when the task ends. Every task runs in a
jail of the node's containment level (:mod:`ckagent.containment`), created before its first
installer and emptied and removed after its end.

Errors: :meth:`Deployer.deploy` raises JailError and DeployError (the TaskErrors of
ckagent.node.errors). Blocking work (the file system, the kernel's cgroups and nftables) runs in one
``trio.to_thread`` hop per phase: the prepare hop makes the jail, finds the code version, makes the
working copy and looks at the dependencies' environment (ckagent.task.runner); the end's hop
collects the outputs and clears the jail and the copy.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from ckagent.code import scrapydata
from ckagent.code.frameworks import PYTHON
from ckagent.code.frameworks import framework as framework_of
from ckagent.code.workcopy import make_working_copy, remove_tree, spider_dirs
from ckagent.code.workspace import Workspaces
from ckagent.containment import ContainmentError, ContainmentLevel, Limits, TaskJail
from ckagent.containment.egress import EgressError, Refusal, TaskRules
from ckagent.containment.process_group import ProcessGroupJail
from ckagent.delivery.outputs import Collected, collect, item_candidates, kept_dir
from ckagent.delivery.outputs import samples as output_samples
from ckagent.master.ids import safe_name
from ckagent.master.ids import task_dir as task_dir_of
from ckagent.master.protocol import Task
from ckagent.node.errors import DeployError, JailError, os_error_text
from ckagent.node.runas import RunAs, task_uid
from ckagent.task.admission import RunningTask
from ckagent.task.commands import resolve_command
from ckagent.task.outcome import NO_COPY, Notice
from ckagent.task.runconfig import RunnerConfig

log = logging.getLogger(__name__)

Deployed = tuple[Path, list[str], "str | None", str]
"""``(code dir, argv, how the command was chosen, what was copied)``."""


@dataclass
class _Hop:
    """What the prepare hop made (``jail``: the jail, its egress rules or their error; ``code``) or
    met (``error``)."""

    jail: tuple[TaskJail, TaskRules | None, EgressError | None] | None = None
    code: Deployed | None = None
    error: Exception | None = None


class Deployer:
    """A task's code, working copy, jail and outputs on this node (see module docstring)."""

    def __init__(self, config: RunnerConfig, workspaces: Workspaces,
                 master_takes_artifacts: Callable[[], bool]) -> None:
        self.config = config
        self._workspaces = workspaces
        self._master_takes_artifacts = master_takes_artifacts
        self.notes: dict[str, list[str]] = {}
        """Lines for a task's log the prepare hop found (Scrapy's data dir: ckagent.code.scrapydata), by
        task id; the runner takes them after the working copy's line."""

    def work_of(self, task: Task) -> Path:
        """Where the task's private working copy is made."""
        return self._workspaces.runs / safe_name(task.id)

    async def deploy(self, rt: RunningTask, work: Path, held: contextlib.AsyncExitStack, notice: Notice,
                     jails: list[TaskJail], check: Callable[[Path], object] | None = None) -> Deployed:
        """The task's jail (appended to ``jails``, the caller's to clear: :meth:`_jailed`), its code
        version (deployed or found; held until ``held`` closes), its command and its working copy in
        ``work``, then ``check(work)`` (blocking and never raising for the task: the dependencies'
        look, ckagent.code.deps) — for a package deployed before (the usual case) all in one thread
        hop (the prepare hop). Raises JailError (first: nothing of the code is made then), DeployError
        (a file system error included, with its errno text and path)."""
        task = rt.task
        wanted = self._limits(task)
        hop = await trio.to_thread.run_sync(self._prepare_hop, task, work, wanted, None, check, rt.run_as)
        if isinstance(hop.error, ContainmentError):
            level = ContainmentLevel.PROCESS_GROUP if self.config.containment is None else self.config.containment.level
            raise JailError(f"the node cannot contain the task ({level}): {hop.error}") from hop.error
        if hop.jail is None:  # not the kernel's refusal: an error of ours, raised as it is
            assert hop.error is not None
            raise hop.error
        await self._jailed(rt, hop.jail, wanted, jails, notice)
        try:
            if hop.error is None and hop.code is None:
                # Not deployed before: fetched (or the files found), then one hop for the copy and the check.
                if task.code_package is not None:
                    code_dir = await self._workspaces.deploy_package(task.spider_id, task.code_version,
                                                                      task.code_package, notice)
                else:
                    code_dir = await self._workspaces.deploy_files(task.spider_id, notice)
                self._workspaces.acquire(code_dir)
                held.callback(self._workspaces.release, code_dir)
                hop = await trio.to_thread.run_sync(self._prepare_hop, task, work, None, code_dir, check, rt.run_as)
            elif hop.code is not None:
                self._workspaces.acquire(hop.code[0])
                held.callback(self._workspaces.release, hop.code[0])
            if hop.error is not None:
                raise hop.error
        except OSError as exc:
            raise DeployError(f"cannot deploy the spider's code: {os_error_text(exc)}") from exc
        assert hop.code is not None
        return hop.code

    def _prepare_hop(self, task: Task, work: Path, wanted: Limits | None, code_dir: Path | None,
                     check: Callable[[Path], object] | None, run_as: RunAs | None) -> _Hop:
        """The prepare hop (blocking): the jail under its egress rules (``wanted`` its limits; None: no
        jail now), the code version (``code_dir``, else a package deployed before, else none yet),
        the command and the working copy (given to ``run_as``, the spider's identity, with its spider's
        dirs), then ``check(work)``. Returns what it met instead of raising."""
        hop = _Hop()
        try:
            if wanted is not None:
                hop.jail = self._jail_and_attach(task, wanted, run_as)
            if code_dir is not None:
                (argv, how), copied = self._resolve_and_copy(task, code_dir, work, run_as)
                hop.code = (code_dir, argv, how, copied)
            elif task.code_package is not None:
                cached = self._reuse_and_copy(task, work, run_as)
                if cached is not None:
                    found, (argv, how), copied = cached
                    hop.code = (found, argv, how, copied)
            if hop.code is not None and check is not None:
                check(work)
        except Exception as exc:  # ContainmentError, DeployError, OSError; a bug: raised on the loop all the same
            hop.error = exc
        return hop

    def _reuse_and_copy(self, task: Task, work: Path,
                        run_as: RunAs | None) -> tuple[Path, tuple[list[str], str | None], str] | None:
        """For a package deployed before: its version dir (touched: pruning keeps the newest), the
        command and the working copy (:meth:`_resolve_and_copy`); None when it must be deployed. Blocking."""
        assert task.code_package is not None
        code_dir = self._workspaces.reuse_package(task.spider_id, task.code_version, task.code_package)
        if code_dir is None:
            return None
        return code_dir, *self._resolve_and_copy(task, code_dir, work, run_as)

    def _resolve_and_copy(self, task: Task, code_dir: Path, work: Path,
                          run_as: RunAs | None) -> tuple[tuple[list[str], str | None], str]:
        """The task's command, then its working copy (:meth:`_working_copy`). Blocking. Raises
        DeployError (a copy that fails: its message starts with ``NO_COPY``)."""
        resolved = resolve_command(task, code_dir)
        try:
            return resolved, self._working_copy(task, code_dir, work, run_as)
        except OSError as exc:
            raise DeployError(f"{NO_COPY}: {exc}") from exc

    def _working_copy(self, task: Task, code_dir: Path, work: Path, run_as: RunAs | None) -> str:
        """Make the task's private working copy and its spider's data/home dirs, given to the spider's
        identity ``run_as`` (blocking; see ckagent.code.workcopy)."""
        remove_tree(work)
        stats = make_working_copy(code_dir, work)
        if run_as is not None:
            run_as.chown_tree(work)
        # The package's own item files (its author's samples) as staged: only what the run writes of
        # them becomes items (ckagent.delivery.outputs.samples). Recorded before any process runs.
        # (Not recorded — a task dir that cannot be written — every item file counts as the run's.)
        try:
            output_samples.save(task_dir_of(self.config.work_dir, task.id),
                                output_samples.snapshot(work, item_candidates(work, task.outputs)))
        except OSError as exc:
            log.warning("task %s: cannot record the package's item files: %s", task.id, exc)
        data_dir, _home = spider_dirs(self.config.work_dir, safe_name(task.spider_id), run_as, spider_id=task.spider_id)
        if framework_of(task.framework).runtime is PYTHON:  # any Python task may run Scrapy
            try:
                line = scrapydata.attach(work, data_dir, run_as, clean=task.clean_start).line()
            except OSError as exc:
                line = f"Scrapy's data dir cannot be kept in {data_dir}: {os_error_text(exc)}"
            self.notes[task.id] = [line]
        return stats.describe()

    def _limits(self, task: Task) -> Limits:
        """The task's limits, else the node's defaults."""
        default = self.config.default_limits
        return Limits(
            memory_bytes=task.resources.memory_bytes if task.resources.memory_bytes is not None else default.memory_bytes,
            pids=task.resources.pids if task.resources.pids is not None else default.pids,
            cpus=task.resources.cpus if task.resources.cpus is not None else default.cpus,
        )

    def _jail_and_attach(self, task: Task, wanted: Limits,
                         run_as: RunAs | None) -> tuple[TaskJail, TaskRules | None, EgressError | None]:
        """The jail at the node's level, then the task's egress rules on it (before any process of the
        task starts: its installers are filtered too). Blocking. Raises ContainmentError."""
        containment, egress = self.config.containment, self.config.egress
        made: TaskJail = ProcessGroupJail(task.id) if containment is None else containment.jail(task.id, wanted)
        if egress is None:
            return made, None, None
        try:
            return made, egress.attach(made, task.id, task.egress, uid=task_uid(run_as)), None
        except EgressError as exc:
            return made, None, exc

    async def _jailed(self, rt: RunningTask, made: tuple[TaskJail, TaskRules | None, EgressError | None],
                      wanted: Limits, jails: list[TaskJail], notice: Notice) -> None:
        """The jail the prepare hop made becomes the task's (``rt.jail``, ``rt.egress``; into ``jails``)
        and is said in the task log; a jail whose egress rules failed is emptied and JailError raised
        (the task must not run unprotected)."""
        jail, attached, failed = made
        egress = self.config.egress
        if egress is not None:
            if failed is not None:
                await empty_jail(jail)
                raise JailError(str(failed)) from failed
            rt.egress = attached
            notice(f"egress ({egress.level}): {egress.effective(rt.task.egress).describe()}")
        rt.jail = jail
        jails.append(jail)
        if wanted != Limits() and jail.limits != wanted:
            notice(f"limits asked: {wanted.describe()}; this node ({jail.level}) enforces: {jail.limits.describe()}")
        elif wanted != Limits():
            notice(f"limits: {wanted.describe()} ({jail.level})")

    def egress_detach(self, rt: RunningTask) -> Callable[..., None] | None:
        """What removes the task's egress rules at its end (blocking; it takes what they refused when
        that was read already, after the task's last process), or None without a policy."""
        egress = self.config.egress
        if egress is None:
            return None

        def detach(refused: list[Refusal] | None = None) -> None:
            if rt.egress is not None:
                egress.detach(rt.egress, egress.refusals(rt.egress) if refused is None else refused)

        return detach

    async def collect_outputs(self, rt: RunningTask, task_dir: Path, work: Path, version_dir: Path | None,
                              notice: Notice) -> None:
        """What the task wrote in its working copy → items, artifacts or kept on the node (ckagent.delivery.outputs),
        before the copy is removed; one ``outputs:`` line in the task log says what became of each file.
        ``version_dir`` None: the task's code version (what the copy was made of) is not known — a
        re-adopted task of a version gone meanwhile: the line says so. Never raises for the files.
        (A task run here collects in its end hop instead: :meth:`collect_blocking`.)"""
        task = rt.task
        if version_dir is None and task.code_package is not None:
            version_dir = await trio.to_thread.run_sync(
                self._workspaces.reuse_package, task.spider_id, task.code_version, task.code_package)
        collected = await trio.to_thread.run_sync(self.collect_blocking, rt, task_dir, work, version_dir)
        self.say_collected(rt, collected, notice)

    def collect_blocking(self, rt: RunningTask, task_dir: Path, work: Path,
                         version_dir: Path | None) -> Collected | OSError | None:
        """:meth:`collect_outputs`' blocking part: what became of the files (None: the version is not
        known; an OSError: they cannot be collected). Blocking; pass the result to :meth:`say_collected`."""
        if version_dir is None:
            return None
        task = rt.task
        keep = kept_dir(self.config.work_dir, safe_name(task.spider_id), safe_name(task.id))
        try:
            return collect(work=work, code_dir=version_dir, since=rt.started_at or 0.0, task_dir=task_dir,
                           outputs=task.outputs, budget_bytes=self.config.max_artifact_bytes,
                           master_takes_artifacts=self._master_takes_artifacts(), keep_dir=keep,
                           streamed=None if rt.delivery is None or rt.delivery.live is None else rt.delivery.live.link,
                           samples=output_samples.load(task_dir))
        except OSError as exc:
            return exc

    def say_collected(self, rt: RunningTask, collected: Collected | OSError | None, notice: Notice) -> None:
        """The task log's ``outputs:`` line for what :meth:`collect_blocking` returned (on the loop)."""
        if collected is None:
            notice("outputs: the task's code version is not on this node any more, so the files it wrote "
                   "cannot be told from its code; they are removed with the working copy")
        elif isinstance(collected, OSError):
            notice(f"outputs: cannot collect the task's files ({collected.strerror or collected}); they are "
                   "removed with the working copy")
        else:
            if rt.delivery is not None:  # the collection's own notices (a file first seen now) before its summary
                rt.delivery.take_notices()
            notice(collected.line())


async def empty_jail(jail: TaskJail, rt: RunningTask | None = None,
                     detach: Callable[[], None] | None = None) -> None:
    """At the end of a task: kill what is left in its jail (an interrupted installer), remove its
    egress rules (``detach``, blocking: after the kill, before the cgroup goes) and the jail (not
    when the task was handed over to the next agent: its spider runs on in it). Shielded."""
    if rt is not None and rt.handed_over:
        return
    with trio.CancelScope(shield=True):
        await jail.kill_all()
        if detach is not None:
            await trio.to_thread.run_sync(detach)
        jail.close()


class Clearing:
    """A task's end on the node: its jail (``jails``: none until made) emptied, its egress rules
    (``detach``, blocking: after the kill, before the cgroup goes) and the jail removed, its working
    copy ``work`` removed — once, also when the task ends by cancellation. Nothing when the task was
    handed over to the next agent (its spider runs on in both; that agent removes them)."""

    def __init__(self, work: Path, rt: RunningTask, detach: Callable[..., None] | None) -> None:
        self.work, self.rt, self.detach = work, rt, detach
        self.jails: list[TaskJail] = []
        self.done = False

    def blocking(self, refused: list[Refusal] | None = None) -> None:
        """The blocking part, for a jail known empty (its supervisor killed what was left): the egress
        rules (``refused``: what they refused, read already), the working copy, the cgroups. Blocking
        (the end hop's, ckagent.task.runner); once."""
        self.done = True
        jail = self.jails[0] if self.jails else None
        try:
            if jail is not None and self.detach is not None:
                self.detach(refused)
        finally:
            try:
                remove_tree(self.work)
            finally:
                if jail is not None:
                    jail.close()

    async def __call__(self) -> None:
        """Everything not done yet: the jail's processes killed, then :meth:`blocking` in one thread
        hop. Shielded."""
        if self.done or self.rt.handed_over:
            return
        jail = self.jails[0] if self.jails else None
        with trio.CancelScope(shield=True):
            if jail is not None:
                await jail.kill_all()
            await trio.to_thread.run_sync(self.blocking)
