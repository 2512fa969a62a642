"""The deploy phase of a task: its code version, its command, its private working copy, its jail and
egress rules — and, at its end, what it wrote in the copy (items, artifacts or kept files).

Each task runs in a private working copy of its code version (ckagent.code.workcopy), with its
spider's ``CK_DATA_DIR`` and ``HOME``; the copy is removed when the task ends. Every task runs in a
jail of the node's containment level (:mod:`ckagent.containment`), created before its first
installer and emptied and removed after its end.

Errors: :meth:`Deployer.deploy` raises DeployError, :meth:`Deployer.open_jail` JailError (the
TaskErrors of ckagent.node.errors). Blocking work (the file system, the kernel's cgroups and
nftables) runs in one ``trio.to_thread`` hop per step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path

import trio

from ckagent.code.workcopy import make_working_copy, remove_tree, spider_dirs
from ckagent.code.workspace import Workspaces
from ckagent.containment import ContainmentError, Limits, TaskJail
from ckagent.containment.egress import EgressError, TaskRules
from ckagent.containment.process_group import ProcessGroupJail
from ckagent.delivery.outputs import collect, kept_dir
from ckagent.master.ids import safe_name
from ckagent.master.protocol import Task
from ckagent.node.errors import DeployError, JailError, os_error_text
from ckagent.task.admission import RunningTask
from ckagent.task.commands import resolve_command
from ckagent.task.outcome import NO_COPY, Notice
from ckagent.task.runconfig import RunnerConfig

Deployed = tuple[Path, list[str], "str | None", str]
"""``(code dir, argv, how the command was chosen, what was copied)``."""


class Deployer:
    """A task's code, working copy, jail and outputs on this node (see module docstring)."""

    def __init__(self, config: RunnerConfig, workspaces: Workspaces,
                 master_takes_artifacts: Callable[[], bool]) -> None:
        self.config = config
        self._workspaces = workspaces
        self._master_takes_artifacts = master_takes_artifacts

    def work_of(self, task: Task) -> Path:
        """Where the task's private working copy is made."""
        return self._workspaces.runs / safe_name(task.id)

    async def deploy(self, task: Task, work: Path, held: contextlib.AsyncExitStack,
                     notice: Notice | None = None) -> Deployed:
        """The task's code version (deployed or found), its command and its working copy in ``work``;
        the version is held (``held`` releases it). Raises DeployError (a file system error included,
        with its errno text and path)."""
        try:
            # A package deployed before (the usual case): one thread hop finds it, resolves the
            # command and makes the working copy.
            cached = None
            if task.code_package is not None:
                cached = await trio.to_thread.run_sync(self._reuse_and_copy, task, work)
            if cached is not None:
                code_dir, (argv, how), copied = cached
                self._workspaces.acquire(code_dir)
                held.callback(self._workspaces.release, code_dir)
                return code_dir, argv, how, copied
            if task.code_package is not None:
                code_dir = await self._workspaces.deploy_package(task.spider_id, task.code_version, task.code_package,
                                                                  notice)
            else:
                code_dir = await self._workspaces.deploy_files(task.spider_id, notice)
            self._workspaces.acquire(code_dir)
            held.callback(self._workspaces.release, code_dir)
            # One thread hop for the command and the working copy.
            (argv, how), copied = await trio.to_thread.run_sync(self._resolve_and_copy, task, code_dir, work)
            return code_dir, argv, how, copied
        except OSError as exc:
            raise DeployError(f"cannot deploy the spider's code: {os_error_text(exc)}") from exc

    def _reuse_and_copy(self, task: Task, work: Path) -> tuple[Path, tuple[list[str], str | None], str] | None:
        """For a package deployed before: its version dir (touched: pruning keeps the newest), the
        command and the working copy (:meth:`_resolve_and_copy`); None when it must be deployed. Blocking."""
        assert task.code_package is not None
        code_dir = self._workspaces.reuse_package(task.spider_id, task.code_version, task.code_package)
        if code_dir is None:
            return None
        return code_dir, *self._resolve_and_copy(task, code_dir, work)

    def _resolve_and_copy(self, task: Task, code_dir: Path, work: Path) -> tuple[tuple[list[str], str | None], str]:
        """The task's command, then its working copy (:meth:`_working_copy`). Blocking. Raises
        DeployError (a copy that fails: its message starts with ``NO_COPY``)."""
        resolved = resolve_command(task, code_dir)
        try:
            return resolved, self._working_copy(task, code_dir, work)
        except OSError as exc:
            raise DeployError(f"{NO_COPY}: {exc}") from exc

    def _working_copy(self, task: Task, code_dir: Path, work: Path) -> str:
        """Make the task's private working copy and its spider's data/home dirs (blocking; see ckagent.code.workcopy)."""
        remove_tree(work)
        stats = make_working_copy(code_dir, work)
        run_as = self.config.run_as
        if run_as is not None:
            run_as.chown_tree(work)
        spider_dirs(self.config.work_dir, safe_name(task.spider_id), run_as)
        return stats.describe()

    async def open_jail(self, rt: RunningTask, notice: Notice) -> TaskJail:
        """The task's jail at the node's level, with the task's limits (else the node's defaults), under
        its egress rules (``rt.egress``). Raises JailError (the jail is emptied first)."""
        task, default = rt.task, self.config.default_limits
        wanted = Limits(
            memory_bytes=task.resources.memory_bytes if task.resources.memory_bytes is not None else default.memory_bytes,
            pids=task.resources.pids if task.resources.pids is not None else default.pids,
            cpus=task.resources.cpus if task.resources.cpus is not None else default.cpus,
        )
        containment, egress = self.config.containment, self.config.egress

        def jail_and_attach() -> tuple[TaskJail, TaskRules | None, EgressError | None]:
            """The jail, then the task's egress rules on it: one thread hop (before any process of
            the task starts: its installers are filtered too). Raises ContainmentError."""
            made: TaskJail = ProcessGroupJail(task.id) if containment is None else containment.jail(task.id, wanted)
            if egress is None:
                return made, None, None
            try:
                return made, egress.attach(made, task.id, task.egress), None
            except EgressError as exc:
                return made, None, exc

        jail: TaskJail
        attached: TaskRules | None = None
        failed: EgressError | None = None
        try:
            if containment is None and egress is None:
                jail = ProcessGroupJail(task.id)
            else:
                jail, attached, failed = await trio.to_thread.run_sync(jail_and_attach)
        except ContainmentError as exc:
            level = "process-group" if containment is None else containment.level
            raise JailError(f"the node cannot contain the task ({level}): {exc}") from exc
        if egress is not None:
            if failed is not None:  # the task must not run unprotected
                await empty_jail(jail)
                raise JailError(str(failed)) from failed
            rt.egress = attached
            notice(f"egress ({egress.level}): {egress.effective(task.egress).describe()}")
        rt.jail = jail
        if wanted != Limits() and jail.limits != wanted:
            notice(f"limits asked: {wanted.describe()}; this node ({jail.level}) enforces: {jail.limits.describe()}")
        elif wanted != Limits():
            notice(f"limits: {wanted.describe()} ({jail.level})")
        return jail

    def egress_detach(self, rt: RunningTask) -> Callable[[], None] | None:
        """What removes the task's egress rules at its end (blocking), or None without a policy."""
        egress = self.config.egress
        if egress is None:
            return None

        def detach() -> None:
            if rt.egress is not None:
                egress.detach(rt.egress, egress.refusals(rt.egress))

        return detach

    async def collect_outputs(self, rt: RunningTask, task_dir: Path, work: Path, version_dir: Path | None,
                              notice: Notice) -> None:
        """What the task wrote in its working copy → items, artifacts or kept on the node (ckagent.delivery.outputs),
        before the copy is removed; one ``outputs:`` line in the task log says what became of each file.
        ``version_dir`` None: the task's code version (what the copy was made of) is not known — a
        re-adopted task of a version gone meanwhile: the line says so. Never raises for the files."""
        task = rt.task
        if version_dir is None and task.code_package is not None:
            version_dir = await trio.to_thread.run_sync(
                self._workspaces.reuse_package, task.spider_id, task.code_version, task.code_package)
        if version_dir is None:
            notice("outputs: the task's code version is not on this node any more, so the files it wrote "
                   "cannot be told from its code; they are removed with the working copy")
            return
        keep = kept_dir(self.config.work_dir, safe_name(task.spider_id), safe_name(task.id))
        try:
            collected = await trio.to_thread.run_sync(functools.partial(
                collect, work=work, code_dir=version_dir, since=rt.started_at or 0.0, task_dir=task_dir,
                outputs=task.outputs, budget_bytes=self.config.max_artifact_bytes,
                master_takes_artifacts=self._master_takes_artifacts(), keep_dir=keep,
                streamed=None if rt.delivery is None or rt.delivery.live is None else rt.delivery.live.link))
        except OSError as exc:
            notice(f"outputs: cannot collect the task's files ({exc.strerror or exc}); they are removed with "
                   "the working copy")
            return
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


async def clear_task(jails: list[TaskJail], work: Path, rt: RunningTask,
                     detach: Callable[[], None] | None = None) -> None:
    """At the end of a task: :func:`empty_jail` for the jail in ``jails`` (none: it was never made)
    and the working copy ``work`` removed (even when the task ends by cancellation), their blocking
    parts (the egress rules' removal, the copy's) in one thread hop. Nothing when the task was
    handed over to the next agent (its spider runs on in both; that agent removes them). Shielded."""
    if rt.handed_over:
        return
    jail = jails[0] if jails else None
    with trio.CancelScope(shield=True):
        if jail is not None:
            await jail.kill_all()

        def blocking() -> None:
            try:
                if jail is not None and detach is not None:
                    detach()
            finally:
                remove_tree(work)

        try:
            await trio.to_thread.run_sync(blocking)
        finally:
            if jail is not None:
                jail.close()

