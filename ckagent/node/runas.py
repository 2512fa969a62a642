"""Who spiders and installers run as: ``task.run_as_user`` resolved once, and the Popen options it gives.

Pure data over the passwd database; imports nothing of the agent.
"""

from __future__ import annotations

import logging
import os
import pwd
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunAs:
    """The identity spiders and installers run as (``task.run_as_user``; needs an agent running as root).

    ``uid``/``gid``/``groups`` go to ``subprocess.Popen(user=, group=, extra_groups=)``; ``home`` is
    the user's home directory (HOME of the spider).
    """

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @classmethod
    def lookup(cls, name: str) -> RunAs:
        """Resolve a user name (or numeric uid) from the passwd database. Raises ValueError when unknown."""
        try:
            pw = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        except KeyError:
            raise ValueError(f"task.run_as_user: no user {name!r} on this node") from None
        groups = tuple(g for g in os.getgrouplist(pw.pw_name, pw.pw_gid) if g != pw.pw_gid)
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir)

    def popen_options(self) -> dict[str, Any]:
        """Keyword arguments for ``subprocess.Popen`` / ``trio.lowlevel.open_process``."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def env(self) -> dict[str, str]:
        """HOME, USER and LOGNAME of this user (they replace the agent's in the spider's environment)."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def chown_tree(self, path: Path) -> None:
        """Give ``path`` and everything under it to this user (symlinks themselves, not their targets).

        Blocking (walks the tree): call it through ``trio.to_thread``. Raises OSError.
        """
        for root, dirs, files in os.walk(path, topdown=False):
            for name in (*dirs, *files):
                os.lchown(os.path.join(root, name), self.uid, self.gid)
        os.lchown(path, self.uid, self.gid)  # last: callers check the top's owner to skip done trees


def popen_identity(run_as: RunAs | None) -> dict[str, Any]:
    """``run_as.popen_options()``, or nothing when spiders run as the agent's own user."""
    return run_as.popen_options() if run_as is not None else {}


def spider_run_as(user: str | None) -> RunAs | None:
    """``task.run_as_user`` resolved; None when unset or when it is the agent's own user.

    Raises ValueError (saying how to fix it) for an unknown user, or when switching users needs root
    and the agent is not.
    """
    if user is None:
        return None
    try:
        run_as = RunAs.lookup(user)
    except ValueError as exc:
        raise ValueError(f"task.run_as_user (AGENT_TASK_RUN_AS_USER): no user {user!r} on this node; "
                         "create the user or unset the setting") from exc
    if run_as.uid == os.geteuid():
        return None
    if os.geteuid() != 0:
        raise ValueError(f"task.run_as_user={user!r} needs the agent to run as root (it runs as uid "
                         f"{os.geteuid()}); unset it or start the agent as root")
    log.info("spiders and installers run as %s (uid %d, gid %d)", run_as.name, run_as.uid, run_as.gid)
    return run_as
