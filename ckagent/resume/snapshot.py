"""Pack a snapshot dir into a checkpoint's manifest and chunks, incrementally, without trusting the dir.

The spider writes ``<task_dir>/snapshots/N/`` (a copy of its state dir) and owns it: it can plant
symlinks (to ``/etc/shadow``, to the agent's ``state.db``), FIFOs, device files, another owner's hard
links, sparse files of a terabyte, trees a thousand levels deep, names with newlines or bytes that are
not UTF-8, and it can change a file while the agent reads it. The agent may be root. So :func:`pack`:

- **walks by descriptors** from the top (opened ``O_NOFOLLOW``; ckagent.node.beneath): each directory is
  opened from the top one component at a time, ``O_NOFOLLOW``; each file ``O_NOFOLLOW | O_NONBLOCK``
  relative to its directory's descriptor and used only when ``fstat`` on that descriptor says a regular
  file (:func:`ckagent.node.beneath.check_regular`: another owner's hard link is refused). No link is
  ever followed, a FIFO never blocks, a device is never opened;
- **skips** what is not a regular file or a directory (symlinks, FIFOs, sockets, devices, another
  owner's hard link), names that are not UTF-8 (the manifest is JSON text) and paths over
  :data:`~ckagent.master.protocol.checkpoints.MAX_PATH_CHARS`, and says so in **one** line per pack
  naming the first few (``Packed.skipped``);
- **bounds** the total size (``PackLimits.max_bytes``: the task's disk limit; decided on ``lstat``
  before a byte is read, so a sparse terabyte is refused unread), the number of entries and the depth:
  over a bound the pack fails (:class:`PackError`) — a partial state would resume wrongly;
- **reads a file consistently**: ``fstat`` before and after; a file that changed while read is read
  again (twice), then the pack fails.

Chunks: each file is cut at multiples of ``CHUNK_BYTES`` (1 MiB); a chunk is named by the sha256 of its
raw bytes and sent gzip-compressed (level 1, ``mtime`` 0: the same bytes give the same gzip). Chunks in
``known`` (the master holds them: the restored checkpoint's, every earlier upload's) are not sent again:
an append-only file (Scrapy's ``requests.seen``) re-sends only its last, partial chunk and what grew.
The chunks to send are compressed while packing and kept in memory up to ``PackLimits.cache_bytes``;
beyond that (and after an agent restart) :func:`read_chunk` reads one again from the snapshot and
checks its sha256 — a snapshot changed after it was packed fails that checkpoint, never ships bytes
that do not match their name.

Errors::

    PackError   the snapshot cannot be packed: its top missing or a link, over a bound, a file that kept
                changing, a read error, a chunk that no longer matches (the message says which and why)

Every function here blocks (system calls, hashing, compression): run it in ``trio.to_thread``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import zlib
from collections.abc import Iterator, Set
from dataclasses import dataclass, field
from pathlib import Path

from ckagent.master.protocol.checkpoints import CHUNK_BYTES, MAX_FILES, MAX_PATH_CHARS, CheckpointFile
from ckagent.node import beneath

__all__ = ["GZIP_LEVEL", "ChunkAt", "PackError", "PackLimits", "Packed", "chunk_places", "gzip_chunk", "pack",
           "read_chunk"]

GZIP_LEVEL = 1
"""gzip level of a chunk on the wire (the protocol's): fast; a JOBDIR's hex fingerprints still halve."""
MAX_DEPTH = 64
"""Directory levels below the snapshot's top a pack enters (deeper: PackError)."""
CACHE_BYTES = 64 << 20
"""Compressed chunks kept in memory after a pack for the upload that follows (the rest is read again)."""
SHOWN_SKIPPED = 5
"""Skipped entries named in the one line a pack logs (the count says the rest)."""
_READS = 3
"""Times a file that changed while read is read before the pack fails."""
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PackError(Exception):
    """The snapshot cannot be packed (see module docstring); the message says which entry and why."""


@dataclass(frozen=True)
class PackLimits:
    """Bounds of one pack. ``max_bytes``: the files' total size (the task's disk limit, or the node's
    setting); ``max_files``: entries (files and directories; the protocol's bound); ``max_depth``:
    directory levels; ``cache_bytes``: compressed chunks kept in memory for the upload."""

    max_bytes: int
    max_files: int = MAX_FILES
    max_depth: int = MAX_DEPTH
    cache_bytes: int = CACHE_BYTES


@dataclass(frozen=True)
class ChunkAt:
    """Where a chunk's bytes are: ``length`` bytes at ``offset`` of the file ``path`` (relative)."""

    path: str
    offset: int
    length: int


@dataclass
class Packed:
    """What :func:`pack` made: the manifest's ``files`` (sorted by path; directories as ``type`` "dir"),
    ``size_bytes`` (the files' total), ``new`` (the chunks not in ``known``, by sha256, in file order:
    where to read each), ``gz`` (the compressed bytes of those kept in memory), ``packed_bytes`` (the
    compressed size of every new chunk: what this checkpoint sends), ``skipped`` (one text per entry
    left out, e.g. ``"'a' (a symlink)"``)."""

    files: list[CheckpointFile] = field(default_factory=list)
    size_bytes: int = 0
    new: dict[str, ChunkAt] = field(default_factory=dict)
    gz: dict[str, bytes] = field(default_factory=dict)
    packed_bytes: int = 0
    skipped: list[str] = field(default_factory=list)

    def skipped_line(self) -> str | None:
        """The one line saying what was left out (None: nothing)."""
        if not self.skipped:
            return None
        shown = ", ".join(self.skipped[:SHOWN_SKIPPED])
        more = f" and {len(self.skipped) - SHOWN_SKIPPED} more" if len(self.skipped) > SHOWN_SKIPPED else ""
        return (f"{len(self.skipped)} entr{'y' if len(self.skipped) == 1 else 'ies'} of the snapshot left out "
                f"(only regular files and directories travel): {shown}{more}")


def gzip_chunk(data: bytes) -> bytes:
    """A chunk as the wire carries it: gzip (one member, no name, mtime 0) at level :data:`GZIP_LEVEL`,
    deterministic. A small chunk gets a window and a state no larger than it needs: zlib's full state
    (256 KiB) costs 100 µs to set up, 20 times the compression of a 10-byte file."""
    size = len(data)
    bits, level = (15, 8) if size >= 1 << 15 else (max(9, size.bit_length()), 1 if size < 4096 else 8)
    deflate = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + bits, level)
    return deflate.compress(data) + deflate.flush()


