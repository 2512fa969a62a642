"""Chromium's sandbox for spiders: whether a spider's Chromium can use its own, decided once at start and
told to every spider as ``CK_CHROMIUM_SANDBOX`` (``1`` or ``0``; the SDK's ``chromium_sandbox()`` and
``chromium_args()`` read it).

Chromium sandboxes its renderers with namespaces and seccomp-bpf. It makes the namespaces one of two
ways: a **setuid helper** (``chrome-sandbox``, which Google Chrome ships setuid root; Debian's and most
distributions' Chromium do not) or **unprivileged user namespaces** (``clone(CLONE_NEWUSER|CLONE_NEWPID|
CLONE_NEWNET)`` by the browser itself). As root it refuses to start without ``--no-sandbox``.

=====================================  ===============================================================
the spider runs as                     ``CK_CHROMIUM_SANDBOX``
=====================================  ===============================================================
root (the ``root`` identity level)     ``0``: Chromium refuses its sandbox as root; ``--no-sandbox``
a uid of its own, the one user, the    ``1`` when a process of that kind may make a user, pid and
agent's own uid (not root)             network namespace here (one probe at start, :func:`decide`),
                                       else ``0`` (``user.max_user_namespaces`` is 0, a container's
                                       seccomp profile refuses ``unshare``, util-linux's ``unshare``
                                       is missing); the start's log line says which and why
=====================================  ===============================================================

A spider launches Chromium with ``--no-sandbox`` only when it is ``0`` (Playwright adds ``--no-sandbox``
unless launched with ``chromium_sandbox=True``). A task's ``env`` may set it (it wins). ``/dev/shm``
needs no switch where the task has its own (the ``mount-namespace`` and ``user-namespace`` private-tmp
levels: a tmpfs of the task's, mode 1777; ckagent.containment.private): ``--disable-dev-shm-usage`` is
only for a small shared ``/dev/shm`` (Docker's 64 MB).

Blocking (one short subprocess): call :func:`decide` / :func:`for_identities` through ``trio.to_thread``.
Never raises.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

from ckagent.node.identity import Identities
from ckagent.node.levels import IdentityLevel
from ckagent.node.runas import RunAs

log = logging.getLogger(__name__)

__all__ = ["CHROMIUM_SANDBOX_VAR", "ChromiumSandbox", "decide", "for_identities"]

CHROMIUM_SANDBOX_VAR = "CK_CHROMIUM_SANDBOX"
"""The variable every spider gets: ``1`` = launch Chromium with its own sandbox, ``0`` = ``--no-sandbox``."""
PROBE_TIMEOUT = 10.0
"""Seconds the namespace probe may take (it runs ``true``)."""
NOBODY = 65534
"""The uid the probe runs as when a root agent has no identity of the level's at hand (the kernel's
answer does not depend on which unprivileged uid asks)."""


@dataclass(frozen=True)
class ChromiumSandbox:
    """The decision: ``on`` (spiders' Chromium uses its own sandbox) and ``why`` (one clause, for the log)."""

    on: bool
    why: str

    def env(self) -> dict[str, str]:
        """``{"CK_CHROMIUM_SANDBOX": "1" | "0"}``."""
        return {CHROMIUM_SANDBOX_VAR: "1" if self.on else "0"}


def decide(spiders_as_root: bool, probe_as: RunAs | None) -> ChromiumSandbox:
    """Whether spiders' Chromium can sandbox itself here: never when ``spiders_as_root``; else when a
    process of ``probe_as`` (None: the agent's own uid; as a root agent, :data:`NOBODY`) may make a user,
    a pid and a network namespace (util-linux's ``unshare``, run once). Blocking; never raises."""
    if spiders_as_root:
        return ChromiumSandbox(False, "spiders run as root, where Chromium refuses its sandbox (--no-sandbox)")
    unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if unshare is None:
        return ChromiumSandbox(False, "util-linux's unshare is missing, so user namespaces cannot be checked "
                                      "(--no-sandbox)")
    options: dict[str, object] = {}
    if probe_as is not None:
        options = probe_as.popen_options()
    elif os.geteuid() == 0:
        options = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    try:
        done = subprocess.run([unshare, "--user", "--pid", "--net", "--fork", "true"], capture_output=True,
                              timeout=PROBE_TIMEOUT, check=False, cwd="/", env={"PATH": "/usr/bin:/bin"},
                              **options)  # type: ignore[call-overload]
    except (OSError, subprocess.SubprocessError) as exc:
        return ChromiumSandbox(False, f"the user-namespace probe could not run: {exc} (--no-sandbox)")
    if done.returncode != 0:
        said = done.stderr.decode(errors="replace").strip().splitlines()
        return ChromiumSandbox(False, f"an unprivileged process may not make user namespaces here "
                                      f"({said[-1] if said else f'exit {done.returncode}'}; "
                                      "see user.max_user_namespaces) (--no-sandbox)")
    return ChromiumSandbox(True, "spiders are not root and may make user namespaces")


def for_identities(identities: Identities) -> ChromiumSandbox:
    """:func:`decide` for the node's identity level (spiders as root at ``root``; the probe runs as the
    builder's uid, or the one user, else as the agent), logged once. Blocking; never raises."""
    sandbox = decide(identities.level is IdentityLevel.ROOT, identities.dedicated_builder or identities.builder)
    log.info("Chromium's sandbox for spiders: %s (%s)", "on" if sandbox.on else "off", sandbox.why)
    return sandbox
