"""What an earlier agent left in the work dir, brought to this agent's identity level at start: the
migration of a node made by an older agent (spiders as root, or all as the one ``task.run_as_user``)
to ``spider-uids`` — once (what is done stays done: a later start finds nothing to do and says
nothing), one log line per kind, nothing deleted that holds a spider's data.

=====================  ==========================================================================
kind                   at start
=====================  ==========================================================================
interrupted working    deleted, except the re-adopted tasks' (ckagent.code.workspace's prune_runs)
copies
per-spider envs of     removed (``venvs/``, ``node/``: ckagent.code.deps.remove_legacy_environments)
the oldest agents
a spider's data and    given to the identity the spider runs as now (its own uid at
home dirs              ``spider-uids``, the one user at ``one-user``) when another one owns them:
                       ``RunAs.chown_tree`` (no link followed; a file with other hard links
                       replaced by a copy of its own; device files removed). A spider whose uid
                       is not recorded yet gets it now. Left for the spider's next task (which
                       gives them the same way, ckagent.code.workcopy.spider_dirs): the spiders
                       of re-adopted tasks (they still run, as whom they were started), dirs
                       whose spider id the agent cannot tell (a hashed name of an id it no longer
                       knows), and every spider when no uid is free without releasing another's
environments           those an older agent built (no ``sealed`` in the marker: built as root or
                       the one user, writable by spiders all along) are removed, not re-owned, except
                       one a re-adopted task runs with; each spider's is rebuilt by the builder at its
                       next task (ckagent.code.envstore.collect, which says so in its line)
task dirs              left as they are: the agent's spool (the start's work-dir modes make each
                       0700, ckagent.node.workmodes), read and removed by the agent only
=====================  ==========================================================================

At ``agent-user`` and ``root`` spiders run as the agent: no dir changes hands.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ckagent.code.deps import remove_legacy_environments
from ckagent.code.envstore import collect
from ckagent.code.workspace import Workspaces
from ckagent.master.ids import safe_name
from ckagent.node.identity import Identities, IdentityError
from ckagent.node.levels import IdentityLevel
from ckagent.node.runas import RunAs
from ckagent.node.state import StateStore
from ckagent.task.adoption import Adoption

__all__ = ["Migrated", "give_spider_dirs", "migrate_node"]

log = logging.getLogger(__name__)

SHOWN = 10
"""Spiders named in the log line (the rest counted)."""


@dataclass
class Migrated:
    """What :func:`give_spider_dirs` did: ``given`` spider id → (uid, the previous owners' uids),
    ``entries`` changed, ``copied`` hard-linked files copied, ``removed`` device files removed, and the
    spiders (or dir names) ``left`` for their next task, with why."""

    given: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    entries: int = 0
    copied: int = 0
    removed: int = 0
    left: dict[str, str] = field(default_factory=dict)


def migrate_node(work_dir: Path, identities: Identities | None, workspaces: Workspaces | None, store: StateStore,
                 adoptions: Collection[Adoption], env_budget_bytes: int) -> Migrated:
    """Bring what an earlier agent left in ``work_dir`` to the identity level of ``identities`` (see the
    module docstring), leaving the re-adopted tasks (``adoptions``) alone: the interrupted working
    copies (``workspaces``), the spiders' data and home dirs (:func:`give_spider_dirs`; the spider ids
    ``store`` names tell the hashed dir names), then the environments older agents built (removed,
    except those the re-adopted tasks run with; ``env_budget_bytes``: deps.env_budget_bytes). Blocking
    (walks and chowns trees, one state store write per spider given a uid): call it through
    ``trio.to_thread``, before the first task. Never raises for a dir it cannot give (logged, left for
    the spider's next task)."""
    if workspaces is not None:
        workspaces.prune_runs([adoption.handle.work for adoption in adoptions])
    remove_legacy_environments(work_dir)
    migrated = give_spider_dirs(work_dir, identities, store.spider_ids(),
                                {adoption.task.spider_id for adoption in adoptions})
    collect(work_dir / "envs", env_budget_bytes, {Path(a.handle.env_dir) for a in adoptions if a.handle.env_dir})
    return migrated


def give_spider_dirs(work_dir: Path, identities: Identities | None, known_spiders: Iterable[str],
                     adopted_spiders: Collection[str]) -> Migrated:
    """Give each spider's data and home dirs another identity owns to the one it runs as now (see the
    module docstring), one log line for all of them; returns what was done. Blocking; never raises."""
    done = Migrated()
    if identities is None or not identities.level.switches_user:
        return done
    names = _dir_names(work_dir)
    if not names:
        return done
    held = identities.held()
    by_name = {safe_name(spider_id): spider_id for spider_id in (*known_spiders, *held)}
    adopted = set(adopted_spiders)
    for name in sorted(names):
        spider_id = by_name.get(name) or (name if safe_name(name) == name else None)
        dirs = [path for path in (work_dir / "spider-data" / name, work_dir / "spider-home" / name) if _is_dir(path)]
        try:
            owners = {(st.st_uid, st.st_gid) for st in map(os.lstat, dirs)}
        except OSError:
            continue  # (removed meanwhile)
        if _settled(identities, held, spider_id, owners):
            continue
        if spider_id is None:
            done.left[name] = "spider id unknown"
            continue
        if spider_id in adopted:
            done.left[spider_id] = "a re-adopted task runs"
            continue
        run_as = _identity_of(identities, spider_id, done)
        if run_as is None:
            continue
        try:
            for path in dirs:
                given = run_as.chown_tree(path)
                done.entries += given.changed
                done.copied += given.copied
                done.removed += given.removed
        except OSError as exc:
            log.warning("migration: cannot give the dirs of spider %s to uid %d: %s (its next task tries again)",
                        spider_id, run_as.uid, exc.strerror or exc)
            done.left[spider_id] = f"error: {exc.strerror or exc}"
            continue
        done.given[spider_id] = (run_as.uid, tuple(sorted({uid for uid, _ in owners})))
    _say(done, identities.level)
    return done


def _settled(identities: Identities, held: dict[str, int], spider_id: str | None,
             owners: set[tuple[int, int]]) -> bool:
    """Whether the dirs (their ``owners``) already belong to whom the spider runs as: at ``spider-uids``
    its recorded uid (a spider id unknown: any spider's recorded uid; none recorded: no dirs), at
    ``one-user`` the one user. Reads no file and records nothing."""
    if identities.level is IdentityLevel.SPIDER_UIDS:
        uid = held.get(spider_id) if spider_id is not None else None
        if uid is not None:
            return owners <= {(uid, uid)}
        if spider_id is None:
            return owners <= {(uid, uid) for uid in held.values()}
        return not owners
    user = identities.for_spider(spider_id or "")  # (the one user: nothing recorded)
    return user is None or owners <= {(user.uid, user.gid)}


def _identity_of(identities: Identities, spider_id: str, done: Migrated) -> RunAs | None:
    """Whom the spider runs as now, its uid handed out when it holds none and one is free (never by
    releasing another spider's: the re-adopted tasks are not counted as busy yet); None when none
    (``done.left`` says why)."""
    if identities.level is IdentityLevel.SPIDER_UIDS and spider_id not in identities.held() \
            and identities.free_uids() < 1:
        done.left[spider_id] = "no free uid"
        return None
    try:
        return identities.for_spider(spider_id)
    except IdentityError as exc:  # (UidsExhausted: a race with another holder)
        done.left[spider_id] = str(exc)
        return None


def _dir_names(work_dir: Path) -> set[str]:
    """The names of the spiders' dirs in ``spider-data/`` and ``spider-home/`` (real dirs only)."""
    names: set[str] = set()
    for folder in ("spider-data", "spider-home"):
        try:
            with os.scandir(work_dir / folder) as entries:
                names |= {entry.name for entry in entries if entry.is_dir(follow_symlinks=False)}
        except OSError:
            continue
    return names


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _say(done: Migrated, level: IdentityLevel) -> None:
    """The one log line of the spiders' dirs (none when nothing changed hands and nothing was left)."""
    if done.given:
        shown = [f"{spider} (uid {uid}; was {', '.join(map(str, was))})" for spider, (uid, was) in
                 list(done.given.items())[:SHOWN]]
        more = f" and {len(done.given) - SHOWN} more" if len(done.given) > SHOWN else ""
        extra = "".join(f", {n} {what}" for n, what in ((done.copied, "hard-linked file(s) copied"),
                                                        (done.removed, "device file(s) removed")) if n)
        left = f"; left for their next task: {_left(done.left)}" if done.left else ""
        whom = "each spider's own uid" if level is IdentityLevel.SPIDER_UIDS else "the one user spiders run as"
        log.info("migration: the data and home dirs of %d spider(s) an earlier agent left are given to %s "
                 "(%d entries%s): %s%s%s", len(done.given), whom, done.entries, extra, ", ".join(shown), more, left)
    elif done.left:
        log.info("migration: the dirs of %d spider(s) are left for their next task: %s", len(done.left),
                 _left(done.left))


def _left(left: dict[str, str]) -> str:
    shown = [f"{name} ({why})" for name, why in list(left.items())[:SHOWN]]
    return ", ".join(shown) + (f" and {len(left) - SHOWN} more" if len(left) > SHOWN else "")
