"""Whom a task's processes run as: the node's identity level (:class:`~ckagent.node.levels.IdentityLevel`),
decided once at start, and each spider's identity under it (:class:`Identities`).

=============  ====================================================  ==================================
level          when                                                  a spider runs as
=============  ====================================================  ==================================
spider-uids    the agent is root, ``task.run_as_user`` unset, and    a uid (gid: the same number) of
               a spider's uid can reach what spiders need            its own from ``task.spider_uids``
one-user       the agent is root, ``task.run_as_user: NAME``         NAME (today's meaning)
agent-user     the agent is not root                                 the agent's own uid
root           ``task.run_as_user: root``, or a root agent where     root (a warning: log, /status,
               spider-uids cannot be had                             the page, registration)
=============  ====================================================  ==================================

``task.run_as_user`` unset is ``auto``: :func:`~ckagent.node.levels.decide` takes ``spider-uids`` when it
can be had and says why not otherwise (:class:`~ckagent.node.levels.Blocker`: not root, no free uid,
a spider's uid cannot reach the work dir, the interpreter or the SDK — checked at start by one probe
process run as a free uid), then the agent's own level (``root`` or ``agent-user``).

**Spider uids** (the allocator: ckagent.node.uidpool). Each spider gets the lowest free uid of the range
the first time it runs here; the
state store records it (:class:`~ckagent.node.state.IdentityRecord`), so it keeps it across tasks and
agent restarts. A uid is free when no other holder has it, ``/etc/passwd`` and ``/etc/group`` do not
name it (read at start; the start's line says how many are free), and, when it is handed out, neither
the passwd/group database (NSS: LDAP, systemd's dynamic users) nor systemd's dynamic-uid registry
knows it, no process runs as it and no other agent on this host claimed it (``task.uid_claims``:
ckagent.node.uidclaims, a host-wide record each uid is claimed in before it is handed out, so two
agents with different work dirs never give one uid to their spiders or builders). No passwd entry is made: HOME is the spider's ``spider-home``
dir, USER and LOGNAME ``ck-<uid>``. One more uid is recorded the same way for the node's builder
(:attr:`Identities.dedicated_builder`; installers still run as :attr:`Identities.builder`).

**When the range is used up**, a new spider takes the uid of the least recently used spider that has
no claimed task here and whose last task began more than ``task.retention`` seconds ago (its kept
files are due for removal anyway): processes still running as that uid are killed, its
``spider-data`` and ``spider-home`` dirs are removed, one log line says so. When there is none (or
``task.retention`` is 0: keep forever) the new spider's task fails with :class:`UidsExhausted`,
which says how to widen the range.

Errors::

    LevelError (ckagent.node.levels)
    └── IdentityError         a level that cannot be had here (a forced one: the start fails; an
        │                     unknown task.run_as_user, one that needs root)
        └── UidsExhausted     no uid left for a new spider (its task fails; the node goes on)

Every function here blocks (files, the state store, a probe process): call it through ``trio.to_thread``.
"""

from __future__ import annotations

import logging
import os
import pwd
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckagent.node.configvalues import UidRange
from ckagent.node.levels import Blocker, IdentityLevel, Judged, Unavailable, decide
from ckagent.node.runas import RunAs
from ckagent.node.state import StateStore
from ckagent.node.uidclaims import UidClaims
from ckagent.node.uidpool import (
    BUILDER,
    SPIDER,
    Census,
    IdentityError,
    SpiderDirs,
    UidPool,
    UidsExhausted,
    census_of,
    first_unknown_uid,
)

__all__ = ["BUILDER", "SPIDER", "Identities", "IdentityError", "UidsExhausted", "judge_identities",
           "open_identities", "runs_as_text"]

log = logging.getLogger(__name__)

PASSWD = Path("/etc/passwd")
GROUP = Path("/etc/group")

PROBE_TIMEOUT = 30.0
"""Seconds the start's reachability probe may take."""
_PROBE = (
    "import os, sys\n"
    "for path in sys.argv[1:]:\n"
    "    try:\n"
    "        os.stat(path)\n"
    "    except OSError as exc:\n"
    "        print(f'{path}: {exc.strerror}'); sys.exit(3)\n"
)


