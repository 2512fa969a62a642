"""The KEDA overlays' Prometheus queries, evaluated by Prometheus's own engine (``promtool test
rules``) on the reference master's /metrics — a real dev master's scrape, and series of the shapes it
gives: pending tasks by spider (an empty queue is one series at 0, ``spider=""``), running tasks (one
series). The queries are read from the rendered manifests. Without any scrape of the master the queries are empty, and the manifests make
that an error for KEDA (``ignoreNullValues: "false"``: the fleet is kept as it is) rather than 0 (KEDA's
default: the fleet scaled in, its crawls migrated towards a master no one reaches)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import yaml
from harness import make_zip, register, scrape_samples
from harness.manifests import by_kind, rendered

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="promtool not installed (Debian/Ubuntu: apt-get install prometheus)")

# (the master's series → value, what the ScaledObject's query reads, what the ScaledJob's reads)
CASES = [
    ({'ckmaster_tasks_pending{spider=""}': 0, "ckmaster_tasks_running": 0}, 0, 0),
    ({'ckmaster_tasks_pending{spider=""}': 0, "ckmaster_tasks_running": 3}, 3, 0),
    ({'ckmaster_tasks_pending{spider="a"}': 2, 'ckmaster_tasks_pending{spider="b"}': 1,
      "ckmaster_tasks_running": 4}, 7, 3),
    ({'ckmaster_tasks_pending{spider="a"}': 5, 'ckmaster_tasks_pending{spider=""}': 2,
      "ckmaster_tasks_running": 0}, 7, 7),
]


def _trigger(variant: str, kind: str) -> dict[str, str]:
    (trigger,) = by_kind(rendered(variant))[kind]["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    return dict(trigger["metadata"])


def _promtool(tmp_path: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "queries.test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": tests}))
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60,
                          check=False)


def _case(series: dict[str, int], expressions: list[tuple[str, int | None]]) -> dict[str, Any]:
    """A promtool test: ``series`` at time 0; each expression's single unlabelled value (None: no value)."""
    return {"interval": "1m",
            "input_series": [{"series": name, "values": str(value)} for name, value in series.items()],
            "promql_expr_test": [{"expr": expr, "eval_time": "0m",
                                  "exp_samples": [] if value is None else [{"labels": "{}", "value": value}]}
                                 for expr, value in expressions]}


def test_the_queries_read_the_masters_queue(tmp_path: Path) -> None:
    fleet, jobs = _trigger("keda", "ScaledObject"), _trigger("keda-job", "ScaledJob")
    tests = [_case(series, [(fleet["query"], want_fleet), (jobs["query"], want_jobs)])
             for series, want_fleet, want_jobs in CASES]
    result = _promtool(tmp_path, tests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_without_a_scrape_of_the_master_the_queries_are_an_error_not_zero(tmp_path: Path) -> None:
    fleet, jobs = _trigger("keda", "ScaledObject"), _trigger("keda-job", "ScaledJob")
    result = _promtool(tmp_path, [_case({}, [(fleet["query"], None), (jobs["query"], None)])])
    assert result.returncode == 0, result.stdout + result.stderr
    assert fleet["ignoreNullValues"] == jobs["ignoreNullValues"] == "false"


def _series(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> dict[str, int]:
    """A scrape's samples as promtool input series (``name{label="value"}`` → value)."""
    out = {}
    for (name, labels), value in samples.items():
        text = ",".join(f'{k}="{v}"' for k, v in sorted(labels))
        out[f"{name}{{{text}}}" if text else name] = int(value)
    return out


async def test_the_queries_over_a_real_dev_masters_scrape(dev_master: Any, tmp_path: Path) -> None:
    """The real reference master, empty (the queries read 0, not nothing), then with two tasks pending
    and one of them claimed by a node (the fleet's query reads 2, the Jobs' 1)."""
    fleet = await trio.to_thread.run_sync(_trigger, "keda", "ScaledObject")  # kustomize: a process
    jobs = await trio.to_thread.run_sync(_trigger, "keda-job", "ScaledJob")
    cases = []
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=10) as http:
            cases.append(_case(_series(await scrape_samples(http)), [(fleet["query"], 0), (jobs["query"], 0)]))
            admin = dev_master.admin
            spider_id = str(await admin.create_spider("alpha", "python"))
            await admin.upload_package(spider_id, make_zip({"main.py": b"print('hi')\n"}))
            tasks = [await admin.create_task(spider_id) for _ in range(2)]
            node = await register(http, dev_master.registration_token, "pod-0")
            assert (await node.claim(tasks[0])).status_code == 200
            await node.heartbeat(maxWorkers=2, freeSlots=1, runningTaskIds=tasks[:1])
            cases.append(_case(_series(await scrape_samples(http)), [(fleet["query"], 2), (jobs["query"], 1)]))
    result = await trio.to_thread.run_sync(_promtool, tmp_path, cases)
    assert result.returncode == 0, result.stdout + result.stderr
