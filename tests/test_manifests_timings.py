"""The manifests' timings and counts held against the agent's own settings, as each pod loads them
(the ConfigMap through the agent's loader, the pod's AGENT_* values over it) and with the defaults:
the grace a pod gets for the migrate and for a drain, the probes against the supervisor's bounds, the
PodDisruptionBudget against the replicas, KEDA's threshold against the slots of a pod and its
scale-in against the migrate, the ScaledJob's idle exit and deadline against the polls and the task
timeouts. Each rule says why in its docstring; the manifests' comments say the same figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness.manifests import VARIANTS, Workload, agent_args, by_kind, pod_settings, rendered, workloads

from ckagent.cli.stopagent import MARGIN
from ckagent.code.frameworks import REGISTRY, SCRAPY_STOP_GRACE
from ckagent.node.config import load_settings
from ckagent.node.resources import compute_max_workers
from ckagent.pod.command import parse as parse_supervise
from ckagent.pod.livez import PROBE_TIMEOUT
from ckagent.task.stop import stop_grace

KUBERNETES_DEFAULT_GRACE = 30
WORKLOAD_VARIANTS = [v for v in VARIANTS if v != "monitoring"]


def _workload(variant: str) -> tuple[list[dict[str, Any]], Workload]:
    objects = rendered(variant)
    (workload,) = workloads(objects)
    return objects, workload


def _settings(variant: str, tmp_path: Path) -> list[Any]:
    """The pod's settings and the defaults (the rules hold for both)."""
    objects, workload = _workload(variant)
    return [pod_settings(objects, workload, tmp_path), load_settings(None, env={}, require_token=False)]


def _start_timeout(workload: Workload) -> float:
    """The supervisor's --start-timeout in the pod (its default unless the command names one): /livez
    answers 200 for an agent (re)starting for less than this."""
    return parse_supervise([*workload.container["command"][3:], *workload.container.get("args", [])]).start_timeout


@pytest.mark.parametrize("variant", WORKLOAD_VARIANTS)
def test_the_grace_covers_the_migrate_and_a_drain(variant: str, tmp_path: Path) -> None:
    """terminationGracePeriodSeconds covers the preStop migrate (migrate_timeout + flush_timeout +
    `ckagent stop`'s margin) and a drain (drain_timeout + the longest stop grace a task may get —
    every framework's default, Scrapy's graceful close of a polite crawl, is within
    task.max_stop_grace — + flush_timeout), with the pod's settings and with the defaults; and the
    agent's own migrate bound fits Kubernetes' default 30 s grace."""
    _, workload = _workload(variant)
    grace = workload.pod["terminationGracePeriodSeconds"]
    longest_default = max(f.stop_grace or 0.0 for f in REGISTRY.values())
    for s in _settings(variant, tmp_path):
        task = s.task
        assert longest_default == SCRAPY_STOP_GRACE <= task.max_stop_grace
        longest = max(task.kill_grace, task.max_stop_grace)
        assert stop_grace("scrapy", None, task.kill_grace, task.max_stop_grace)[0] <= longest
        assert stop_grace("scrapy", 10_000.0, task.kill_grace, task.max_stop_grace)[0] <= longest
        assert grace > task.drain_timeout + longest + task.flush_timeout
        assert grace > task.migrate_timeout + task.flush_timeout + MARGIN
        assert task.migrate_timeout + task.flush_timeout <= KUBERNETES_DEFAULT_GRACE
    assert grace == 260 > 60 + 180 + 10, "the figure the comments give"


@pytest.mark.parametrize("variant", WORKLOAD_VARIANTS)
def test_liveness_asks_the_supervisor_and_never_restarts_a_starting_agent(variant: str) -> None:
    """The kubelet restarts the container (and every crawl in it) after a run of failed liveness
    probes: initialDelaySeconds + periodSeconds × failureThreshold (35 s), less than the supervisor's
    start timeout (120 s) during which an agent restarting in place may not answer. So liveness asks
    the supervisor, which covers that window, never the agent's port; and its timeoutSeconds exceeds
    the supervisor's own wait on the agent's /healthz (PROBE_TIMEOUT, 2 s), so a slow but alive agent is
    not a failed probe. Readiness may ask the agent: a restarting agent is rightly not ready."""
    _, workload = _workload(variant)
    live, ready = workload.container["livenessProbe"], workload.container["readinessProbe"]
    window = live["initialDelaySeconds"] + live["periodSeconds"] * live["failureThreshold"]
    assert window < _start_timeout(workload) == 120
    assert live["httpGet"]["port"] == "supervisor" != ready["httpGet"]["port"]
    assert live["timeoutSeconds"] > PROBE_TIMEOUT
    assert ready["timeoutSeconds"] > PROBE_TIMEOUT
    assert "startupProbe" not in workload.container, "the supervisor covers the agent's start"


