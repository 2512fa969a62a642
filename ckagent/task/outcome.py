"""The outcome rules: how a task's end becomes its result (status, errorCode, errorMessage).

====================  ==========  ============  =================================
outcome               status      errorCode     errorMessage
====================  ==========  ============  =================================
exit 0                SUCCESS     —             — (finishReason from the final stats)
exit 0, log cut       SUCCESS     LOG_BUDGET    how many bytes were dropped and why
exit ≠ 0              FAILED      EXIT_NONZERO  "exit code N" + the output's last lines
killed by a signal    FAILED      SIGNALED      "killed by SIGX (exit code -N)" + the output's last lines
timeout               FAILED      TIMEOUT       "执行超时"
stalled               FAILED      STALLED       how long nothing happened
stopped               CANCELLED   CANCELLED     the reason (every stop: ckagent.task.stop)
code refused          FAILED      DEPLOY_FAILED the entry and the rule, or what the framework needs
install failed        FAILED      DEPS_FAILED   the installer's last whole lines
not startable         FAILED      EXIT_NONZERO  what could not be started (exitCode null)
OOM kill in the task  FAILED      OOM_KILLED    the limit and the peak (cgroup levels)
no jail / agent bug   FAILED      AGENT_ERROR   what failed (errno text and path kept)
filled the disk       FAILED      DISK_FULL     what it held, its share, the free space and the floor
====================  ==========  ============  =================================

The full table (with AGENT_LOST, BAD_TASK) is docs/protocol.md's "Outcomes". Every final result also
carries its attempt, its ``causeClass`` and ``retryable`` (:func:`cause_fields`; docs/protocol.md, "Causes
and retries") and the newest checkpoint its attempt shipped. Everything here is pure logic on the Trio
thread except :func:`output_tail` (one small blocking read).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckagent.code.builder import read_only_hint
from ckagent.containment import Figures, TaskJail, format_bytes
from ckagent.containment.egress import Refusal
from ckagent.containment.process import clock
from ckagent.containment.stopping import ProcessOutcome
from ckagent.containment.tails import TailBuffer, last_lines
from ckagent.delivery import LogSink
from ckagent.delivery.lines import mask_argv, secret_values
from ckagent.delivery.spool import open_spool
from ckagent.master.protocol import Task, TaskResult, cause_of, utc_iso
from ckagent.node.errors import DeployError, DepsError, TaskError
from ckagent.node.logs import Masker, escape_controls
from ckagent.task.stop import StopReason, stopped_outcome

if TYPE_CHECKING:
    from ckagent.task.admission import RunningTask

STDERR_TAIL_CHARS = 1500
"""Characters of the spider's last stderr lines carried by an EXIT_NONZERO errorMessage."""
MESSAGE_CHARS = 4000
"""Most characters of an errorMessage built from an installer's or the agent's own text."""
NO_COPY = "cannot make the task's working copy"
"""How a DeployError of the working copy begins (its notice is the message itself)."""

Notice = Callable[[str], None]
"""Writes one ``[ckagent …]`` line into the task's log."""


@dataclass
class TaskOutcome:
    """What happened, before it becomes a TaskResult."""

    status: str
    error_code: str | None = None
    error_message: str | None = None
    exit_code: int | None = None
    figures: Figures | None = None
    egress_refused: list[Refusal] | None = None
    checkpoint_id: str | None = None
    """The newest checkpoint the attempt shipped, when the one who judged knows it (a migrate, the soft
    memory ceiling); None: :func:`task_result` asks the task's checkpoints."""
    disk_culprit: bool = True
    """For DISK_FULL: the task itself filled the disk (class ``resource``); False: another did (``disruption``)."""


def judge_exit(rt: RunningTask, outcome: ProcessOutcome, notice: Notice, stderr_tail: TailBuffer, sink: LogSink,
               agent_secrets: tuple[str, ...]) -> TaskOutcome:
    """The outcome of an ended spider: the task's stop reason when the agent stopped it (TIMEOUT,
    STALLED, DISK_FULL, CANCELLED: ckagent.task.stop.stopped_outcome), else its exit status (a death
    by signal names the signal). Writes one notice."""
    reason = rt.stop.reason
    # A task that filled the disk is DISK_FULL however it ended: it may die of the full disk before the
    # stop reaches it, or exit (even 0) before any look saw it (judged at its end: ckagent.delivery.diskwatch).
    if reason is not None and (outcome.stopped or reason is StopReason.DISK_FULL):
        status, code, message = stopped_outcome(rt.stop)
        words = rt.stop.describe() if status != "CANCELLED" else f"stopped ({rt.stop.describe()})"
        ended = (ended_by_agent(words, outcome) if outcome.stopped
                 else f"process exited with code {outcome.returncode}; {words}")
        notice(ended + f"; task {status}" + (f" ({code})" if status != code else ""))
        return TaskOutcome(status, code, message, outcome.returncode)
    notice(f"process exited with code {outcome.returncode}")
    if outcome.returncode == 0:
        if sink.truncated is not None:
            return TaskOutcome("SUCCESS", "LOG_BUDGET", f"output truncated: {sink.dropped_bytes} bytes "
                               f"dropped because {sink.truncated}", 0)
        return TaskOutcome("SUCCESS", exit_code=0)
    # A signal the agent did not send (it sent none: not stopped, not timed out): a crash, a kill.
    code = "SIGNALED" if outcome.returncode is not None and outcome.returncode < 0 else "EXIT_NONZERO"
    if (hint := read_only_hint(stderr_tail.text())) is not None:
        notice(hint)
    return TaskOutcome("FAILED", code, exit_message(outcome.returncode, stderr_tail, rt.task, agent_secrets),
                       outcome.returncode)


