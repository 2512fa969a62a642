"""The environment a Python process was started with, as ``/proc/<pid>/environ`` shows it — also where
the test may not read that file.

The agent makes itself non-dumpable (ckagent.node.hardening): its ``/proc`` files then belong to root,
and a test running as the agent's own plain user cannot read its ``environ`` (only root can: the very
reader the secrets tests guard against). :class:`EnvironProbe` gets the same bytes another way: a
``sitecustomize`` module on the process's ``PYTHONPATH`` reads ``/proc/self/environ`` when each
Python image starts — right after ``execve``, while the process is still dumpable — and appends it to
a log. ``/proc/<pid>/environ`` is the block the latest ``execve`` of that pid put in place, and Python
never writes into it, so the probe's last record for a pid is what the file shows for as long as that
image runs. Where the test can read the file itself (root) :meth:`EnvironProbe.initial_environ` reads
it and checks that the probe's record agrees, so the probe is held to the kernel's word.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["EnvironProbe"]

LOG_ENV = "CK_TEST_ENVIRON_LOG"

_SITECUSTOMIZE = r'''
"""Test probe (tests/harness/environs.py): record this image's /proc/self/environ, then run the
sitecustomize this one hides, if any."""
import importlib.machinery as _machinery
import importlib.util as _util
import json as _json
import os as _os
import sys as _sys

try:
    with open("/proc/self/environ", "rb") as _f:
        _record = _json.dumps({"pid": _os.getpid(), "argv": list(getattr(_sys, "orig_argv", _sys.argv)),
                               "environ": _f.read().decode("latin-1")}) + "\n"
    _fd = _os.open(_os.environ["%(log_env)s"], _os.O_WRONLY | _os.O_APPEND | _os.O_CREAT | _os.O_CLOEXEC, 0o600)
    try:
        _os.write(_fd, _record.encode())  # one write on O_APPEND: records of concurrent processes never mix
    finally:
        _os.close(_fd)
except (KeyError, OSError):
    pass
_here = _os.path.dirname(_os.path.abspath(__file__))
_spec = _machinery.PathFinder.find_spec("sitecustomize", [p for p in _sys.path
                                                          if _os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(_util.module_from_spec(_spec))
'''


class EnvironProbe:
    """A probe in ``directory`` (made if missing): pass :attr:`env` to the Python processes to watch
    (their children inherit it unless given an environment of their own, as spiders are)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE % {"log_env": LOG_ENV})
        self.directory = directory
        self.log = directory / "environs.jsonl"
        path = os.environ.get("PYTHONPATH")
        self.env = {"PYTHONPATH": f"{directory}{os.pathsep}{path}" if path else str(directory),
                    LOG_ENV: str(self.log)}
        """The variables that put the probe in a process's way."""

    def images(self, pid: int) -> list[bytes]:
        """The environ each Python image of ``pid`` started with, in the order they started (a process
        that re-executes itself has several)."""
        if not self.log.exists():
            return []
        records = (json.loads(line) for line in self.log.read_text().splitlines())
        return [r["environ"].encode("latin-1") for r in records if r["pid"] == pid]

    def initial_environ(self, pid: int) -> bytes:
        """What ``/proc/<pid>/environ`` shows: the file where this process may read it (then the probe's
        record must agree), else the probe's record. Raises AssertionError when the probe recorded
        nothing for ``pid`` (it was not started with :attr:`env`, or is not Python)."""
        images = self.images(pid)
        assert images, f"the environ probe has no record of pid {pid} (started with probe.env?)"
        recorded = images[-1]
        try:
            actual = Path(f"/proc/{pid}/environ").read_bytes()
        except PermissionError:  # (non-dumpable and another user's, to this one: root owns its /proc files)
            return recorded
        assert actual == recorded, f"the probe's record of pid {pid} differs from /proc/{pid}/environ"
        return actual
