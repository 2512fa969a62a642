"""What becomes of the files a task wrote: items, artifacts, or kept on the node — never deleted silently.

When a task's process has ended (and before its working copy is removed), :func:`collect` walks the
working copy and finds every regular file the task **created or changed** (not in the code version,
another size, or newer than the spider's start with other bytes). Each one gets a fate:

1. **Items** — files named by ``outputs.items`` (globs relative to the working directory), else the
   conventions of the frameworks: crawlee's datasets (``storage/datasets/<name>/*.json``, one item
   per file, in name order). Their items are appended to the task's items spool (``items.jsonl``),
   in file order, before the items stream is closed: they reach the master like the SDK's, exactly
   once (the outbox's guarantees). See :mod:`ckagent.delivery.outputs.itemfiles` for the formats.
   A file a glob names that is not an item file (by its extension) is treated as the other files
   below; a glob that matches no created or changed file is said in the log (``outputs.items
   'quotes.json' matched no file``).
   **Only what this run wrote is items**: an item file the package ships is the author's sample.
   Each one is recorded when the working copy is staged (:mod:`.samples`: inode, size, mtime, the
   hash of its start); at the end, one left alone is no item and no artifact (the line says so:
   ``output.jsonl: the package's sample (3 KiB), not written by this run: left alone``), one the
   run appended to gives only the appended items (``output.jsonl → 100 items (after the package's
   sample of 3 KiB)``), one it rewrote, truncated or replaced gives all of its items.
2. **Artifacts** — files named by ``outputs.artifacts``; without that list, every other created or
   changed file except the **cache rule** below. They are moved into the task directory
   (``work_dir/tasks/<task-id>/artifacts/``) with a manifest (``artifacts.json``: path, size,
   sha256) and uploaded by the outbox before the final result (:mod:`ckagent.delivery.artifacts`).
3. **Kept on the node** — artifacts over the size budget (``task.max_artifact_bytes``; files are
   taken in path order while they fit), every artifact when the master does not take artifacts (no
   ``artifacts`` feature), and, when ``outputs.artifacts`` is declared, the created files it does
   not name: moved to ``work_dir/spider-data/<spider>/outputs/<task-id>/`` (deleted after
   ``task.retention`` like a delivered task's directory). The log says where.

**The cache rule** (never items nor artifacts, not mentioned): a path with a folder named
``__pycache__``, ``.pytest_cache``, ``.mypy_cache``, ``.ruff_cache``, ``.cache``, ``.npm``, ``.yarn``,
``.pnpm-store``, ``node_modules``, ``.venv``, ``.git`` or ``.scrapy`` (Scrapy's HTTP cache and job
state), a ``*.pyc``/``*.pyo`` file, crawlee's own state (``storage/request_queues/``, and
``storage/key_value_stores/*/SDK_*``). Symlinks are never followed nor collected.

**The files are the spider's** (it owns its working copy and task dir and may plant links, FIFOs, hard
links, or swap a folder for a link while the agent works): the walk, every read, move and removal go
by descriptors below the working copy, the task dir and the spider's data dir (:mod:`.files`,
ckagent.node.beneath) — no link followed, only regular files; a file that is a hard link to a file of
another owner (the agent's state.db, another spider's) is not the task's: never an item nor an
artifact, said in the log (``x.json: a hard link to a file of uid 0 …: not collected``).

The last line of every task's log that ran says what became of its files::

    outputs: results.json → 100 items; images/ (30 files, 1.2 MB) → artifacts; books.db kept at /…/books.db

Blocking: :func:`collect` walks, copies and hashes; call it in one ``trio.to_thread`` hop.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckagent.containment import format_bytes
from ckagent.delivery.outputs.files import (
    ARTIFACTS_DIR,
    MANIFEST,
    cleanup_kept,
    hash_file,
    keep,
    kept_dir,
    load_manifest,
    prune,
    read_artifact,
    same_bytes,
    write_manifest,
)
from ckagent.delivery.outputs.itemfiles import ITEM_EXTENSIONS, ItemFileError, append_item_file, count_lines
from ckagent.delivery.outputs.samples import NOTHING, Sample, judge
from ckagent.delivery.spool import ITEMS_FILE, open_spool
from ckagent.master.protocol import ArtifactRef, TaskOutputs
from ckagent.node import beneath

__all__ = ["ARTIFACTS_DIR", "MANIFEST", "Collected", "cleanup_kept", "collect", "is_cache", "item_candidates",
           "kept_dir", "load_manifest", "match_glob", "read_artifact"]

CACHE_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".cache", ".npm", ".yarn",
                        ".pnpm-store", "node_modules", ".venv", ".git", ".scrapy"})
CACHE_SUFFIXES = (".pyc", ".pyo")
_CRAWLEE_DATASET = re.compile(r"^storage/datasets/[^/]+/[^/]+\.json$")


def is_cache(rel: str) -> bool:
    """True for a path (POSIX, relative to the working copy) the cache rule leaves out."""
    parts = rel.split("/")
    if any(part in CACHE_DIRS for part in parts[:-1]) or rel.endswith(CACHE_SUFFIXES):
        return True
    if rel.startswith("storage/request_queues/"):
        return True
    return len(parts) == 4 and parts[0] == "storage" and parts[1] == "key_value_stores" and parts[3].startswith("SDK_")


def match_glob(rel: str, pattern: str) -> bool:
    """``rel`` matches ``pattern``: ``*`` within a folder, ``**`` any folders, a trailing ``/`` or a
    folder name = everything under it."""
    pattern = pattern.strip()
    while pattern.startswith("./"):
        pattern = pattern[2:]
    if pattern.endswith("/"):
        pattern += "**"
    return bool(_glob_regex(pattern).match(rel)) or bool(_glob_regex(pattern.rstrip("/") + "/**").match(rel))


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape("["))
                i += 1
            else:
                out.append(fnmatch.translate(pattern[i:end + 1])[4:-3])
                i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("^" + "".join(out) + "$")


@dataclass
class Collected:
    """What :func:`collect` did: for the log line, the result and ``ckagent exec``."""

    items: list[tuple[str, int]] = field(default_factory=list)
    """(item file, items appended) in the order read."""
    artifacts: list[ArtifactRef] = field(default_factory=list)
    """Artifacts moved to the task directory for upload."""
    kept: list[tuple[str, int]] = field(default_factory=list)
    """(path, bytes) of files kept on the node in :attr:`kept_dir`."""
    kept_dir: Path | None = None
    kept_why: str = ""
    problems: list[str] = field(default_factory=list)
    """Files that could not be read or moved (named in the log; they stay where they were)."""
    appended: dict[str, int] = field(default_factory=dict)
    """Item files this run appended to a sample of the package: path → the sample's size (bytes)."""
    samples: list[tuple[str, int]] = field(default_factory=list)
    """(path, bytes) of the package's samples the item globs name that this run did not write."""

    def line(self) -> str:
        """``outputs: results.json → 100 items; images/ (30 files, 1.2 MB) → artifacts; …``."""
        parts = [f"{path} → {count} item{'' if count == 1 else 's'}"
                 + (f" (after the package's sample of {format_bytes(self.appended[path])})"
                    if path in self.appended else "") for path, count in self.items]
        parts += _samples_said(self.samples)
        parts += [f"{what} → artifacts" for what in _grouped([(a.path, a.size_bytes) for a in self.artifacts])]
        if self.kept:
            where = str(self.kept_dir)
            parts += [f"{what} kept at {where}/" for what in _grouped(self.kept)]
            if self.kept_why:
                parts[-1] += f" ({self.kept_why})"
        parts += self.problems
        return "outputs: " + ("; ".join(parts) if parts else "no file created or changed in the working copy")


