"""The spider's stdout/stderr pipes are enlarged (PIPE_BYTES), so bursts do not block the spider.

Why it matters beyond speed: under PYTHONUNBUFFERED=1 (set for every spider) CPython's stdout is a
raw file, and a write larger than the free pipe space that a signal handler interrupts is cut short
without an error. A 1 MiB pipe makes that window much rarer than the 64 KiB default.
"""

from __future__ import annotations

import os
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import trio

from ckagent.containment.process import MARKER_VAR, PIPE_BYTES, run_supervised

CHILD = textwrap.dedent("""
    import fcntl, os, sys, time
    deadline = time.monotonic() + 10
    sizes = [0, 0]
    while time.monotonic() < deadline:
        sizes = [fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) for fd in (1, 2)]
        if min(sizes) > 65536:
            break
        time.sleep(0.01)
    os.write(1, ("sizes %d %d\\n" % tuple(sizes)).encode())
""")


def _pipe_max_size() -> int:
    return int(Path("/proc/sys/fs/pipe-max-size").read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_GETPIPE_SZ is Linux only")
async def test_spider_pipes_are_enlarged(tmp_path: Path) -> None:
    task_id = uuid.uuid4().hex
    system_max = _pipe_max_size()
    out: list[bytes] = []
    with trio.fail_after(30):
        outcome = await run_supervised(
            [sys.executable, "-c", CHILD], cwd=tmp_path, env={**os.environ, MARKER_VAR: task_id},
            task_id=task_id, output=out.append, deadline_seconds=20, grace=1.0, stop=trio.Event(),
            notice=lambda text: None,
        )
    assert outcome.returncode == 0
    expected = min(PIPE_BYTES, system_max)
    assert b"".join(out).decode().split() == ["sizes", str(expected), str(expected)]


INTERLEAVED = textwrap.dedent("""
    import os, sys, time
    os.write(1, b"stdout line, first half")   # what an unbuffered print() does: the text ...
    time.sleep(0.3)
    os.write(2, b"a whole stderr line\\n")      # ... another pipe's line meanwhile ...
    time.sleep(0.3)
    os.write(1, b", second half\\n")             # ... and then the newline
    os.write(1, b"no newline at the end")
""")


async def test_a_line_of_one_pipe_never_lands_inside_a_line_of_the_other(tmp_path: Path) -> None:
    task_id = uuid.uuid4().hex
    out: list[bytes] = []
    with trio.fail_after(30):
        outcome = await run_supervised(
            [sys.executable, "-c", INTERLEAVED], cwd=tmp_path, env={**os.environ, MARKER_VAR: task_id},
            task_id=task_id, output=out.append, deadline_seconds=20, grace=1.0, stop=trio.Event(),
            notice=lambda text: None,
        )
    assert outcome.returncode == 0
    lines = b"".join(out).decode().splitlines()
    assert lines[:3] == ["a whole stderr line", "stdout line, first half, second half", "no newline at the end"], lines