@pytest.mark.parametrize("variant", WORKLOAD_VARIANTS)
def test_the_disruption_budget_lets_drains_go_on_one_pod_at_a_time(variant: str) -> None:
    """Where there is a budget: at most one pod unavailable (>= 1: a budget never blocks a drain for
    good), fewer than the replicas (a drain leaves a pod that takes the migrated crawls), unhealthy
    pods evictable, selecting the workload's pods; a rolling update adds a pod before it removes one.
    Jobs' pods have none (a Job has no scale for maxUnavailable)."""
    objects, workload = _workload(variant)
    kinds = by_kind(objects)
    if workload.kind == "ScaledJob":
        assert "PodDisruptionBudget" not in kinds
        return
    budget = kinds["PodDisruptionBudget"]["spec"]
    assert budget["maxUnavailable"] == 1 and "minAvailable" not in budget
    assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert budget["selector"]["matchLabels"].items() <= workload.labels.items()
    replicas = workload.obj["spec"].get("replicas")
    if "ScaledObject" in kinds:
        assert replicas is None, "the ScaledObject owns the replicas"
    else:
        assert replicas > budget["maxUnavailable"]
    if workload.kind == "Deployment":
        rolling = workload.obj["spec"]["strategy"]["rollingUpdate"]
        assert rolling == {"maxUnavailable": 0, "maxSurge": 1}


def test_keda_scales_on_the_slots_of_a_pod_and_scales_in_slower_than_a_migrate(tmp_path: Path) -> None:
    """The ScaledObject's threshold is the slots one pod has (agent.max_workers as the agent computes
    it from the container's limits); it removes at most one pod per period, and a period is longer
    than a pod's migrate, so a removed pod's crawls are back in the queue before the next is chosen;
    the fleet goes to zero no sooner than the HPA's scale-down window; and the Deployment's agents
    never leave on their own (a pod that exits is restarted by its ReplicaSet: the scaler decides)."""
    objects, workload = _workload("keda")
    kinds = by_kind(objects)
    scaled = kinds["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": workload.obj["metadata"]["name"]}
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == "sum(ckmaster_tasks_pending) + sum(ckmaster_tasks_running)"
    limits = workload.container["resources"]["limits"]
    assert limits["memory"].endswith("Gi")
    settings = pod_settings(objects, workload, tmp_path)
    slots = compute_max_workers(settings.agent.max_workers, f"{int(float(limits['cpu']) * 1000)}m",
                                memory_bytes=int(limits["memory"][:-2]) * 1024**3)
    assert float(trigger["metadata"]["threshold"]) == slots == 2
    down = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    (policy,) = down["policies"]
    assert policy["type"] == "Pods" and policy["value"] == 1
    for s in _settings("keda", tmp_path):
        assert policy["periodSeconds"] > s.task.migrate_timeout + s.task.flush_timeout + MARGIN
    assert scaled["cooldownPeriod"] >= down["stabilizationWindowSeconds"] >= policy["periodSeconds"]
    assert settings.agent.exit_when_idle == 0 and settings.agent.max_tasks == 0
    assert agent_args(workload) == []


def test_the_job_waits_two_long_polls_for_its_task_and_its_deadline_covers_one_task(tmp_path: Path) -> None:
    """A Job's agent claims one task (--max-tasks 1) and leaves after --exit-when-idle seconds without
    one: more than two long polls, so a Job started for a task does not leave before it could claim
    it. activeDeadlineSeconds covers the agent's start (the supervisor's start timeout), the wait for a
    task, a task of the node's default timeout (task.execute_timeout), its longest stop grace and the
    flush — with the room the manifest's comment gives for a task naming a longer timeout."""
    objects, workload = _workload("keda-job")
    job = by_kind(objects)["ScaledJob"]["spec"]
    pod = pod_settings(objects, workload, tmp_path)
    assert pod.agent.max_tasks == 1 and pod.agent.exit_when_idle == 60
    idle = pod.agent.exit_when_idle
    deadline = job["jobTargetRef"]["activeDeadlineSeconds"]
    for settings in _settings("keda-job", tmp_path):
        task = settings.task
        assert idle > 2 * task.long_poll_wait
        longest = max(task.kill_grace, task.max_stop_grace)
        start = _start_timeout(workload)
        assert deadline > start + idle + task.execute_timeout + longest + task.flush_timeout
        assert deadline - (start + idle + longest + task.flush_timeout) == 14_030
