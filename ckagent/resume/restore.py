"""Restore a checkpoint into a new attempt's state dir: :func:`restore`, before the spider is spawned.

The manifest and the chunks come from the network, so nothing in them is trusted:

- the manifest is the protocol's (:meth:`CheckpointManifest.from_json
  <ckagent.master.protocol.checkpoints.CheckpointManifest.from_json>` refuses absolute or climbing paths,
  NUL, a path twice or beneath a file, wrong chunk counts, bad sha256 names, over 100,000 entries); here
  also: its id must be the one asked for, and its size must fit the task's disk limit
  (``RestoreLimits.max_bytes``) and the disk's free space — refused before a byte is written;
- each chunk is gunzipped with a bound: at most ``CHUNK_BYTES`` come out (a gzip bomb stops there), one
  gzip member, nothing after it; its length must be what its place in the file says and its sha256 its
  name — else the restore fails;
- files are written beneath the state dir by descriptors (ckagent.node.beneath: every directory opened
  ``O_NOFOLLOW`` from the top, every file made ``O_CREAT | O_EXCL | O_NOFOLLOW``), with the manifest's
  permission bits (never set-id bits), owned by the spider's identity (``run_as``: its uid and gid, as
  the agent gives a task dir to it); directory modes are applied last (a 0555 dir still gets its files).

The state dir is made (mode 0700, the spider's) or emptied first; a restore that fails empties it again.
A master blip (transport error, 429/5xx, an answer that is not the protocol's) is waited out with the
delivery's backoff, within ``RestoreLimits.timeout`` for the whole restore.

Errors::

    RestoreError   "the checkpoint 1-4 could not be restored: <why>" — the runner reports the attempt
                   DEPLOY_FAILED with that message (the master's refusal, a hostile manifest or chunk,
                   a full disk, no answer within the timeout)

Blocking work (gunzip, sha256, writes) runs in worker threads, several chunks per hop.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import trio

from ckagent.delivery.waiting import Backoff
from ckagent.master.client import MasterClient, MasterProtocolError, MasterRejected, MasterUnavailable
from ckagent.master.protocol.checkpoints import (
    CHUNK_BYTES,
    CheckpointFile,
    CheckpointManifest,
    CheckpointRef,
    unpack_chunk,
)
from ckagent.node import beneath
from ckagent.node.runas import RunAs

__all__ = ["RestoreError", "RestoreLimits", "gunzip_chunk", "restore"]

log = logging.getLogger(__name__)

T = TypeVar("T")
BATCH_BYTES = 8 << 20
"""Compressed chunk bytes handed to one worker-thread hop (gunzip, check, write)."""
CACHE_CHUNK_BYTES = 64 << 10
"""Chunks up to this size are kept by sha256 while restoring (many small files alike: one download)."""
CACHE_TOTAL_BYTES = 16 << 20
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC


class RestoreError(Exception):
    """A checkpoint could not be restored; the message says which and why (module docstring)."""


@dataclass(frozen=True)
class RestoreLimits:
    """``max_bytes``: the most the state dir may hold (the task's disk limit); ``timeout``: seconds the
    whole restore may take, master outages included."""

    max_bytes: int
    timeout: float = 600.0


def gunzip_chunk(gz: bytes, sha: str, length: int) -> bytes:
    """The raw bytes of a chunk from its gzip bytes, checked as the master checks them
    (:func:`ckagent.master.protocol.checkpoints.unpack_chunk`: one gzip member, at most CHUNK_BYTES
    unpacked — a bomb stops there —, sha256 ``sha``) and exactly ``length`` of them. Raises ValueError
    (ChunkError) saying which check failed."""
    return unpack_chunk(gz, sha, length)


@dataclass
class _Writer:
    """Writes the manifest's entries beneath the state dir (blocking; one instance per restore)."""

    top: int
    owner: tuple[int, int] | None
    dirs: list[tuple[str, int]] = field(default_factory=list)
    fd: int | None = None  # the file being written
    entry: CheckpointFile | None = None

    def make_dir(self, entry: CheckpointFile) -> None:
        os.close(beneath.open_dir(self.top, entry.path, create=True))
        self.dirs.append((entry.path, entry.mode & 0o777))

    def open(self, entry: CheckpointFile) -> None:
        parts = beneath.parts_of(entry.path)
        parent = beneath.open_dir(self.top, "/".join(parts[:-1]), create=True) if len(parts) > 1 else os.dup(self.top)
        try:
            self.fd = os.open(parts[-1], _NEW_FILE, 0o600, dir_fd=parent)
        finally:
            os.close(parent)
        self.entry = entry
        if self.owner is not None:
            os.fchown(self.fd, *self.owner)

    def write(self, entry: CheckpointFile, index: int, gz: bytes) -> bytes:
        if self.entry is not entry:
            self.open(entry)
        assert self.fd is not None
        offset = index * CHUNK_BYTES
        data = gunzip_chunk(gz, entry.chunks[index], min(CHUNK_BYTES, entry.size - offset))
        view = memoryview(data)
        while view:
            view = view[os.pwrite(self.fd, view, offset + len(data) - len(view)):]
        if index == len(entry.chunks) - 1:
            self.close()
        return data

    def close(self) -> None:
        if self.fd is not None and self.entry is not None:
            os.fchmod(self.fd, self.entry.mode & 0o777)
        if self.fd is not None:
            os.close(self.fd)
        self.fd = self.entry = None

    def batch(self, ops: list[tuple[CheckpointFile, int, bytes]]) -> None:
        """``(entry, chunk index, gzip bytes)``; index -1: a directory or an empty file."""
        for entry, index, gz in ops:
            if entry.type == "dir":
                self.make_dir(entry)
            elif index < 0:
                self.open(entry)
                self.close()
            else:
                self.write(entry, index, gz)

    def finish(self) -> None:
        self.close()
        for path, mode in sorted(self.dirs, key=lambda d: d[0].count("/"), reverse=True):
            fd = beneath.open_dir(self.top, path)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)


