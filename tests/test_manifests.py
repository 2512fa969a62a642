"""Service manifests in config/: validated with real checkers (they cannot be run here).

- Kubernetes: every kustomization of config/k8s (the base and each overlay) rendered by a real
  kustomize (tests/harness/kustomize.py), every built-in object validated strictly against the
  Kubernetes API schemas of each version the docs name (kubernetes-validate, offline), every custom
  resource (KEDA's ScaledObject and ScaledJob, the prometheus-operator's ServiceMonitor) against its
  published CRD (tests/data/crds), and the ScaledJob's Job against the Kubernetes schemas too; then the
  facts a schema cannot see: the pod (PID 1, hooks, probes, the config it reads, the Secret), what
  each overlay changes, the NetworkPolicy. The timings: tests/test_manifests_timings.py.
- systemd: ``systemd-analyze verify`` on the unit (paths pointed at a temp dir), no warnings allowed.
- Dockerfile: parsed here (instructions and their JSON-form arguments) and checked against the
  Deployment and the agent's settings.
- The agent configuration inside the ConfigMap passes the agent's own loader.
- The NetworkPolicy denies what the agent's default egress policy denies (the same networks, entry by
  entry), and allows DNS and everything else.
"""

from __future__ import annotations

import configparser
import hashlib
import ipaddress
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.kustomize import kustomize_binary, kustomize_build
from harness.manifests import (
    CRDS,
    K8S,
    KUBERNETES_VERSIONS,
    VARIANTS,
    by_kind,
    config_text,
    crd,
    custom_errors,
    pod_settings,
    rendered,
    schema_errors,
    workloads,
)

from ckagent.node.config import load_settings
from ckagent.node.egress_policy import DEFAULT_DENY, GROUPS, parse_text
from ckagent.pod.command import parse as parse_supervise

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "config" / "ckagent.service"
DOCKERFILE = REPO / "config" / "Dockerfile"
CONFIG_PATH = "/etc/ckagent/node/config.yaml"
PYZ = ["python", "/opt/ckagent/ckagent.pyz"]
SUPERVISE = [*PYZ, "supervise", "-c", CONFIG_PATH]
# what each kustomization renders, by kind
KINDS = {
    "base": {"ConfigMap", "Deployment", "PodDisruptionBudget", "NetworkPolicy", "Service"},
    "statefulset": {"ConfigMap", "StatefulSet", "PodDisruptionBudget", "NetworkPolicy", "Service"},
    "keda": {"ConfigMap", "Deployment", "PodDisruptionBudget", "NetworkPolicy", "Service", "ScaledObject"},
    "keda-job": {"ConfigMap", "ScaledJob", "NetworkPolicy", "Service"},
    "net-admin": {"ConfigMap", "Deployment", "PodDisruptionBudget", "NetworkPolicy", "Service"},
    "privileged": {"ConfigMap", "Deployment", "PodDisruptionBudget", "NetworkPolicy", "Service"},
    "monitoring": {"ServiceMonitor"},
}
CUSTOM = {"ScaledObject", "ScaledJob", "ServiceMonitor"}


