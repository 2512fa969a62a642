"""Whose nftables table is it: the agents' table names and owner comments, and the removal of the tables
no agent can come back for.

An agent's table is ``inet ckagent_<10 hex>``: the hash of its work dir's group name and of its mount
namespace; its comment is ``ckagent@<inode, hex> work_dir=<path>`` (an older agent's:
``ckagent work_dir=<path>``, named after the work dir alone: :func:`legacy_table_name`). A starting
agent deletes the tables of work dirs that no longer exist in *its* mount namespace
(:func:`remove_orphans`) and its own work dir's legacy table (:func:`remove_legacy`). Agents in other
mount namespaces that share the network namespace (containers or pods on the host network, the suite's
pod sandbox) see other files: a work dir missing here proves nothing there, so their tables are never
touched, and their names differ even for the same work dir path — no agent's start deletes a
neighbour's live table, whose tasks would then crawl without their policy.

Every function here blocks (a netlink round trip); none raises but :func:`table_name` (ValueError).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable

from ckagent.containment.egress.netlink import Netlink, NetlinkError

log = logging.getLogger(__name__)

TABLE_PREFIX = "ckagent_"
OWNER_COMMENT = "ckagent work_dir="
"""The comment of a table made by an agent before tables named their mount namespace (legacy)."""
MNTNS_COMMENT = "ckagent@"
"""The comment of a table: ``ckagent@<mount namespace inode, hex> work_dir=<path>`` (compact: a comment
holds at most 127 bytes, and a work dir that does not fit leaves the table without one)."""


def mount_namespace() -> int:
    """The inode of this process's mount namespace (``/proc/self/ns/mnt``); 0 when it cannot be read."""
    try:
        return os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return 0

def table_name(group_name: str, mntns: int | None = None) -> str:
    """``ckagent_<10 hex>``: the hash of the containment's agent group name (``ckagent-<hash>``, from the
    work dir) and of the mount namespace (``mntns``, default this process's: :func:`mount_namespace`),
    so agents with one work dir path in two mount namespaces on one network namespace never share a
    table. Not a valid nft name for an empty ``group_name``: ValueError."""
    if not group_name:
        raise ValueError("no agent group name")
    ns = mount_namespace() if mntns is None else mntns
    return "ckagent_" + hashlib.sha256(f"{ns}:{group_name}".encode()).hexdigest()[:10]


def legacy_table_name(group_name: str) -> str:
    """The name an agent before mount-namespace names gave the table of ``group_name``'s work dir."""
    return group_name.replace("-", "_")


def owner_comment(work_dir: str) -> str:
    """The comment of this agent's table for ``work_dir``: ``ckagent@<inode, hex> work_dir=<path>``."""
    return f"{MNTNS_COMMENT}{mount_namespace():x} work_dir={work_dir}"


def table_owner(comment: str) -> tuple[int | None, str] | None:
    """A table comment → (its mount namespace inode, None for a legacy comment without one; the work
    dir), or None when it is not an agent's owner comment (none, another program's, malformed)."""
    if comment.startswith(OWNER_COMMENT):
        return None, comment[len(OWNER_COMMENT):]
    if comment.startswith(MNTNS_COMMENT):
        ns, sep, work_dir = comment[len(MNTNS_COMMENT):].partition(" work_dir=")
        if sep and work_dir and 0 < len(ns) <= 16 and all(c in "0123456789abcdef" for c in ns):
            return int(ns, 16), work_dir
    return None


def owned_tables(netlink: Netlink, *, all_namespaces: bool = False) -> dict[str, str | None]:
    """The ``inet ckagent_*`` tables of agents in this mount namespace (and legacy ones, whose comment
    names no namespace) → the work dir their comment names (None: no owner comment, e.g. a very old
    agent's, or a work dir too long for a comment). Tables of another mount namespace are left out:
    what is missing here says nothing of their work dirs (``all_namespaces``: every agent's, for the
suite's clean-up of its own temporary work dirs). One netlink dump. Raises NetlinkError."""
    here = mount_namespace()
    out: dict[str, str | None] = {}
    for name, comment in netlink.tables():
        if not name.startswith(TABLE_PREFIX):
            continue
        owner = table_owner(comment)
        if owner is None:
            out[name] = None
        elif owner[0] is None or owner[0] == here or all_namespaces:
            out[name] = owner[1]
    return out


def remove_orphans(orphaned: Callable[[str], bool] = lambda work_dir: not os.path.exists(work_dir),
                   keep: str = "", *, all_namespaces: bool = False) -> list[str]:
    """Delete the ckagent tables of this mount namespace whose comment names a work dir ``orphaned``
    says is gone (by default: it does not exist; no agent can run there, no task of one is left), except
    ``keep``; another mount namespace's tables are never deleted (:func:`owned_tables`). Returns the
    deleted names; [] when netlink cannot be used (no rights). Never raises."""
    removed: list[str] = []
    try:
        netlink = Netlink()
    except NetlinkError:
        return removed
    try:
        for name, work_dir in owned_tables(netlink, all_namespaces=all_namespaces).items():
            if name != keep and work_dir is not None and orphaned(work_dir):
                with contextlib.suppress(NetlinkError):  # (gone meanwhile)
                    netlink.delete_table(name)
                    removed.append(name)
    except NetlinkError as exc:
        log.debug("egress: cannot list the tables (%s)", exc)
    finally:
        netlink.close()
    return removed


def remove_legacy(group_name: str, work_dir: str) -> bool:
    """Delete the table an older agent made for ``work_dir`` under the name before mount-namespace names
    (:func:`legacy_table_name`), when its legacy comment names exactly this work dir: this work dir's
    agent is starting, so its old table only filters what this one filters again. True when one went.
    Never raises."""
    name = legacy_table_name(group_name)
    try:
        netlink = Netlink()
    except NetlinkError:
        return False
    try:
        comments = dict(netlink.tables())
        if name in comments and comments[name] == OWNER_COMMENT + work_dir:
            netlink.delete_table(name)
            return True
    except NetlinkError as exc:
        log.debug("egress: cannot remove the legacy table %s (%s)", name, exc)
    finally:
        netlink.close()
    return False
