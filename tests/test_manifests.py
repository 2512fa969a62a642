"""Service manifests in config/: validated with real checkers (they cannot be run here).

- Kubernetes: ``kubernetes-validate --strict`` against the bundled 1.30 schemas (from the dev
  extras, else fetched by ``uv tool run``), plus the cross-file facts a schema cannot see.
- systemd: ``systemd-analyze verify`` on the unit (paths pointed at a temp dir), no warnings allowed.
- Dockerfile: parsed here (instructions and their JSON-form arguments) and checked against the
  Deployment and the agent's settings.
- The agent configuration inside the ConfigMap passes the agent's own loader.
- The NetworkPolicy denies what the agent's default egress policy denies (the same networks, entry by
  entry), and allows DNS and everything else.
"""

from __future__ import annotations

import configparser
import ipaddress
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckagent.code.frameworks import REGISTRY, SCRAPY_STOP_GRACE
from ckagent.node.config import load_settings
from ckagent.node.configschema import SETTINGS
from ckagent.node.egress_policy import DEFAULT_DENY, GROUPS, parse_text
from ckagent.task.stop import stop_grace

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "config" / "k8s"
UNIT = REPO / "config" / "ckagent.service"
DOCKERFILE = REPO / "config" / "Dockerfile"
KUBERNETES_VERSION = "1.30.0"
KUBERNETES_VALIDATE = "kubernetes-validate==1.37.0"
# what the agent may take to stop with default settings: drain_timeout + the longest stop grace (a Scrapy
# crawl's graceful close, task.max_stop_grace) + flush_timeout
DEFAULT_STOP_SECONDS = 60 + 180 + 10


def _documents() -> dict[str, dict[str, Any]]:
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[doc["kind"]] = doc
    return docs


def _stop_bound(config: dict[str, Any]) -> float:
    task = config.get("task", {})
    defaults = {s.key: s.default for s in SETTINGS if s.section == "task"}
    grace = max(float(task.get(k, defaults[k])) for k in ("kill_grace", "max_stop_grace"))
    return float(task.get("drain_timeout", defaults["drain_timeout"])) + grace + float(
        task.get("flush_timeout", defaults["flush_timeout"]))


def test_termination_grace_follows_the_longest_stop_grace(tmp_path: Path) -> None:
    """The pod's terminationGracePeriodSeconds covers a drain, the longest stop grace a task may get —
    every framework's default (Scrapy's graceful close of a polite crawl) is within task.max_stop_grace —
    and the flush, with the ConfigMap's settings as the agent loads them and with the defaults."""
    docs = _documents()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    config_text = docs["ConfigMap"]["data"]["config.yaml"]
    (tmp_path / "config.yaml").write_text(config_text)
    loaded = load_settings(tmp_path / "config.yaml", env={}, require_token=False).task
    defaults = load_settings(None, env={}, require_token=False).task
    longest_default = max(f.stop_grace or 0.0 for f in REGISTRY.values())
    assert longest_default == SCRAPY_STOP_GRACE <= defaults.max_stop_grace <= loaded.max_stop_grace
    for s in (loaded, defaults):
        longest = max(s.kill_grace, s.max_stop_grace)
        assert stop_grace("scrapy", None, s.kill_grace, s.max_stop_grace)[0] <= longest
        assert stop_grace("scrapy", 10_000.0, s.kill_grace, s.max_stop_grace)[0] <= longest
        assert pod["terminationGracePeriodSeconds"] > s.drain_timeout + longest + s.flush_timeout
    assert pod["terminationGracePeriodSeconds"] > DEFAULT_STOP_SECONDS


def test_prestop_migrates_within_the_grace_and_kubernetes_default(tmp_path: Path) -> None:
    """preStop runs `ckagent stop --migrate` with the agent's own config (it finds the agent by that
    config's work dir); the migrate's bound (migrate_timeout + flush_timeout + the stop command's 10 s
    margin) fits terminationGracePeriodSeconds, and with the ConfigMap's and the default settings the
    agent's own bound fits Kubernetes' default 30 s grace."""
    from ckagent.cli.stopagent import MARGIN

    docs = _documents()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == container["args"][:2] and command[2:4] == ["stop", "--migrate"]
    assert command[4:] == container["args"][3:], "the hook names the config the agent runs with"
    (tmp_path / "config.yaml").write_text(docs["ConfigMap"]["data"]["config.yaml"])
    loaded = load_settings(tmp_path / "config.yaml", env={}, require_token=False).task
    defaults = load_settings(None, env={}, require_token=False).task
    for s in (loaded, defaults):
        assert s.migrate_timeout + s.flush_timeout <= 30  # Kubernetes' default terminationGracePeriodSeconds
        assert pod["terminationGracePeriodSeconds"] > s.migrate_timeout + s.flush_timeout + MARGIN