def chunk_places(files: list[CheckpointFile]) -> Iterator[tuple[str, ChunkAt]]:
    """(sha256, where) of every chunk of ``files``, in order (a sha may come more than once)."""
    for entry in files:
        for index, sha in enumerate(entry.chunks):
            offset = index * CHUNK_BYTES
            yield sha, ChunkAt(entry.path, offset, min(CHUNK_BYTES, entry.size - offset))


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a byte that is not UTF-8 (os.fsdecode's surrogate escape)
        return False
    return True


class _Packer:
    def __init__(self, topfd: int, known: Set[str], limits: PackLimits) -> None:
        self.topfd = topfd
        self.owner = os.fstat(topfd).st_uid
        self.known = known
        self.limits = limits
        self.out = Packed()
        self.entries = 0
        self.cached = 0

    def count(self, rel: str) -> None:
        self.entries += 1
        if self.entries > self.limits.max_files:
            raise PackError(f"more than {self.limits.max_files} files and directories (at {rel!r}); not packed")

    def walk(self) -> None:
        pending: list[tuple[str, int]] = [("", 0)]  # (rel dir: "" or "a/b/", depth); depth-first
        while pending:
            rel_dir, depth = pending.pop()
            try:
                fd = beneath.open_dir(self.topfd, rel_dir.rstrip("/") or None)
            except (FileNotFoundError, beneath.NotBeneath) as exc:  # gone, or swapped for a link meanwhile
                self.out.skipped.append(f"{rel_dir!r} ({exc.strerror or 'changed while read'})")
                continue
            except OSError as exc:
                raise PackError(f"{rel_dir!r}: cannot open: {exc}") from exc
            try:
                subdirs = self.directory(fd, rel_dir, depth)
            finally:
                os.close(fd)
            pending.extend((sub, depth + 1) for sub in reversed(subdirs))

    def directory(self, fd: int, rel_dir: str, depth: int) -> list[str]:
        """Pack the files of one directory; returns its subdirectories' rel paths (sorted)."""
        with os.scandir(fd) as found:
            names = sorted(entry.name for entry in found)
        subdirs = []
        for name in names:
            rel = rel_dir + name
            if not _utf8(rel):
                self.out.skipped.append(f"{rel!r} (a name that is not UTF-8)")
                continue
            if len(rel) > MAX_PATH_CHARS:
                self.out.skipped.append(f"{rel[:60]!r}… (a path over {MAX_PATH_CHARS} characters)")
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if depth + 1 > self.limits.max_depth:
                    raise PackError(f"{rel!r}: more than {self.limits.max_depth} directory levels; not packed")
                self.count(rel)
                self.out.files.append(CheckpointFile(rel, "dir", 0, stat.S_IMODE(st.st_mode) & 0o777, []))
                subdirs.append(rel + "/")
            elif stat.S_ISREG(st.st_mode):
                self.count(rel)
                self.file(fd, name, rel, st)
            else:
                self.out.skipped.append(f"{rel!r} ({_kind(st.st_mode)})")
        return subdirs

    def budget(self, rel: str, size: int) -> None:
        if self.out.size_bytes + size > self.limits.max_bytes:
            raise PackError(f"{rel!r}: the snapshot holds more than {self.limits.max_bytes} bytes "
                            f"(the task's disk limit); not packed")

    def file(self, dirfd: int, name: str, rel: str, st: os.stat_result) -> None:
        self.budget(rel, st.st_size)  # on lstat: a sparse terabyte is refused unread
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dirfd)
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR):  # swapped meanwhile
                self.out.skipped.append(f"{rel!r} (changed into something else while read)")
                return
            raise PackError(f"{rel!r}: cannot open: {exc}") from exc
        try:
            try:
                beneath.check_regular(os.fstat(fd), self.owner, rel)
            except beneath.NotBeneath as exc:
                self.out.skipped.append(f"{rel!r} ({str(exc.strerror).removeprefix(rel + ': ')})")
                return
            for _ in range(_READS):
                read = self.read(fd, rel)
                if read is not None:
                    size, mode, chunks = read
                    break
            else:
                raise PackError(f"{rel!r}: changed every time it was read ({_READS} times); not packed")
        finally:
            os.close(fd)
        self.out.files.append(CheckpointFile(rel, "file", size, mode, [sha for sha, _, _ in chunks]))
        self.out.size_bytes += size
        for sha, offset, data in chunks:
            if data is not None:
                self.keep(sha, ChunkAt(rel, offset, len(data)), data)

    def read(self, fd: int, rel: str) -> tuple[int, int, list[tuple[str, int, bytes | None]]] | None:
        """One consistent read of a file: (size, mode, [(sha, offset, bytes of a new chunk or None)]), or None
        when it changed meanwhile (size or times)."""
        before = os.fstat(fd)
        size = before.st_size
        self.budget(rel, size)
        chunks: list[tuple[str, int, bytes | None]] = []
        for offset in range(0, size, CHUNK_BYTES):
            try:
                data = os.pread(fd, min(CHUNK_BYTES, size - offset), offset)
            except OSError as exc:
                raise PackError(f"{rel!r}: cannot read: {exc}") from exc
            if len(data) != min(CHUNK_BYTES, size - offset):
                return None  # truncated meanwhile
            sha = hashlib.sha256(data).hexdigest()
            chunks.append((sha, offset, None if sha in self.known or sha in self.out.new else data))
        after = os.fstat(fd)
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (size, before.st_mtime_ns, before.st_ctime_ns):
            return None
        return size, stat.S_IMODE(after.st_mode) & 0o777, chunks

    def keep(self, sha: str, at: ChunkAt, data: bytes) -> None:
        if sha in self.out.new:  # the same bytes twice in one snapshot
            return
        self.out.new[sha] = at
        gz = gzip_chunk(data)
        self.out.packed_bytes += len(gz)
        if self.cached + len(gz) <= self.limits.cache_bytes:
            self.out.gz[sha] = gz
            self.cached += len(gz)


