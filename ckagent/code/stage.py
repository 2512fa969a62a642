"""The files an install reads, taken out of a project by the agent: regular files only, no link followed.

The builder (ckagent.code.builder) never reads a project: the agent reads the dependency files it needs
from the task's working copy — a tree the spider owns — through :class:`ProjectFiles`, and writes what
an install needs into the environment's build directory (:func:`write_staged`). The project's code
(``setup.py``, its packages, its scripts) is never there, so no installer can build or run it.

A working copy is the spider's: it can hold a symlink to the agent's ``state.db`` or a FIFO, or swap a
directory for a link. Every path is read through ckagent.node.beneath (walked from the top's
descriptor one component at a time with ``O_NOFOLLOW``, a regular file only, another owner's hard link
refused), at most :data:`MAX_FILE_BYTES`; each file is read once, so the bytes hashed into an
environment's key are the bytes staged for its build.

Errors::

    DepsError (ckagent.node.errors)
    └── NotStageable    a dependency file that is a link, not a regular file, or too big (the task
                        fails DEPS_FAILED naming it)

Blocking (small reads): call it through ``trio.to_thread`` (the task's prepare hop).
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path, PurePosixPath

from ckagent.node import beneath
from ckagent.node.errors import DepsError

__all__ = ["MAX_FILE_BYTES", "NotStageable", "ProjectFiles", "safe_relative", "write_staged"]

MAX_FILE_BYTES = 64 * 1024 * 1024
"""The largest dependency file read (a lock file of a big project is a few MB)."""



class NotStageable(DepsError):
    """A dependency file the agent will not read (a link, not a regular file, too big); the message says which."""


def safe_relative(rel: str) -> PurePosixPath | None:
    """``rel`` as a relative path inside a tree (``a/b.txt``; ``./x`` normalised), None when it leaves
    it (absolute, ``..`` above the top, empty, NUL)."""
    if not rel or "\0" in rel or rel.startswith("/"):
        return None
    parts: list[str] = []
    for part in rel.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                return None
            parts.pop()
            continue
        parts.append(part)
    return PurePosixPath(*parts) if parts else PurePosixPath(".")


class ProjectFiles:
    """Reads a project's dependency files under ``top`` (see module docstring); ``read`` remembers
    every file it read (``read_files``: relative path → bytes, absent ones as None)."""

    def __init__(self, top: Path) -> None:
        self.top = top
        self.read_files: dict[str, bytes | None] = {}

    def _open_dir(self, parts: tuple[str, ...]) -> int:
        """A descriptor of the directory ``parts`` below the top (ckagent.node.beneath). Raises OSError."""
        return beneath.open_dir(self.top, "/".join(parts) or None)

    def read(self, rel: str) -> bytes | None:
        """The bytes of the file ``rel`` (relative to the top), None when it is absent, a directory, or a
        path that leaves the tree. Raises NotStageable for a link, a file that is not regular, another
        owner's hard link, one too big."""
        path = safe_relative(rel)
        if path is None or str(path) == ".":
            return None
        key = str(path)
        if key in self.read_files:
            return self.read_files[key]
        try:
            data: bytes | None = beneath.read_bytes(self.top, key, MAX_FILE_BYTES)
        except beneath.NotBeneath as exc:
            if (exc.errno == errno.EINVAL and "a directory" in str(exc)) or (exc.errno == errno.ENOTDIR and "not a directory on the way" in str(exc)):
                data = None
            else:
                raise NotStageable(f"{exc}: dependency files are read only as regular files of the project") \
                    from exc
        except FileNotFoundError:
            data = None
        except OSError as exc:
            if exc.errno == errno.EFBIG:
                raise NotStageable(f"{exc.strerror or exc} (more than a dependency file may have)") from exc
            if exc.errno in (errno.ENOTDIR, errno.EISDIR):
                data = None
            else:
                raise
        self.read_files[key] = data
        return data

    def text(self, rel: str) -> str | None:
        """:meth:`read` decoded as UTF-8 (bad bytes replaced)."""
        data = self.read(rel)
        return None if data is None else data.decode("utf-8", errors="replace")

    def is_file(self, rel: str) -> bool:
        """Whether ``rel`` is a regular file :meth:`read` can read (read now)."""
        return self.read(rel) is not None

    def is_dir(self, rel: str) -> bool:
        """Whether ``rel`` is a directory below the top reached without a link. Never raises."""
        path = safe_relative(rel)
        if path is None:
            return False
        try:
            fd = self._open_dir(() if str(path) == "." else path.parts)
        except OSError:
            return False
        os.close(fd)
        return True

    def list_dir(self, rel: str) -> list[str]:
        """The names in the directory ``rel`` (empty when it is not one reached without a link). Never raises."""
        path = safe_relative(rel)
        if path is None:
            return []
        try:
            fd = self._open_dir(() if str(path) == "." else path.parts)
        except OSError:
            return []
        try:
            return sorted(os.listdir(fd))
        except OSError:
            return []
        finally:
            os.close(fd)

    def digests(self) -> dict[str, str]:
        """``{relative path: sha256 hex}`` of every file read (absent ones left out)."""
        return {rel: hashlib.sha256(data).hexdigest() for rel, data in sorted(self.read_files.items())
                if data is not None}


def write_staged(dest: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` (relative path → bytes) under ``dest`` (made, mode 0755; files 0644, whatever the
    agent's umask: the builder reads them). A path that leaves ``dest`` is refused (ValueError).
    Blocking. Raises OSError."""
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest, 0o755)
    for rel, data in files.items():
        path = safe_relative(rel)
        if path is None or str(path) == ".":
            raise ValueError(f"a staged file must stay inside its directory: {rel!r}")
        target = dest.joinpath(*path.parts)
        for parent in reversed(target.relative_to(dest).parents):
            if str(parent) != ".":
                (dest / parent).mkdir(exist_ok=True)
                os.chmod(dest / parent, 0o755)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.fchmod(fd, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