def test_kubernetes_manifests_pass_the_schema_checker() -> None:
    try:
        import kubernetes_validate  # noqa: F401

        command = [sys.executable, "-m", "kubernetes_validate"]
    except ImportError:
        command = [str(Path(sys.executable).parent / "uv"), "tool", "run", "--quiet", "--from", KUBERNETES_VALIDATE,
                   "kubernetes-validate"]
    files = sorted(str(p) for p in K8S.glob("*.yaml"))
    assert len(files) == 4
    result = subprocess.run([*command, "--strict", "-k", KUBERNETES_VERSION, *files], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == 4, result.stdout


def test_deployment_drains_probes_the_status_port_and_takes_secrets_and_cpu_from_the_cluster(
    tmp_path: Path,
) -> None:
    docs = _documents()
    deployment, secret, configmap = docs["Deployment"], docs["Secret"], docs["ConfigMap"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config_text = configmap["data"]["config.yaml"]
    config = yaml.safe_load(config_text)

    # the config in the ConfigMap is valid for the agent (token comes from the Secret at run time)
    (tmp_path / "config.yaml").write_text(config_text)
    settings = load_settings(tmp_path / "config.yaml", env={}, require_token=False)
    assert settings.agent.port == 9000

    assert pod["terminationGracePeriodSeconds"] > _stop_bound(config) >= DEFAULT_STOP_SECONDS
    env = {e["name"]: e for e in container["env"]}
    ref = env["AGENT_REGISTRATION_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert "value" not in env["AGENT_REGISTRATION_TOKEN"]
    cpu = env["CPU_LIMIT_MILLICORES"]["valueFrom"]["resourceFieldRef"]
    assert cpu == {"containerName": container["name"], "resource": "limits.cpu", "divisor": "1m"}
    names = list(env)
    assert names.index("CPU_LIMIT_MILLICORES") < names.index("CONTAINER_CPU_LIMIT"), "$(VAR) needs the earlier var"
    assert env["CONTAINER_CPU_LIMIT"]["value"] == "$(CPU_LIMIT_MILLICORES)m"
    # what the agent will receive for the limit in the manifest parses as that many cores
    millicores = int(float(container["resources"]["limits"]["cpu"]) * 1000)
    limit = load_settings(None, env={"CONTAINER_CPU_LIMIT": f"{millicores}m"}, require_token=False)
    assert limit.agent.container_cpu_limit_cores == millicores / 1000

    (port,) = container["ports"]
    assert port["containerPort"] == settings.agent.port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port["name"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port["name"]}
    assert config["agent"]["bind"] == "0.0.0.0", "probes come from the kubelet, not from localhost"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[str(settings.task.work_dir)] == "data"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"/tmp", "/var/lib/ckagent"} <= set(mounts), "HOME and /tmp stay writable for uv and spiders"


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
    docs = _documents()
    policy, deployment = docs["NetworkPolicy"], docs["Deployment"]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
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
    text = (K8S / "networkpolicy.yaml").read_text()
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


def test_dockerfile_runs_the_pyz_under_tini_as_the_deployments_user() -> None:
    instructions = _dockerfile()
    known = {"FROM", "RUN", "COPY", "ENV", "USER", "WORKDIR", "VOLUME", "EXPOSE", "STOPSIGNAL", "HEALTHCHECK",
             "ENTRYPOINT", "CMD", "ARG", "LABEL"}
    assert {keyword for keyword, _ in instructions} <= known
    froms = [args for keyword, args in instructions if keyword == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build")
    last = {keyword: args for keyword, args in instructions}
    assert json.loads(last["ENTRYPOINT"]) == ["/usr/bin/tini", "--"]
    assert "tini" in next(a for k, a in instructions if k == "RUN" and "apt-get install" in a)
    cmd = json.loads(last["CMD"])
    deployment = _documents()["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert cmd == container["args"]
    assert any(k == "COPY" and a.startswith("--from=build /out/ckagent.pyz ") for k, a in instructions)
    assert any(k == "RUN" and "build/build_pyz.py" in a for k, a in instructions)
    assert last["STOPSIGNAL"] == "SIGTERM"
    user = deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert last["USER"] == f"{user}:{user}"
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(a for k, a in instructions if k == "ENV")))
    assert env["AGENT_BIND"] == "0.0.0.0" and env["SHIV_ROOT"].startswith("/opt/")
    assert f"127.0.0.1:{env['AGENT_PORT']}/healthz" in last["HEALTHCHECK"]
    assert last["EXPOSE"] == env["AGENT_PORT"]
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
    assert float(service["TimeoutStopSec"]) > DEFAULT_STOP_SECONDS
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
