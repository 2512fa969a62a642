"""``ckagent config check`` as a command, as root and as an unprivileged user, and what a check of the
levels may leave on the machine (nothing: no ``ckagent-check-*`` cgroup, no ``ckagent_check_*`` table)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckagent.containment.hierarchy import own_dirs
from harness.examples import REPO

__all__ = ["CheckRun", "check_leftovers", "config_check", "unprivileged_config_check"]

CHECK_TIMEOUT = 120.0
"""Seconds a `config check` may take (the pyz's first start extracts it: a few seconds)."""

UNPRIVILEGED = "nobody"
"""The user the unprivileged check runs as: one every Debian system has, so no useradd (no
/etc/passwd lock, no serial group); the check writes only below a directory the test made."""


@dataclass(frozen=True)
class CheckRun:
    """One `config check`: exit code, stdout, stderr."""

    returncode: int
    stdout: str
    stderr: str

    def section(self, concern: str) -> list[str]:
        """The lines of ``concern`` (``containment``/``egress``): its head line and the indented ones."""
        lines = self.stdout.splitlines()
        heads = [i for i, line in enumerate(lines) if line.startswith(f"{concern}: ")]
        assert heads, f"no {concern} line in the check's output:\n{self.stdout}\n{self.stderr}"
        found = [lines[heads[0]]]
        for line in lines[heads[0] + 1:]:
            if not line.startswith("  "):
                break
            found.append(line)
        return found

    def text(self, concern: str) -> str:
        """:meth:`section` as one string (lines joined by newlines)."""
        return "\n".join(self.section(concern))


def _clean_env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "PYTHON", "SHIV_", "CK_"))}
    base["COLUMNS"] = "200"
    base.update(env)
    return base


def config_check(cwd: Path, **env: str) -> CheckRun:
    """``python -m ckagent config check`` with this interpreter (the checkout), the ``AGENT_*`` settings
    ``env`` only, in ``cwd`` (blocking)."""
    done = subprocess.run([sys.executable, "-m", "ckagent", "config", "check"], cwd=cwd, capture_output=True,
                          text=True, timeout=CHECK_TIMEOUT, check=False,
                          env=_clean_env(PYTHONPATH=str(REPO), AGENT_WORK_DIR=str(cwd / "work"), **env))
    return CheckRun(done.returncode, done.stdout, done.stderr)


@contextmanager
def unprivileged_config_check(pyz: Path) -> Iterator[Callable[..., CheckRun]]:
    """A function that runs ``/usr/bin/python3 ckagent.pyz config check`` as :data:`UNPRIVILEGED` with
    the ``AGENT_*`` settings it is given: a copy of the session's pyz in a directory of root's that the
    user can enter, its work dir and the pyz's extraction in one the user owns; all removed afterwards.
    Skips when this process is not root or the user or /usr/bin/python3 is missing (blocking)."""
    import pwd

    if os.geteuid() != 0:
        pytest.skip(f"running a command as another user needs root; this test runs as uid {os.geteuid()}")
    python = Path("/usr/bin/python3")
    if not python.is_file():
        pytest.skip("the unprivileged check runs the pyz with the system's /usr/bin/python3, which is missing")
    try:
        user = pwd.getpwnam(UNPRIVILEGED)
    except KeyError:
        pytest.skip(f"no user {UNPRIVILEGED!r} on this machine")
    reach = Path(tempfile.mkdtemp(prefix="ck-check-"))
    try:
        reach.chmod(0o755)
        shutil.copy(pyz, reach / "ckagent.pyz")
        (reach / "ckagent.pyz").chmod(0o755)
        home = reach / "home"
        home.mkdir()
        os.chown(home, user.pw_uid, user.pw_gid)

        def run(**env: str) -> CheckRun:
            done = subprocess.run(
                [str(python), str(reach / "ckagent.pyz"), "config", "check"], cwd=home, capture_output=True,
                text=True, timeout=CHECK_TIMEOUT, check=False, user=user.pw_uid, group=user.pw_gid,
                extra_groups=[], env=_clean_env(HOME=str(home), USER=UNPRIVILEGED, SHIV_ROOT=str(home / "shiv"),
                                                AGENT_WORK_DIR=str(home / "work"), **env))
            return CheckRun(done.returncode, done.stdout, done.stderr)

        yield run
    finally:
        shutil.rmtree(reach, ignore_errors=True)


def check_leftovers() -> list[str]:
    """What a finished level check left on this machine: ``ckagent-check-<pid>-*`` cgroups below this
    process's own cgroup in every hierarchy, and ``inet ckagent_check_<pid>`` tables (listed with
    ``nft``, when it is installed and this process may list), of processes that are gone (a check still
    running, e.g. another test's `config check`, has its own in place). [] when nothing (blocking)."""
    found = [str(path) for directory in set(own_dirs().values()) for path in directory.glob("ckagent-check-*")
             if _gone(path.name.split("-")[2])]
    nft = shutil.which("nft")
    if nft is not None:
        done = subprocess.run([nft, "-j", "list", "tables"], capture_output=True, text=True, timeout=30, check=False)
        if done.returncode == 0 and done.stdout.strip():
            found += [f"table inet {o['table']['name']}" for o in json.loads(done.stdout).get("nftables", [])
                      if "table" in o and o["table"]["name"].startswith("ckagent_check_")
                      and _gone(o["table"]["name"].removeprefix("ckagent_check_"))]
    return found


def _gone(pid: str) -> bool:
    """Whether the process ``pid`` (text) has exited (True for text that is no pid)."""
    return not pid.isdigit() or not os.path.exists(f"/proc/{pid}")
