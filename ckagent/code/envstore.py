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

**Read-only for spiders.** A build runs as the node's builder in a directory only it may enter
(ckagent.code.builder); :func:`mark_ready` seals the finished environment (root's, or the agent's where
it is not root, no write bit anywhere) and writes the marker last, saying who built it and that it is
sealed: a ready environment is a sealed one (:func:`is_ready` also checks the top's owner and mode).
An environment made by an older agent — built as root, or as the one ``task.run_as_user``, and
writable by spiders all along — has no ``sealed`` in its marker: no key of today names it (the
builder is part of the key), and collection removes it as soon as no task uses it (a task re-adopted
after the upgrade may still run in it), whatever the budget, with one log line. It is not re-owned
instead: a spider could have written into it, and sealing would keep what it wrote.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ckagent.code.builder import StillWritten, remove_tree, seal, seal_top, sealed_by, writers
from ckagent.node.procid import kill_each

log = logging.getLogger(__name__)

MARKER = ".ckagent-env.json"
"""Written into an environment when its build succeeded and it is sealed: ``{"key", "kind", "sizeBytes",
"builtAt", "builder", "sealed": true}``."""


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
        """Remove least recently used ready environments over the budget, abandoned builds and
        environments of older agents (not sealed: see module docstring).

        Returns the removed paths. Blocking work runs in one worker thread; never raises for a
        file that vanished meanwhile. Cancellation: the thread finishes its pass.
        """
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


def is_ready(env_dir: Path, key: str, owner: tuple[int, int] | None = None) -> bool:
    """True when ``env_dir`` holds a finished, sealed build of ``key`` (sealed for ``owner`` when given:
    ckagent.code.builder.sealed_by); its marker is touched (last use)."""
    marker = read_marker(env_dir)
    if marker is None or marker.get("key") != key or marker.get("sealed") is not True:
        return False
    if owner is not None and not sealed_by(env_dir, owner):
        return False
    try:
        os.utime(env_dir / MARKER)
    except OSError:
        return False
    return True


def start_build(env_dir: Path) -> None:
    """Remove what a failed or interrupted build of this environment left (a sealed one too) and create
    it empty, mode 0700 (the caller gives it to the builder)."""
    if env_dir.exists() or env_dir.is_symlink():
        remove_tree(env_dir)
    env_dir.parent.mkdir(parents=True, exist_ok=True)
    env_dir.mkdir(mode=0o700)
    os.chmod(env_dir, 0o700)


def mark_ready(env_dir: Path, key: str, kind: str, *, owner: tuple[int, int], builder: str,
               builder_uid: int | None = None) -> int:
    """The last step of a build: seal ``env_dir`` for ``owner`` (ckagent.code.builder.seal), then write
    the marker (``builder``: who built it), then make the top read-only. ``builder_uid``: a uid of
    the builder's own, whose processes must hold no file of it open for writing once it is sealed
    (ckagent.code.builder.writers: one that does is killed and the environment is not marked: its
    box should have been emptied, so something outlived it). Returns the environment's size in bytes.
    Raises OSError (StillWritten)."""
    sealed = seal(env_dir, owner, top=False)
    if builder_uid is not None and (held := writers(env_dir, builder_uid)):
        kill_each(held)  # each proven first: never a later owner of a pid the scan saw
        raise StillWritten(errno.EBUSY, f"process(es) {', '.join(str(p.pid) for p in held)} of the builder "
                                        f"(uid {builder_uid}) "
                                        f"still held files of {env_dir.name} open for writing after the install "
                                        "ended: killed, and the environment is not used (it is built again)")
    tmp = env_dir / (MARKER + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
    try:
        os.write(fd, json.dumps({"key": key, "kind": kind, "sizeBytes": sealed.size_bytes, "builtAt": time.time(),
                                 "builder": builder, "sealed": True}).encode())
        os.fchmod(fd, 0o444)
    finally:
        os.close(fd)
    os.replace(tmp, env_dir / MARKER)
    seal_top(env_dir, owner)
    return sealed.size_bytes


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
    """Keep the ready environments under ``root`` within ``budget_bytes`` (0: no bound; blocking; see
    EnvStore.collect).

    Abandoned builds (no marker, untouched for ABANDONED_AGE seconds, not protected) and environments
    of older agents (a marker without ``sealed``: see module docstring) go first, whatever the
    budget; then ready environments, least recently used (marker mtime) first, until the rest fits.
    A protected path (``protected(path)`` true, asked right before its removal) is never removed,
    even if the budget stays exceeded.
    """
    is_protected = protected.__contains__ if isinstance(protected, set) else protected
    now = time.time() if now is None else now
    removed: list[Path] = []
    legacy: list[str] = []
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
                remove_tree(entry)
                removed.append(entry)
            continue
        if marker.get("sealed") is not True:
            if not is_protected(entry):
                remove_tree(entry)
                removed.append(entry)
                legacy.append(entry.name)
            continue
        try:
            used = (entry / MARKER).stat().st_mtime
        except OSError:
            continue
        size = marker.get("sizeBytes")
        ready.append((used, size if isinstance(size, int) else 0, entry))
    if legacy:
        log.info("removed %d environment(s) an older agent built and spiders could write (%s): environments are "
                 "built by the node's builder and sealed read-only now; each spider's is rebuilt at its next task",
                 len(legacy), ", ".join(sorted(legacy)[:10]) + (" …" if len(legacy) > 10 else ""))
    total = sum(size for _, size, _ in ready)
    for _used, size, entry in sorted(ready):
        if budget_bytes <= 0 or total <= budget_bytes:
            break
        if is_protected(entry):
            continue
        log.info("removing dependency environment %s (%d bytes, least recently used; budget %d bytes)",
                 entry.name, size, budget_bytes)
        remove_tree(entry)
        removed.append(entry)
        total -= size
    return removed