def test_every_kustomization_is_listed_and_renders_what_it_says() -> None:
    on_disk = {"base"} | {p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml")}
    assert on_disk == set(VARIANTS) == set(KINDS)
    assert not list(K8S.glob("*.yaml")), "the manifests live in base/ and overlays/"
    for variant in VARIANTS:
        objects = rendered(variant)
        assert {o["kind"] for o in objects} == KINDS[variant], variant
        assert len(objects) == len(KINDS[variant]), variant
        for obj in objects:
            assert "namespace" not in obj["metadata"], "the user's namespace, not ours"
            assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "ckagent"


def _built_in_objects() -> list[dict[str, Any]]:
    """Every distinct built-in object of every variant (most are the same in several), the ScaledJob's
    jobTargetRef as the batch/v1 Job (a JobSpec) KEDA makes of it."""
    distinct: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        for obj in rendered(variant):
            if obj["kind"] == "ScaledJob":
                obj = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": obj["metadata"]["name"]},
                       "spec": obj["spec"]["jobTargetRef"]}
            elif obj["kind"] in CUSTOM:
                continue
            distinct.setdefault(json.dumps(obj, sort_keys=True), obj)
    return list(distinct.values())


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_passes_the_kubernetes_schemas_of_each_version(version: str) -> None:
    """Built-in kinds against the strict schemas of every version documented (an unknown or misplaced
    field fails), the Jobs the ScaledJob makes included."""
    objects = [*_built_in_objects(), yaml.safe_load((K8S / "examples" / "secret.yaml").read_text())]
    assert {o["kind"] for o in objects} == {k for kinds in KINDS.values() for k in kinds} - CUSTOM | {"Job", "Secret"}
    errors = [error for obj in objects if (error := schema_errors(obj, version))]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if KINDS[v] & CUSTOM])
def test_custom_resources_pass_their_published_crds(variant: str) -> None:
    errors = [e for obj in rendered(variant) if obj["kind"] in CUSTOM for e in custom_errors(obj)]
    assert not errors, "\n".join(errors)


