"""The agent's side of a spider's state, played by a test: the task dir's control files, the spider's env.

:class:`TaskFiles` lays out a task dir as the agent does for issue 38 (``state/``, ``control.jsonl``,
``control-ack.jsonl``, ``snapshots/``, ``items.jsonl``), gives the spider's environment
(:meth:`TaskFiles.env`), appends requests (:meth:`TaskFiles.request`, :meth:`TaskFiles.append`) and
waits for the spider's answers (:meth:`TaskFiles.wait_ack`). :meth:`TaskFiles.resume_into` makes the
next attempt's task dir from an answered snapshot, as the agent and the master would (the state dir
restored, the items before the snapshot's offset kept by the master). :func:`sdk_env` and
:func:`start_spider` start a spider (Python with the SDK importable, or Node) as a real process;
:class:`Spiders` starts the ones that say ``ready`` once their state API is in use, and ends them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

__all__ = ["NODE_SDK", "PYTHON_SDK_SRC", "SPIDER_TIMEOUT", "Spiders", "TaskFiles", "read_jsonl", "sdk_env",
           "start_spider"]

SPIDER_TIMEOUT = 30.0
"""Seconds any one spider process of these tests may take."""

REPO = Path(__file__).resolve().parents[2]
PYTHON_SDK_SRC = REPO / "sdk" / "python" / "src"
NODE_SDK = REPO / "sdk" / "node" / "crawlerkeeper-sdk.cjs"


def read_jsonl(path: Path) -> list[Any]:
    """The JSON values of a file's whole lines (a partial last line is not read)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]


def sdk_env(**extra: str) -> dict[str, str]:
    """This process's environment without CK_* variables, the Python SDK importable, ``extra`` added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CK_")}
    env["PYTHONPATH"] = str(PYTHON_SDK_SRC)
    env.pop("PYTHONHOME", None)
    env.update(extra)
    return env


def start_spider(code: str, env: dict[str, str], *, node: bool = False, cwd: Path | None = None,
                 python: str = sys.executable) -> subprocess.Popen[str]:
    """Start ``code`` (Python, dedented; or Node with ``node=True``, the SDK at ``./ck.cjs`` in ``cwd``) as
    a real process with ``env``; its stdin, stdout and stderr are pipes (text)."""
    if node:
        assert cwd is not None, "a Node spider needs a cwd to hold its copy of the SDK"
        shutil.copy(NODE_SDK, cwd / "ck.cjs")
        argv = ["node", "-e", textwrap.dedent(code)]
    else:
        argv = [python, "-c", textwrap.dedent(code)]
    return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


class TaskFiles:
    """One attempt's task dir, the files of the spider's side of the control channel."""

    def __init__(self, task_dir: Path, attempt: int = 1) -> None:
        self.dir = task_dir
        self.attempt = attempt
        self.state = task_dir / "state"
        self.control = task_dir / "control.jsonl"
        self.ack = task_dir / "control-ack.jsonl"
        self.snapshots = task_dir / "snapshots"
        self.items = task_dir / "items.jsonl"
        self.state.mkdir(parents=True, exist_ok=True)

    def env(self, **extra: str) -> dict[str, str]:
        """The spider's environment as an agent gives it (the CK_* of issue 38 and the items file)."""
        return sdk_env(
            CK_TASK_DIR=str(self.dir), CK_ITEMS_FILE=str(self.items), CK_STATE_DIR=str(self.state),
            CK_CONTROL_FILE=str(self.control), CK_CONTROL_ACK_FILE=str(self.ack),
            CK_SNAPSHOT_DIR=str(self.snapshots), CK_ATTEMPT=str(self.attempt), **extra,
        )

    def append(self, data: bytes) -> None:
        """Append raw bytes to the control file (one write)."""
        with open(self.control, "ab") as file:
            file.write(data)

    def request(self, rid: int, event: str = "persistState", **fields: Any) -> None:
        """Append one request line: ``{"event", "id", **fields}``."""
        self.append((json.dumps({"event": event, "id": rid, **fields}) + "\n").encode())

    def acks(self) -> list[dict[str, Any]]:
        return read_jsonl(self.ack)

    def wait_ack(self, rid: int, timeout: float = 20.0, proc: subprocess.Popen[str] | None = None) -> dict[str, Any]:
        """The answer to request ``rid`` once the spider wrote it (polls the file: another process writes it).
        Fails after ``timeout`` seconds, or at once when ``proc`` ended without answering."""
        deadline = time.monotonic() + timeout
        while True:
            for answer in self.acks():
                if answer.get("id") == rid:
                    return answer
            if proc is not None and proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"the spider ended ({proc.returncode}) without answering {rid}:\n{out}\n{err}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no answer to request {rid} in {timeout} s; acks: {self.acks()}")
            time.sleep(0.02)

    def items_before(self, offset: int) -> list[Any]:
        """The items the master keeps for a snapshot at ``offset`` (whole lines before it)."""
        data = self.items.read_bytes()[:offset]
        assert offset == 0 or data.endswith(b"\n"), "an items offset must be at a line boundary"
        return [json.loads(line) for line in data.splitlines()]

    def resume_into(self, task_dir: Path, snapshot: str) -> TaskFiles:
        """The next attempt's task dir, its state dir a copy of ``snapshots/<snapshot>`` (links kept as
        links: the copy is the spider's, never followed)."""
        nxt = TaskFiles(task_dir, self.attempt + 1)
        shutil.rmtree(nxt.state)
        shutil.copytree(self.snapshots / snapshot, nxt.state, symlinks=True)
        return nxt


class Spiders:
    """The spider processes of one test: :meth:`start` waits for their ``ready`` line, :meth:`finish`
    closes their stdin (the sign to end) and waits, :meth:`close` kills what is left."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def start(self, code: str, env: dict[str, str], *, node: bool = False, cwd: Path | None = None,
              python: str = sys.executable) -> subprocess.Popen[str]:
        proc = start_spider(code, env, node=node, cwd=cwd, python=python)
        self.started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"{line!r}\n{proc.communicate(timeout=SPIDER_TIMEOUT)}"
        return proc

    @staticmethod
    def finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
        """Close the spider's stdin and wait for it; it must exit 0. Returns (stdout, stderr)."""
        out, err = proc.communicate(timeout=SPIDER_TIMEOUT)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
        return out, err

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=SPIDER_TIMEOUT)
