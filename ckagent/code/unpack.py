"""A code package's rules, checked before a byte of an entry is written, and its extraction.

Rules (ckagent.code.workspace applies them to packages and to spider-file listings alike):

- the package: zip magic bytes, a readable central directory, at most ``max_entries`` entries
  (counted from the end-of-central-directory record before zipfile loads the directory);
- each entry: a relative path (no ``/``-absolute path, drive letter, ``..``, NUL), no symlink, no
  device file/fifo/socket, no duplicate or file-vs-directory clash;
- sizes: the declared total at most ``max_total_bytes``, an entry's compression ratio at most
  ``max_ratio`` (for entries over 1 MiB) and the *actual* bytes written counted against the total
  too (a zip bomb lying about its sizes still stops at the cap).

A package whose entries all sit under one top-level folder (GitHub's "Download ZIP") is unwrapped:
that folder's content is the project root (not an egg's ``EGG-INFO/``); macOS's ``__MACOSX/`` entries
are dropped. A Scrapyd egg is a zip like any other here (ckagent.code.eggs reads what it says).

Exceptions::

    DeployError        an entry or the package breaks a rule; the message names the entry and the rule
"""

from __future__ import annotations

import lzma
import os
import re
import stat
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from ckagent.node.errors import DeployError

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
_RATIO_FLOOR_BYTES = 1 << 20
WRITE_CHUNK_BYTES = 1 << 20
"""Bytes read or written at a time while extracting or hashing."""



@dataclass(frozen=True)
class Limits:
    """Caps on what a package may contain. Sizes in bytes; ``max_ratio`` is uncompressed:compressed."""

    max_package_bytes: int = 256 * 1024 * 1024
    max_total_bytes: int = 1024 * 1024 * 1024
    max_entries: int = 20000
    max_ratio: float = 200.0


_DRIVE = re.compile(r"^[A-Za-z]:")


def check_member_path(name: str) -> PurePosixPath:
    """Validate a relative path from a package or a file listing; returns it normalised.

    Raises DeployError naming the entry and the rule (absolute path, drive letter, ``..``, NUL, empty).
    """
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


def check_layout(entries: list[tuple[str, PurePosixPath, bool]]) -> None:
    """Refuse two entries with the same path and a file that is also a directory of another entry.

    ``entries`` holds (original name, normalised path, is_dir). Raises DeployError.
    """
    files: dict[PurePosixPath, str] = {}
    dirs: dict[PurePosixPath, str] = {}
    for name, rel, is_dir in entries:
        if not is_dir:
            if rel in files:
                raise DeployError(f"entry {name!r}: appears more than once")
            files[rel] = name
        else:
            dirs.setdefault(rel, name)
        for parent in list(rel.parents)[:-1]:
            dirs.setdefault(parent, name)
    for rel, name in files.items():
        if rel in dirs:
            raise DeployError(f"entry {name!r}: is a file and also a directory of {dirs[rel]!r}")


def _declared_entry_count(fh: BinaryIO) -> int | None:
    """Entry count from the end-of-central-directory record (zip64 aware), read before zipfile parses it.

    A hostile central directory of millions of entries would otherwise be loaded whole into memory
    before the count could be checked. None when no record is found (the zip is unreadable).
    """
    size = fh.seek(0, os.SEEK_END)
    tail_len = min(size, 22 + 65535)
    fh.seek(size - tail_len)
    tail = fh.read(tail_len)
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < 22:
        return None
    count: int = struct.unpack("<H", tail[at + 10 : at + 12])[0]
    if count != 0xFFFF or at < 20 or tail[at - 20 : at - 16] != b"PK\x06\x07":
        return count
    zip64_offset: int = struct.unpack("<Q", tail[at - 12 : at - 4])[0]
    if zip64_offset + 56 > size:
        return None
    fh.seek(zip64_offset)
    record = fh.read(56)
    if record[:4] != b"PK\x06\x06":
        return None
    total: int = struct.unpack("<Q", record[32:40])[0]
    return total


_READ_ERRORS = (zipfile.BadZipFile, EOFError, zlib.error, lzma.LZMAError, NotImplementedError, RuntimeError,
                ValueError)


