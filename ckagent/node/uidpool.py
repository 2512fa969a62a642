"""The ``spider-uids`` level's uids: which ids of ``task.spider_uids`` are free, and the allocator that hands
one to each spider (and one to the node's builder), records it in the state store and, when the range
is used up, releases the least recently used idle spider's (ckagent.node.identity says when and why).

A uid is free for a new holder when no holder has it, /etc/passwd and /etc/group (read at start) do not
name it, the passwd/group database (NSS: LDAP, systemd's dynamic users) and systemd's dynamic-uid
registry do not know it, no process runs as it, and no other agent on this host claimed it
(ckagent.node.uidclaims: a uid is claimed there before the state store records it, and unclaimed when
it is released). At start the pool claims again the uids its state store holds: one another live work
dir claims is given up (a warning names both work dirs) and its holder gets another at its next use
(its files are given to that one then: ckagent.code.workcopy.spider_dirs, the builder's ``own``).
Blocking throughout (files, /proc, the state store).
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ckagent.node.configvalues import UidRange
from ckagent.node.levels import Blocker, LevelError
from ckagent.node.procid import ProcessIdentity, identities_by_uid, kill_each
from ckagent.node.state import StateStore
from ckagent.node.stateids import IdentityRecord
from ckagent.node.uidclaims import UidClaims

__all__ = ["BUILDER", "SPIDER", "Census", "IdentityError", "SpiderDirs", "UidPool", "UidsExhausted", "census_of",
           "first_unknown_uid", "ids_in", "uids_of_processes"]

log = logging.getLogger("ckagent.node.identity")  # one logger for the identity lines (the start's, the releases)

SYSTEMD_DYNAMIC_UIDS = Path("/run/systemd/dynamic-uid")
"""systemd's registry of the uids it gave to ``DynamicUser=yes`` services (one entry per uid)."""

SPIDER = "spider"
BUILDER = "builder"
"""The ``kind`` of a state store identity record: a spider's (``name`` its id) or the builder's (``name`` "")."""


class IdentityError(LevelError):
    """An identity level that cannot be had here (ckagent.node.identity's exception tree)."""


class UidsExhausted(IdentityError):
    """Every uid of ``task.spider_uids`` is held and none can be released: a new spider cannot run here."""


SpiderDirs = Callable[[str], tuple[Path, Path]]
"""A spider id → its ``(spider-data, spider-home)`` dirs (the task wing names them: ckagent.code.workcopy)."""


def ids_in(path: Path) -> set[int]:
    """The ids (third field) of a passwd- or group-format file; empty when it cannot be read."""
    found: set[int] = set()
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return found
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[2].strip().isdigit():
            found.add(int(fields[2]))
    return found


