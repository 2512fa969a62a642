"""A stop reaches the process that does the work, through launchers that pass no signal on.

Real processes: ``npm start`` (npm → ``sh -c`` → node), ``sh -c`` with two commands (dash forwards
nothing), and a plain Python spider whose child must not be signalled before the main process
(a Scrapy spider's browser). The spider's SIGTERM handler must run, and the log must say whether
it exited within the grace or was killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import psutil
import pytest
import trio

from ckagent.containment.process import MARKER_VAR, ProcessOutcome, run_supervised
from ckagent.containment.stoptarget import is_launcher, stop_targets

TRAP_JS = textwrap.dedent("""
    process.on('SIGTERM', () => {
      console.log('handler ran');
      setTimeout(() => { console.log('flushed'); process.exit(0); }, 200);
    });
    console.log('ready');
    setInterval(() => {}, 1000);
""")

TRAP_PY = textwrap.dedent("""
    import signal, sys, time
    def handler(signum, frame):
        print("handler ran", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, handler)
    print("ready", flush=True)
    while True:
        time.sleep(1)
""")


async def _run_until_ready(argv: list[str], cwd: Path, grace: float = 5.0) -> tuple[ProcessOutcome, str, list[str]]:
    """Start ``argv``, stop it once it printed ``ready``; (outcome, its output, the agent's notices)."""
    task_id = uuid.uuid4().hex
    out: list[bytes] = []
    notices: list[str] = []
    stop = trio.Event()

    def output(chunk: bytes) -> None:
        out.append(chunk)
        if b"ready" in b"".join(out):
            stop.set()

    with trio.fail_after(60):
        outcome = await run_supervised(
            argv, cwd=cwd, env={**os.environ, MARKER_VAR: task_id}, task_id=task_id, output=output,
            deadline_seconds=None, grace=grace, stop=stop, notice=notices.append,
        )
    return outcome, b"".join(out).decode(errors="replace"), notices


@pytest.mark.skipif(shutil.which("npm") is None, reason="needs npm")
async def test_npm_start_spider_runs_its_sigterm_handler(tmp_path: Path) -> None:
    (tmp_path / "trap.js").write_text(TRAP_JS)
    (tmp_path / "package.json").write_text(json.dumps({"name": "t", "version": "1.0.0",
                                                       "scripts": {"start": "node trap.js"}}))
    outcome, text, notices = await _run_until_ready(["npm", "start", "--silent"], tmp_path)
    assert "handler ran" in text and "flushed" in text, (text, notices)
    assert outcome.kill_sent_at is None and outcome.workers_left == 0, notices
    sent = next(n for n in notices if "sent SIGTERM" in n)
    assert "node trap.js" in sent and "below the launcher" in sent, sent


async def test_sh_c_with_a_setup_step_signals_the_worker(tmp_path: Path) -> None:
    (tmp_path / "trap.py").write_text(TRAP_PY)
    script = f"true && {sys.executable} trap.py; echo after"
    outcome, text, notices = await _run_until_ready(["/bin/sh", "-c", script], tmp_path)
    assert "handler ran" in text, (text, notices)
    assert outcome.kill_sent_at is None, notices
    assert "trap.py" in next(n for n in notices if "sent SIGTERM" in n)


async def test_a_killed_worker_is_reported_as_killed(tmp_path: Path) -> None:
    """The worker ignores SIGTERM: the kill after the grace is said, not a graceful exit."""
    (tmp_path / "deaf.py").write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                      "print('ready', flush=True)\ntime.sleep(60)\n")
    outcome, _, notices = await _run_until_ready(["/bin/sh", "-c", f"{sys.executable} deaf.py; true"], tmp_path,
                                                 grace=1.0)
    assert outcome.kill_sent_at is not None, notices
    assert any("killed every process" in n for n in notices), notices


def test_a_non_launcher_main_process_alone_gets_the_signal() -> None:
    """Python spawning a child (a browser): only the main process is signalled."""
    child = "import time; time.sleep(60)"
    main = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
            "print('ready', p.pid, flush=True); time.sleep(60)")
    with subprocess.Popen([sys.executable, "-c", main], stdout=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None
            child_pid = int(proc.stdout.readline().split()[1])
            assert [t.pid for t in stop_targets(proc.pid)] == [proc.pid]
            assert not is_launcher(psutil.Process(proc.pid))
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid, 9)
            proc.kill()