def exit_message(returncode: int | None, stderr_tail: TailBuffer, task: Task, agent_secrets: tuple[str, ...]) -> str:
    """``exit code N`` / ``killed by SIGX``, then the last lines of the spider's output (bounded, masked)."""
    head = f"exit code {returncode}"
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            head = f"killed by {signal.Signals(-returncode).name} (exit code {returncode})"
    masker = Masker(secret_words(task, agent_secrets))
    tail = last_lines(masker(stderr_tail.text()), STDERR_TAIL_CHARS)
    return f"{head}; last lines of output:\n{tail}" if tail else f"{head} (no output)"


def failed_outcome(rt: RunningTask, exc: TaskError, notice: Notice, agent_secrets: tuple[str, ...]) -> TaskOutcome:
    """The FAILED outcome of a task whose phase raised ``exc`` (its jail not emptied yet: an
    installer the kernel's OOM killer ended is reported OOM_KILLED). Writes one notice."""
    text = str(exc)
    jail, figures = rt.jail, None
    if isinstance(exc, DeployError):
        notice(text if text.startswith(NO_COPY) else f"deploy failed: {text}")
    elif isinstance(exc, DepsError):
        notice(f"dependency install failed: {text.splitlines()[0] if text else ''}")
        figures = jail.figures() if jail is not None else None
        if jail is not None and figures is not None and figures.oom_kills:
            return oom_outcome(jail, figures, None, "the dependency installer")
    else:
        notice(f"task FAILED ({exc.error_code}): {text}")
    if isinstance(exc, DepsError):  # the installer's output may echo the task's secrets
        text = Masker(secret_words(rt.task, agent_secrets))(text)
    return TaskOutcome("FAILED", exc.error_code, bounded(text, MESSAGE_CHARS), figures=figures)


def oom_outcome(jail: TaskJail, figures: Figures, returncode: int | None, what: str) -> TaskOutcome:
    """FAILED/OOM_KILLED naming the limit and the peak; ``what`` names the victim (``the spider``)."""
    limit = jail.limits.memory_bytes
    peak = figures.memory_peak_bytes
    message = (f"{what} was killed by the kernel's OOM killer ({figures.oom_kills} process(es)): memory limit "
               f"{format_bytes(limit) if limit is not None else 'none (node memory ran out)'}, peak "
               f"{format_bytes(peak) if peak is not None else 'unknown'}")
    return TaskOutcome("FAILED", "OOM_KILLED", message, returncode, figures=figures)


def cause_fields(error_code: str | None, *, disk_culprit: bool = True) -> dict[str, Any]:
    """TaskResult keyword arguments ``cause_class`` and ``retryable`` of a final result with ``error_code``
    (None: a success), by :func:`ckagent.master.protocol.cause_of`."""
    cause, retryable = cause_of(error_code, disk_culprit=disk_culprit)
    return {"cause_class": cause, "retryable": retryable}


def shipped_checkpoint(rt: RunningTask) -> str | None:
    """The id of the newest checkpoint the task's attempt shipped (``rt.checkpoints.last``), or None
    (none shipped, or a task without checkpoints)."""
    last = getattr(getattr(rt, "checkpoints", None), "last", None)
    value = getattr(last, "id", None)
    return value if isinstance(value, str) and value else None


