"""Operator notices: conditions that are no error but that whoever runs the node must know.

Each notice is one line, logged once when it starts, listed in ``/status`` (``warnings``) and on the
status page until it ends. Today: spiders that run as root (``Identities.as_root_notice``,
ckagent.node.identity) and a master clock far from this node's (ckagent.master.masterclock).
:class:`Notices` holds them by key.
"""

from __future__ import annotations

import logging

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