def _prepare(state_dir: Path, run_as: RunAs | None) -> int:
    """Make (or empty) the state dir, the spider's, 0700; a descriptor of it. Raises OSError."""
    parent = beneath.open_top(state_dir.parent)
    try:
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(state_dir.name, dir_fd=parent, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):  # a link or a file the spider left: gone, never followed
                os.unlink(state_dir.name, dir_fd=parent)
        fd = beneath.open_dir(parent, state_dir.name, create=True)
    finally:
        os.close(parent)
    try:
        beneath.remove(fd)
        if run_as is not None and os.geteuid() == 0:
            os.fchown(fd, run_as.uid, run_as.gid)
        os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_fits(manifest: CheckpointManifest, ref: CheckpointRef, limits: RestoreLimits, fd: int) -> None:
    if manifest.id != ref.id:
        raise ValueError(f"the master answered the manifest of checkpoint {manifest.id!r}")
    if manifest.size_bytes > limits.max_bytes:
        raise ValueError(f"it holds {manifest.size_bytes} bytes, more than the task's disk limit "
                         f"({limits.max_bytes} bytes)")
    fs = os.fstatvfs(fd)
    if manifest.size_bytes > fs.f_bavail * fs.f_frsize:
        raise ValueError(f"it holds {manifest.size_bytes} bytes, the disk has {fs.f_bavail * fs.f_frsize} free")


PROTOCOL_ERRORS = 3
"""Answers that are not the protocol's (a hostile manifest, a portal's page) tolerated per call."""


