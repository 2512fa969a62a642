"""Wire types of a task's outputs: the declared ``outputs`` of a task/spider and the artifact list of a result.

``outputs`` (docs/protocol.md, "Outputs and artifacts")::

    {"items": ["results.json", "out/*.jsonl"], "artifacts": ["images/**", "books.db"]}

Globs are relative to the task's working directory (``**`` matches any number of folders). A glob
that is absolute, climbs out (``..``) or holds a NUL or control character is refused with a
ProtocolError naming it — a hostile answer never reaches a path.

An artifact reference (``artifacts`` of a final result, the master's list)::

    {"path": "images/full/a.jpg", "sizeBytes": 1234, "sha256": "<64 hex digits>"}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ckagent.master.protocol._fields import ProtocolError, req_int, req_object

__all__ = ["ARTIFACTS", "ArtifactRef", "TaskOutputs", "check_artifact_path", "check_glob"]

ARTIFACTS = "artifacts"
"""A master feature (registration answer's ``features``): ``PUT /api/tasks/{id}/artifacts/{path}``
takes a task's artifacts. Without it the agent keeps the files on the node and says so in the task log."""

MAX_GLOBS = 64
"""Most globs in one of ``outputs.items`` / ``outputs.artifacts``."""

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f]")


def check_glob(value: Any, where: str) -> str:
    """A relative glob inside the working directory; raises ProtocolError naming ``where`` otherwise."""
    if not isinstance(value, str) or not value.strip():
        raise ProtocolError(where, "expected a non-empty glob string, relative to the task's working directory")
    if _BAD_CHARS.search(value):
        raise ProtocolError(where, "a glob must not hold control characters")
    if value.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", value):
        raise ProtocolError(where, f"{value!r} is absolute: write it relative to the working directory")
    if ".." in value.replace("\\", "/").split("/"):
        raise ProtocolError(where, f"{value!r} climbs out of the working directory ('..')")
    return value


def check_artifact_path(value: Any, where: str = "path") -> str:
    """A relative POSIX path of an artifact (no ``..``, no empty or ``.`` part, no control characters).
    Raises ProtocolError."""
    if not isinstance(value, str) or not value:
        raise ProtocolError(where, "expected a non-empty relative path")
    if _BAD_CHARS.search(value) or "\\" in value:
        raise ProtocolError(where, "an artifact path must not hold control characters or backslashes")
    parts = value.split("/")
    if value.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ProtocolError(where, f"{value!r} is not a plain relative path (no leading '/', '.', '..' or '//')")
    if len(value.encode()) > 1024:
        raise ProtocolError(where, "an artifact path is at most 1024 bytes")
    return value


def _globs(o: dict[str, Any], key: str, path: str) -> list[str]:
    raw = o.get(key)
    where = f"{path}.{key}" if path else key
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ProtocolError(where, "expected an array of glob strings")
    if len(raw) > MAX_GLOBS:
        raise ProtocolError(where, f"at most {MAX_GLOBS} globs")
    return [check_glob(value, f"{where}[{i}]") for i, value in enumerate(raw)]


@dataclass(frozen=True)
class TaskOutputs:
    """``outputs`` of a task or spider: globs of item files and of artifacts (relative to the working copy).

    ``items``: files read into the task's items stream by extension (``.jsonl``/``.ndjson``/``.jl``,
    ``.json``, ``.csv``). ``artifacts``: files shipped to the master as they are. A declared
    ``outputs`` replaces the conventions (framework item files; every other new or changed file an
    artifact): only what it names is collected; the rest is kept on the node, said in the log.
    """

    items: list[str] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, obj: Any, path: str = "outputs") -> TaskOutputs | None:
        """Validate (None/absent → None). Raises ProtocolError naming the bad glob."""
        if obj is None:
            return None
        o = req_object(obj, path)
        return cls(items=_globs(o, "items", path), artifacts=_globs(o, "artifacts", path))

    def to_json(self) -> dict[str, Any]:
        """``{"items": [...], "artifacts": [...]}``."""
        return {"items": list(self.items), "artifacts": list(self.artifacts)}


@dataclass(frozen=True)
class ArtifactRef:
    """One artifact of a task: its relative ``path``, ``size_bytes`` and ``sha256`` (64 lowercase hex)."""

    path: str
    size_bytes: int
    sha256: str

    @classmethod
    def from_json(cls, obj: Any, path: str = "") -> ArtifactRef:
        """Validate. Raises ProtocolError."""
        o = req_object(obj, path)
        sha = o.get("sha256")
        where = f"{path}.sha256" if path else "sha256"
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise ProtocolError(where, "expected 64 lowercase hexadecimal digits")
        return cls(path=check_artifact_path(o.get("path"), f"{path}.path" if path else "path"),
                   size_bytes=req_int(o, "sizeBytes", lo=0, path=path), sha256=sha)

    def to_json(self) -> dict[str, Any]:
        """``{"path", "sizeBytes", "sha256"}``."""
        return {"path": self.path, "sizeBytes": self.size_bytes, "sha256": self.sha256}


def artifact_list(obj: Any, path: str = "artifacts") -> list[ArtifactRef] | None:
    """The optional ``artifacts`` array of a result (None when absent). Raises ProtocolError."""
    if obj is None:
        return None
    if not isinstance(obj, list):
        raise ProtocolError(path, "expected an array of {path, sizeBytes, sha256}")
    return [ArtifactRef.from_json(value, f"{path}[{i}]") for i, value in enumerate(obj)]