def pack(snapshot_dir: Path | int, known: Set[str], limits: PackLimits) -> Packed:
    """Pack the snapshot dir (see module docstring): its manifest files, the chunks not in ``known``
    (sha256 hex of chunks the master holds), their compressed bytes (kept up to the cache bound).
    ``snapshot_dir``: a path whose every component is the agent's but the last (opened ``O_NOFOLLOW``),
    or a descriptor of it the caller opened beneath its task dir (``beneath.open_dir``). Blocking.
    Raises PackError."""
    try:
        topfd = os.dup(snapshot_dir) if isinstance(snapshot_dir, int) else beneath.open_top(snapshot_dir)
    except OSError as exc:
        raise PackError(f"{snapshot_dir}: cannot open the snapshot: {exc}") from exc
    try:
        packer = _Packer(topfd, known, limits)
        packer.walk()
        packer.out.files.sort(key=lambda f: f.path)
        return packer.out
    finally:
        os.close(topfd)


def read_chunk(snapshot_dir: Path | int, at: ChunkAt, sha: str) -> bytes:
    """The raw bytes of one chunk, read again from the snapshot (a path or descriptor, as :func:`pack`'s;
    by descriptors below it) and checked against ``sha``. Blocking. Raises PackError (gone, not a regular file any more, or other
    bytes: the snapshot changed after it was packed)."""
    try:
        fd = beneath.open_file(snapshot_dir, at.path)
    except OSError as exc:
        raise PackError(f"{at.path!r}: cannot read it again: {exc}") from exc
    try:
        with contextlib.suppress(OSError):
            data = os.pread(fd, at.length, at.offset)
            if len(data) == at.length and hashlib.sha256(data).hexdigest() == sha:
                return data
    finally:
        os.close(fd)
    raise PackError(f"{at.path!r}: changed after it was packed (the chunk at {at.offset} is not {sha[:12]}…)")
