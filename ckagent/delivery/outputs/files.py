"""What the collection does to a task's files, by descriptors (ckagent.node.beneath): the spider owns them.

The working copy, the task dir and the spider's data dir are the spider's: it can plant links, FIFOs
and hard links in them, and swap a folder for a link while the agent works. So every move, hash, read,
removal and manifest write of :mod:`ckagent.delivery.outputs` and :mod:`ckagent.delivery.artifacts`
is made below a top the spider cannot change (``work_dir/tasks/<id>``, ``work_dir/spiders/.runs/<id>``,
``work_dir/spider-data/<spider>``) by :mod:`ckagent.node.beneath`: never through a link, only regular
files, never another owner's hard link.

The manifest (``artifacts.json``) lies in the task dir, so the spider may rewrite it too: what it names
is read only below the task dir, and its folder for kept files (``keepDir``) is used only when it is
the place :func:`kept_dir` names for this task in a data dir of the task dir's owner
(:func:`kept_place`) — never another spider's data dir, never a path of the spider's choosing.

Every function blocks (file I/O): call it in a worker thread. Errors: OSError (NotBeneath for a file
that is not the tree's regular file), ValueError for a manifest that is not one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from ckagent.master.protocol import ArtifactRef
from ckagent.node import beneath
from ckagent.node.beneath import NotBeneath

__all__ = ["ARTIFACTS_DIR", "MANIFEST", "MAX_MANIFEST_BYTES", "cleanup_kept", "hash_file", "keep", "kept_dir",
           "kept_place", "load_manifest", "prune", "read_artifact", "same_bytes", "write_manifest"]

ARTIFACTS_DIR = "artifacts"
"""Folder of the task directory holding the artifacts until the master has them."""
MANIFEST = "artifacts.json"
"""The task directory's artifact list: ``{"artifacts": [ArtifactRef JSON], "keepDir": str}``."""
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
"""A manifest larger than this is not read (a spider may replace the file with anything)."""
SPIDER_DATA = "spider-data"
KEPT = "outputs"
_CHUNK = 1 << 20


def kept_dir(work_dir: Path, safe_spider: str, safe_task: str) -> Path:
    """Where a task's files kept on the node go: ``work_dir/spider-data/<spider>/outputs/<task>/``."""
    return work_dir / SPIDER_DATA / safe_spider / KEPT / safe_task


def kept_place(task_dir: Path, keep_dir: Path) -> tuple[Path, str]:
    """``keep_dir`` as (its spider's data dir: the top files are moved below, the path below it) when it
    is this task's place (``<work_dir>/spider-data/<spider>/outputs/<task id>``, ``work_dir`` the one the
    task dir is in) in a data dir owned by the task dir's owner. Raises NotBeneath otherwise (a manifest
    the spider rewrote), OSError when the data dir cannot be looked at."""
    work_dir = task_dir.parent.parent
    parts = keep_dir.parts
    if (keep_dir.parent.parent.parent.parent != work_dir or keep_dir.parent.parent.parent.name != SPIDER_DATA
            or keep_dir.parent.name != KEPT or keep_dir.name != task_dir.name or ".." in parts
            or keep_dir.parent.parent.name in ("", ".", "..")):
        raise NotBeneath(errno.EINVAL, f"{keep_dir}: not this task's folder for kept files")
    top = keep_dir.parent.parent
    owner = os.stat(top, follow_symlinks=False)
    if not stat.S_ISDIR(owner.st_mode) or owner.st_uid != os.stat(task_dir).st_uid:
        raise NotBeneath(errno.EPERM, f"{top}: not the data dir of the task's owner")
    return top, f"{KEPT}/{keep_dir.name}"


def keep(src_top: Path, src_rel: str, keep_dir: Path, rel: str) -> os.stat_result:
    """Move the file ``src_rel`` below ``src_top`` to ``rel`` in ``keep_dir`` (this task's folder for
    kept files: :func:`kept_dir`; made when missing, its folders given to the data dir's owner).
    Returns the file's lstat. Raises OSError (NotBeneath)."""
    top = keep_dir.parent.parent
    top.mkdir(parents=True, exist_ok=True)
    return beneath.move(src_top, src_rel, top, f"{keep_dir.relative_to(top).as_posix()}/{rel}")


def same_bytes(code_dir: Path, work: Path, rel: str) -> bool:
    """True when the file ``rel`` has the same bytes in the code version and in the working copy (both
    opened below their tops; False when either cannot be read as a regular file)."""
    try:
        a = beneath.open_file(code_dir, rel)
    except OSError:
        return False
    try:
        try:
            b = beneath.open_file(work, rel)
        except OSError:
            return False
        try:
            if os.fstat(a).st_size != os.fstat(b).st_size:
                return False
            while True:
                x, y = os.read(a, _CHUNK), os.read(b, _CHUNK)
                if x != y:
                    return False
                if not x:
                    return True
        finally:
            os.close(b)
    finally:
        os.close(a)


