"""Operator notices: conditions that are no error but that whoever runs the node must know.

Each notice is one line, logged once when it starts, listed in ``/status`` (``warnings``) and on the
status page until it ends. Today: spiders that run as root (:func:`spiders_as_root`) and a master
clock far from this node's (ckagent.master.masterclock). :class:`Notices` holds them by key.
"""

from __future__ import annotations

import logging
import os

from ckagent.node.runas import RunAs

log = logging.getLogger(__name__)


class Notices:
    """The operator notices in force, by key (``"spiders-as-root"``, ``"master-clock"``)."""

    def __init__(self) -> None:
        self._by_key: dict[str, str] = {}

    def set(self, key: str, text: str) -> None:
        """Raise (or update) a notice; logged as a warning when it is new."""
        if key not in self._by_key:
            log.warning("%s", text)
        self._by_key[key] = text

    def clear(self, key: str, ended: str | None = None) -> None:
        """End a notice (``ended``, when given, is logged as info)."""
        if self._by_key.pop(key, None) is not None and ended:
            log.info("%s", ended)

    def texts(self) -> tuple[str, ...]:
        """The notices in force, in the order they were raised."""
        return tuple(self._by_key.values())


def spider_user(run_as: RunAs | None) -> dict[str, object]:
    """Whom spiders run as: ``{"name", "uid", "root"}`` (sent at registration inside ``containment``)."""
    if run_as is not None:
        return {"name": run_as.name, "uid": run_as.uid, "root": run_as.uid == 0}
    uid = os.geteuid()
    try:
        import pwd

        name = pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        name = str(uid)
    return {"name": name, "uid": uid, "root": uid == 0}


def spiders_as_root(run_as: RunAs | None) -> str | None:
    """The notice for spiders that run as root (the agent is root and ``task.run_as_user`` is unset), else None."""
    if not spider_user(run_as)["root"]:
        return None
    return ("spiders run as root: the agent runs as root and task.run_as_user is unset, so any spider can read "
            "this node's files, the agent's memory and its credentials; set task.run_as_user to an "
            "unprivileged user (./run.sh --spider-user=ckspider start creates one, see docs/deploy.md)")
