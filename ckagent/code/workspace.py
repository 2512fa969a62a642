"""A spider's code on this node: ``work_dir/spiders/<spiderId>/<version>/``, written atomically.

Two modes (docs/protocol.md): a code package (zip: url, sha256, sizeBytes) or the spider-files
list. Either way the code is assembled in a private temp dir under ``spiders/.staging/``, checked,
and renamed into place in one step; until that rename nothing is written anywhere else, so a
refused package leaves the node exactly as it was. A version already present is reused (no
download). Old versions are pruned, least recently used first, keeping :data:`KEEP_VERSIONS` and
never one a running task uses.

Before anything is extracted the package is at most ``max_package_bytes`` (declared and while
streaming: the download is streamed to a file and aborted at the cap, never held in memory) and has
the sha256 and size announced; its entries then pass the rules of ckagent.code.unpack (paths, kinds,
sizes, the single-folder unwrap); a zip holding one Scrapyd egg has it unpacked in its place
(ckagent.code.eggs.unnest).

Spider files: the same path and size rules per listed file, each download checked against its
sha256, files unchanged since the newest existing version copied from it rather than downloaded.

Exceptions::

    DeployError        the code cannot be deployed; the message names the entry and the rule
                       (the task fails with DEPLOY_FAILED, the agent carries on)
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Collection
from pathlib import Path

import stamina
import trio

from ckagent.code.eggs import unnest
from ckagent.code.unpack import WRITE_CHUNK_BYTES, Limits, check_layout, check_member_path, extract_zip
from ckagent.master.client import MasterClient, MasterError, MasterUnavailable, retry_wait
from ckagent.master.endpoints import DOWNLOAD, SPIDER_FILE, Endpoint, Retry
from ckagent.master.ids import safe_name
from ckagent.master.protocol import CodePackage, SpiderFile
from ckagent.node.errors import DeployError
from ckagent.node.workmodes import PRIVATE_DIR_MODE

__all__ = ["KEEP_VERSIONS", "DeployError", "Limits", "Workspaces", "check_member_path", "extract_zip", "safe_name"]

log = logging.getLogger(__name__)

KEEP_VERSIONS = 3
"""Code versions kept per spider (least recently used pruned first; in-use versions never)."""
STAGING = ".staging"
"""Directory under the workspace root holding the temp dirs of deploys in progress."""
RUNS = ".runs"
"""Directory under the workspace root holding the tasks' private working copies (ckagent.code.workcopy)."""
_DOWNLOAD_ATTEMPTS = 5
Notice = Callable[[str], None]
"""Writes one line into the task's log (the supervisor's notice)."""
DOWNLOAD_STALL_TIMEOUT = 30.0
"""Seconds a code download may receive nothing before it is cut off and retried (server.download_stall_timeout)."""
DOWNLOAD_RETRY_TIMEOUT = 900.0
"""Seconds a code download is retried (with backoff) before the deploy fails."""


class _HashingFile:
    """A file being downloaded: bytes go to disk off the event loop, hashed and counted against a cap."""

    def __init__(self, path: Path, cap_bytes: int, entry: str) -> None:
        self.path = path
        self.cap_bytes = cap_bytes
        self.entry = entry
        self.size = 0
        self._digest = hashlib.sha256()
        self._fh = open(path, "wb")  # noqa: SIM115  (closed in close())
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    async def write(self, chunk: bytes) -> None:
        """Append ``chunk``; DeployError as soon as the cap is passed (the download is aborted)."""
        self.size += len(chunk)
        if self.size > self.cap_bytes:
            raise DeployError(
                f"{self.entry}: the master sent more than {self.cap_bytes} bytes (size cap; download aborted)"
            )
        self._pending.append(chunk)
        self._pending_bytes += len(chunk)
        if self._pending_bytes >= WRITE_CHUNK_BYTES:
            await self.flush()

    async def flush(self) -> None:
        """Hash and write what is buffered (at most ~1 MiB), in a worker thread."""
        data, self._pending, self._pending_bytes = b"".join(self._pending), [], 0
        if data:
            await trio.to_thread.run_sync(self._write_sync, data)

    def _write_sync(self, data: bytes) -> None:
        self._digest.update(data)
        self._fh.write(data)

    def reset(self) -> None:
        """Start over (a retried download)."""
        self._fh.seek(0)
        self._fh.truncate()
        self._digest = hashlib.sha256()
        self.size = 0
        self._pending, self._pending_bytes = [], 0

    def hexdigest(self) -> str:
        """sha256 of everything flushed so far."""
        return self._digest.hexdigest()

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._fh.close()