def hash_file(top: Path, rel: str) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of the regular file ``rel`` below ``top``, read from one descriptor.
    Raises OSError (NotBeneath)."""
    fd = beneath.open_file(top, rel)
    try:
        digest = hashlib.sha256()
        size = 0
        while chunk := os.read(fd, _CHUNK):
            digest.update(chunk)
            size += len(chunk)
        return digest.hexdigest(), size
    finally:
        os.close(fd)


def read_checked(task_dir: Path, ref: ArtifactRef) -> bytes | None:
    """The artifact's bytes (below ``task_dir/artifacts``), or None when it is gone, not a regular file
    of the task's, or no longer what the manifest says."""
    try:
        data = beneath.read_bytes(task_dir, f"{ARTIFACTS_DIR}/{ref.path}", ref.size_bytes)
    except OSError:
        return None
    if len(data) != ref.size_bytes or hashlib.sha256(data).hexdigest() != ref.sha256:
        return None
    return data


def prune(top: Path, rels: list[str]) -> None:
    """Remove ``rels`` (files, symlinks, folders) below ``top``, then the folders left empty. Never raises."""
    for rel in rels:
        with contextlib.suppress(OSError):
            beneath.remove(top, rel)
    with contextlib.suppress(OSError):
        beneath.remove_empty_dirs(top)


def write_manifest(task_dir: Path, body: dict[str, Any]) -> None:
    """Write ``artifacts.json`` anew (a file of the agent's, by a rename: nothing the spider planted at
    its name is followed). Raises OSError."""
    beneath.write_new(task_dir, MANIFEST, json.dumps(body, ensure_ascii=False).encode())


def load_manifest(task_dir: Path) -> tuple[list[ArtifactRef], Path]:
    """(the artifacts listed by ``task_dir/artifacts.json``, the folder for files kept on the node).
    No manifest: ([], ``task_dir/kept``). A broken one raises OSError/ValueError (also one that is not
    a regular file, or larger than MAX_MANIFEST_BYTES). Blocking."""
    try:
        body = json.loads(beneath.read_bytes(task_dir, MANIFEST, MAX_MANIFEST_BYTES))
    except FileNotFoundError:
        return [], task_dir / "kept"
    if not isinstance(body, dict):
        raise ValueError(f"{MANIFEST}: not an object")
    refs = [ArtifactRef.from_json(entry, f"artifacts[{i}]") for i, entry in enumerate(body.get("artifacts", []))]
    keep_dir = body.get("keepDir")
    return refs, Path(keep_dir) if isinstance(keep_dir, str) and keep_dir else task_dir / "kept"


def read_artifact(task_dir: Path, rel: str, max_bytes: int) -> bytes | None:
    """The bytes of the artifact ``rel`` of a task on this node (its task directory, or the folder of
    kept files after an upload that could not be made: when it is this task's, :func:`kept_place`);
    None when ``rel`` is not in the task's manifest, the file is gone, is not a regular file of the
    task's or holds more than ``max_bytes``. Never reads a path from outside the manifest."""
    try:
        refs, keep_dir = load_manifest(task_dir)
    except (OSError, ValueError):
        return None
    if rel not in {ref.path for ref in refs}:
        return None
    places: list[tuple[Path, str]] = [(task_dir, f"{ARTIFACTS_DIR}/{rel}")]
    with contextlib.suppress(OSError):
        top, below = kept_place(task_dir, keep_dir)
        places.append((top, f"{below}/{rel}"))
    for top, path in places:
        try:
            return beneath.read_bytes(top, path, max_bytes)
        except OSError:
            continue
    return None


def cleanup_kept(work_dir: Path, older_than: float) -> int:
    """Delete folders of kept files (``spider-data/*/outputs/<task>/``) not changed for ``older_than``
    seconds, by descriptors (a spider's ``outputs`` that is a link leads nowhere). Returns how many;
    never raises. Blocking."""
    cutoff = time.time() - older_than
    deleted = 0
    try:
        with os.scandir(work_dir / SPIDER_DATA) as spiders:
            tops = [Path(entry.path) for entry in spiders if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return 0
    for top in tops:
        try:
            fd = beneath.open_dir(top, KEPT)
        except OSError:
            continue
        try:
            with os.scandir(fd) as entries:
                old = [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)
                       and entry.stat(follow_symlinks=False).st_mtime < cutoff]
            for name in old:
                try:
                    beneath.remove(fd, name)
                except OSError:
                    continue
                deleted += 1
        except OSError:
            continue
        finally:
            os.close(fd)
    return deleted