def _samples_said(samples: list[tuple[str, int]]) -> list[str]:
    """The package's samples left alone, by name; a folder holding several as ``folder/ (n files, size)``."""
    folders: dict[str, list[int]] = {}
    for path, size in samples:
        if "/" in path:
            folders.setdefault(path.split("/", 1)[0] + "/", []).append(size)
    out: list[str] = []
    said: set[str] = set()
    for path, size in samples:
        top = path.split("/", 1)[0] + "/" if "/" in path else ""
        if top and len(folders[top]) > 1:
            if top not in said:
                said.add(top)
                sizes = folders[top]
                out.append(f"{top} ({len(sizes)} files, {format_bytes(sum(sizes))}): the package's samples, not "
                           "written by this run: left alone")
        else:
            out.append(f"{path}: the package's sample ({format_bytes(size)}), not written by this run: left alone")
    return out


def _grouped(files: list[tuple[str, int]]) -> list[str]:
    """Files at the top of the working copy by name; those in a folder as ``folder/ (n files, size)``."""
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    for path, size in files:
        top = path.split("/", 1)[0] + "/" if "/" in path else path
        if top not in groups:
            groups[top] = []
            order.append(top)
        groups[top].append(size)
    out = []
    for top in order:
        sizes = groups[top]
        if top.endswith("/"):
            out.append(f"{top} ({len(sizes)} file{'' if len(sizes) == 1 else 's'}, {format_bytes(sum(sizes))})")
        else:
            out.append(f"{top} ({format_bytes(sizes[0])})")
    return out