class Identities:
    """Whom each spider's processes run as on this node, at its identity level (see module docstring).

    Built once at start by :func:`open_identities` (``RunnerConfig.identities``). ``level`` is the level
    in force, ``details`` one line about it, ``passed_over`` the stronger levels not had (each with
    why), ``builder`` the identity installers run as (None: the agent's own), ``dedicated_builder`` the
    builder uid recorded at ``spider-uids`` (None at the other levels).
    """

    def __init__(self, level: IdentityLevel, details: str, *, passed_over: tuple[Unavailable, ...] = (),
                 user: RunAs | None = None, pool: UidPool | None = None, dirs_of: SpiderDirs | None = None,
                 dedicated_builder: RunAs | None = None) -> None:
        self.level = level
        self.details = details
        self.passed_over = passed_over
        self._user = user
        self._pool = pool
        self._dirs_of = dirs_of
        self.builder: RunAs | None = user if level is IdentityLevel.ONE_USER else None
        """Who runs installers (ckagent.code.builder): the dedicated builder uid at ``spider-uids``, the one
        user at ``one-user``, else the agent itself (None)."""
        self.dedicated_builder = dedicated_builder
        """The builder's own uid at ``spider-uids`` (recorded like a spider's), for installers that must
        not run as any spider (ckagent.code); None at the other levels."""

    def for_spider(self, spider_id: str) -> RunAs | None:
        """The identity ``spider_id``'s processes run as; None = the agent's own (``agent-user``, ``root``).
        At ``spider-uids`` the first call for a spider hands out its uid and records it; every call
        records the use (the least recently used spider is released first). Blocking (the state store).
        Raises UidsExhausted (``spider-uids`` only)."""
        if self._pool is None:
            return self._user if self.level is IdentityLevel.ONE_USER else None
        assert self._dirs_of is not None
        uid = self._pool.uid_of(SPIDER, spider_id)
        return RunAs.of_uid(uid, str(self._dirs_of(spider_id)[1]))

    def held(self) -> dict[str, int]:
        """At ``spider-uids``: ``{spider id: uid}`` of every spider holding one here (empty otherwise)."""
        if self._pool is None:
            return {}
        return {name: uid for (kind, name), uid in self._pool.held().items() if kind == SPIDER}

    def free_uids(self) -> int:
        """At ``spider-uids``: the uids of the range no spider (nor the builder) holds, that /etc/passwd
        and /etc/group do not name — what new spiders get without releasing another's (0 otherwise)."""
        return self._pool.free() if self._pool is not None else 0

    def as_root_notice(self) -> str | None:
        """The operator notice when spiders run as root (None otherwise): why, and what would change it."""
        if self.level is not IdentityLevel.ROOT:
            return None
        risk = "any spider can read this node's files, the agent's memory and its credentials"
        blocked = [u for u in self.passed_over if u.level is IdentityLevel.SPIDER_UIDS and u.blocker is not
                   Blocker.RUN_AS_USER]
        if blocked:
            return (f"spiders run as root: spider-uids (a uid per spider) is not available here: "
                    f"{blocked[0].message}; {risk}; to get it: {blocked[0].blocker.remedy}")
        return (f"spiders run as root: task.run_as_user is root, so {risk}; unset it to give each spider a "
                "uid of its own (spider-uids)")

    def notice(self) -> tuple[str, str] | None:
        """The operator notice of the level (``(key, text)`` for ckagent.node.notices), None when spiders
        run under uids of their own (``spider-uids``, ``one-user``): ``spiders-as-root`` at ``root``
        (:meth:`as_root_notice`), ``spiders-as-agent`` at ``agent-user`` (spiders share the agent's uid:
        its files and each other's are theirs to read and write; what would give each a uid of its own)."""
        as_root = self.as_root_notice()
        if as_root is not None:
            return "spiders-as-root", as_root
        if self.level is not IdentityLevel.AGENT_USER:
            return None
        uid = os.geteuid()
        blocked = [u for u in self.passed_over if u.level is IdentityLevel.SPIDER_UIDS]
        remedy = blocked[0].blocker.remedy if blocked else Blocker.NOT_ROOT.remedy
        return ("spiders-as-agent", f"spiders run as the agent's own user {_user_name(uid)} (uid {uid}; identity "
                f"agent-user): the agent is non-dumpable, but any spider can read and write the agent's files and "
                f"every other spider's; to give each spider a uid of its own (spider-uids): {remedy}")

    def to_json(self) -> dict[str, Any]:
        """The identity object of registration (``containment.spiderUser``) and /status (``identity``):
        ``level``, ``details``, ``passedOver`` (each stronger level not had: ``{level, blocker, message,
        remedy}``, blocker a :class:`~ckagent.node.levels.Blocker` value), ``builderUid`` (the uid
        installers run as; null: the agent's own), and the fields older masters read: ``name``/``uid`` of
        the one identity spiders run as (``ck-<uid>`` and null at ``spider-uids``: each spider its own),
        ``root``; at ``spider-uids`` also ``uidRange`` (FIRST-LAST), ``spiders`` (uids held) and ``free``.
        Reads no file and never blocks (the held uids are the pool's memory, read without its lock)."""
        common = {"passedOver": [{"level": u.level.value, "blocker": u.blocker.value, "message": u.message,
                                  "remedy": u.blocker.remedy} for u in self.passed_over],
                  "builderUid": self.builder.uid if self.builder is not None else None}
        if self.level is IdentityLevel.SPIDER_UIDS:
            assert self._pool is not None
            spiders, free = self._pool.counts()  # (never waits for an allocation: called on the event loop)
            return {"level": self.level.value, "details": self.details, "name": "ck-<uid>", "uid": None,
                    "root": False, "uidRange": str(self._pool.census.uids), "spiders": spiders,
                    "free": free, **common}
        if self._user is not None:
            name, uid = self._user.name, self._user.uid
        else:
            uid = os.geteuid()
            name = _user_name(uid)
        return {"level": self.level.value, "details": self.details, "name": name, "uid": uid, "root": uid == 0,
                **common}


