"""config/k8s as the cluster would receive it: each variant rendered by a real kustomize, its objects
validated offline, its pods and the agent settings they run with.

- :data:`VARIANTS` names every kustomization (base and each overlay); :func:`rendered` gives its
  objects (rendered once per process) or skips the test saying why no kustomize can be had
  (:mod:`harness.kustomize`); :func:`by_kind` indexes them, :func:`workloads` gives the objects that
  run the agent's pod with that pod's spec (Deployment, StatefulSet, ScaledJob's Jobs).
- :func:`schema_errors` validates a built-in object against the Kubernetes API's schema of a version
  (kubernetes-validate, strict: unknown fields refused), :func:`custom_errors` a custom resource
  against the openAPIV3Schema of the CRD its project publishes (tests/data/crds; unknown fields
  refused where the schema does not keep them, as the API server's strict field validation does).
- :func:`pod_settings` loads the settings a pod's agent runs with: the ConfigMap's config.yaml through
  the agent's own loader, with the pod's plain ``AGENT_*`` values over it.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.kustomize import KustomizeUnavailable, kustomize_binary, kustomize_build

__all__ = [
    "CRDS",
    "K8S",
    "KUBERNETES_VERSIONS",
    "VARIANTS",
    "Workload",
    "agent_args",
    "by_kind",
    "custom_errors",
    "pod_settings",
    "rendered",
    "schema_errors",
    "workloads",
]

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "config" / "k8s"
CRDS = REPO / "tests" / "data" / "crds"
VARIANTS = ("base", "statefulset", "keda", "keda-job", "net-admin", "privileged", "monitoring")
# The Kubernetes versions the manifests are validated for (docs/deploy.md, "Kubernetes"): every minor
# release whose schemas kubernetes-validate bundles from 1.29 on.
KUBERNETES_VERSIONS = ("1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0")
CRD_FILES = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("keda.sh/v1alpha1", "ScaledJob"): "keda.sh_scaledjobs.yaml.gz",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}


def variant_dir(variant: str) -> Path:
    """The kustomization directory of ``variant`` (one of :data:`VARIANTS`)."""
    return K8S / "base" if variant == "base" else K8S / "overlays" / variant


@functools.cache
def _rendered_all() -> dict[str, list[dict[str, Any]]] | str:
    """Every variant rendered, side by side (a kustomize build of an overlay with patches spends most of
    its second loading its schemas: one process per variant, at once); or why there is no kustomize."""
    try:
        binary = kustomize_binary()
    except KustomizeUnavailable as exc:
        return f"NOT RENDERED: {exc}"
    with concurrent.futures.ThreadPoolExecutor(len(VARIANTS)) as pool:
        builds = {v: pool.submit(kustomize_build, variant_dir(v), binary) for v in VARIANTS}
        return {v: build.result() for v, build in builds.items()}


def rendered(variant: str) -> list[dict[str, Any]]:
    """A deep copy of the objects ``kustomize build`` gives for ``variant``; skips the calling test
    with the reason when no kustomize can be had. Blocking (a download the first time, processes)."""
    every = _rendered_all()
    if isinstance(every, str):
        pytest.skip(every)
    objects = every[variant]
    return copy.deepcopy(objects)


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{kind: object}``; fails when a kind occurs twice (none does in these manifests)."""
    kinds: dict[str, dict[str, Any]] = {}
    for obj in objects:
        assert obj["kind"] not in kinds, f"two {obj['kind']} objects"
        kinds[obj["kind"]] = obj
    return kinds


@dataclass
class Workload:
    """An object that runs the agent's pod: its ``kind``, the object, and the pod's spec and labels."""

    kind: str
    obj: dict[str, Any]
    pod: dict[str, Any]
    labels: dict[str, str]

    @property
    def container(self) -> dict[str, Any]:
        (container,) = self.pod["containers"]
        return dict(container)


