"""The host-wide record of the uids agents handed out at ``spider-uids``: one agent's spider never gets
a uid another agent on this host gave to one of its spiders or to its builder.

Each agent keeps its holders in its own state store (ckagent.node.uidpool); two agents on one host
with different work dirs would each hand out the lowest free uid. So every uid an agent hands out is
first *claimed* here, like systemd's ``/run/systemd/dynamic-uid`` but persistent (a uid owns files
across reboots): a directory (``task.uid_claims``, default :data:`HOST_DIR`; owned by root, mode 0700)
with one file per claimed uid, named by the uid in decimal, holding the claiming agent's work dir
(resolved) and node name::

    {"ckagent": "uid-claim/1", "workDir": "/opt/ckagent/node/data", "node": "crawler-7"}

A claim is **live** while its work dir still holds a state store (``state.db``); a claim whose work
dir is gone is **stale**: the next agent that wants the uid takes it over (one log line). Claims are
made and removed under an exclusive ``flock`` of the directory (agents on one host are serialised),
and a new entry appears whole: written to a temporary file (``O_CREAT|O_EXCL|O_NOFOLLOW``), then
linked to its name (``link`` fails when the name exists, follows no symlink).

Hostile or garbled entries: any root-level tool could leave anything here. Entries are opened without
following symlinks and without blocking (a FIFO), only regular files of at most
:data:`MAX_ENTRY_BYTES` are read; anything that is not an entry of the shape above is a claim by
someone unknown: that uid is skipped (one warning per uid), never taken over, never removed.

Blocking (a few system calls per uid): call from a worker thread. Thread-safe. Errors:
:class:`UidClaimsError` (an ``OSError``) from :class:`UidClaims` when the directory cannot be used
(not a directory, a symlink, owned by another user); a claim's write failing raises ``OSError`` from
:meth:`UidClaims.claim`; reading a garbled entry never raises.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HOST_DIR", "Claim", "UidClaims", "UidClaimsError"]

log = logging.getLogger("ckagent.node.identity")  # the identity lines' logger (ckagent.node.uidpool)

HOST_DIR = Path("/var/lib/ckagent/uids")
"""The host-wide record (``task.uid_claims``' default)."""
FORMAT = "uid-claim/1"
MAX_ENTRY_BYTES = 8192
"""A file larger than this is not an entry (an agent's own is under a few hundred bytes)."""
STATE_STORE = "state.db"
"""What makes a claim's work dir live: its state store (ckagent.node.state, in every agent's work dir)."""
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UidClaimsError(OSError):
    """The claims directory cannot be used (see the module docstring)."""


@dataclass(frozen=True)
class Claim:
    """One uid's claim: the claiming agent's ``work_dir`` (resolved) and ``node`` name; both "" for an
    entry that could not be read (a claim by someone unknown: ``unknown``)."""

    uid: int
    work_dir: str
    node: str

    @property
    def unknown(self) -> bool:
        return not self.work_dir

    def describe(self) -> str:
        """``work dir /x (node n)``, or what an unreadable entry is, for log lines."""
        if self.unknown:
            return "an entry this agent cannot read (garbled, a link, not a file)"
        return f"work dir {self.work_dir} (node {self.node or '?'})"


def parse_claim(uid: int, data: bytes) -> Claim | None:
    """An entry's bytes → Claim; None for anything else (garbage, a wrong shape or type). Never raises."""
    if len(data) > MAX_ENTRY_BYTES:
        return None
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("ckagent") != FORMAT:
        return None
    work_dir, node = obj.get("workDir"), obj.get("node", "")
    if not (isinstance(work_dir, str) and work_dir.startswith("/") and len(work_dir) <= 4096 and "\0" not in work_dir
            and isinstance(node, str) and len(node) <= 512):
        return None
    return Claim(uid, work_dir, node)


class UidClaims:
    """The claims directory as one agent sees it: ``directory`` (made when missing, mode 0700), this
    agent's ``work_dir`` (resolved here) and ``node`` name. Holds the directory open for its life
    (:meth:`close`). Raises UidClaimsError when the directory cannot be used (module docstring)."""

    def __init__(self, directory: Path, work_dir: Path, node: str) -> None:
        self.directory = directory
        self.work_dir = str(work_dir.resolve())
        self.node = node
        self._lock = threading.Lock()
        self._warned: set[int] = set()
        directory.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
        try:
            self._fd = os.open(directory, _O_DIR)
        except OSError as exc:
            raise UidClaimsError(exc.errno, f"uid claims: cannot open {directory} as a directory (a symlink or not "
                                 f"a directory?): {exc.strerror}") from exc
        st = os.fstat(self._fd)
        if st.st_uid != os.geteuid():
            os.close(self._fd)
            raise UidClaimsError(errno.EPERM, f"uid claims: {directory} is owned by uid {st.st_uid}, not this agent's "
                                 f"uid {os.geteuid()}: anyone who owns it could hide or forge claims")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(self._fd, 0o700)
            log.info("uid claims: %s made private (mode 0700, was %o)", directory, stat.S_IMODE(st.st_mode))

    def close(self) -> None:
        """Close the directory (the claims stay)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This object's lock and the host-wide flock of the directory (every agent on the host)."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _read(self, uid: int) -> Claim | None:
        """The uid's claim (None: no entry; an unknown claim for anything unreadable). Never raises."""
        try:
            fd = os.open(str(uid), _O_READ, dir_fd=self._fd)
        except FileNotFoundError:
            return None
        except OSError:  # a symlink (ELOOP), a FIFO without writer is fine (O_NONBLOCK); anything else: unknown
            return Claim(uid, "", "")
        try:
            st = os.fstat(fd)
            data = os.read(fd, MAX_ENTRY_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
            claim = parse_claim(uid, data) if stat.S_ISREG(st.st_mode) else None
        except OSError:
            claim = None
        finally:
            os.close(fd)
        return claim if claim is not None else Claim(uid, "", "")

    def _live(self, claim: Claim) -> bool:
        """Another work dir's claim still holds: unknown ones always; else while its state store exists."""
        if claim.unknown:
            return True
        try:
            os.lstat(os.path.join(claim.work_dir, STATE_STORE))
        except FileNotFoundError:
            return False
        except OSError:  # cannot tell (a permission, an I/O error): it holds
            return True
        return True

    def _warn_unknown(self, claim: Claim) -> None:
        if claim.unknown and claim.uid not in self._warned:
            self._warned.add(claim.uid)
            log.warning("uid claims: %s/%d is not a claim this agent can read (garbled, a link, not a file): "
                        "uid %d is treated as claimed by someone unknown and never handed out; remove the entry "
                        "if no one uses that uid", self.directory, claim.uid, claim.uid)

    def holder(self, uid: int) -> Claim | None:
        """Who else holds ``uid``: another work dir's live claim, or an unknown one; None when it is free
        or this agent's. Changes nothing. Never raises (a closed directory: None)."""
        with self._lock:
            if self._fd < 0:
                return None
            claim = self._read(uid)
            if claim is None or claim.work_dir == self.work_dir or not self._live(claim):
                return None
            self._warn_unknown(claim)
            return claim

    def claim(self, uid: int) -> Claim | None:
        """Claim ``uid`` for this work dir: None when it is this agent's now (a new entry, one already
        its own, or a stale one taken over: logged), else the claim that holds it (another live work
        dir's, or an unknown one; nothing changed). Raises OSError when an entry cannot be written."""
        with self._locked():
            found = self._read(uid)
            if found is not None:
                if found.work_dir == self.work_dir:
                    return None
                if self._live(found):
                    self._warn_unknown(found)
                    return found
                os.unlink(str(uid), dir_fd=self._fd)
                log.warning("uid claims: uid %d was claimed by %s, which is gone (no %s): taken over by work dir %s",
                            uid, found.describe(), STATE_STORE, self.work_dir)
            self._create(uid)
            return None

    def _create(self, uid: int) -> None:
        """Write the entry whole under a temporary name, then link it to its name (under the flock)."""
        body = json.dumps({"ckagent": FORMAT, "workDir": self.work_dir, "node": self.node}).encode() + b"\n"
        temp = f".{uid}.{secrets.token_hex(6)}.tmp"
        fd = os.open(temp, _O_NEW, 0o600, dir_fd=self._fd)
        try:
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.link(temp, str(uid), src_dir_fd=self._fd, dst_dir_fd=self._fd, follow_symlinks=False)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=self._fd)
        with contextlib.suppress(OSError):
            os.fsync(self._fd)

    def unclaim(self, uid: int) -> None:
        """Remove this work dir's claim of ``uid`` (anyone else's, or none, is left as it is). Never raises
        (a failure is logged: the uid stays claimed, so no one else gets it)."""
        with self._locked():
            found = self._read(uid)
            if found is None or found.work_dir != self.work_dir:
                return
            try:
                os.unlink(str(uid), dir_fd=self._fd)
            except OSError as exc:
                log.warning("uid claims: cannot remove the claim of uid %d (%s/%d): %s", uid, self.directory, uid,
                            exc.strerror or exc)

    def ours(self) -> set[int]:
        """The uids this work dir claims (one scan of the directory). Never raises (unreadable: empty)."""
        with self._lock:
            try:
                names = os.listdir(self._fd)
            except OSError:
                return set()
            found: set[int] = set()
            for name in names:
                if name.isdigit() and name == str(int(name)):
                    claim = self._read(int(name))
                    if claim is not None and claim.work_dir == self.work_dir:
                        found.add(int(name))
            return found
