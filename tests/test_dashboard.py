"""config/grafana-dashboard.json: well-formed, and every metric and label it queries is one the agent exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ckagent.delivery.lifecycle import DepsPrepared, TaskAdmitted, TaskFinished, TaskStarted
from ckagent.master.protocol import Task, TaskResult
from ckagent.port.metrics import AgentMetrics, LiveFigures, OutboxFigures
from ckagent.task.supervisor import RunningTask

DASHBOARD = Path(__file__).resolve().parent.parent / "config" / "grafana-dashboard.json"
TARGET_LABELS = {"instance", "job", "le"}  # added by Prometheus (and the histogram's own)


def load() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def exported() -> dict[str, set[str]]:
    """Sample name → label names, from the agent's own exposition with every hook exercised once."""
    metrics = AgentMetrics("0.0.0", "node")
    rt = RunningTask(task=Task.from_json({"id": "t", "spiderId": "s", "framework": "python"}))
    metrics.record(TaskAdmitted(rt.task.id, rt.task.spider_id, rt.claimed_at))
    metrics.record(TaskStarted(rt.task.id, rt.claimed_at, time.time()))
    metrics.record(DepsPrepared(rt.task.id, 1.0, False))
    metrics.record(TaskFinished(rt.task.id, TaskResult(status="FAILED", error_code="TIMEOUT", duration_ms=10)))
    metrics.master_request("poll", "ok", 0.1)
    metrics.crawl.observe("t", "shop", {"items": 3, "requests": 4, "errors": 1,
                                        "responsesByStatus": {"200": 3, "404": 1}}, True)
    body, _ = metrics.render(LiveFigures(state="RUNNING", outbox=OutboxFigures()))
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_dashboard_is_well_formed() -> None:
    dashboard = load()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("status", "running vs slots", "duration", "outbox", "master request errors", "per node",
                  "items scraped per spider", "requests per spider", "responses by status class",
                  "task outcomes by errorcode"):
        assert topic in titles, topic
    for p in dashboard["panels"]:
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for target in p["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert 'instance=~"$instance"' in target["expr"], (p["title"], target["expr"])


def test_every_queried_metric_and_label_is_exported() -> None:
    names = exported()
    queried: set[str] = set()
    for expr in expressions(load()):
        for metric in re.findall(r"\bckagent_[a-z0-9_]+\b", expr):
            queried.add(metric)
            assert metric in names, f"{metric} (in {expr}) is not exported"
        # Label matchers: metric{label=..., label!=..., label=~...}
        for metric, matchers in re.findall(r"\b(ckagent_[a-z0-9_]+)\{([^}]*)\}", expr):
            for label in re.findall(r"([a-z_]+)\s*(?:=~|!~|!=|=)", matchers):
                assert label in names[metric] | TARGET_LABELS, f"{metric} has no label {label!r}: {expr}"
        # Grouping: by (a, b) must name labels of the metrics under it.
        for grouping in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            inner = set(re.findall(r"\bckagent_[a-z0-9_]+\b", expr))
            available = set().union(*(names[m] for m in inner)) | TARGET_LABELS
            for label in (g.strip() for g in grouping.split(",")):
                assert label in available, f"grouping by {label!r} that no queried metric has: {expr}"
    # The dashboard covers the families an operator needs.
    for family in ("ckagent_tasks_finished_total", "ckagent_tasks_running", "ckagent_max_workers",
                   "ckagent_task_duration_seconds_bucket", "ckagent_outbox_log_lines", "ckagent_outbox_results",
                   "ckagent_master_requests_total", "ckagent_heartbeat_age_seconds", "ckagent_build_info",
                   "ckagent_crawl_items_total", "ckagent_crawl_requests_total", "ckagent_crawl_responses_total",
                   "ckagent_crawl_errors_total"):
        assert family in queried, family


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian/Ubuntu: apt-get install prometheus)")
def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    rules = []
    for i, expr in enumerate(expressions(load())):
        if expr.startswith("label_values("):
            continue  # a Grafana function, not PromQL
        concrete = expr.replace("$__rate_interval", "5m").replace("$instance", ".*")
        rules.append({"record": f"ckagent:dashboard_query_{i}", "expr": concrete})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