def workloads(objects: list[dict[str, Any]]) -> Iterator[Workload]:
    """Each Deployment, StatefulSet and ScaledJob in ``objects`` with its pod template."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            template = obj["spec"]["template"]
        elif obj["kind"] == "ScaledJob":
            template = obj["spec"]["jobTargetRef"]["template"]
        else:
            continue
        yield Workload(obj["kind"], obj, template["spec"], template["metadata"]["labels"])


def schema_errors(obj: dict[str, Any], version: str) -> str | None:
    """Why ``obj`` (a built-in kind) fails the strict schema of Kubernetes ``version``, or None."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError,
            kubernetes_validate.InvalidSchemaError) as exc:
        return f"{obj['kind']} {obj['metadata'].get('name')} on Kubernetes {version}: {exc}"
    return None


@functools.cache
def crd(api_version: str, kind: str) -> dict[str, Any]:
    """The published CustomResourceDefinition of ``kind`` (tests/data/crds)."""
    path = CRDS / CRD_FILES[(api_version, kind)]
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    (document,) = [d for d in yaml.load_all(text, Loader=loader) if d]
    return dict(document)


def _strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its properties and
    neither keeps unknown fields (``x-kubernetes-preserve-unknown-fields``) nor says otherwise."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def _validator(api_version: str, kind: str) -> Any:
    import jsonschema

    group, _, version = api_version.partition("/")
    definition = crd(api_version, kind)
    assert definition["spec"]["group"] == group and definition["spec"]["names"]["kind"] == kind
    (served,) = [v for v in definition["spec"]["versions"] if v["name"] == version]
    assert served["served"], f"{api_version} {kind} is not served"
    schema = _strict(served["schema"]["openAPIV3Schema"])
    # the API server checks metadata itself (ObjectMeta); the CRD's schema says only `type: object`
    schema["properties"]["metadata"] = {"type": "object"}
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft4Validator)
    return cls(schema)


def custom_errors(obj: dict[str, Any]) -> list[str]:
    """Why ``obj`` (a custom resource of :data:`CRD_FILES`) fails its CRD's schema, one line per error."""
    validator = _validator(obj["apiVersion"], obj["kind"])
    return [f"{obj['kind']} {obj['metadata'].get('name')}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(obj)]


def config_text(objects: list[dict[str, Any]], workload: Workload) -> str:
    """The config.yaml the pod's command names (``-c``), read from the ConfigMap volume mounted there."""
    command = workload.container["command"]
    path = Path(command[command.index("-c") + 1])
    for mount in workload.container["volumeMounts"]:
        inside = path.relative_to(mount["mountPath"]) if path.is_relative_to(mount["mountPath"]) else None
        if inside is None:
            continue
        (volume,) = [v for v in workload.pod["volumes"] if v["name"] == mount["name"]]
        source = volume["configMap"]
        (configmap,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == source["name"]]
        keys = {item["path"]: item["key"] for item in source.get("items", [])} or {k: k for k in configmap["data"]}
        return str(configmap["data"][keys[str(inside)]])
    raise AssertionError(f"{path} is on no volume of the pod")


def agent_args(workload: Workload) -> list[str]:
    """The arguments the pod's supervisor gives ``ckagent run`` (after its ``--``), parsed by the
    supervisor's own parser from the container's command and args."""
    from ckagent.pod.command import parse

    return parse([*workload.container["command"][3:], *workload.container.get("args", [])]).agent_args


def pod_settings(objects: list[dict[str, Any]], workload: Workload, tmp_path: Path) -> Any:
    """The agent's Settings in ``workload``'s pod: the ConfigMap's config.yaml (as the command names
    it) through ckagent's loader, with the container's plain ``AGENT_*`` env values over it (values
    from the cluster — secrets, the pod's name and IP — left out), and the `ckagent run` flags the
    supervisor passes on (parsed by the CLI's own parser, laid over as `run` does)."""
    from ckagent.cli import _app
    from ckagent.cli.runflags import RunFlags
    from ckagent.node.config import load_settings

    path = tmp_path / f"{workload.kind}.config.yaml"
    path.write_text(config_text(objects, workload))
    env = {e["name"]: e["value"] for e in workload.container.get("env", [])
           if "value" in e and e["name"].startswith("AGENT_")}
    settings = load_settings(path, env=env, require_token=False)
    command, bound, ignored = _app().parse_args(["run", *agent_args(workload)])
    assert command.__name__ == "run" and not ignored, (command, ignored)
    flags = RunFlags.parse(bound.arguments.get("exit_when_idle"), bound.arguments.get("max_tasks"))
    return flags.apply(settings)
