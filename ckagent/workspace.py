"""A spider's code on this node: ``work_dir/spiders/<spiderId>/<version>/``, written atomically.

Two modes (docs/protocol.md): a code package (zip: url, sha256, sizeBytes) or the spider-files
list. Either way the code lands in a temp dir beside its final place, is checked, and is renamed
into place in one step; a version already present is reused. Zip entries and file paths are
checked before a byte is written: no absolute paths, drive letters, ``..``, symlinks or device
files; caps on total size, entry count and compression ratio (zip bombs).

Exceptions::

    DeployError        the code cannot be deployed; the message names the entry and the rule
                       (the task fails with DEPLOY_FAILED, the agent carries on)
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import trio

from ckagent.master import MasterClient, MasterError
from ckagent.protocol import CodePackage, ProtocolError, SpiderFile

log = logging.getLogger(__name__)

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
KEEP_VERSIONS = 3


class DeployError(Exception):
    """The spider's code cannot be deployed (bad package, failed download, broken rule)."""


@dataclass(frozen=True)
class Limits:
    """Caps on what a package may contain. Sizes in bytes."""

    max_package_bytes: int = 256 * 1024 * 1024
    max_total_bytes: int = 1024 * 1024 * 1024
    max_entries: int = 20000
    max_ratio: float = 200.0


_DRIVE = re.compile(r"^[A-Za-z]:")