async def _retrying(call: Callable[[], Awaitable[T]], backoff: Backoff) -> T:
    """``call()`` until it answers; a blip is waited out; the third answer that is not the protocol's
    raises ValueError (a manifest the protocol refuses is not worth ten minutes of retries)."""
    wrong = 0
    while True:
        try:
            return await call()
        except MasterProtocolError as exc:
            wrong += 1
            if wrong >= PROTOCOL_ERRORS:
                raise ValueError(f"the master's answer is not the protocol's: {exc}") from exc
            await backoff.wait(exc.retry_after)
        except MasterUnavailable as exc:
            await backoff.wait(exc.retry_after)


async def restore(master: MasterClient, task_id: str, ref: CheckpointRef, state_dir: Path, limits: RestoreLimits,
                  run_as: RunAs | None = None) -> CheckpointManifest:
    """Restore the checkpoint ``ref`` of task ``task_id`` into ``state_dir`` (module docstring), its
    files owned by ``run_as`` (None: the agent's own user). ``state_dir``'s parent is the task dir (the
    agent's path). Returns the manifest (its chunks are the master's: ``CheckpointShipper.seed``).
    Raises RestoreError; the state dir is left empty then. Cancellation: as usual (the dir is left
    as it is: the next attempt empties it)."""
    backoff = Backoff(master)
    owner = (run_as.uid, run_as.gid) if run_as is not None and os.geteuid() == 0 else None
    fd: int | None = None
    try:
        with trio.fail_after(limits.timeout):
            manifest = await _retrying(lambda: master.get_checkpoint(task_id, ref), backoff)
            fd = await trio.to_thread.run_sync(_prepare, state_dir, run_as)
            await trio.to_thread.run_sync(_check_fits, manifest, ref, limits, fd)
            writer = _Writer(fd, owner)
            try:
                await _fill(master, task_id, manifest, writer, backoff)
                await trio.to_thread.run_sync(writer.finish)
            finally:
                writer.close()
    except (trio.TooSlowError, MasterRejected, OSError, ValueError) as exc:
        why = (f"no complete answer from the master within {limits.timeout:g} s"
               if isinstance(exc, trio.TooSlowError) else str(exc))
        failed = RestoreError(f"the checkpoint {ref.id} could not be restored: {why}")
        failure: BaseException = exc
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    else:
        if fd is not None:
            os.close(fd)
        log.debug("task %s: checkpoint %s restored (%d entries, %d bytes)", task_id, ref.id, len(manifest.files),
                  manifest.size_bytes)
        return manifest
    if fd is not None:  # what was written goes: the attempt fails, nothing half-restored is left
        try:
            with contextlib.suppress(OSError):
                await trio.to_thread.run_sync(beneath.remove, fd)
        finally:
            os.close(fd)
    raise failed from failure


async def _fill(master: MasterClient, task_id: str, manifest: CheckpointManifest, writer: _Writer,
                backoff: Backoff) -> None:
    """Download every chunk (small ones once) and hand them to the writer in batches."""
    cache: dict[str, bytes] = {}
    cached = 0
    ops: list[tuple[CheckpointFile, int, bytes]] = []
    size = 0
    for entry in manifest.files:
        if entry.type == "dir" or not entry.chunks:
            ops.append((entry, -1, b""))
        for index, sha in enumerate(entry.chunks):
            gz = cache.get(sha)
            if gz is None:
                gz = await _retrying(functools.partial(master.get_checkpoint_chunk, task_id, sha), backoff)
                if min(CHUNK_BYTES, entry.size - index * CHUNK_BYTES) <= CACHE_CHUNK_BYTES and \
                        cached + len(gz) <= CACHE_TOTAL_BYTES:
                    cache[sha] = gz
                    cached += len(gz)
            ops.append((entry, index, gz))
            size += len(gz)
            if size >= BATCH_BYTES:
                await trio.to_thread.run_sync(writer.batch, ops)
                ops, size = [], 0
        if len(ops) >= 1000:
            await trio.to_thread.run_sync(writer.batch, ops)
            ops, size = [], 0
    if ops:
        await trio.to_thread.run_sync(writer.batch, ops)