def runs_as_text(run_as: RunAs | None, level: IdentityLevel | str) -> str:
    """Whom a spider runs as, in words (the task log's line, ``ckagent exec``'s header): ``runs as
    ck-61185 (uid 61185, gid 61185; identity spider-uids)``; ``run_as`` None = the agent's own uid."""
    if run_as is None:
        uid = os.geteuid()
        return f"runs as {'root' if uid == 0 else 'the agent'} (uid {uid}; identity {level})"
    return f"runs as {run_as.name} (uid {run_as.uid}, gid {run_as.gid}; identity {level})"


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@dataclass(frozen=True)
class _Forced:
    """What ``task.run_as_user`` asks for: the level, and the user it names (None: unset)."""

    level: IdentityLevel | None
    user: RunAs | None


def _forced(run_as_user: str | None, euid: int) -> _Forced:
    """``task.run_as_user`` resolved (None: auto). Raises IdentityError for an unknown user, or one
    that needs root when the agent is not."""
    if run_as_user is None:
        return _Forced(None, None)
    try:
        user = RunAs.lookup(run_as_user)
    except ValueError:
        raise IdentityError(f"task.run_as_user (AGENT_TASK_RUN_AS_USER): no user {run_as_user!r} on this node; "
                            "create the user or unset the setting") from None
    if user.uid == euid:
        return _Forced(IdentityLevel.ROOT if euid == 0 else IdentityLevel.AGENT_USER, None)
    if euid != 0:
        raise IdentityError(f"task.run_as_user={run_as_user!r} needs the agent to run as root (it runs as uid "
                            f"{euid}); unset it or start the agent as root", Blocker.NOT_ROOT)
    return _Forced(IdentityLevel.ROOT if user.uid == 0 else IdentityLevel.ONE_USER, user)


