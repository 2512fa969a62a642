"""Content-addressed dependency environments under one root: built once, shared, collected.

An environment (a Python virtualenv, a Node ``node_modules`` install) lives in
``root/<kind>-<key[:24]>/``, where ``key`` hashes everything that determines it — the dependency
files, the interpreter's path and version, the framework's default packages, the identity it runs
as (ckagent.code.deps computes it). Spiders whose projects declare the same dependencies share one
environment; whatever changes the key builds a new one beside the old, so an environment is never
modified after it is ready (a relaxed pin or a removed package takes effect because the new key
starts from nothing: sync semantics without a sync step)::

    absent → building (under its key's lock; no marker yet) → ready (marker written last, with
    its size in bytes) → in use (counted while a task runs with it; the marker's mtime is the last
    use) → collected (least recently used first, when the ready ones exceed the budget; never one
    in use or being built)

A directory without a marker is a build that failed or was interrupted: the next build of its key
removes it first, and so does collection. The blocking helpers (:func:`is_ready`,
:func:`mark_ready`, :func:`collect`) stat, read and delete files: call them through
``trio.to_thread``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio

log = logging.getLogger(__name__)

MARKER = ".ckagent-env.json"
"""Written into an environment when its build succeeded: ``{"key", "kind", "sizeBytes", "builtAt"}``."""


@dataclass
class Prepared:
    """The outcome of :meth:`ckagent.code.deps.Dependencies.prepare`: what to put first on PATH and extra env vars.

    ``notes`` are lines for the task log (e.g. a node version warning); ``seconds`` the time taken;
    ``env_dir`` the environment the task uses (hand the object back to ``Dependencies.release``).
    """

    path_prefix: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cache_hit: bool = True
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    env_dir: Path | None = None


@dataclass
class Checked:
    """What a blocking look before the install phase found (:meth:`ckagent.code.deps.Dependencies.check`,
    in the task's prepare hop): the environment ``env_dir`` (already marked in use, so collection
    cannot take it between the look and the install), whether it is ``ready``, the builder's
    ``plan`` for it, the look's ``seconds``; or the ``error`` it met (raised by the install phase).

    Hand it to ``Dependencies.prepare`` (which takes the mark over) or :meth:`drop` it.
    """

    env_dir: Path | None = None
    ready: bool = False
    plan: object = None
    seconds: float = 0.0
    error: Exception | None = None
    store: EnvStore | None = None

    def take(self) -> Path:
        """The marked environment, now the caller's to release (raises the look's error, if any)."""
        if self.error is not None:
            raise self.error
        assert self.env_dir is not None, "a Checked taken twice"
        env_dir, self.env_dir = self.env_dir, None
        return env_dir

    def drop(self) -> None:
        """Not used after all (the task ended before its install): its environment's mark is dropped."""
        if self.env_dir is not None and self.store is not None:
            self.store.release(self.env_dir)
            self.env_dir = None


class EnvStore:
    """The environments under ``root``: per-key build locks and in-use counts (one agent per root).

    ``budget_bytes``: ready environments beyond this total are collected, least recently used
    first (0 = keep everything).
    """

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self._locks: dict[str, trio.Lock] = {}
        self._in_use: Counter[Path] = Counter()
        self._building: set[Path] = set()
        self._guard = threading.Lock()  # in-use counts change in a task's prepare hop too (never held long)

    def path(self, kind: str, key: str) -> Path:
        """Where the environment of ``kind`` (``py``, ``node``) with ``key`` (hex digest) lives."""
        return self.root / f"{kind}-{key[:24]}"

    def lock(self, key: str) -> trio.Lock:
        """The lock held while the environment of ``key`` is checked or built (one build per key)."""
        return self._locks.setdefault(key, trio.Lock())

    def building(self, path: Path) -> _Building:
        """Context manager marking ``path`` as being built (collection leaves it alone)."""
        return _Building(self._building, path)

    def acquire(self, path: Path) -> None:
        """A task runs with the environment at ``path``: collection skips it until :meth:`release`.
        Thread-safe (a task's prepare hop marks its environment before it checks it)."""
        with self._guard:
            self._in_use[path] += 1

    def release(self, path: Path) -> None:
        """The task that used ``path`` finished (idempotent per acquire). Thread-safe."""
        with self._guard:
            self._in_use[path] -= 1
            if self._in_use[path] <= 0:
                del self._in_use[path]

    @contextlib.contextmanager
    def using(self, env_dir: Path, prepared: Prepared, *, marked: bool = False) -> Iterator[None]:
        """Mark ``env_dir`` in use before it is checked or built (collection never takes it from under
        a starting task; ``marked``: the caller has marked it already); on success it is
        ``prepared.env_dir``, on any failure the mark is dropped."""
        if not marked:
            self.acquire(env_dir)
        ok = False
        try:
            yield
            ok = True
        finally:
            if ok:
                prepared.env_dir = env_dir
            else:
                self.release(env_dir)

    def is_protected(self, path: Path) -> bool:
        """Whether collection must leave ``path`` alone now (in use or being built).

        Read from the collection thread right before each removal: a task marks its environment in
        use *before* checking that it is ready, so a removal and a new use never cross.
        """
        with self._guard:
            return path in self._in_use or path in self._building

    async def collect(self) -> list[Path]:
        """Remove least recently used ready environments over the budget, and abandoned builds.

        Returns the removed paths. Blocking work runs in one worker thread; never raises for a
        file that vanished meanwhile. Cancellation: the thread finishes its pass.
        """
        if self.budget_bytes <= 0:
            return []
        return await trio.to_thread.run_sync(collect, self.root, self.budget_bytes, self.is_protected)


