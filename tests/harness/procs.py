"""A task's processes as /proc shows them, the ``no_strays`` fixture, settings for an in-process agent at a containment level, spider building blocks."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml

from ckagent.containment import available_levels
from ckagent.devmaster.client import AdminClient
from harness.core import agent_settings, eventually
from harness.recording import RecordingMaster


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with libyaml's parser when PyYAML has it (the same documents, ~10× less CPU:
    openapi.yaml takes 0.1 s in pure Python, and every pytest-xdist worker loads it at collection)."""
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    state = _state(pid)
    return state is not None and state not in ("Z", "X")


def marked_pids(task_id: str) -> list[int]:
    """Live processes whose environment carries CK_TASK_ID=<task_id> (read straight from /proc)."""
    marker = f"CK_TASK_ID={task_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read()
        except OSError:
            continue
        if marker in environ.split(b"\0") and alive(int(entry)):
            found.append(int(entry))
    return found


LEVELS_HERE = [level.value for level in available_levels(Path(tempfile.gettempdir()) / "ckagent-levels-probe")]
"""Containment levels this machine can run, as their setting's text; every test here runs at each
(``task.containment``)."""
LEVEL = {"current": "auto"}




STRAY_ROOTS: list[Path] = []
"""Work dirs outside tmp_path whose spiders the ``no_strays`` fixture also cleans up."""


@pytest.fixture(autouse=True)
def no_strays(tmp_path: Path) -> Any:
    """After each test, SIGKILL spider processes it left alive (only a failing test does), so one
    failure does not leave 10-minute sleepers behind. Matched by CK_TASK_DIR under the test's dirs."""
    yield
    roots = [str(tmp_path), *map(str, STRAY_ROOTS)]
    STRAY_ROOTS.clear()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
        except OSError:
            continue
        task_dirs = [v[len(b"CK_TASK_DIR="):].decode(errors="replace") for v in environ
                     if v.startswith(b"CK_TASK_DIR=")]
        if any(d.startswith(root + os.sep) for d in task_dirs for root in roots):
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)


def pids_in(lines: list[str], label: str) -> list[int]:
    """Pids a spider printed as ``<label> <pid>``."""
    return [int(m.group(1)) for line in lines if (m := re.search(rf"\b{label} (\d+)\b", line))]


async def wait_for_log(admin: AdminClient, task_id: str, text: str, timeout: float = 20) -> list[str]:  # noqa: ASYNC109
    """Poll the master until the task's log holds ``text``; returns the lines."""
    with trio.fail_after(timeout):
        while True:
            lines = await admin.get_logs(task_id)
            if any(text in line for line in lines):
                return lines
            await trio.sleep(0.1)


async def wait_for_path(path: Path, timeout: float = 20) -> None:  # noqa: ASYNC109
    """Wait until ``path`` exists."""
    await eventually(trio.Path(path).exists, timeout)


def settings_for(tmp_path: Path, master: RecordingMaster, **env: str) -> Any:
    """Agent settings for these tests: 1 s kill grace, no index probing."""
    values = {"AGENT_TASK_KILL_GRACE": "1", "AGENT_UV_INDEX_URL": "http://127.0.0.1:9/simple",
              "AGENT_TASK_CONTAINMENT": LEVEL["current"]}
    values.update(env)
    return agent_settings(tmp_path / "agent", master.base_url, master.registration_token, **values)


# Spider building blocks (Python source).
ESCAPE = textwrap.dedent("""
    def escape(label):
        # Double fork + setsid: the grandchild leaves the spider's process group and session.
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            pid = os.fork()
            if pid == 0:
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                time.sleep(300)
                os._exit(0)
            os.write(w, str(pid).encode())
            os._exit(0)
        os.close(w)
        pid = int(os.read(r, 32))
        os.wait()
        print(label, pid, flush=True)
""")


SLOW_BACKEND = '''
import os, time

def get_requires_for_build_wheel(config_settings=None):
    with open({pid_file!r}, "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(300)
    return []

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise RuntimeError("never reached")
'''
"""A PEP 517 build backend that writes its pid to ``{pid_file}`` and hangs: an install to cancel."""
