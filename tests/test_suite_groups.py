"""The suite's serial groups hold: pytest-xdist's ``--dist loadgroup`` sends the tests of one
``xdist_group`` to one worker (tests/conftest.py's SERIAL_GROUPS rely on it: two useradd at once fail).

A pytest and pytest-xdist pair that stops grouping (pytest 9.2 with xdist 3.8 did, silently) fails here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROBE = '''
import os, pathlib, time, pytest

def record(name):
    pathlib.Path(name).write_text(os.environ.get("PYTEST_XDIST_WORKER", "none"))
    time.sleep(0.5)  # long enough for the other worker to be free for the next test

@pytest.mark.xdist_group("g")
def test_a(): record("a")

@pytest.mark.xdist_group("g")
def test_b(): record("b")

def test_c(): record("c")

def test_d(): record("d")
'''


@pytest.mark.slow  # a pytest with two workers of its own: a few seconds, more under load
def test_a_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(PROBE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
         "-c", "/dev/null", "--rootdir", str(tmp_path), "test_probe.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    workers = {name: (tmp_path / name).read_text() for name in "abcd"}
    assert workers["a"] == workers["b"] != "none", workers