def _known_to_nss(uid: int) -> bool:
    """A user or group of that number exists for the system (NSS: files, LDAP, systemd's dynamic users)."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except (KeyError, OverflowError):
            pass
    return False


def uids_of_processes() -> dict[int, list[ProcessIdentity]]:
    """Real and effective uids of every process → the processes' identities (one psutil scan:
    ckagent.node.procid). A kill proves each first (``procid.kill_each``). Blocking."""
    return identities_by_uid()


@dataclass(frozen=True)
class Census:
    """The range at start: its ids named by /etc/passwd or /etc/group (``taken``)."""

    uids: UidRange
    taken: frozenset[int]

    @property
    def usable(self) -> int:
        return len(self.uids) - len(self.taken)


def census_of(uids: UidRange, passwd: Path, group: Path) -> Census:
    """The range and its ids named by the passwd and group files."""
    taken = {uid for uid in ids_in(passwd) | ids_in(group) if uid in uids}
    return Census(uids, frozenset(taken))


class UidPool:
    """The spider-uids level's allocator over the state store (see module docstring). ``claims``: the
    host-wide record of claimed uids (None: this store's holders only). Thread-safe. Raises OSError
    when a claim of the store's uids cannot be written."""

    def __init__(self, store: StateStore, census: Census, dirs_of: SpiderDirs, retention: float,
                 busy: Callable[[], Iterable[str]], claims: UidClaims | None = None) -> None:
        self.store = store
        self.census = census
        self.dirs_of = dirs_of
        self.retention = retention
        self.busy = busy
        self.claims = claims
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], int] = {}
        for record in store.identities():
            other = claims.claim(record.uid) if claims is not None and self._valid(record.uid) else None
            if other is not None:  # another agent on this host handed it out too: theirs; ours gets another
                assert claims is not None
                self.store.release_identity(record.kind, record.name)
                log.warning("identity: %s %r held uid %d, which %s also claims (two agents on this host handed "
                            "it out); this agent (work dir %s) gives it up: the %s gets another uid at its next "
                            "use (its files are given to that one then)", record.kind, record.name, record.uid,
                            other.describe(), claims.work_dir, record.kind)
            elif self._valid(record.uid):
                self._held[(record.kind, record.name)] = record.uid
            else:  # out of today's range, or a real user's now: a new one at its next use
                self.store.release_identity(record.kind, record.name)
                if claims is not None:
                    claims.unclaim(record.uid)
                log.warning("identity: %s %r held uid %d, which %s; it gets another uid at its next task (its "
                            "files are given to that one then)", record.kind, record.name, record.uid,
                            "is outside task.spider_uids now" if record.uid not in census.uids
                            else "/etc/passwd or /etc/group names now")
        if claims is not None:  # claimed for this work dir, held by none in its store (a crash between): free
            for uid in claims.ours() - set(self._held.values()):
                claims.unclaim(uid)
                log.info("identity: uid %d was claimed for work dir %s but is held by none of its spiders: "
                         "unclaimed", uid, claims.work_dir)

    def _valid(self, uid: int) -> bool:
        return uid in self.census.uids and uid not in self.census.taken

    def held(self) -> dict[tuple[str, str], int]:
        """``{(kind, name): uid}`` of every holder."""
        with self._lock:
            return dict(self._held)

    def free(self) -> int:
        """Uids of the range no holder has and /etc/passwd and /etc/group do not name."""
        with self._lock:
            return self.census.usable - len(self._held)

    def counts(self) -> tuple[int, int]:
        """(spiders holding a uid, :meth:`free`) as they stand, without waiting for an allocation in
        flight (which holds the lock through process scans, NSS lookups, a release's removals): the
        table is copied in one step under the GIL. For /status and /metrics, on the event loop."""
        held = dict(self._held)
        return sum(1 for kind, _name in held if kind == SPIDER), self.census.usable - len(held)

    def uid_of(self, kind: str, name: str) -> int:
        """The uid ``(kind, name)`` holds, handed out now when it holds none (recorded in the state
        store; ``last_used`` updated either way). Raises UidsExhausted."""
        with self._lock:
            now = time.time()
            uid = self._held.get((kind, name))
            if uid is not None:
                self.store.touch_identity(kind, name, now)
                return uid
            uid = self._next_free()
            if uid is None:
                uid = self._release_one(now)  # (a uid of this store: claimed for this work dir already)
            try:
                self.store.hold_identity(kind, name, uid, now)
            except BaseException:
                if self.claims is not None and uid not in self._held.values():
                    self.claims.unclaim(uid)
                raise
            self._held[(kind, name)] = uid
            log.info("identity: %s %r gets uid %d (%d uid(s) of task.spider_uids %s left)", kind, name, uid,
                     self.census.usable - len(self._held), self.census.uids)
            return uid

    def _next_free(self) -> int | None:
        """The lowest uid free for a new holder (see module docstring), claimed for this work dir; None when
        there is none. Under the lock. Raises OSError when a claim cannot be written."""
        held = set(self._held.values())
        running: dict[int, list[ProcessIdentity]] | None = None
        registry = _systemd_dynamic_uids()
        claims = self.claims
        for uid in self.census.uids:
            if uid in held or uid in self.census.taken or uid in registry:
                continue
            if claims is not None and claims.holder(uid) is not None:  # (read only: cheaper than NSS's lookups)
                continue
            if _known_to_nss(uid):
                continue
            if running is None:
                running = uids_of_processes()
            if uid in running:  # someone else's (a container's mapped ids, a service): not ours to give
                continue
            if claims is not None and claims.claim(uid) is not None:  # claimed by another agent since: theirs
                continue
            return uid
        return None

    def _release_one(self, now: float) -> int:
        """Release the least recently used idle spider's uid (see module docstring) and return it.
        Under the lock. Raises UidsExhausted."""
        if self.retention <= 0:
            raise UidsExhausted(self._exhausted("task.retention is 0 (keep forever), so no spider's files are "
                                                "released"), Blocker.NO_FREE_UIDS)
        busy = set(self.busy())
        for record in self.store.identities():  # least recently used first
            if record.kind != SPIDER or record.name in busy or record.last_used > now - self.retention:
                continue
            if self._release(record):
                return record.uid
        raise UidsExhausted(self._exhausted(f"every spider holding one ran a task within task.retention "
                                            f"({self.retention:g} s) or has one here now"), Blocker.NO_FREE_UIDS)

    def _exhausted(self, why: str) -> str:
        return (f"no uid of task.spider_uids ({self.census.uids}) is free for a new spider: {len(self._held)} "
                f"held, {len(self.census.taken)} named by /etc/passwd or /etc/group; {why}. Widen "
                "task.spider_uids (AGENT_TASK_SPIDER_UIDS), or lower task.retention")

    def _release(self, record: IdentityRecord) -> bool:
        """Kill what still runs as the spider's uid, remove its dirs, forget its uid. False (logged)
        when its files cannot all be removed (the uid is kept then)."""
        # What the scan found is proven before the kill (its pidfd opened, its start time checked
        # again): a process that ended since, its pid now someone else's, is never reached.
        killed = len(kill_each(uids_of_processes().get(record.uid, [])))
        removed: list[str] = []
        for path in self.dirs_of(record.name):
            if not path.exists() and not path.is_symlink():
                continue
            try:
                if path.is_symlink() or not path.is_dir():
                    path.unlink()
                else:
                    shutil.rmtree(path)
            except OSError as exc:
                log.warning("identity: cannot release uid %d of spider %r: %s is not removed (%s)", record.uid,
                            record.name, path, exc.strerror or exc)
                return False
            removed.append(str(path))
        self.store.release_identity(record.kind, record.name)
        del self._held[(record.kind, record.name)]
        idle = time.time() - record.last_used
        log.warning("identity: task.spider_uids is used up: spider %r (idle %.0f s) gives its uid %d to a new "
                    "spider; its files are removed: %s%s", record.name, idle, record.uid,
                    ", ".join(removed) or "none", f"; {killed} process(es) still running as it killed" if killed else "")
        return True


def _systemd_dynamic_uids() -> set[int]:
    """The uids systemd gave to DynamicUser services (its registry's entries are named by uid)."""
    try:
        return {int(name) for name in os.listdir(SYSTEMD_DYNAMIC_UIDS) if name.isdigit()}
    except OSError:
        return set()


def first_unknown_uid(census: Census) -> int | None:
    """The first uid of the range the system does not know (files, NSS, systemd's registry); None when
    there is none. What a check may probe as without recording anything."""
    registry = _systemd_dynamic_uids()
    for uid in census.uids:
        if uid not in census.taken and uid not in registry and not _known_to_nss(uid):
            return uid
    return None
