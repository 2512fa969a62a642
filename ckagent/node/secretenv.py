"""The agent's credentials outside every process's initial environment.

``/proc/<pid>/environ`` shows the environment a process was *started* with; nothing a process does
later (``unsetenv``, ``os.environ.pop``) changes it, and root (a spider running as root) reads it
regardless of the non-dumpable flag. So the credentials an operator passes as environment variables
(``AGENT_REGISTRATION_TOKEN``, ``AGENT_API_KEY``: :data:`SECRET_ENV`) are moved into a memory file:

- ``ckagent run`` started with one of them in its environment writes them to a ``memfd`` and
  re-executes itself (same pid, same arguments) with an environment that holds only
  ``CKAGENT_SECRETS_FD=<fd>`` (:func:`reexec_without_secrets`). run.sh does the same for itself
  before anything else, so neither run.sh nor the agent it starts carries them in its environ.
- Whoever needs the values reads them from that fd (:func:`inherited_secrets`, with ``pread``: any
  number of readers, any number of times). The fd is not inherited by spiders or installers (the
  agent closes every fd but the ones it passes); the agent hands it on only to the ``run.sh
  upgrade`` it starts (:func:`secrets_fd`).

The memory file is reachable only through ``/proc/<pid>/fd`` of a process holding it, which needs the
same access as reading that process's environ. It protects against other users; against a spider
running as root nothing in the agent can: run spiders as another user (``task.run_as_user``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Mapping

log = logging.getLogger(__name__)

SECRET_ENV = ("AGENT_REGISTRATION_TOKEN", "AGENT_API_KEY")
"""The environment variables of the settings that are secrets (tests keep this equal to ckagent.node.config),
and ``AGENT_API_KEY``: no longer a setting, but a key an operator still sets must not reach a spider either."""

FD_ENV = "CKAGENT_SECRETS_FD"
"""Names the inherited memory file holding the secrets (a JSON object ``{name: value}``)."""

_MAX_BYTES = 1 << 20


def inherited_secrets(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The secret variables from the fd :data:`FD_ENV` names (``{}`` when it names none).

    Never raises: an fd that is closed, unreadable or not a JSON object of strings gives ``{}`` and
    one warning (the settings then say which credential is missing).
    """
    environ = os.environ if environ is None else environ
    text = environ.get(FD_ENV)
    if not text:
        return {}
    try:
        data = json.loads(os.pread(int(text), _MAX_BYTES, 0))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return {str(k): str(v) for k, v in data.items() if k in SECRET_ENV and isinstance(v, str)}
    except (OSError, ValueError) as exc:
        log.warning("%s=%s does not name a readable secrets file (%s): its credentials are ignored",
                    FD_ENV, text, type(exc).__name__)
        return {}


def agent_environ() -> dict[str, str]:
    """``os.environ`` with the inherited secrets (:func:`inherited_secrets`) over it: what settings read."""
    return {**os.environ, **inherited_secrets()}


def secrets_fd() -> int | None:
    """The inherited secrets fd to pass to a helper that starts another agent (``run.sh upgrade``), or None."""
    text = os.environ.get(FD_ENV)
    return int(text) if text and text.isdigit() else None


def reexec_without_secrets() -> None:
    """Re-execute this process with its secret variables moved into a memory file (see the module docstring).

    Returns at once (doing nothing) when no :data:`SECRET_ENV` variable is set, or where ``memfd_create``
    is missing (not Linux). Otherwise it does not return: ``execve`` replaces the process image, the pid
    stays. In the new image, call it again: it finds no secret variable and makes the fd private
    (not inherited by what the agent starts; :func:`secrets_fd` hands it on explicitly).
    Raises OSError only when ``execve`` itself fails.
    """
    found = {name: os.environ[name] for name in SECRET_ENV if os.environ.get(name)}
    inherited = secrets_fd()
    if not found:
        if inherited is not None:
            with contextlib.suppress(OSError):
                os.set_inheritable(inherited, False)
        return
    if not hasattr(os, "memfd_create"):
        return
    merged = {**inherited_secrets(), **found}
    fd = os.memfd_create("ckagent-secrets", 0)  # no MFD_CLOEXEC: the new image must hold it
    os.write(fd, json.dumps(merged).encode())
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env[FD_ENV] = str(fd)
    if inherited is not None and inherited != fd:
        os.close(inherited)
    sys.stdout.flush()
    sys.stderr.flush()
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    os.execve(sys.executable, argv, env)