class _Building:
    def __init__(self, building: set[Path], path: Path) -> None:
        self._building = building
        self._path = path

    def __enter__(self) -> None:
        self._building.add(self._path)

    def __exit__(self, *exc: object) -> None:
        self._building.discard(self._path)


def read_marker(env_dir: Path) -> dict[str, object] | None:
    """The marker of a ready environment, or None (absent, unreadable: not ready)."""
    try:
        data = json.loads((env_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_ready(env_dir: Path, key: str) -> bool:
    """True when ``env_dir`` holds a finished build of ``key``; its marker is touched (last use)."""
    marker = read_marker(env_dir)
    if marker is None or marker.get("key") != key:
        return False
    try:
        os.utime(env_dir / MARKER)
    except OSError:
        return False
    return True


def start_build(env_dir: Path) -> None:
    """Remove what a failed or interrupted build of this environment left and create it empty."""
    if env_dir.exists() or env_dir.is_symlink():
        shutil.rmtree(env_dir, ignore_errors=True)
    env_dir.mkdir(parents=True, exist_ok=True)


def mark_ready(env_dir: Path, key: str, kind: str) -> int:
    """Write the marker (last step of a build); returns the environment's size in bytes."""
    size = dir_size_bytes(env_dir)
    tmp = env_dir / (MARKER + ".tmp")
    tmp.write_text(json.dumps({"key": key, "kind": kind, "sizeBytes": size, "builtAt": time.time()}))
    os.replace(tmp, env_dir / MARKER)
    return size


def dir_size_bytes(path: Path) -> int:
    """Bytes allocated to the regular files under ``path`` (hard links counted once; symlinks not followed)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


ABANDONED_AGE = 3600.0
"""Seconds after which a directory without a marker counts as an abandoned build (collection removes it)."""


def collect(root: Path, budget_bytes: int, protected: Callable[[Path], bool] | set[Path],
            now: float | None = None) -> list[Path]:
    """Keep the ready environments under ``root`` within ``budget_bytes`` (blocking; see EnvStore.collect).

    Abandoned builds (no marker, untouched for ABANDONED_AGE seconds, not protected) go first; then
    ready environments, least recently used (marker mtime) first, until the rest fits. A protected
    path (``protected(path)`` true, asked right before its removal) is never removed, even if the
    budget stays exceeded.
    """
    is_protected = protected.__contains__ if isinstance(protected, set) else protected
    now = time.time() if now is None else now
    removed: list[Path] = []
    ready: list[tuple[float, int, Path]] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir() or entry.is_symlink():
            continue
        marker = read_marker(entry)
        if marker is None:
            try:
                idle = now - entry.stat().st_mtime
            except OSError:
                continue
            if idle > ABANDONED_AGE and not is_protected(entry):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
            continue
        try:
            used = (entry / MARKER).stat().st_mtime
        except OSError:
            continue
        size = marker.get("sizeBytes")
        ready.append((used, size if isinstance(size, int) else 0, entry))
    total = sum(size for _, size, _ in ready)
    for _used, size, entry in sorted(ready):
        if total <= budget_bytes:
            break
        if is_protected(entry):
            continue
        log.info("removing dependency environment %s (%d bytes, least recently used; budget %d bytes)",
                 entry.name, size, budget_bytes)
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
        total -= size
    return removed

