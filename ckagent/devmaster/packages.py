"""Code packages as the reference master receives them: a zip checked and read into its regular files.

The master only checks that a package is a readable zip within the size limits; what is safe to
unpack is the agent's decision (ckagent.code.workspace).
"""

from __future__ import annotations

import hashlib
import io
import stat
import zipfile
from dataclasses import dataclass, field

from ckagent.devmaster.errors import BadRequestError, PayloadTooLargeError

__all__ = ["MAX_PACKAGE_BYTES", "MAX_PACKAGE_UNCOMPRESSED_BYTES", "PackageContents", "PackageFile", "read_package"]

MAX_PACKAGE_BYTES = 256 * 1024 * 1024
"""Largest zip the admin API accepts (bytes)."""
MAX_PACKAGE_UNCOMPRESSED_BYTES = 512 * 1024 * 1024
"""Largest total size of a package's files once unpacked (bytes): the files are stored in SQLite too."""


@dataclass(frozen=True)
class PackageFile:
    """One regular file of a code package: ``path`` inside the zip, its bytes and their sha256 (hex)."""

    path: str
    data: bytes
    sha256: str

    @property
    def size_bytes(self) -> int:
        """Length of ``data`` in bytes."""
        return len(self.data)


@dataclass(frozen=True)
class PackageContents:
    """A validated code package: the zip's sha256 (hex), its size, ``code_version`` and regular files."""

    sha256: str
    size_bytes: int
    files: list[PackageFile] = field(default_factory=list)

    @property
    def code_version(self) -> str:
        """The first 12 hex digits of the zip's sha256."""
        return self.sha256[:12]


def read_package(data: bytes) -> PackageContents:
    """Check that ``data`` is a readable zip and read its regular files (blocking: run in a thread).

    Directories and symlink entries are skipped; paths are kept exactly as the zip names them (the
    agent, not the master, decides what is safe to unpack). A later entry with the same path wins,
    as it would on extraction. Raises BadRequestError (not a zip, or a file fails its CRC) and
    PayloadTooLargeError (over MAX_PACKAGE_BYTES, or more than MAX_PACKAGE_UNCOMPRESSED_BYTES unpacked).
    """
    if len(data) > MAX_PACKAGE_BYTES:
        raise PayloadTooLargeError(f"package is larger than {MAX_PACKAGE_BYTES} bytes")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise BadRequestError(f"the package is not a zip file: {exc}") from exc
    files: dict[str, PackageFile] = {}
    total = 0
    with archive:
        for info in archive.infolist():
            if info.is_dir() or stat.S_ISLNK(info.external_attr >> 16):
                continue
            total += info.file_size
            if total > MAX_PACKAGE_UNCOMPRESSED_BYTES:
                raise PayloadTooLargeError(
                    f"the package unpacks to more than {MAX_PACKAGE_UNCOMPRESSED_BYTES} bytes"
                )
            try:
                content = archive.read(info)
            except (zipfile.BadZipFile, NotImplementedError, RuntimeError, OSError) as exc:
                raise BadRequestError(f"cannot read {info.filename!r} from the package: {exc}") from exc
            files[info.filename] = PackageFile(
                path=info.filename, data=content, sha256=hashlib.sha256(content).hexdigest()
            )
    return PackageContents(
        sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), files=list(files.values())
    )
