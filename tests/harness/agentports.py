"""Another agent's entry in a registry of agents' ports, held by a real process of its own."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["REGISTERING", "another_agent"]

REPO = Path(__file__).resolve().parents[2]

REGISTERING = """
import sys
from pathlib import Path
from ckagent.node.agentports import PortRegistry
registry = PortRegistry(Path(sys.argv[1]))
registry.register(int(p) for p in sys.argv[2:])
print("ready", registry.path, flush=True)
sys.stdin.read()  # until the test closes stdin (or kills this process)
registry.close()
"""
"""A process that registers ``argv[2:]`` in the registry directory ``argv[1]`` and holds the entry
until its stdin closes."""


@contextlib.contextmanager
def another_agent(directory: Path, ports: list[int]) -> Iterator[subprocess.Popen[str]]:
    """A process (not this one: its own pid and start time) whose entry in ``directory`` names
    ``ports`` while it runs; it removes the entry when the block ends, unless the test killed it."""
    process = subprocess.Popen([sys.executable, "-c", REGISTERING, str(directory), *map(str, ports)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("ready"), line
        yield process
    finally:
        if process.poll() is None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