def check_member_path(name: str) -> PurePosixPath:
    """Validate a relative path from a package; returns it normalised. Raises DeployError naming the rule."""
    if not name or "\0" in name:
        raise DeployError(f"entry {name!r}: empty name or NUL byte")
    unified = name.replace("\\", "/")
    if unified.startswith("/"):
        raise DeployError(f"entry {name!r}: absolute paths are not allowed")
    if _DRIVE.match(unified):
        raise DeployError(f"entry {name!r}: drive letters are not allowed")
    parts = [p for p in unified.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise DeployError(f"entry {name!r}: '..' path components are not allowed")
    if not parts:
        raise DeployError(f"entry {name!r}: names no file")
    return PurePosixPath(*parts)


def extract_zip(zip_path: Path, dest: Path, limits: Limits) -> int:
    """Check every entry of ``zip_path`` and extract it under ``dest`` (which must exist, empty).

    Returns the number of files written. Blocking: run it in a thread. Raises DeployError (the
    first broken rule, naming the entry) — possibly after some files were written under ``dest``,
    which is a temp dir the caller removes.
    """
    with open(zip_path, "rb") as fh:
        if fh.read(4) not in ZIP_MAGIC:
            raise DeployError("the package is not a zip file (wrong magic bytes)")
    try:
        archive = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DeployError(f"the package is not a readable zip: {exc}") from exc
    with archive:
        infos = archive.infolist()
        if len(infos) > limits.max_entries:
            raise DeployError(f"the package has {len(infos)} entries; the limit is {limits.max_entries}")
        declared = 0
        plan: list[tuple[zipfile.ZipInfo, PurePosixPath]] = []
        for info in infos:
            rel = check_member_path(info.filename)
            mode = info.external_attr >> 16
            kind = stat.S_IFMT(mode)
            if kind == stat.S_IFLNK:
                raise DeployError(f"entry {info.filename!r}: symlinks are not allowed")
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise DeployError(f"entry {info.filename!r}: device files, fifos and sockets are not allowed")
            declared += info.file_size
            if declared > limits.max_total_bytes:
                raise DeployError(f"the package unpacks to more than {limits.max_total_bytes} bytes (zip bomb?)")
            if info.compress_size and info.file_size / info.compress_size > limits.max_ratio and info.file_size > 1 << 20:
                raise DeployError(
                    f"entry {info.filename!r}: compression ratio {info.file_size / info.compress_size:.0f}:1 "
                    f"exceeds {limits.max_ratio:.0f}:1 (zip bomb?)"
                )
            plan.append((info, rel))
        counts = Counter(str(rel).lower() for info, rel in plan if not info.is_dir())
        duplicate = next((name for name, n in counts.items() if n > 1), None)
        if duplicate is not None:
            raise DeployError(f"entry {duplicate!r}: appears more than once")
        written_total = 0
        files = 0
        for info, rel in plan:
            target = dest.joinpath(*rel.parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                with archive.open(info) as src, open(target, "xb") as out:
                    while chunk := src.read(1 << 20):
                        written_total += len(chunk)
                        if written_total > limits.max_total_bytes:
                            raise DeployError(
                                f"entry {info.filename!r}: the package unpacks to more than "
                                f"{limits.max_total_bytes} bytes (zip bomb?)"
                            )
                        out.write(chunk)
            except (zipfile.BadZipFile, EOFError, OSError, RuntimeError) as exc:
                if isinstance(exc, FileExistsError):
                    raise DeployError(f"entry {info.filename!r}: appears more than once") from exc
                raise DeployError(f"entry {info.filename!r}: cannot be read ({exc}); truncated zip?") from exc
            if (info.external_attr >> 16) & 0o111:
                target.chmod(0o755)
            files += 1
        return files


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class Workspaces:
    """Deploys spiders' code under ``root`` (= ``work_dir/spiders``) and tracks versions in use.

    One deploy per spider at a time is guaranteed by the caller (the per-spider lock).
    """

    def __init__(self, root: Path, master: MasterClient, limits: Limits | None = None) -> None:
        self.root = root
        self._master = master
        self.limits = limits or Limits()
        self._in_use: Counter[Path] = Counter()
        self.downloaded_bytes = 0

    def acquire(self, path: Path) -> None:
        """Mark a version dir as used by a running task (pruning skips it)."""
        self._in_use[path] += 1

    def release(self, path: Path) -> None:
        """The task that used ``path`` finished."""
        self._in_use[path] -= 1
        if self._in_use[path] <= 0:
            del self._in_use[path]

    async def deploy_package(self, spider_id: str, version: str | None, package: CodePackage) -> Path:
        """Download, verify and extract a code package; returns the version dir (reused if present).

        Raises DeployError. Cancellation stops the download; the temp dir is removed.
        """
        name = _safe_name(version or package.sha256[:12])
        spider_dir = self.root / _safe_name(spider_id)
        final = spider_dir / name
        if final.is_dir():
            return final
        if package.size_bytes > self.limits.max_package_bytes:
            raise DeployError(
                f"the package is {package.size_bytes} bytes; the limit is {self.limits.max_package_bytes}"
            )
        spider_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".deploy-", dir=spider_dir))
        try:
            zip_path = tmp / "package.zip"
            await self._download(package.url, zip_path, package.size_bytes, package.sha256)
            code = tmp / "code"
            code.mkdir()
            await trio.to_thread.run_sync(extract_zip, zip_path, code, self.limits)
            _move_into_place(code, final)
        finally:
            await trio.to_thread.run_sync(shutil.rmtree, tmp, True)
        await trio.to_thread.run_sync(self._prune, spider_dir)
        return final

    async def deploy_files(self, spider_id: str) -> Path:
        """Sync the spider-files list into a version dir named by the listing's hash; returns it.

        Files whose sha256 matches a file of the newest existing version are copied from it, not
        downloaded again. Raises DeployError.
        """
        try:
            listing = SpiderFile.list_from_json(
                await self._master.call_retrying(
                    "spider_files", "GET", f"/api/spider-files/spider/{spider_id}", attempts=5
                )
            )
        except (MasterError, ProtocolError) as exc:
            raise DeployError(f"cannot list the spider's files: {exc}") from exc
        if not listing:
            raise DeployError("the master lists no files for this spider")
        rels = [check_member_path(f.path) for f in listing]
        digest = hashlib.sha256()
        for f, rel in sorted(zip(listing, rels, strict=True), key=lambda pair: str(pair[1])):
            digest.update(f"{rel}\0{f.sha256}\n".encode())
        spider_dir = self.root / _safe_name(spider_id)
        final = spider_dir / f"files-{digest.hexdigest()[:12]}"
        if final.is_dir():
            return final
        spider_dir.mkdir(parents=True, exist_ok=True)
        previous = self._newest(spider_dir)
        known = await trio.to_thread.run_sync(_index_by_sha, previous) if previous else {}
        tmp = Path(tempfile.mkdtemp(prefix=".deploy-", dir=spider_dir))
        try:
            code = tmp / "code"
            total = 0
            for f, rel in zip(listing, rels, strict=True):
                total += f.size_bytes
                if total > self.limits.max_total_bytes:
                    raise DeployError(f"the spider's files exceed {self.limits.max_total_bytes} bytes")
                target = code.joinpath(*rel.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                if f.sha256 in known:
                    shutil.copy2(known[f.sha256], target)
                    continue
                await self._download(f"/api/spider-files/{f.id}", target, f.size_bytes, f.sha256, entry=f.path)
            _move_into_place(code, final)
        finally:
            await trio.to_thread.run_sync(shutil.rmtree, tmp, True)
        await trio.to_thread.run_sync(self._prune, spider_dir)
        return final

    async def _download(self, url: str, dest: Path, size: int, sha256: str, entry: str = "package") -> None:
        cap = max(size, 0)
        try:
            response = await self._master.call_retrying(
                "download", "GET", url, raw=True, attempts=5, read_timeout=300
            )
        except MasterError as exc:
            raise DeployError(f"{entry}: download failed: {exc}") from exc
        data = response.content
        if len(data) > max(cap, self.limits.max_package_bytes) or (size and len(data) != size):
            raise DeployError(f"{entry}: expected {size} bytes, got {len(data)}")
        actual = await trio.to_thread.run_sync(lambda: hashlib.sha256(data).hexdigest())
        if actual != sha256.lower():
            raise DeployError(f"{entry}: sha256 mismatch (expected {sha256}, got {actual})")
        self.downloaded_bytes += len(data)
        await trio.to_thread.run_sync(dest.write_bytes, data)

    def _newest(self, spider_dir: Path) -> Path | None:
        versions = [p for p in spider_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
        return max(versions, key=lambda p: p.stat().st_mtime, default=None)

    def _prune(self, spider_dir: Path) -> None:
        versions = sorted(
            (p for p in spider_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        for old in versions[KEEP_VERSIONS:]:
            if old not in self._in_use:
                log.info("pruning old code version %s", old)
                shutil.rmtree(old, ignore_errors=True)


def _move_into_place(staged: Path, final: Path) -> None:
    """Rename the checked code dir into place in one step (a version that appeared meanwhile wins)."""
    try:
        os.rename(staged, final)
    except OSError:
        if not final.is_dir():
            raise


def _index_by_sha(directory: Path) -> dict[str, Path]:
    index: dict[str, Path] = {}
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            index.setdefault(_sha256_file(path), path)
    return index


_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def _safe_name(text: str) -> str:
    """A path component made from an id: anything odd becomes '_', never '..' or empty."""
    name = _SAFE.sub("_", text)[:100]
    return name if name.strip(".") else "_" + name