class Workspaces:
    """Deploys spiders' code under ``root`` (= ``work_dir/spiders``) and tracks versions in use.

    One deploy per spider at a time is guaranteed by the caller (the per-spider lock). Creating
    the object creates ``root/.staging`` and empties it (temp dirs a crash left behind).
    ``downloads``/``downloaded_bytes`` count what came from the master (metrics, tests).
    A download that receives nothing for ``stall_timeout`` seconds (server.download_stall_timeout),
    or fails as an unavailable master, is retried from the start with backoff for up to
    ``retry_timeout`` seconds (the task's own deadline, a cancel scope around the deploy, may end
    it sooner); each retry is said in the task's log (``notice``).
    """

    def __init__(self, root: Path, master: MasterClient, limits: Limits | None = None, *,
                 stall_timeout: float = DOWNLOAD_STALL_TIMEOUT,
                 retry_timeout: float = DOWNLOAD_RETRY_TIMEOUT) -> None:
        self.root = root
        self.stall_timeout = stall_timeout
        self.retry_timeout = retry_timeout
        self.staging = root / STAGING
        self.runs = root / RUNS
        self._master = master
        self.limits = limits or Limits()
        self._in_use: Counter[Path] = Counter()
        self.downloads = 0
        self.downloaded_bytes = 0
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        # Working copies an earlier agent left stay until prune_runs: a re-adopted task runs in its own.
        self.runs.mkdir(parents=True, exist_ok=True)

    def prune_runs(self, keep: Collection[str | Path]) -> int:
        """Delete the working copies an earlier agent left, except ``keep`` (those of the tasks it
        re-adopts: their spiders still run in them, and what they write there is their output).
        Returns how many were deleted; never raises (what cannot be deleted is logged). Blocking."""
        kept = {Path(path).name for path in keep}
        deleted = 0
        for entry in sorted(self.runs.iterdir()) if self.runs.is_dir() else []:
            if entry.name in kept:
                continue
            try:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            except OSError as exc:
                log.warning("cannot delete the working copy %s an earlier agent left: %s", entry, exc)
                continue
            deleted += 1
        return deleted

    def acquire(self, path: Path) -> None:
        """Mark a version dir as used by a running task (pruning skips it)."""
        self._in_use[path] += 1

    def release(self, path: Path) -> None:
        """The task that used ``path`` finished."""
        self._in_use[path] -= 1
        if self._in_use[path] <= 0:
            del self._in_use[path]

    def spider_dir(self, spider_id: str) -> Path:
        """Where a spider's versions live (the id made safe as a single path component)."""
        return self.root / safe_name(spider_id)

    def reuse_package(self, spider_id: str, version: str | None, package: CodePackage) -> Path | None:
        """The version dir of a package deployed before (touched, so pruning keeps it), else None.
        Blocking: call it in a thread (with the work that follows it, to spare a hop)."""
        final = self.spider_dir(spider_id) / safe_name(version or package.sha256[:12])
        return final if _reuse(final) else None

    async def deploy_package(self, spider_id: str, version: str | None, package: CodePackage,
                             notice: Notice | None = None) -> Path:
        """Download, verify and extract a code package; returns the version dir (reused if present).

        Raises DeployError. Cancellation stops the download; the temp dir is removed.
        """
        spider_dir = self.spider_dir(spider_id)
        final = spider_dir / safe_name(version or package.sha256[:12])
        if await trio.to_thread.run_sync(self.reuse_package, spider_id, version, package) is not None:
            return final
        if package.size_bytes > self.limits.max_package_bytes:
            raise DeployError(
                f"package: {package.size_bytes} bytes announced; the limit is {self.limits.max_package_bytes}"
            )
        tmp = Path(await trio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix="pkg-", dir=self.staging)))
        try:
            zip_path = tmp / "package.zip"
            await self._download(package.url, zip_path, package.size_bytes, package.sha256, "package", notice)
            code = tmp / "code"
            await trio.to_thread.run_sync(code.mkdir)
            files = await trio.to_thread.run_sync(extract_zip, zip_path, code, self.limits)
            inner = await trio.to_thread.run_sync(unnest, code, self.limits)
            if inner is not None and notice is not None:
                notice(f"the package holds the Scrapyd egg {inner}: unpacked in its place, beside the package's "
                       "other files")
            await trio.to_thread.run_sync(_move_into_place, code, final)
            log.info("spider %s: deployed package %s (%d files)", spider_id, final.name, files)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, tmp, True)
        await trio.to_thread.run_sync(self._prune, spider_dir)
        return final

    async def deploy_files(self, spider_id: str, notice: Notice | None = None) -> Path:
        """Sync the spider-files list into a version dir named by the listing's hash; returns it.

        A file whose path and sha256 match the newest existing version is copied from it, not
        downloaded; every download is checked against its sha256; files no longer listed are simply
        not in the new version. Raises DeployError.
        """
        try:
            listing = await self._master.spider_files(spider_id, retry=Retry(attempts=_DOWNLOAD_ATTEMPTS))
        except MasterError as exc:
            raise DeployError(f"cannot list the spider's files: {exc}") from exc
        if not listing:
            raise DeployError("the master lists no files for this spider")
        if len(listing) > self.limits.max_entries:
            raise DeployError(f"the spider has {len(listing)} files; the limit is {self.limits.max_entries}")
        rels = [check_member_path(f.path) for f in listing]
        check_layout([(f.path, rel, False) for f, rel in zip(listing, rels, strict=True)])
        total = 0
        for f in listing:
            if len(f.sha256) != 64 or any(c not in "0123456789abcdef" for c in f.sha256):
                raise DeployError(f"entry {f.path!r}: the listing's sha256 is not 64 hex digits")
            total += f.size_bytes
            if total > self.limits.max_total_bytes:
                raise DeployError(
                    f"entry {f.path!r}: the spider's files exceed {self.limits.max_total_bytes} bytes (total size cap)"
                )
        digest = hashlib.sha256()
        for f, rel in sorted(zip(listing, rels, strict=True), key=lambda pair: str(pair[1])):
            digest.update(f"{rel}\0{f.sha256}\n".encode())
        spider_dir = self.spider_dir(spider_id)
        final = spider_dir / f"files-{digest.hexdigest()[:16]}"
        if await trio.to_thread.run_sync(_reuse, final):
            return final
        previous = await trio.to_thread.run_sync(_newest, spider_dir)
        tmp = Path(await trio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix="files-", dir=self.staging)))
        try:
            code = tmp / "code"
            wanted = [(f, code.joinpath(*rel.parts), None if previous is None else previous.joinpath(*rel.parts))
                      for f, rel in zip(listing, rels, strict=True)]
            copied = await trio.to_thread.run_sync(_copy_unchanged, wanted)
            for f, target, _ in wanted:
                if target in copied:
                    continue
                await trio.to_thread.run_sync(_make_parent, target)
                await self._download(
                    SPIDER_FILE.path(file=f.id), target, f.size_bytes, f.sha256, f"entry {f.path!r}", notice,
                    endpoint=SPIDER_FILE,
                )
            await trio.to_thread.run_sync(_move_into_place, code, final)
            log.info("spider %s: synced %d files into %s (%d unchanged, copied)",
                     spider_id, len(listing), final.name, len(copied))
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, tmp, True)
        await trio.to_thread.run_sync(self._prune, spider_dir)
        return final

    async def _download(self, url: str, dest: Path, size: int, sha256: str, entry: str,
                        notice: Notice | None = None, *, endpoint: Endpoint[None] = DOWNLOAD) -> None:
        """Stream ``url`` (a code package, or the ``endpoint`` it is of) into ``dest`` (capped at the announced size and the package limit), check sha256.
        Retried as the class docstring says; raises DeployError."""
        cap = min(size, self.limits.max_package_bytes) if size > 0 else self.limits.max_package_bytes
        out = await trio.to_thread.run_sync(_HashingFile, dest, cap, entry)
        failed: list[str] = []
        try:
            try:
                async for attempt in stamina.retry_context(
                    on=retry_wait, attempts=None, timeout=self.retry_timeout, wait_initial=1.0, wait_max=30.0
                ):
                    with attempt:
                        if failed and notice is not None:
                            notice(f"{entry}: download attempt {attempt.num} after {failed[-1]}")
                        if out.size:
                            await trio.to_thread.run_sync(out.reset)
                        try:
                            await self._master.download(endpoint, url, out.write, read_timeout=self.stall_timeout)
                        except MasterUnavailable as exc:
                            failed.append(f"{_mib(out.size)} of {_mib(size)} received: {exc}")
                            raise
                        await out.flush()
            except MasterError as exc:
                raise DeployError(f"{entry}: download failed: {exc}") from exc
        finally:
            # Shielded: a cancel (task stopped mid-download) must not skip the close and leak the fd.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(out.close)
        self.downloads += 1
        self.downloaded_bytes += out.size
        if out.size != size:
            raise DeployError(f"{entry}: expected {size} bytes, got {out.size} (truncated or wrong size)")
        actual = out.hexdigest()
        if actual != sha256.lower():
            raise DeployError(f"{entry}: sha256 mismatch (expected {sha256.lower()}, got {actual})")

    def _prune(self, spider_dir: Path) -> None:
        """Remove the least recently used versions beyond KEEP_VERSIONS, never one in use (blocking)."""
        versions = sorted(_versions(spider_dir), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in versions[KEEP_VERSIONS:]:
            if old not in self._in_use:
                log.info("pruning old code version %s", old)
                shutil.rmtree(old, ignore_errors=True)


def _mib(size: int) -> str:
    return f"{size / 1024**2:.1f} MiB"


def _versions(spider_dir: Path) -> list[Path]:
    if not spider_dir.is_dir():
        return []
    return [p for p in spider_dir.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")]


def _newest(spider_dir: Path) -> Path | None:
    return max(_versions(spider_dir), key=lambda p: p.stat().st_mtime, default=None)


def _reuse(final: Path) -> bool:
    """True when ``final`` exists; it is touched so pruning sees it as recently used (blocking)."""
    if not final.is_dir():
        return False
    os.utime(final)
    return True


def _copy_unchanged(wanted: list[tuple[SpiderFile, Path, Path | None]]) -> set[Path]:
    """Copy files whose previous copy (same path) has the listed size and sha256; returns the targets done."""
    done: set[Path] = set()
    for f, target, old in wanted:
        if old is None or old.is_symlink() or not old.is_file() or old.stat().st_size != f.size_bytes:
            continue
        if _sha256_file(old) != f.sha256:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(old, target)
        done.add(target)
    return done


def _make_parent(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)


def _move_into_place(staged: Path, final: Path) -> None:
    """Rename the checked code dir into place in one step (a version that appeared meanwhile wins)."""
    final.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)  # a spider's code: the agent's alone
    try:
        os.rename(staged, final)
    except OSError:
        if not final.is_dir():
            raise
    os.utime(final)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(WRITE_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