def _probe(uid: int, python: str, paths: list[str]) -> None:
    """Run ``python`` as ``uid`` (its gid the same number, no groups) and stat each of ``paths`` (each
    reached through every directory above it). Raises IdentityError (UNREACHABLE) naming what it could
    not reach. Blocking: one short process."""
    why: str | None = None
    try:
        done = subprocess.run([python, "-I", "-S", "-c", _PROBE, *paths], capture_output=True,
                              timeout=PROBE_TIMEOUT, check=False, stdin=subprocess.DEVNULL, cwd="/",
                              user=uid, group=uid, extra_groups=[], env={"PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        why = f"got no answer from the interpreter {python} within {PROBE_TIMEOUT:g} s"
    except OSError as exc:
        why = f"cannot execute the spiders' interpreter {python} ({exc.strerror or exc}; deps.python)"
    else:
        if done.returncode == 3:
            why = f"cannot reach {done.stdout.decode(errors='replace').strip()}"
        elif done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
            why = f"cannot run the spiders' interpreter {python} ({tail[0][:300]}; deps.python)"
    if why is not None:
        raise IdentityError(f"a spider's uid ({uid}) {why}", Blocker.UNREACHABLE)


def _reach_paths(work_dir: Path, sdk_dir: Path | None) -> list[str]:
    """What every spider's uid must reach: the work dir's nearest existing directory, searched (its
    ``/.``: through each directory above it and itself; the agent makes the work dir itself searchable)
    and the bundled SDK. Strings, not Paths: ``Path(d) / "."`` is ``d``, whose stat needs no search
    permission on ``d`` itself."""
    probe = work_dir
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    paths = [os.path.join(probe if probe != work_dir else work_dir.parent, ".")]
    if sdk_dir is not None:
        paths.append(str(sdk_dir / "crawlerkeeper_sdk" / "__init__.py"))
    return paths


@dataclass
class _Settings:
    run_as_user: str | None
    uids: UidRange
    work_dir: Path
    python: str
    sdk_dir: Path | None
    passwd: Path
    group: Path


def _spider_uids(s: _Settings, euid: int, probe_uid: Callable[[Census], int | None]) -> tuple[Census, str]:
    """The spider-uids level's checks (not root, no usable uid, nothing reachable); its census and
    start line. Raises IdentityError."""
    if euid != 0:
        raise IdentityError(f"the agent runs as uid {euid}, not root", Blocker.NOT_ROOT)
    census = census_of(s.uids, s.passwd, s.group)
    if census.usable < 2:
        raise IdentityError(f"task.spider_uids {s.uids}: {len(census.taken)} of its {len(s.uids)} ids are named "
                            f"by {s.passwd} or {s.group}, fewer than 2 are left (a builder and a spider)",
                            Blocker.NO_FREE_UIDS)
    uid = probe_uid(census)
    if uid is None:
        raise IdentityError(f"task.spider_uids {s.uids}: every id is in use (NSS, systemd's dynamic users, a "
                            "running process)", Blocker.NO_FREE_UIDS)
    _probe(uid, s.python, _reach_paths(s.work_dir, s.sdk_dir))
    return census, (f"each spider its own uid and gid from task.spider_uids {s.uids} ({len(s.uids)} ids, "
                    f"{len(census.taken)} named by /etc/passwd or /etc/group)")


def _details(level: IdentityLevel, user: RunAs | None) -> str:
    if level is IdentityLevel.ONE_USER:
        assert user is not None
        return f"every spider as {user.name} (uid {user.uid}, gid {user.gid})"
    uid = os.geteuid()
    if level is IdentityLevel.AGENT_USER:
        return f"spiders as the agent's own user {_user_name(uid)} (uid {uid}); the agent is non-dumpable"
    return "spiders as root"


def _decide(s: _Settings, euid: int, probe_uid: Callable[[Census], int | None], *, judge: bool
            ) -> tuple[IdentityLevel, str, RunAs | None, tuple[Unavailable, ...]]:
    """The level, its details, the one user (``one-user``), the levels passed over."""
    forced = _forced(s.run_as_user, euid)
    found: dict[str, Any] = {}

    def attempt(level: IdentityLevel) -> IdentityLevel:
        if level is IdentityLevel.SPIDER_UIDS:
            found["details"] = _spider_uids(s, euid, probe_uid)[1]
        return level

    if forced.level is None:
        own = IdentityLevel.ROOT if euid == 0 else IdentityLevel.AGENT_USER
        level, passed_over = decide(None, [IdentityLevel.SPIDER_UIDS, own], attempt, setting="task.run_as_user",
                                    error=IdentityError)
    else:
        level = forced.level
        why = f"task.run_as_user is {s.run_as_user}"
        if euid != 0:
            passed_over = (Unavailable(IdentityLevel.SPIDER_UIDS, Blocker.NOT_ROOT, f"the agent runs as uid {euid}, "
                                       "not root"),)
        elif judge:
            try:
                _spider_uids(s, euid, probe_uid)
                passed_over = (Unavailable(IdentityLevel.SPIDER_UIDS, Blocker.RUN_AS_USER, why),)
            except IdentityError as exc:
                passed_over = tuple(exc.unavailable(IdentityLevel.SPIDER_UIDS))
        else:
            passed_over = (Unavailable(IdentityLevel.SPIDER_UIDS, Blocker.RUN_AS_USER, why),)
    details = found.get("details") or _details(level, forced.user)
    return level, details, forced.user, passed_over


def open_identities(run_as_user: str | None, uids: UidRange, work_dir: Path, store: StateStore, *,
                    python: str, sdk_dir: Path | None, dirs_of: SpiderDirs, retention: float,
                    busy: Callable[[], Iterable[str]] = tuple, passwd: Path = PASSWD, group: Path = GROUP,
                    euid: int | None = None, claims: Path | None = None, node: str = "") -> Identities:
    """The node's :class:`Identities` from its settings (``task.run_as_user``, ``task.spider_uids``,
    ``task.work_dir``, ``deps.python``, the bundled SDK's dir, ``task.retention``): decided as the module
    docstring says, logged in one line (and each level passed over), the builder's uid recorded at
    ``spider-uids``; the work dir is made searchable by every uid there (mode o+x: spiders reach their
    own dirs in it). ``dirs_of`` names a spider's data and home dirs (removed when its uid is released),
    ``busy`` the spiders with a claimed task here (called on the Trio thread when it is one); ``claims``
    the host-wide record of claimed uids (``task.uid_claims``, ckagent.node.uidclaims; None: none, this
    store's holders only), ``node`` this node's name in its entries. Blocking (files, the state store,
    one probe process). Raises IdentityError for an unknown or unusable ``task.run_as_user`` (the agent
    exits 2); OSError when a uid claim cannot be written."""
    euid = os.geteuid() if euid is None else euid
    settings = _Settings(run_as_user, uids, work_dir, python, sdk_dir, passwd, group)
    if euid == 0 and run_as_user is None:
        _searchable(work_dir)
    pool: list[UidPool] = []

    def probe_uid(census: Census) -> int | None:
        made = UidPool(store, census, dirs_of, retention, _on_trio(busy), _open_claims(claims, work_dir, node))
        pool.append(made)
        try:
            return made.uid_of(BUILDER, "")
        except UidsExhausted:
            return None

    level, details, user, passed_over = _decide(settings, euid, probe_uid, judge=False)
    identities = Identities(level, details, passed_over=passed_over, user=user,
                            pool=pool[0] if level is IdentityLevel.SPIDER_UIDS else None, dirs_of=dirs_of)
    if level is IdentityLevel.SPIDER_UIDS:
        made = pool[0]
        builder_uid = made.uid_of(BUILDER, "")
        identities.dedicated_builder = identities.builder = RunAs.of_uid(builder_uid, str(work_dir / "builder-home"))
        held = identities.held()
        details += f"; {len(held)} spider(s) hold one, builder uid {builder_uid}, {made.free()} free"
        identities.details = details
    log.info("identity: %s — %s", level, details)
    for unavailable in passed_over:
        if unavailable.blocker is not Blocker.RUN_AS_USER:
            log.info("identity: not %s: %s (to get it: %s)", unavailable.level, unavailable.message,
                     unavailable.blocker.remedy)
    return identities


def judge_identities(run_as_user: str | None, uids: UidRange, work_dir: Path, *, python: str,
                     sdk_dir: Path | None, passwd: Path = PASSWD, group: Path = GROUP,
                     euid: int | None = None) -> Judged:
    """The identity level :func:`open_identities` would give, judged without changing the machine (no
    uid recorded: the probe runs as the first free uid; the work dir's mode is not changed, so a work
    dir that does not exist yet is judged by the directory above it). Blocking. Raises IdentityError
    as :func:`open_identities` would."""
    euid = os.geteuid() if euid is None else euid
    settings = _Settings(run_as_user, uids, work_dir, python, sdk_dir, passwd, group)

    level, details, _user, passed_over = _decide(settings, euid, first_unknown_uid, judge=True)
    return Judged(level, details, passed_over)


def _open_claims(directory: Path | None, work_dir: Path, node: str) -> UidClaims | None:
    """The host-wide record of claimed uids in ``directory`` (None: none); None with a warning when it
    cannot be used (the agent's spiders' uids are then only this store's)."""
    if directory is None:
        return None
    try:
        return UidClaims(directory, work_dir, node)
    except OSError as exc:
        log.warning("identity: %s; spiders' uids are not recorded host-wide: another agent on this host may hand "
                    "out the same ones (fix the directory, or set task.uid_claims)", exc.strerror or exc)
        return None


def _searchable(work_dir: Path) -> None:
    """Make the work dir searchable by every uid (o+x; made if missing): spiders reach their own dirs in it."""
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
        mode = work_dir.stat().st_mode
        if not mode & 0o001:
            os.chmod(work_dir, (mode & 0o7777) | 0o001)
            log.info("identity: %s made searchable by every user (o+x), so that spiders' uids reach their own "
                     "directories in it", work_dir)
    except OSError as exc:
        log.warning("identity: cannot make %s searchable by every user: %s", work_dir, exc.strerror or exc)


def _on_trio(busy: Callable[[], Iterable[str]]) -> Callable[[], Iterable[str]]:
    """``busy`` called on the Trio thread when called from one of its worker threads (it reads the
    agent's running set), else directly."""
    def call() -> Iterable[str]:
        try:
            import trio

            return list(trio.from_thread.run_sync(busy))
        except RuntimeError:  # not a Trio worker thread
            return list(busy())

    return call
