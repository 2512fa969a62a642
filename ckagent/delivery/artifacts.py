"""Artifact upload: each file of a task's ``artifacts.json`` to the master, once, before the final result.

The collector (:mod:`ckagent.delivery.outputs`) moved the files into ``work_dir/tasks/<task-id>/artifacts/``
and wrote their list (path, size, sha256) to ``artifacts.json`` before the final result was stored,
so the spool outlives a crash. After both streams are complete the task's delivery calls
:func:`upload_artifacts`: ``PUT /api/tasks/{id}/artifacts/{path}`` with the bytes, the
``X-Content-SHA256`` header and ``Content-Type: application/octet-stream``, one file at a time.
The master answers ``{"path", "sizeBytes", "sha256"}`` (the same as asked: an acknowledgement);
a path it already holds with the same sha256 is acknowledged again, never stored twice, so a resend
after an outage or a restart duplicates nothing. Acknowledged paths are appended to
``artifacts.sent``, so a restart resumes after the last acknowledged one.

Answers:

- transport errors, 429/5xx, a 2xx that is not the protocol's → retried with backoff, forever
  (cancellation leaves the rest for the next start);
- 409 (the master holds another file at that path) and 413 (too large for it) → that file is not
  shipped: logged and kept on the node (its folder is named);
- a master without the ``artifacts`` feature (an older one), or one answering 404/405 to the
  endpoint → nothing more is uploaded; the files are moved to the spider's kept folder and the
  agent's log says where (the task log said so already when the master lacked it at the task's end).

The final result then lists what the master acknowledged (``artifacts``).

The task dir is the spider's (it may replace any file in it): the manifest, ``artifacts.sent`` and each
artifact are read below it by descriptors, regular files only, never through a link
(:mod:`ckagent.delivery.outputs.files`); ``artifacts.sent`` is appended to never through a link; files
are kept only in this task's own folder of its spider's data dir, whatever the manifest says.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import trio

from ckagent.delivery.outputs import ARTIFACTS_DIR, load_manifest
from ckagent.delivery.outputs.files import MAX_MANIFEST_BYTES, kept_place, read_checked
from ckagent.delivery.spool import open_spool
from ckagent.delivery.waiting import Backoff
from ckagent.master.client import MasterClient, MasterConflict, MasterRejected, MasterUnavailable
from ckagent.master.protocol import ARTIFACTS, ArtifactRef
from ckagent.node import beneath

log = logging.getLogger(__name__)

SENT_FILE = "artifacts.sent"
"""Paths the master acknowledged, one per line (append-only)."""
_NOT_SHIPPED = frozenset({409, 413, 422})
_NO_ENDPOINT = frozenset({404, 405, 501})


ArtifactState = tuple[list[ArtifactRef], Path, set[str]]
"""What :func:`read_state` reads: the manifest's artifacts, its folder for kept files, the acknowledged paths."""


def read_state(task_dir: Path) -> ArtifactState:
    """(the manifest's artifacts, its folder for kept files, the acknowledged paths). Blocking.
    Raises OSError or ValueError (a broken manifest, or one or an ``artifacts.sent`` that is not a
    regular file of the task's: see module docstring)."""
    refs, keep_dir = load_manifest(task_dir)
    try:
        sent = set(beneath.read_bytes(task_dir, SENT_FILE, MAX_MANIFEST_BYTES).decode("utf-8", "replace").splitlines())
    except FileNotFoundError:
        sent = set()
    return refs, keep_dir, sent


def _mark_sent(task_dir: Path, path: str) -> None:
    fd = open_spool(task_dir / SENT_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (path + "\n").encode())
    finally:
        os.close(fd)


def _keep(task_dir: Path, keep_dir: Path, paths: list[str]) -> None:
    """Move artifacts that will not be shipped to the folder for kept files (blocking; a file already
    gone is skipped). ``keep_dir`` (the manifest's) is used only when it is this task's own
    (:func:`~ckagent.delivery.outputs.files.kept_place`); otherwise the files stay in the task dir (logged)."""
    try:
        top, below = kept_place(task_dir, keep_dir)
    except OSError as exc:
        log.warning("%s: the manifest's folder for kept files is not this task's (%s); the files stay in %s",
                    task_dir.name, exc, task_dir / ARTIFACTS_DIR)
        return
    for rel in paths:
        try:
            beneath.move(task_dir, f"{ARTIFACTS_DIR}/{rel}", top, f"{below}/{rel}")
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("%s: artifact %s cannot be kept (%s); it stays in %s", task_dir.name, rel, exc,
                        task_dir / ARTIFACTS_DIR)


async def upload_artifacts(master: MasterClient, task_id: str, task_dir: Path,
                           limiter: trio.CapacityLimiter | None = None,
                           state: ArtifactState | OSError | ValueError | None = None) -> list[ArtifactRef] | None:
    """Upload the task's artifacts not acknowledged yet (module docstring).

    ``state``: what :func:`read_state` returned (or raised) for ``task_dir``, when the caller read it
    in a thread hop of its own; None: read here.

    Returns the artifacts the master holds (for the result's ``artifacts``), or None when the task
    has none. Never raises for master trouble (retried with backoff until cancelled); a broken
    manifest is logged and treated as no artifacts. Cancellation: what was acknowledged is on disk.
    """
    try:
        if state is None:
            state = await trio.to_thread.run_sync(read_state, task_dir)
        if isinstance(state, (OSError, ValueError)):
            raise state
        refs, keep_dir, sent = state
    except (OSError, ValueError) as exc:
        log.error("task %s: cannot read its artifact list (%s); no artifacts sent", task_id, exc)
        return None
    if not refs:
        return None
    held: list[ArtifactRef] = [ref for ref in refs if ref.path in sent]
    not_shipped: list[str] = []
    for index, ref in enumerate(refs):
        if ref.path in sent:
            continue
        data = await trio.to_thread.run_sync(read_checked, task_dir, ref)
        if data is None:
            log.warning("task %s: artifact %s is gone or changed on disk; not sent", task_id, ref.path)
            continue
        backoff = Backoff(master)
        while True:
            if master.registered and ARTIFACTS not in master.features:
                rest = [r.path for r in refs[index:] if r.path not in sent]
                await trio.to_thread.run_sync(_keep, task_dir, keep_dir, rest)
                log.warning("task %s: the master does not take artifacts (no %r feature): %d file(s) kept at %s",
                            task_id, ARTIFACTS, len(rest), keep_dir)
                return held or None
            try:
                async with limiter if limiter is not None else contextlib.nullcontext():
                    await master.put_artifact(task_id, ref, data)
            except MasterUnavailable as exc:  # a protocol error too: not an acknowledgement
                await backoff.wait(exc.retry_after)
                continue
            except MasterConflict as exc:
                log.warning("task %s: master refused artifact %s (%s); kept at %s", task_id, ref.path, exc, keep_dir)
                not_shipped.append(ref.path)
                break
            except MasterRejected as exc:
                if exc.status in _NOT_SHIPPED:
                    log.warning("task %s: master refused artifact %s (%s); kept at %s", task_id, ref.path, exc,
                                keep_dir)
                    not_shipped.append(ref.path)
                    break
                if exc.status in _NO_ENDPOINT:
                    master.features = master.features - {ARTIFACTS}
                    continue  # the check above keeps the rest
                await backoff.wait()
                continue
            await trio.to_thread.run_sync(_mark_sent, task_dir, ref.path)
            sent.add(ref.path)
            held.append(ref)
            break
    if not_shipped:
        await trio.to_thread.run_sync(_keep, task_dir, keep_dir, not_shipped)
    return held or None