def task_result(rt: RunningTask, outcome: TaskOutcome, started_wall: float) -> TaskResult:
    """The final result of a task that ends now: ``startedAt`` when the agent took it (``started_wall``,
    epoch seconds), the phases apart (deployMs, installMs, runMs); its attempt, cause class and
    retryable (:func:`cause_fields`), and the newest checkpoint it shipped."""
    finished_wall = time.time()
    phases = rt.phase_seconds

    def ms(name: str) -> int | None:
        return None if name not in phases else max(0, int(phases[name] * 1000))

    run_ms = None if rt.started_at is None else max(0, int((finished_wall - rt.started_at) * 1000))
    return TaskResult(
        status=outcome.status,
        exit_code=outcome.exit_code,
        error_code=outcome.error_code,
        error_message=outcome.error_message,
        started_at=utc_iso(datetime.fromtimestamp(started_wall, timezone.utc)),
        finished_at=utc_iso(datetime.fromtimestamp(finished_wall, timezone.utc)),
        duration_ms=max(0, int((finished_wall - started_wall) * 1000)),
        deploy_ms=ms("deploy"),
        install_ms=ms("install"),
        run_ms=run_ms,
        **figure_fields(outcome.figures),
        egress_refused=[{"address": r.address, "port": r.port, "count": r.count}
                        for r in outcome.egress_refused] if outcome.egress_refused else None,
        attempt=rt.task.attempt,
        **cause_fields(outcome.error_code, disk_culprit=outcome.disk_culprit),
        checkpoint_id=outcome.checkpoint_id or shipped_checkpoint(rt),
    )


def figure_fields(figures: Figures | None) -> dict[str, Any]:
    """TaskResult keyword arguments of the resource figures (none at the process-group level)."""
    if figures is None:
        return {}
    return {"cpu_seconds": None if figures.cpu_seconds is None else round(figures.cpu_seconds, 3),
            "memory_peak_bytes": figures.memory_peak_bytes, "pids_peak": figures.pids_peak,
            "io_read_bytes": figures.io_read_bytes, "io_write_bytes": figures.io_write_bytes}


def ended_by_agent(why: str, outcome: ProcessOutcome) -> str:
    """One line saying what the agent did to end a task's processes, and when (UTC)."""
    parts = [why]
    if outcome.term_sent_at is not None:
        parts.append(f"stop signal to the main process at {clock(outcome.term_sent_at)}")
    if outcome.kill_sent_at is not None:
        parts.append(f"every process killed at {clock(outcome.kill_sent_at)}")
    elif outcome.workers_left:
        parts.append(f"the launcher exited, {outcome.workers_left} process(es) it ran outlived the grace period "
                     "and were killed")
    elif outcome.term_sent_at is not None:
        parts.append("the spider exited within the grace period")
    if outcome.killed_leftovers:
        parts.append(f"{outcome.killed_leftovers} leftover process(es) killed")
    return "; ".join(parts)


def bounded(text: str, max_chars: int) -> str:
    """``text`` within ``max_chars``: its first line and its last whole lines (never a line cut in the middle)."""
    if len(text) <= max_chars:
        return text
    first, _, rest = text.partition("\n")
    first = first[:300]
    return f"{first}\n{last_lines(rest, max_chars - len(first) - 1, max_lines=60)}"


def secret_words(task: Task, agent_secrets: tuple[str, ...]) -> list[str]:
    """What a message about ``task`` must mask: its env values, the agent's secrets, its command's words."""
    return list(secret_values(task.env, agent_secrets, task_words(task)))


def task_words(task: Task) -> list[str]:
    """The words of a task's command line that came from the task (``command``, then ``args``)."""
    return [*(task.command or ()), *task.args]


def shown_argv(argv: list[str], task: Task, agent_secrets: tuple[str, ...] = ()) -> str:
    """The command line for the ``running`` line: what ran (program, script, flags), shell-quoted, with
    secrets masked (:func:`ckagent.delivery.lines.mask_argv`): values of secret-looking flags and
    ``NAME=VALUE`` words, URL passwords, credential headers, and wherever they occur, the values of the
    task's secret-named env variables (``*TOKEN``, ``*KEY``…: ckagent.delivery.lines) and the agent's own
    credentials (docs/protocol.md, "Arguments"). Control characters are escaped: one line whatever the
    words hold."""
    return escape_controls(shlex.join(mask_argv(argv, secret_values(task.env, agent_secrets))))


def output_tail(path: Path, size_bytes: int = 16384) -> bytes:
    """The last ``size_bytes`` of the task's output (stdout and stderr are one file), without the
    agent's own notices and installer lines. Blocking (one small read); b"" when the file cannot be read — also when the
    spider replaced it by a link or a FIFO (never followed, never waited on: the tail goes into the
    result's message, which the master stores)."""
    try:
        fd = open_spool(path)
    except OSError:
        return b""
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, min(size, size_bytes), max(0, size - size_bytes))
    except OSError:
        return b""
    finally:
        os.close(fd)
    # the agent's notices ("[ckagent <time>] ...") and the installers' lines it wrote ("[ckagent] $ uv ...")
    return b"".join(line for line in data.splitlines(keepends=True) if not line.startswith((b"[ckagent ", b"[ckagent]")))


def result_from_json(data: dict[str, Any]) -> TaskResult:
    """Rebuild a stored result (state store JSON)."""
    return TaskResult.from_json(data)
