"""The KEDA overlays' Prometheus queries, evaluated by Prometheus's own engine (``promtool test
rules``) on the reference master's series as its /metrics exposes them: pending tasks by spider (no
series at all while nothing waits), running tasks (one series). The queries are read from the rendered
manifests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.manifests import by_kind, rendered

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="promtool not installed (Debian/Ubuntu: apt-get install prometheus)")

# (series → value, what the ScaledObject's query reads, what the ScaledJob's reads)
CASES = [
    ({}, 0, 0),
    ({"ckmaster_tasks_running": 3}, 3, 0),  # nothing waits: the pending gauge has no series
    ({'ckmaster_tasks_pending{spider="a"}': 2, 'ckmaster_tasks_pending{spider="b"}': 1,
      "ckmaster_tasks_running": 4}, 7, 3),
    ({'ckmaster_tasks_pending{spider="a"}': 5, "ckmaster_tasks_running": 0}, 5, 5),
]


def _query(variant: str, kind: str) -> str:
    (trigger,) = by_kind(rendered(variant))[kind]["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    return str(trigger["metadata"]["query"])


def _promtool(tmp_path: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "queries.test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": tests}))
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60,
                          check=False)


def _case(series: dict[str, int], expressions: list[tuple[str, int | None]]) -> dict[str, Any]:
    return {"interval": "1m",
            "input_series": [{"series": name, "values": str(value)} for name, value in series.items()],
            "promql_expr_test": [{"expr": expr, "eval_time": "0m",
                                  "exp_samples": [] if value is None else [{"labels": "{}", "value": value}]}
                                 for expr, value in expressions]}


def test_the_queries_read_the_queue_and_zero_when_nothing_waits(tmp_path: Path) -> None:
    scaled_object, scaled_job = _query("keda", "ScaledObject"), _query("keda-job", "ScaledJob")
    tests = [_case(series, [(scaled_object, fleet), (scaled_job, jobs)]) for series, fleet, jobs in CASES]
    result = _promtool(tmp_path, tests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_without_or_vector_the_sum_reads_nothing_while_crawls_run(tmp_path: Path) -> None:
    """Why the terms carry ``or vector(0)``: the plain sum is no value at all (KEDA: "nothing to
    do") when nothing is pending, even with tasks running."""
    plain = "sum(ckmaster_tasks_pending) + sum(ckmaster_tasks_running)"
    result = _promtool(tmp_path, [_case({"ckmaster_tasks_running": 3}, [(plain, None)])])
    assert result.returncode == 0, result.stdout + result.stderr