def item_candidates(work: Path, outputs: TaskOutputs | None) -> list[str]:
    """The files of the working copy ``work`` that would be item files now (POSIX relative paths,
    sorted): those ``outputs.items`` names with an item file's extension, else crawlee's dataset
    files. What :func:`ckagent.delivery.outputs.samples.snapshot` records when the copy is staged.
    Blocking (a walk by descriptors); never raises (an unreadable copy has none)."""
    globs = outputs.items if outputs is not None and outputs.items else None
    found: list[str] = []
    try:
        for rel_dir, _dirs, entries in beneath.walk(work, skip_dir=lambda rel: rel.rsplit("/", 1)[-1] in CACHE_DIRS):
            for name, st in entries:
                rel = rel_dir + name
                if not stat.S_ISREG(st.st_mode) or is_cache(rel):
                    continue
                if (any(match_glob(rel, g) for g in globs) and rel.lower().endswith(ITEM_EXTENSIONS)
                        if globs is not None else bool(_CRAWLEE_DATASET.match(rel))):
                    found.append(rel)
    except OSError:
        return []
    return sorted(found)


def changed_files(work: Path, code_dir: Path, since: float, others: list[str] | None = None,
                  foreign: list[str] | None = None, samples: dict[str, Sample] | None = None,
                  starts: dict[str, int] | None = None) -> list[tuple[str, os.stat_result]]:
    """Regular files of ``work`` the task created or changed (POSIX relative paths, sorted), caches left out.

    A file counts when ``code_dir`` has none at its path, or one of another size, or when its mtime is
    after ``since`` (epoch seconds) and its bytes differ. A file at the path of one of ``samples``
    (the package's item files as staged) is judged by :func:`ckagent.delivery.outputs.samples.judge`
    instead: it counts unless it is the sample left alone, and ``starts`` (when given) gets where
    this run's bytes begin in it. ``others`` (when given) gets every other
    entry: unchanged files, symlinks, FIFOs and the like, cache files and cache folders (a folder once,
    not its content). ``foreign`` (when given) gets the files that are hard links to a file of another
    owner than the working copy's (not the task's: see module docstring); they are in ``others`` too.
    The walk is by descriptors (ckagent.node.beneath.walk): no link is followed."""
    found: list[tuple[str, os.stat_result]] = []
    other = others if others is not None else []
    owner = os.stat(work, follow_symlinks=False).st_uid
    for rel_dir, _dirs, entries in beneath.walk(work, skip_dir=lambda rel: rel.rsplit("/", 1)[-1] in CACHE_DIRS):
        for name, st in entries:
            rel = rel_dir + name
            if is_cache(rel) or not stat.S_ISREG(st.st_mode):
                other.append(rel)
                continue
            if st.st_nlink > 1 and st.st_uid != owner:
                other.append(rel)
                if foreign is not None:
                    foreign.append(rel)
                continue
            sample = samples.get(rel) if samples else None
            if sample is not None:
                start = judge(sample, st, work, rel)
                if start == NOTHING:
                    other.append(rel)
                else:
                    found.append((rel, st))
                    if starts is not None:
                        starts[rel] = start
                continue
            try:
                original = os.lstat(code_dir / rel)
            except OSError:
                found.append((rel, st))
                continue
            if original.st_size != st.st_size or (st.st_mtime > since and not same_bytes(code_dir, work, rel)):
                found.append((rel, st))
            else:
                other.append(rel)
    found.sort(key=lambda entry: entry[0])
    return found