def extract_zip(zip_path: Path, dest: Path, limits: Limits) -> int:
    """Check every entry of ``zip_path`` and extract it under ``dest`` (which must exist, empty).

    Returns the number of files written. Blocking: run it in a thread. Raises DeployError (the
    first broken rule, naming the entry) — possibly after some files were written under ``dest``,
    which is a temp dir the caller removes. Nothing is ever written outside ``dest``: paths are
    checked before extraction and no symlink is created.
    """
    with open(zip_path, "rb") as fh:
        if fh.read(4) not in ZIP_MAGIC:
            raise DeployError("package: not a zip file (wrong magic bytes)")
        declared_entries = _declared_entry_count(fh)
    if declared_entries is None:
        raise DeployError("package: not a readable zip (no end-of-central-directory record; truncated?)")
    if declared_entries > limits.max_entries:
        raise DeployError(f"package: {declared_entries} entries; the limit is {limits.max_entries}")
    try:
        archive = zipfile.ZipFile(zip_path)
    except (*_READ_ERRORS, OSError) as exc:
        raise DeployError(f"package: not a readable zip ({exc}; truncated?)") from exc
    with archive:
        infos = archive.infolist()
        if len(infos) > limits.max_entries:
            raise DeployError(f"package: {len(infos)} entries; the limit is {limits.max_entries}")
        declared = 0
        plan: list[tuple[zipfile.ZipInfo, PurePosixPath]] = []
        for info in infos:
            rel = check_member_path(info.filename)
            kind = stat.S_IFMT(info.external_attr >> 16)
            if kind == stat.S_IFLNK:
                points_to = _symlink_target(archive, info)
                raise DeployError(
                    f"entry {info.filename!r}: symlinks are not allowed (it points to {points_to!r})"
                )
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise DeployError(f"entry {info.filename!r}: device files, fifos and sockets are not allowed")
            declared += info.file_size
            if declared > limits.max_total_bytes:
                raise DeployError(
                    f"entry {info.filename!r}: the package unpacks to more than {limits.max_total_bytes} "
                    "bytes (total size cap; zip bomb?)"
                )
            if info.file_size > _RATIO_FLOOR_BYTES and (
                info.compress_size == 0 or info.file_size / info.compress_size > limits.max_ratio
            ):
                ratio = info.file_size / max(info.compress_size, 1)
                raise DeployError(
                    f"entry {info.filename!r}: compression ratio {ratio:.0f}:1 exceeds "
                    f"{limits.max_ratio:.0f}:1 (zip bomb?)"
                )
            plan.append((info, rel))
        plan = unwrap_single_folder(plan)
        check_layout([(info.filename, rel, info.is_dir()) for info, rel in plan])
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
                    while chunk := src.read(WRITE_CHUNK_BYTES):
                        written_total += len(chunk)
                        if written_total > limits.max_total_bytes:
                            raise DeployError(
                                f"entry {info.filename!r}: the package unpacks to more than "
                                f"{limits.max_total_bytes} bytes (total size cap; zip bomb?)"
                            )
                        out.write(chunk)
            except _READ_ERRORS as exc:
                raise DeployError(f"entry {info.filename!r}: cannot be read ({exc}; truncated zip?)") from exc
            if (info.external_attr >> 16) & 0o111:
                target.chmod(0o755)
            files += 1
        return files


EGG_INFO = "EGG-INFO"
"""A Scrapyd egg's metadata folder (ckagent.code.eggs): never unwrapped as a single top folder."""
MAC_METADATA = "__MACOSX"
"""Folder macOS's Archive Utility adds to zips (resource forks): never part of a project."""


def unwrap_single_folder(
    plan: list[tuple[zipfile.ZipInfo, PurePosixPath]],
) -> list[tuple[zipfile.ZipInfo, PurePosixPath]]:
    """Entries as they land in the code dir: ``__MACOSX/`` dropped, and when every entry sits under one
    top-level folder (GitHub's "Download ZIP", ``git archive --prefix=x/``), that folder unwrapped —
    unless it is an egg's ``EGG-INFO/`` (an egg of no code stays an egg: ckagent.code.eggs says what it lacks)."""
    plan = [(info, rel) for info, rel in plan if rel.parts[0] != MAC_METADATA]
    tops = {rel.parts[0] for _, rel in plan}
    if len(tops) != 1 or tops == {EGG_INFO} or any(len(rel.parts) == 1 and not info.is_dir() for info, rel in plan):
        return plan
    return [(info, PurePosixPath(*rel.parts[1:])) for info, rel in plan if len(rel.parts) > 1]


def _symlink_target(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> str:
    """What a symlink entry points to (for the error message), or '?' when unreadable."""
    if info.file_size > 4096:
        return "?"
    try:
        return archive.read(info).decode("utf-8", errors="replace")[:200]
    except (*_READ_ERRORS, OSError):
        return "?"
