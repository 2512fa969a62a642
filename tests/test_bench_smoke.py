"""The benchmarks' smoke mode runs in the suite, so the benchmark code cannot rot.

``python -m bench --quick --no-scrapyd --only dispatch,makespan,overhead`` runs a few tasks per
benchmark against a real dev master and a real agent process (no Scrapyd, no package downloads).
Figures are not asserted (speed targets live in bench/, the machine is noisy); what is asserted is
that every benchmark ran, produced its figures and wrote the report.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckagent

REPO = Path(ckagent.__file__).resolve().parent.parent

@pytest.mark.slow
def test_quick_benchmarks_run_and_write_the_report(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--no-scrapyd", "--only", "dispatch,makespan,overhead",
         "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = out.read_text()
    for heading in ("## Summary", "## dispatch", "## makespan", "## overhead", "| Python |"):
        assert heading in report, report
    assert "FAILED" not in report, report
    # Each table has its rows with numbers in them (a NaN prints as "–").
    assert "| ckagent long poll | 5 |" in report
    assert "| python -c pass | 4 | 2 | ckagent |" in report
    assert "| ckagent (python -c tasks) |" in report


@pytest.mark.slow
def test_quick_node_load_benchmarks_run_and_write_the_report(tmp_path: Path) -> None:
    """Items flood, many tasks and the /metrics scrape (issue 18) in smoke mode: each ran, lost nothing."""
    out = tmp_path / "report.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--no-scrapyd", "--only", "items,manytasks,scrape",
         "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = out.read_text()
    for heading in ("## items", "## manytasks", "## scrape"):
        assert heading in report, report
    assert "FAILED" not in report, report
    assert "| items at the master | 20,000 | all, once, in order |" in report
    assert "| tasks incomplete | 0 |" in report
    assert "| loop lateness while scraping | p50 " in report


def test_summary_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    from bench._harness import summary

    figures = summary([0.3, 0.1, 0.2, 0.5, 0.4])
    assert figures["n"] == 5 and figures["p50"] == 0.3 and figures["max"] == 0.5
    assert figures["p95"] == 0.5  # nearest rank: ceil(0.95 * 5) = 5th value
    assert math.isnan(summary([])["p50"])
    twenty = summary([float(i) for i in range(1, 21)])
    assert twenty["p95"] == 19.0 and twenty["p50"] == 10.5


def test_quick_checkpoint_benchmark_runs_and_writes_the_report(tmp_path: Path) -> None:
    """The checkpoint cost (issue 38) in smoke mode: a synthetic JOBDIR packed, shipped to a real dev master
    (twice: the incremental part), restored byte for byte."""
    out = tmp_path / "report.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--no-scrapyd", "--only", "checkpoint", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = out.read_text()
    assert "## checkpoint" in report and "FAILED" not in report, report
    for row in ("| checkpoint 1: 10,000 seen, 1,000 pending (all new) |", "| checkpoint 2: +100 seen and pending",
                "| restore of checkpoint 2 on another node |"):
        assert row in report, report