def collect(*, work: Path, code_dir: Path, since: float, task_dir: Path, outputs: TaskOutputs | None,
            budget_bytes: int, master_takes_artifacts: bool, keep_dir: Path,
            streamed: Callable[[str], tuple[Path, int] | None] | None = None,
            samples: dict[str, Sample] | None = None) -> Collected:
    """Give each created or changed file of the working copy ``work`` its fate (module docstring).

    ``since``: the spider's start (epoch seconds). ``budget_bytes``: most artifact bytes shipped (0 =
    none shipped, all kept). Appends items to ``task_dir/items.jsonl``; moves artifacts to
    ``task_dir/artifacts/`` and writes ``task_dir/artifacts.json``; moves kept files to ``keep_dir``.
    ``streamed(rel)``: (the link, where its stream starts) of a JSON Lines item file streamed while
    the task ran (its items are in the items journal's stream: counted, not appended; see
    :mod:`.live`), or None. ``samples``: the package's item files as staged (:mod:`.samples`): only
    what this run wrote of them is items; the ones it left alone are named in the line.
    Never raises for one file's trouble (it is named in :attr:`Collected.problems`); raises OSError
    when the items spool or the manifest cannot be written.
    """
    result = Collected()
    others: list[str] = []
    foreign: list[str] = []
    starts: dict[str, int] = {}
    files = changed_files(work, code_dir, since, others, foreign, samples, starts)
    result.problems += [f"{rel}: a hard link to a file the task does not own: not collected" for rel in foreign]
    item_globs = outputs.items if outputs is not None and outputs.items else None
    artifact_globs = outputs.artifacts if outputs is not None and outputs.artifacts else None
    item_files = [(rel, st) for rel, st in files
                  if (any(match_glob(rel, g) for g in item_globs) if item_globs is not None
                      else bool(_CRAWLEE_DATASET.match(rel)))]
    written = {rel for rel, _ in files}
    result.samples = [(rel, sample.size) for rel, sample in sorted((samples or {}).items())
                      if rel not in written and (item_globs is None or any(match_glob(rel, g) for g in item_globs))
                      and os.path.lexists(work / rel)]
    if item_globs is not None:
        result.problems += [f"outputs.items {g!r} matched no file" for g in item_globs
                            if not any(match_glob(rel, g) for rel, _ in files)
                            and not any(match_glob(rel, g) for rel, _ in result.samples)]
        not_items = [rel for rel, _ in item_files if not rel.lower().endswith(ITEM_EXTENSIONS)]
        if not_items:  # the fate of any other file (artifact, or kept with the log saying where)
            kinds = ", ".join(ITEM_EXTENSIONS)
            what = (f"{not_items[0]} is named by outputs.items but is not an item file" if len(not_items) == 1
                    else f"{len(not_items)} files named by outputs.items are not item files")
            result.problems.append(f"{what} ({kinds}): treated as other files")
            item_files = [(rel, st) for rel, st in item_files if rel.lower().endswith(ITEM_EXTENSIONS)]
    item_set = {rel for rel, _ in item_files}
    rest = [(rel, st) for rel, st in files if rel not in item_set]
    unread: set[str] = set()  # item files that could not be read
    if item_files:
        # Every streamed file's link first (made now for one the run did not see), then the others'
        # items appended: the items journal orders the links' last lines before items.jsonl's growth.
        links = {rel: streamed(rel) for rel, _st in item_files} if streamed is not None else {}
        # (the spool as every spool file: never through a link the spider planted at its name)
        with os.fdopen(open_spool(task_dir / ITEMS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as spool:
            for rel, _st in item_files:
                link = links.get(rel)
                start = starts.get(rel, 0)
                try:
                    count = (count_lines(task_dir, link[0].relative_to(task_dir).as_posix(), link[1])
                             if link is not None else append_item_file(work, rel, spool, start))
                except ItemFileError as exc:
                    result.problems.append(f"{exc} (after {exc.items} items)")
                    count = exc.items
                except OSError as exc:  # not read: it goes the way of the other files (never pruned)
                    result.problems.append(f"{rel}: cannot read ({exc.strerror or exc}): treated as other files")
                    unread.add(rel)
                    rest.append((rel, _st))
                    continue
                result.items.append((rel, count))
                begun = link[1] if link is not None else start
                if begun > 0:
                    result.appended[rel] = begun
                spool.flush()
            os.fsync(spool.fileno())
    rest.sort(key=lambda entry: entry[0])
    crawlee = item_globs is None and any(_CRAWLEE_DATASET.match(rel) for rel in item_set)
    if crawlee:  # one line for a dataset of many files
        total = sum(count for _, count in result.items)
        result.items = [(f"storage/datasets/ ({len(item_set)} file{'' if len(item_set) == 1 else 's'})", total)]
    shipped: list[tuple[str, os.stat_result]] = []
    kept: list[tuple[str, os.stat_result]] = []
    used = 0
    for rel, st in rest:
        if (artifact_globs is not None and not any(match_glob(rel, g) for g in artifact_globs)) or not master_takes_artifacts or used + st.st_size > budget_bytes:
            kept.append((rel, st))
        else:
            used += st.st_size
            shipped.append((rel, st))
    if kept:
        if not master_takes_artifacts:
            result.kept_why = "the master does not take artifacts"
        elif any(artifact_globs is None or any(match_glob(rel, g) for g in artifact_globs) for rel, _ in kept):
            result.kept_why = f"over the artifact budget of {format_bytes(budget_bytes)}"
        else:
            result.kept_why = "not named by outputs.artifacts"
    adopted = False
    if shipped and not os.path.lexists(task_dir / ARTIFACTS_DIR):
        # One rename moves the whole working copy (10,000 files cost no more than one); what is not an
        # artifact is deleted from it below (the code's files: a handful, not the task's output). (A
        # rename never follows a link at its target: one the spider planted meanwhile fails it.)
        try:
            os.rename(work, task_dir / ARTIFACTS_DIR)
            adopted = True
        except OSError:
            adopted = False
    source, prefix = (task_dir, f"{ARTIFACTS_DIR}/") if adopted else (work, "")
    for rel, _st in shipped:
        try:
            if not adopted:
                beneath.move(work, rel, task_dir, f"{ARTIFACTS_DIR}/{rel}")
            digest, size = hash_file(task_dir, f"{ARTIFACTS_DIR}/{rel}")
        except OSError as exc:
            result.problems.append(f"{rel}: cannot collect ({exc.strerror or exc})")
            continue
        result.artifacts.append(ArtifactRef(path=rel, size_bytes=size, sha256=digest))
    for rel, _st in kept:
        try:
            moved = keep(source, prefix + rel, keep_dir, rel)
        except OSError as exc:
            result.problems.append(f"{rel}: cannot keep ({exc.strerror or exc})")
            continue
        result.kept.append((rel, moved.st_size))
    if result.kept:
        result.kept_dir = keep_dir
    if adopted:
        prune(task_dir / ARTIFACTS_DIR, others + [rel for rel, _ in item_files if rel not in unread])
    if result.artifacts or result.kept:
        write_manifest(task_dir, {"artifacts": [a.to_json() for a in result.artifacts], "keepDir": str(keep_dir)})
    return result