def test_the_checkers_refuse_an_unknown_field() -> None:
    """The validation is strict: a misspelt field fails, in a built-in kind and in a custom resource."""
    deployment = by_kind(rendered("base"))["Deployment"]
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    assert schema_errors(deployment, KUBERNETES_VERSIONS[0]) is not None
    scaled = by_kind(rendered("keda"))["ScaledObject"]
    scaled["spec"]["cooldownPeriods"] = 300
    assert any("cooldownPeriods" in e for e in custom_errors(scaled))
    job = by_kind(rendered("keda-job"))["ScaledJob"]
    job["spec"]["jobTargetRef"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    assert custom_errors(job)
    monitor = by_kind(rendered("monitoring"))["ServiceMonitor"]
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    assert custom_errors(monitor)


def test_the_crds_are_the_published_files_named_in_their_readme() -> None:
    readme = (CRDS / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|.*\| `([0-9a-f]{40})`.*\| `([0-9a-f]{64})` \|$", readme, re.M)
    assert {name for name, _, _ in rows} == {p.name for p in CRDS.iterdir() if p.name.endswith((".yaml", ".gz"))}
    for name, _, digest in rows:
        data = (CRDS / name).read_bytes()
        if name.endswith(".gz"):
            import gzip

            data = gzip.decompress(data)
        assert hashlib.sha256(data).hexdigest() == digest, name
    assert (CRDS / "LICENSE.keda").read_text().lstrip().startswith("Apache License")
    assert (CRDS / "LICENSE.prometheus-operator").read_text().startswith("Apache License")
    for api_version, kind in [("keda.sh/v1alpha1", "ScaledObject"), ("keda.sh/v1alpha1", "ScaledJob"),
                              ("monitoring.coreos.com/v1", "ServiceMonitor")]:
        assert crd(api_version, kind)["spec"]["names"]["kind"] == kind


def test_monitoring_is_an_addon_that_composes_with_every_variant(tmp_path: Path) -> None:
    """overlays/monitoring holds only the ServiceMonitor (so a kustomization listing it beside any variant
    builds: kustomize refuses the same object twice — built here with the StatefulSet, as the docs
    show), and it scrapes each variant's status Service, which selects the variant's pods."""
    rendered("base")  # skips when there is no kustomize
    shutil.copytree(K8S, tmp_path / "k8s")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": [
        "k8s/overlays/statefulset", "k8s/overlays/monitoring"]}))
    composed = kustomize_build(tmp_path, kustomize_binary())
    assert {o["kind"] for o in composed} == KINDS["statefulset"] | KINDS["monitoring"]
    (monitor,) = rendered("monitoring")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for variant in VARIANTS:
        objects = rendered(variant)
        services = [o for o in objects if o["kind"] == "Service"]
        if variant == "monitoring":
            assert not services
            continue
        (service,) = services
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert service["spec"]["publishNotReadyAddresses"] is True, "a migrating pod is still scraped"
        for workload in workloads(objects):
            assert service["spec"]["selector"].items() <= workload.labels.items()
            (port,) = [p for p in workload.container["ports"] if p["name"] == endpoint["port"]]
            assert port["containerPort"] == pod_settings(objects, workload, tmp_path).agent.port


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "monitoring"])
def test_every_pod_runs_the_supervisor_migrates_on_stop_and_probes_both_ports(variant: str, tmp_path: Path) -> None:
    objects = rendered(variant)
    kinds = by_kind(objects)
    (workload,) = workloads(objects)
    container = workload.container
    # PID 1 is the supervisor; the config it names is the ConfigMap's, mounted there
    assert container["command"] == SUPERVISE
    options = parse_supervise([*container["command"][3:], *container.get("args", [])])
    assert options.config == CONFIG_PATH and options.live_port is None
    assert options.agent_args == container.get("args", ["--"])[1:], "the agent's own flags follow `--`"
    settings = pod_settings(objects, workload, tmp_path)
    assert settings.agent.port == 9000 and str(settings.agent.bind) == "0.0.0.0", "the kubelet probes the pod IP"
    assert yaml.safe_load(config_text(objects, workload))["agent"]["sigterm"] == "migrate"
    # preStop: the migrate, with the config the agent runs with (it finds the agent by its work dir)
    assert container["lifecycle"]["preStop"]["exec"]["command"] == [*PYZ, "stop", "--migrate", "-c", CONFIG_PATH]
    # liveness asks the supervisor (agent.port + 1), readiness the agent
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"status": settings.agent.port, "supervisor": settings.agent.port + 1}
    assert "AGENT_LIVE_PORT" not in {e["name"] for e in container["env"]}, "the supervisor's default port"
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "supervisor"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "status"}
    assert "startupProbe" not in container
    # the token from the Secret, never a value
    env = {e["name"]: e for e in container["env"]}
    ref = env["AGENT_REGISTRATION_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert "Secret" not in kinds, "apply -k would overwrite the operator's real token with a placeholder"
    example = yaml.safe_load((K8S / "examples" / "secret.yaml").read_text())
    assert ref["name"] == example["metadata"]["name"] and ref["key"] in example["stringData"]
    assert "value" not in env["AGENT_REGISTRATION_TOKEN"]
    assert env["AGENT_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # the CPU limit from the downward API, parsed by the agent as that many cores
    cpu = env["CPU_LIMIT_MILLICORES"]["valueFrom"]["resourceFieldRef"]
    assert cpu == {"containerName": container["name"], "resource": "limits.cpu", "divisor": "1m"}
    names = list(env)
    assert names.index("CPU_LIMIT_MILLICORES") < names.index("CONTAINER_CPU_LIMIT"), "$(VAR) needs the earlier var"
    assert env["CONTAINER_CPU_LIMIT"]["value"] == "$(CPU_LIMIT_MILLICORES)m"
    millicores = int(float(container["resources"]["limits"]["cpu"]) * 1000)
    limit = load_settings(None, env={"CONTAINER_CPU_LIMIT": f"{millicores}m"}, require_token=False)
    assert limit.agent.container_cpu_limit_cores == millicores / 1000
    # writable work dir, HOME and /tmp on a read-only root
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[str(settings.task.work_dir)] == "data"
    assert {"/tmp", "/var/lib/ckagent"} <= set(mounts), "HOME and /tmp stay writable for uv and spiders"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert workload.pod["automountServiceAccountToken"] is False and workload.pod["enableServiceLinks"] is False


def _base_pod() -> dict[str, Any]:
    return dict(by_kind(rendered("base"))["Deployment"]["spec"]["template"])


def test_the_statefulset_pod_is_the_deployments_but_for_its_name_and_volume(tmp_path: Path) -> None:
    """A StatefulSet runs at most one pod under a name: only its agents say so (agent.name_exclusive,
    so the master hands a rescheduled pod its name at once); a Deployment's or a Job's never do."""
    for variant in VARIANTS:
        objects = rendered(variant)
        for workload in workloads(objects):
            exclusive = pod_settings(objects, workload, tmp_path).agent.name_exclusive
            assert exclusive is (workload.kind == "StatefulSet"), variant
    kinds = by_kind(rendered("statefulset"))
    sts, service = kinds["StatefulSet"], kinds["Service"]
    template, base = sts["spec"]["template"], _base_pod()
    (container,) = template["spec"]["containers"]
    (base_container,) = base["spec"]["containers"]
    env = container.pop("env")
    assert env == [{"name": "AGENT_NAME_EXCLUSIVE", "value": "true"}, *base_container.pop("env")]
    assert container == base_container
    assert template["spec"].pop("securityContext") == {**base["spec"].pop("securityContext"),
                                                       "fsGroupChangePolicy": "OnRootMismatch"}
    volumes = template["spec"].pop("volumes")
    assert volumes == [v for v in base["spec"].pop("volumes") if v["name"] != "data"]
    assert template == base
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    assert sts["spec"]["serviceName"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"


def test_the_job_pod_is_the_deployments_running_one_task() -> None:
    job = by_kind(rendered("keda-job"))["ScaledJob"]
    target, base = job["spec"]["jobTargetRef"], _base_pod()
    template = target["template"]
    (container,) = template["spec"]["containers"]
    assert container.pop("args") == ["--", "--max-tasks", "1", "--exit-when-idle", "60"]
    assert template["spec"].pop("restartPolicy") == "Never", "the supervisor restarts the agent, not the kubelet"
    assert template == base
    assert target["backoffLimit"] == 0 and target["parallelism"] == target["completions"] == 1
    trigger = job["spec"]["triggers"][0]
    assert trigger["metadata"]["threshold"] == "1", "one Job per pending task"
    assert job["spec"]["scalingStrategy"] == {"strategy": "accurate", "pendingPodConditions": ["Ready"]}


def test_net_admin_and_privileged_change_only_who_the_pod_is() -> None:
    base = _base_pod()
    for variant in ("net-admin", "privileged"):
        pod = by_kind(rendered(variant))["Deployment"]["spec"]["template"]
        context = pod["spec"].pop("securityContext")
        assert context["runAsUser"] == 0 and context["runAsNonRoot"] is False, "capabilities are root's only"
        container = pod["spec"]["containers"][0]
        security = container.pop("securityContext")
        base_container = {k: v for k, v in base["spec"]["containers"][0].items() if k != "securityContext"}
        assert container == base_container
        assert {k: v for k, v in pod["spec"].items() if k != "containers"} == {
            k: v for k, v in base["spec"].items() if k not in ("containers", "securityContext")}
        assert security["readOnlyRootFilesystem"] is True
        if variant == "net-admin":
            assert "NET_ADMIN" in security["capabilities"]["add"] and security["capabilities"]["drop"] == ["ALL"]
            assert security["allowPrivilegeEscalation"] is False and "privileged" not in security
        else:
            assert security == {"privileged": True, "readOnlyRootFilesystem": True}


def test_the_configmap_passes_the_agents_loader(tmp_path: Path) -> None:
    objects = rendered("base")
    (workload,) = workloads(objects)
    settings = pod_settings(objects, workload, tmp_path)
    assert str(settings.task.work_dir) == "/var/lib/ckagent/data"
    assert settings.agent.labels == {"pool": "k8s"}


def _network_policy_allows(policy: dict[str, Any], address: str, port: int, protocol: str = "TCP") -> bool:
    """Whether ``policy``'s egress rules let the pod connect to ``address``:``port`` (the rules are
    OR-ed; a rule without ``to`` is every destination, without ``ports`` every port)."""
    ip = ipaddress.ip_address(address)
    for rule in policy["spec"]["egress"]:
        ports = rule.get("ports")
        if ports is not None and not any(p["port"] == port and p.get("protocol", "TCP") == protocol for p in ports):
            continue
        if "to" not in rule:
            return True
        for peer in rule["to"]:
            block = peer["ipBlock"]
            cidr = ipaddress.ip_network(block["cidr"])
            if ip.version == cidr.version and ip in cidr and not any(
                    ip in ipaddress.ip_network(e) for e in block.get("except", []) if ipaddress.ip_network(e).version == ip.version):
                return True
    return False


def test_network_policy_denies_what_the_default_egress_policy_denies() -> None:
    policy = by_kind(rendered("base"))["NetworkPolicy"]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    for variant in VARIANTS:
        for workload in workloads(rendered(variant)):
            assert policy["spec"]["podSelector"]["matchLabels"].items() <= workload.labels.items(), variant
    assert policy["spec"]["policyTypes"] == ["Egress"], "egress only: the agent's port keeps its probes"

    # The denied networks are the default policy's groups, entry by entry (the `agent` group is a port:
    # not expressible in a NetworkPolicy, and the manifest says so).
    groups = DEFAULT_DENY.split(",")
    assert groups == ["metadata", "link-local", "agent"], "the default changed: change networkpolicy.yaml too"
    blocks = [peer["ipBlock"] for rule in policy["spec"]["egress"] for peer in rule.get("to", [])]
    assert sorted(b["cidr"] for b in blocks) == ["0.0.0.0/0", "::/0"]
    excepted = [e for b in blocks for e in b.get("except", [])]
    assert sorted(excepted) == sorted(n for g in groups for n in GROUPS[g])
    for block in blocks:
        for entry in block["except"]:
            assert ipaddress.ip_network(entry).subnet_of(ipaddress.ip_network(block["cidr"]))
    text = (K8S / "base" / "networkpolicy.yaml").read_text()
    assert "Not expressible here: the `agent` group" in text

    # What the cluster then lets through is what the agent's policy lets through, DNS included.
    default = parse_text(DEFAULT_DENY, "")
    for address, port in [("169.254.169.254", 80), ("169.254.170.2", 80), ("100.100.100.200", 80),
                          ("168.63.129.16", 80), ("169.254.1.1", 8080), ("fd00:ec2::254", 80), ("fe80::1", 443),
                          ("203.0.113.7", 443), ("10.0.0.5", 3128), ("192.168.1.1", 80), ("2001:db8::1", 443),
                          ("100.64.0.1", 80), ("8.8.8.8", 53)]:
        assert _network_policy_allows(policy, address, port) == (not default.blocks(address, port)), (address, port)
    assert _network_policy_allows(policy, "10.96.0.10", 53, "UDP"), "cluster DNS"
    assert _network_policy_allows(policy, "169.254.20.10", 53, "UDP"), "NodeLocal DNSCache"


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    assert not pending, "dangling line continuation"
    return instructions


def test_dockerfile_runs_the_supervisor_as_the_deployments_pid_1_and_user() -> None:
    instructions = _dockerfile()
    known = {"FROM", "RUN", "COPY", "ENV", "USER", "WORKDIR", "VOLUME", "EXPOSE", "STOPSIGNAL", "HEALTHCHECK",
             "ENTRYPOINT", "CMD", "ARG", "LABEL"}
    assert {keyword for keyword, _ in instructions} <= known
    froms = [args for keyword, args in instructions if keyword == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build")
    last = {keyword: args for keyword, args in instructions}
    deployment = by_kind(rendered("base"))["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    # The image's PID 1 is the pod's: the supervisor, with the config file the ConfigMap is mounted at
    # (the pod writes its command out: it does not depend on the image's tag).
    assert json.loads(last["ENTRYPOINT"]) == container["command"] == SUPERVISE
    assert "CMD" not in last, "the agent's own arguments, if any, come after `--` (the Job's args)"
    assert not any(k == "RUN" and "tini" in a for k, a in instructions), "the supervisor replaced tini"
    pyz = container["command"][1]
    assert any(k == "COPY" and a.startswith("--from=build /out/ckagent.pyz ") and a.endswith(pyz)
               for k, a in instructions)
    assert any(k == "RUN" and "build/build_pyz.py" in a for k, a in instructions)
    assert any(k == "COPY" and a.split()[-1] == CONFIG_PATH for k, a in instructions), "the image's own config"
    assert last["STOPSIGNAL"] == "SIGTERM"
    user = deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert last["USER"] == f"{user}:{user}"
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(a for k, a in instructions if k == "ENV")))
    assert env["AGENT_BIND"] == "0.0.0.0" and env["SHIV_ROOT"].startswith("/opt/")
    assert f"127.0.0.1:{int(env['AGENT_PORT']) + 1}/livez" in last["HEALTHCHECK"], "the supervisor's /livez"
    ports = {p["containerPort"] for p in container["ports"]}
    assert int(env["AGENT_PORT"]) in ports and set(map(int, last["EXPOSE"].split())) <= ports
    # the extraction is made at build time (warm start, read-only root filesystem)
    assert any(k == "RUN" and "ckagent.pyz version" in a for k, a in instructions)
    for path in re.findall(r"^COPY (?!--from)(\S+)", DOCKERFILE.read_text(), re.M):
        assert (REPO / path).exists(), f"COPY source {path} missing from the repository"


def test_systemd_unit_verifies_and_leaves_time_to_drain(tmp_path: Path) -> None:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNIT)
    service = parser["Service"]
    assert service["KillMode"] == "process" and service["KillSignal"] == "SIGTERM"
    assert float(service["TimeoutStopSec"]) > 60 + 180 + 10  # drain + the longest stop grace + flush
    assert service["ExecStart"].startswith("/opt/ckagent/run.sh start ")
    assert "--daemon" not in service["ExecStart"], "systemd supervises a foreground process"
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("NOT VERIFIED: systemd-analyze is not installed (apt-get install systemd)")
    root = tmp_path / "opt"
    root.mkdir()
    shutil.copy2(REPO / "run.sh", root / "run.sh")
    unit = tmp_path / "ckagent.service"
    unit.write_text(UNIT.read_text().replace("/opt/ckagent", str(root)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stderr.strip() == "" and result.stdout.strip() == "", (
        result.stdout + result.stderr)


def test_the_docs_name_the_versions_and_overlays_validated() -> None:
    """docs/deploy.md's Kubernetes section names every Kubernetes version the objects are validated for,
    the kustomize release, and every kustomization."""
    from harness.kustomize import KUSTOMIZE_VERSION

    text = (REPO / "docs" / "deploy.md").read_text()
    section = text[text.index("## Kubernetes"):text.index("## Packages and releases")]
    validated = section[section.index("### What is validated"):]
    minors = [v.rsplit(".", 1)[0] for v in KUBERNETES_VERSIONS]
    assert f"**{', '.join(minors[:-1])} and {minors[-1]}**" in " ".join(validated.split())
    assert f"kustomize {KUSTOMIZE_VERSION}" in validated
    for variant in VARIANTS:
        assert f"| `{variant if variant == 'base' else 'overlays/' + variant}` |" in section


def test_the_prestop_command_runs_with_the_pods_config(tmp_path: Path) -> None:
    """The hook as written (the pyz's `stop --migrate -c CONFIG`; here the checkout's module) parses and
    reads the ConfigMap's config: with no agent on its work dir it says so and exits 3 at once."""
    import sys

    objects = rendered("base")
    (workload,) = workloads(objects)
    hook = workload.container["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == PYZ
    config = yaml.safe_load(config_text(objects, workload))
    config["task"]["work_dir"] = str(tmp_path / "data")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "ckagent", *hook[2:-1], str(tmp_path / "config.yaml")]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"no agent runs on {tmp_path / 'data'}" in result.stderr
