"""Guards of the agent process itself against the spiders it runs (same machine, often same user).

Secrets (registration token, API key) live in the agent's memory and often in its environment.
Spiders never get them in their own environment (see ckagent.code.deps.spider_base_env), but a spider
running as the agent's user could read ``/proc/<agent pid>/environ`` or attach a debugger.
"""

from __future__ import annotations

import ctypes
import gc
import sys

PR_SET_DUMPABLE = 4
"""prctl option (linux/prctl.h)."""


def protect_agent_memory() -> bool:
    """Make this process non-dumpable (Linux ``prctl(PR_SET_DUMPABLE, 0)``), as ssh-agent does.

    The agent's environment and memory hold its secrets (registration token, API key). A spider
    running as the same user could otherwise read ``/proc/<agent pid>/environ`` or ptrace the agent;
    a non-dumpable process's /proc files belong to root and ptrace needs CAP_SYS_PTRACE. Spiders are
    not affected (execve makes them dumpable again). It cannot protect against spiders running as
    root: use ``task.run_as_user`` for untrusted code. Returns True when the flag was set (False on
    other systems or when the call failed); never raises.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (as Go's runtime does), so the
    sockets of many tasks' proxied connections and watched files do not run it out. Returns the soft
    limit in force (0 when it cannot be read); never raises."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (ImportError, OSError, ValueError):
        return 0


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive (modules, settings, clients, the status server: what
    the agent keeps for its life) to the GC's permanent generation (``gc.freeze``): a full collection
    no longer walks them. Measured in bench/scrape.py's process: full collections of 17–39 ms CPU on
    the loop's thread, at any allocation, before. Called once, when the status server serves."""
    gc.collect()
    gc.freeze()
