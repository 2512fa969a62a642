"""The wire types (``ckagent.master.protocol``) against their written contract (``ckagent/master/protocol/openapi.yaml``).

The contract tests read the OpenAPI file and drive the Python types with it: field names, required
vs optional (by removing fields from valid payloads), nullability, enums, and every example in the
file. Where ``jsonschema`` is installed (it comes with ``openapi-spec-validator``), the schemas and
``from_json`` must also agree on a table of malformed values. The focused tests at the end pin the
validation rules a reader of ``from_json`` relies on (error paths, secrets, shell splitting...).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from harness import load_yaml

import ckagent.master.protocol as protocol
from ckagent.master.protocol import (
    CAUSE_CLASSES,
    CHECKPOINT_REASONS,
    ERROR_CODES,
    FINAL_STATUSES,
    FRAMEWORKS,
    NODE_STATUSES,
    RESUME_MODES,
    STOP_SIGNALS,
    TASK_STATUSES,
    TIMEOUT_MESSAGE,
    ArtifactRef,
    CauseClass,
    CheckpointFile,
    CheckpointManifest,
    CheckpointRef,
    CodePackage,
    Heartbeat,
    HeartbeatResponse,
    ItemBatch,
    LogBatch,
    NodeLeaving,
    PendingTasks,
    ProtocolError,
    RegisterRequest,
    RegisterResponse,
    ResultAccepted,
    ResumeMode,
    RetryPolicy,
    SeqAccepted,
    SeqConflict,
    SpiderFile,
    Task,
    TaskOutputs,
    TaskRelease,
    TaskResources,
    TaskResult,
    TaskStats,
    VersionPolicy,
    utc_iso,
    utc_now_iso,
)
from ckagent.node.egress_policy import parse_text

REPO = Path(__file__).resolve().parents[1]
SPEC_PATH = Path(protocol.__file__).with_name("openapi.yaml")
DOC_PATH = REPO / "docs" / "protocol.md"
SPEC: dict[str, Any] = load_yaml(SPEC_PATH.read_text(encoding="utf-8"))
SCHEMAS: dict[str, Any] = SPEC["components"]["schemas"]

# schema name -> the type that reads and writes it
TYPES: dict[str, Any] = {
    "RegisterRequest": RegisterRequest,
    "RegisterResponse": RegisterResponse,
    "Heartbeat": Heartbeat,
    "HeartbeatResponse": HeartbeatResponse,
    "CodePackage": CodePackage,
    "Task": Task,
    "PendingTasks": PendingTasks,
    "TaskResult": TaskResult,
    "TaskStats": TaskStats,
    "LogBatch": LogBatch,
    "ItemBatch": ItemBatch,
    "SeqAccepted": SeqAccepted,
    "ResultAccepted": ResultAccepted,
    "SeqConflict": SeqConflict,
    "SpiderFile": SpiderFile,
    "TaskRelease": TaskRelease,
    "NodeLeaving": NodeLeaving,
    "TaskOutputs": TaskOutputs,
    "ArtifactRef": ArtifactRef,
    "CheckpointRef": CheckpointRef,
    "RetryPolicy": RetryPolicy,
    "CheckpointFile": CheckpointFile,
    "CheckpointManifest": CheckpointManifest,
}
ENUMS: dict[str, tuple[str, ...]] = {
    "TaskStatus": TASK_STATUSES,
    "ErrorCode": ERROR_CODES,
    "Framework": FRAMEWORKS,
    "NodeStatus": NODE_STATUSES,
    "CauseClass": CAUSE_CLASSES,
    "ResumeMode": RESUME_MODES,
}
UNTYPED = {"Error"}  # written by the master, never parsed into a type by the agent
# Node batches: the request is spliced from LogBatch/ItemBatch bodies, the results read by
# ckagent.delivery.nodebatch (each result is a SeqAccepted or an Error with its status).
UNTYPED |= {"NodeBatches", "NodeBatchResults"}
# Answers and conflicts of the checkpoint calls, read by functions (ckagent.master.endpoints, .errors).
UNTYPED |= {"ChunkStored", "CheckpointAccepted", "Superseded", "CheckpointConflict"}
# from_json names a field "<prefix><key>" for these types (their default path)
FIELD_PREFIX = {"CodePackage": "codePackage.", "Task": "task.", "CheckpointRef": "checkpoint.", "RetryPolicy": "retry."}
SHA = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


def full_instances() -> dict[str, Any]:
    """One instance per type with every field given (nothing None, no list or map empty)."""
    package = CodePackage(url="http://m.example/api/packages/s1/v3.zip", sha256=SHA, size_bytes=1234)
    checkpoint = CheckpointRef(id="1-4", attempt=1, item_seq=450, log_seq=1210, created_at="2026-11-29T16:07:50.000Z",
                               size_bytes=183244, url="/api/tasks/t1/checkpoints/1-4")
    chunk = CheckpointFile(path="jobdir/requests.seen", type="file", size=12, mode=0o644, chunks=[SHA])
    manifest = CheckpointManifest(id="2-5", attempt=2, created_at="2026-12-05T18:00:00.000Z", reason="migrate",
                                  item_seq=450, log_seq=1210, size_bytes=12, packed_bytes=40, files=[chunk])
    retry = RetryPolicy(max_attempts=3, backoff_seconds=10.0, factor=1.5, on=[CauseClass.RESOURCE, CauseClass.SPIDER],
                        exit_codes=[75])
    task = Task(
        id="t1",
        spider_id="s1",
        spider_name="shop",
        framework="scrapy",
        command=["scrapy", "crawl", "shop"],
        args=["-a", "x=1"],
        env={"FOO": "bar"},
        timeout_seconds=60.0,
        code_version="v3",
        code_package=package,
        params={"start_url": "https://shop.example/"},
        stall_timeout_seconds=600.0,
        resources=TaskResources(memory_bytes=200 << 20, pids=64, cpus=1.5, memory_soft_bytes=150 << 20),
        stop_signal="SIGINT",
        egress=parse_text("private", "10.0.0.5:3128"),
        claimed=True,
        outputs=TaskOutputs(items=["results.json"], artifacts=["images/"]),
        stop_grace_seconds=120.0,
        clean_start=True,
        attempt=2,
        item_seq_start=450,
        log_seq_start=1210,
        checkpoint=checkpoint,
        checkpoint_interval_seconds=30.0,
        resume=ResumeMode.RESTART_KEEP,
        retry=retry,
    )
    stats = TaskStats(seq=42, stats={"items": 3, "finishReason": "finished"}, progress={"done": 1, "total": 2},
                      at="2026-11-29T16:04:00.000Z")
    return {
        "RegisterRequest": RegisterRequest(
            name="n1",
            ip="10.0.0.1",
            port=9000,
            version="0.1.0",
            os="Linux",
            arch="x86_64",
            python="3.11.9",
            cpu_count=4,
            memory_total_bytes=8 << 30,
            max_workers=3,
            runtimes={"python": "3.11.9"},
            labels={"region": "eu"},
            node_uid="5f0c1d2e3a4b4c5d8e9f0a1b2c3d4e5f",
            protocol_version=1,
            features=["paused-reason"],
            containment={"level": "cgroup-v2", "details": "cgroup v2 at /sys/fs/cgroup/x", "limits": ["memory"]},
            egress={"level": "nftables", "details": "nftables table inet ckagent_x", "policy": "deny metadata",
                    "deny": ["metadata"], "allow": []},
            name_exclusive=True,
        ),
        "RegisterResponse": RegisterResponse(node_id="7", api_key="k-123",
                                             policy=VersionPolicy("0.1.0", "0.2.0"), features=["claim-in-poll", "node-batches"]),
        "Heartbeat": Heartbeat(
            status="RUNNING",
            cpu_percent=12.5,
            memory_percent=40.0,
            disk_percent=50.0,
            memory_used_bytes=1 << 30,
            disk_free_bytes=10 << 30,
            load1=0.5,
            running_task_ids=["t1"],
            running_spider_ids=["s1"],
            max_workers=3,
            free_slots=2,
            version="0.1.0",
            uptime_seconds=12.5,
            runtimes={"node": "20.11.1"},
            paused_reason="free disk space below task.min_free_disk_bytes",
            claiming_task_ids=["t2"],
            reporting_task_ids=["t0"],
            claim_poll_ids=[1764600000123456],
            last_claim_poll_id=1764600000123456,
        ),
        "TaskRelease": TaskRelease(reason="claimed while the node started draining"),
        "NodeLeaving": NodeLeaving(node_uid="5f0c1d2e3a4b4c5d8e9f0a1b2c3d4e5f", reason="drained"),
        "HeartbeatResponse": HeartbeatResponse(cancel_task_ids=["t9"], policy=VersionPolicy("0.1.0", "0.2.0")),
        "CodePackage": package,
        "Task": task,
        "PendingTasks": PendingTasks(tasks=[task], cancel_task_ids=["t9"]),
        "TaskResult": TaskResult(
            status="FAILED",
            exit_code=1,
            error_code="EXIT_NONZERO",
            error_message="exited with status 1",
            started_at="2026-11-29T16:03:50.123Z",
            finished_at="2026-11-29T16:04:00.123Z",
            duration_ms=10000,
            item_count=3,
            log_lines=20,
            deploy_ms=120,
            install_ms=2500,
            run_ms=7300,
            finish_reason="finished",
            stats=stats,
            cpu_seconds=1.25,
            memory_peak_bytes=50 << 20,
            pids_peak=3,
            io_read_bytes=4096,
            io_write_bytes=8192,
            egress_refused=[{"address": "169.254.169.254", "port": 80, "count": 3}],
            incomplete=True,
            incomplete_reason="items: master answered 403 (node quota exceeded) for 600 s",
            artifacts=[ArtifactRef(path="images/a.jpg", size_bytes=3, sha256=SHA)],
            attempt=2,
            cause_class=CauseClass.SPIDER,
            retryable=True,
            checkpoint_id="2-5",
        ),
        "TaskOutputs": TaskOutputs(items=["out/*.jsonl"], artifacts=["books.db"]),
        "ArtifactRef": ArtifactRef(path="images/a.jpg", size_bytes=3, sha256=SHA),
        "TaskStats": stats,
        "LogBatch": LogBatch(seq=5, lines=["a", "b"], attempt=2),
        "ItemBatch": ItemBatch(seq=2, items=[{"a": 1}], attempt=2),
        "CheckpointRef": checkpoint,
        "RetryPolicy": retry,
        "CheckpointFile": chunk,
        "CheckpointManifest": manifest,
        "SeqAccepted": SeqAccepted(accepted_seq=7),
        "ResultAccepted": ResultAccepted(status="SUCCESS"),
        "SeqConflict": SeqConflict(expected_seq=3),
        "SpiderFile": SpiderFile(id="f1", path="spiders/shop.py", size_bytes=10, sha256=SHA),
    }


def wire(instance: Any) -> dict[str, Any]:
    """``instance.to_json()`` as it comes out of a strict JSON encoder and back."""
    return json.loads(json.dumps(instance.to_json(), allow_nan=False))


def resolve(node: Any) -> Any:
    """Follow a local ``$ref`` ("#/components/...") to what it points at."""
    while isinstance(node, dict) and "$ref" in node:
        target: Any = SPEC
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def walk(node: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    """Every (json-path, dict) in the document."""
    if isinstance(node, dict):
        yield where, node
        for key, value in node.items():
            yield from walk(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, f"{where}/{i}")


def allows_null(prop: dict[str, Any]) -> bool:
    """Whether a property schema admits JSON null (``type: [..., "null"]`` or a null branch)."""
    types = prop.get("type")
    if types == "null" or (isinstance(types, list) and "null" in types):
        return True
    return any(allows_null(resolve(branch)) for branch in prop.get("oneOf", []) + prop.get("anyOf", []))


def enum_of(prop: dict[str, Any]) -> list[str] | None:
    """The enum a property schema draws from (through $ref and oneOf), or None."""
    prop = resolve(prop)
    if "enum" in prop:
        return list(prop["enum"])
    for branch in prop.get("oneOf", []) + prop.get("anyOf", []):
        found = enum_of(branch)
        if found is not None:
            return found
    return None


def _if_matches(condition: dict[str, Any], payload: dict[str, Any]) -> bool:
    supported = {"required", "properties"}
    assert set(condition) <= supported, f"test helper cannot evaluate {set(condition) - supported}"
    if any(key not in payload for key in condition.get("required", [])):
        return False
    for key, sub in condition.get("properties", {}).items():
        assert set(sub) == {"enum"}, f"test helper cannot evaluate {sub}"
        if key in payload and payload[key] not in sub["enum"]:
            return False
    return True


def required_for(schema: dict[str, Any], payload: dict[str, Any]) -> set[str]:
    """The schema's required fields for this payload, with ``allOf: [{if, then: {required}}]`` applied."""
    required = set(schema.get("required", []))
    for part in schema.get("allOf", []):
        if "if" in part and _if_matches(part["if"], payload):
            required |= set(part["then"].get("required", []))
    return required


def parse(name: str, payload: Any) -> Any:
    return TYPES[name].from_json(payload)


def payload_cases() -> Iterator[Any]:
    """(schema name, label, payload): the full instance and every example of each typed schema."""
    full = full_instances()
    for name in TYPES:
        yield pytest.param(name, wire(full[name]), id=f"{name}-full")
        for i, example in enumerate(SCHEMAS[name].get("examples", [])):
            yield pytest.param(name, example, id=f"{name}-example{i}")


# --------------------------------------------------------------------------- the document itself


def test_openapi_document_is_valid() -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(SPEC)  # raises OpenAPIValidationError naming the broken part
    assert SPEC["openapi"].startswith("3.1")


def test_every_ref_resolves() -> None:
    # openapi-spec-validator does not notice a dangling $ref in a schema; this does
    refs = [(where, node["$ref"]) for where, node in walk(SPEC) if isinstance(node.get("$ref"), str)]
    assert refs
    for where, ref in refs:
        assert ref.startswith("#/"), f"{where}: only local refs expected, got {ref}"
        try:
            resolve({"$ref": ref})
        except KeyError:
            pytest.fail(f"{where}: $ref {ref} points nowhere")


def test_every_schema_is_accounted_for_and_used() -> None:
    assert set(SCHEMAS) == set(TYPES) | set(ENUMS) | UNTYPED
    used = {
        ref.rsplit("/", 1)[1] for _, node in walk(SPEC["paths"]) if isinstance(ref := node.get("$ref"), str)
    }
    used |= {
        ref.rsplit("/", 1)[1]
        for _, node in walk(SPEC["components"])
        if isinstance(ref := node.get("$ref"), str) and "/schemas/" in ref
    }
    assert set(SCHEMAS) <= used, f"schemas nothing refers to: {set(SCHEMAS) - used}"


# (method, path) -> (request schema, 200 schema, statuses the operation must declare)
STREAM_STATUSES = {"200", "401", "404", "409", "413", "422", "429", "5XX"}
OPERATIONS: dict[tuple[str, str], tuple[str | None, str | None, set[str]]] = {
    ("post", "/api/nodes/register"): (
        "RegisterRequest",
        "RegisterResponse",
        {"200", "401", "413", "422", "429", "5XX"},
    ),
    ("post", "/api/nodes/{nodeId}/heartbeat"): (
        "Heartbeat",
        "HeartbeatResponse",
        {"200", "401", "413", "422", "429", "5XX"},
    ),
    ("post", "/api/nodes/{nodeId}/leaving"): ("NodeLeaving", None, {"200", "401", "404", "409", "413", "422", "429",
                                                                  "5XX"}),
    ("post", "/api/nodes/{nodeId}/batches"): ("NodeBatches", "NodeBatchResults", {"200", "400", "401", "413", "429", "5XX"}),
    ("get", "/api/nodes/{nodeId}/tasks/pending"): (None, "PendingTasks", {"200", "401", "422", "429", "5XX"}),
    ("post", "/api/tasks/{taskId}/result"): ("TaskResult", None, STREAM_STATUSES),
    ("post", "/api/tasks/{taskId}/release"): ("TaskRelease", None, STREAM_STATUSES),
    ("post", "/api/tasks/{taskId}/logs"): ("LogBatch", "SeqAccepted", STREAM_STATUSES),
    ("post", "/api/tasks/{taskId}/items"): ("ItemBatch", "SeqAccepted", STREAM_STATUSES),
    ("post", "/api/tasks/{taskId}/stats"): ("TaskStats", None, STREAM_STATUSES),
    ("put", "/api/tasks/{taskId}/artifacts/{path}"): (
        "bytes", "ArtifactRef", {"200", "400", "401", "404", "409", "413", "422", "429", "5XX"},
    ),
    ("get", "/api/spider-files/spider/{spiderId}"): (
        None,
        "SpiderFile[]",
        {"200", "401", "404", "429", "5XX"},
    ),
    ("get", "/api/spider-files/{fileId}"): (None, None, {"200", "401", "404", "429", "5XX"}),
    ("get", "/api/packages/{spiderId}/{codeVersion}.zip"): (None, None, {"200", "401", "404", "429", "5XX"}),
    ("put", "/api/tasks/{taskId}/checkpoint-chunks/{sha256}"): ("gzip", "ChunkStored", STREAM_STATUSES - {"400"}),
    ("get", "/api/tasks/{taskId}/checkpoint-chunks/{sha256}"): (None, None, {"200", "401", "404", "429", "5XX"}),
    ("post", "/api/tasks/{taskId}/checkpoints"): ("CheckpointManifest", "CheckpointAccepted", STREAM_STATUSES),
    ("get", "/api/tasks/{taskId}/checkpoints/{checkpointId}"): (None, "CheckpointManifest",
                                                               {"200", "401", "404", "429", "5XX"}),
}
HTTP_METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


def _schema_name(schema: dict[str, Any]) -> str:
    if schema.get("type") == "array":
        return _schema_name(schema["items"]) + "[]"
    return str(schema["$ref"]).rsplit("/", 1)[1]


def test_operations_match_the_protocol() -> None:
    found = {(m, path) for path, item in SPEC["paths"].items() for m in item if m in HTTP_METHODS}
    assert found == set(OPERATIONS)
    for (method, path), (request, ok, statuses) in OPERATIONS.items():
        op = SPEC["paths"][path][method]
        assert set(op["responses"]) == statuses, f"{method} {path}"
        body = op.get("requestBody")
        if request is None:
            assert body is None
        elif request == "bytes":
            assert body["required"] is True and set(body["content"]) == {"application/octet-stream"}
        elif request == "gzip":
            assert body["required"] is True and set(body["content"]) == {"application/gzip"}
        else:
            assert body["required"] is True
            assert _schema_name(body["content"]["application/json"]["schema"]) == request
        if ok is not None:
            assert _schema_name(op["responses"]["200"]["content"]["application/json"]["schema"]) == ok
        for status in ("401", "404", "422"):
            if status in statuses:
                response = resolve(op["responses"][status])
                assert _schema_name(response["content"]["application/json"]["schema"]) == "Error"


def test_stream_conflicts_carry_expected_seq() -> None:
    for path in ("/api/tasks/{taskId}/logs", "/api/tasks/{taskId}/items"):
        conflict = resolve(SPEC["paths"][path]["post"]["responses"]["409"])
        branches = {_schema_name(b) for b in conflict["content"]["application/json"]["schema"]["anyOf"]}
        assert branches == {"SeqConflict", "Superseded", "Error"}
    claim = SPEC["paths"]["/api/tasks/{taskId}/result"]["post"]["responses"]["409"]
    assert {_schema_name(b) for b in claim["content"]["application/json"]["schema"]["anyOf"]} == {"Superseded", "Error"}
    chunk = resolve(SPEC["paths"]["/api/tasks/{taskId}/checkpoint-chunks/{sha256}"]["put"]["responses"]["409"])
    assert {_schema_name(b) for b in chunk["content"]["application/json"]["schema"]["anyOf"]} == {"Superseded", "Error"}
    assert set(SCHEMAS["Superseded"]["required"]) == {"error", "supersededBy"}
    assert {"missingChunks", "storedItems", "supersededBy"} <= set(SCHEMAS["CheckpointConflict"]["properties"])
    assert set(SCHEMAS["Error"]["properties"]) == {"error", "field"}
    assert SCHEMAS["Error"]["required"] == ["error"]


def test_security_bearer_key_everywhere_but_register() -> None:
    schemes = SPEC["components"]["securitySchemes"]
    assert schemes["nodeKey"] == {**schemes["nodeKey"], "type": "http", "scheme": "bearer"}
    token = schemes["registrationToken"]
    assert (token["type"], token["in"], token["name"]) == ("apiKey", "header", "X-Registration-Token")
    assert SPEC["security"] == [{"nodeKey": []}]
    for method, path in OPERATIONS:
        security = SPEC["paths"][path][method].get("security")
        if path == "/api/nodes/register":
            assert security == [{"registrationToken": []}]
        else:
            assert security is None, f"{method} {path} must use the document's Bearer key"


def test_pending_query_parameters() -> None:
    params = {p["name"]: p for p in SPEC["paths"]["/api/nodes/{nodeId}/tasks/pending"]["get"]["parameters"]}
    assert set(params) == {"limit", "excludeSpiderIds", "runningSpiderIds", "waitSeconds", "claim", "pollId"}
    assert all(p["in"] == "query" and not p.get("required", False) for p in params.values())
    assert params["limit"]["schema"]["type"] == "integer"
    assert (params["excludeSpiderIds"]["style"], params["excludeSpiderIds"]["explode"]) == ("form", False)
    assert params["waitSeconds"]["schema"] == {"type": "number", "minimum": 0, "default": 0}
    assert "30" in params["waitSeconds"]["description"]
    assert params["claim"]["schema"]["type"] == params["pollId"]["schema"]["type"] == "integer"


# --------------------------------------------------------------------------- types vs schemas


@pytest.mark.parametrize("name", list(TYPES))
def test_fields_equal_schema_properties(name: str) -> None:
    instance = full_instances()[name]
    assert isinstance(instance, TYPES[name])
    for f in dataclasses.fields(instance):
        if f.name != "bad_tasks":  # not on the wire
            assert getattr(instance, f.name) not in (None, [], {}, ""), f"{name}.{f.name} not populated"
    assert set(wire(instance)) == set(SCHEMAS[name]["properties"])


@pytest.mark.parametrize(("name", "payload"), list(payload_cases()))
def test_required_and_optional_fields(name: str, payload: dict[str, Any]) -> None:
    """Remove (and null) each property in turn: required ones are refused, naming the field."""
    schema = SCHEMAS[name]
    prefix = FIELD_PREFIX.get(name, "")
    parse(name, payload)  # the starting point is valid
    for key in schema["properties"]:
        for mode in ("missing", "null"):
            mutated = copy.deepcopy(payload)
            if mode == "missing":
                mutated.pop(key, None)
            else:
                mutated[key] = None
            if key in required_for(schema, mutated):
                with pytest.raises(ProtocolError) as caught:
                    parse(name, mutated)
                assert caught.value.field == prefix + key, f"{key} {mode}"
            else:
                parse(name, mutated)  # must not raise


@pytest.mark.parametrize("name", list(TYPES))
def test_optional_properties_are_nullable_and_required_ones_are_not(name: str) -> None:
    schema = SCHEMAS[name]
    for key, prop in schema["properties"].items():
        assert allows_null(prop) == (key not in schema.get("required", [])), f"{name}.{key}"


def test_conditional_error_code() -> None:
    # the one conditional requirement: FAILED and CANCELLED need an errorCode
    for status in TASK_STATUSES:
        needs = status in FINAL_STATUSES and status != "SUCCESS"
        assert ("errorCode" in required_for(SCHEMAS["TaskResult"], {"status": status})) == needs
        if needs:
            with pytest.raises(ProtocolError, match="errorCode"):
                TaskResult.from_json({"status": status})
        else:
            assert TaskResult.from_json({"status": status}).error_code is None


@pytest.mark.parametrize("name", list(ENUMS))
def test_enums_equal_python_constants(name: str) -> None:
    assert tuple(SCHEMAS[name]["enum"]) == ENUMS[name]


ENUM_FIELDS = [
    ("Heartbeat", "status", NODE_STATUSES),
    ("Task", "framework", FRAMEWORKS),
    ("Task", "stopSignal", STOP_SIGNALS),
    ("TaskResult", "status", TASK_STATUSES),
    ("TaskResult", "errorCode", ERROR_CODES),
    ("TaskResult", "causeClass", CAUSE_CLASSES),
    ("Task", "resume", RESUME_MODES),
    ("CheckpointManifest", "reason", CHECKPOINT_REASONS),
    ("CheckpointFile", "type", ("file", "dir")),
    ("ResultAccepted", "status", FINAL_STATUSES),
]


def test_every_enum_property_is_listed() -> None:
    found = {
        (name, key)
        for name in TYPES
        for key, prop in SCHEMAS[name]["properties"].items()
        if enum_of(prop) is not None
    }
    assert found == {(name, key) for name, key, _ in ENUM_FIELDS}


@pytest.mark.parametrize(("name", "key", "constant"), ENUM_FIELDS)
def test_enum_properties_accept_exactly_their_values(name: str, key: str, constant: tuple[str, ...]) -> None:
    assert tuple(enum_of(SCHEMAS[name]["properties"][key]) or ()) == constant
    base = ENUM_BASES.get(name) or wire(full_instances()[name])
    prefix = FIELD_PREFIX.get(name, "")
    for value in constant:
        assert getattr(parse(name, {**base, key: value}), _snake(key)) == value
    for bogus in ("bogus", constant[0].lower() if constant[0].isupper() else constant[0].upper(), 1, True):
        with pytest.raises(ProtocolError) as caught:
            parse(name, {**base, key: bogus})
        assert caught.value.field == prefix + key


ENUM_BASES = {"CheckpointFile": {"path": "a", "type": "file", "size": 0, "mode": 0o644, "chunks": []}}
"""A payload each value of the enum fits (an empty file is also a valid dir)."""


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


@pytest.mark.parametrize("name", list(TYPES))
def test_every_typed_schema_has_examples(name: str) -> None:
    assert SCHEMAS[name].get("examples"), f"{name} needs at least one example"


@pytest.mark.parametrize(("name", "payload"), list(payload_cases()))
def test_examples_parse_and_round_trip(name: str, payload: dict[str, Any]) -> None:
    parsed = parse(name, payload)
    assert parse(name, parsed.to_json()) == parsed
    assert parse(name, wire(parsed)) == parsed
    if isinstance(parsed, PendingTasks):
        assert parsed.bad_tasks == []


def test_timeout_example_uses_the_backend_message() -> None:
    timeouts = [e for e in SCHEMAS["TaskResult"]["examples"] if e.get("errorCode") == "TIMEOUT"]
    assert timeouts
    assert all(e["errorMessage"] == TIMEOUT_MESSAGE == "执行超时" for e in timeouts)


def test_spider_file_listing() -> None:
    listing = [wire(full_instances()["SpiderFile"]), *SCHEMAS["SpiderFile"]["examples"]]
    parsed = SpiderFile.list_from_json(listing)
    assert [f.to_json() for f in parsed] == [SpiderFile.from_json(e).to_json() for e in listing]
    with pytest.raises(ProtocolError) as caught:
        SpiderFile.list_from_json([listing[0], {**listing[0], "sizeBytes": -1}])
    assert caught.value.field == "[1].sizeBytes"
    with pytest.raises(ProtocolError):
        SpiderFile.list_from_json({"files": listing})


# --------------------------------------------------------------------------- schemas vs from_json (jsonschema)


def _validator(name: str) -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    root = {"$ref": f"#/components/schemas/{name}", "components": SPEC["components"]}
    return jsonschema.Draft202012Validator(root)


@pytest.mark.parametrize(("name", "payload"), list(payload_cases()))
def test_examples_and_output_satisfy_the_json_schema(name: str, payload: dict[str, Any]) -> None:
    validator = _validator(name)
    validator.validate(payload)
    validator.validate(wire(parse(name, payload)))


def test_error_examples_satisfy_the_json_schema() -> None:
    validator = _validator("Error")
    assert SCHEMAS["Error"]["examples"]
    for example in SCHEMAS["Error"]["examples"]:
        validator.validate(example)


BAD_VALUES: list[Any] = [True, "", "text", 0, -1, 2.0, 1.5, 70000, [], [1], ["x"], {}, {"a": 1}, {"a": "b"}]
# Fields read as ids: from_json also takes integers (turned into strings), the schema says string.
INT_TOLERANT = {
    ("RegisterRequest", "name"),
    ("RegisterResponse", "nodeId"),
    ("RegisterResponse", "apiKey"),
    ("Heartbeat", "runningTaskIds"),
    ("Heartbeat", "runningSpiderIds"),
    ("Heartbeat", "claimingTaskIds"),
    ("Heartbeat", "reportingTaskIds"),
    ("HeartbeatResponse", "cancelTaskIds"),
    ("PendingTasks", "cancelTaskIds"),
    ("CodePackage", "url"),
    ("Task", "id"),
    ("Task", "spiderId"),
    ("SpiderFile", "id"),
    ("SpiderFile", "path"),
    ("SpiderFile", "sha256"),
    ("CheckpointRef", "id"),
    ("CheckpointManifest", "id"),
}
# Rules across fields that a JSON schema does not express: from_json refuses some values the schema
# allows (a chunk count other than ceil(size / 1 MiB); a sizeBytes other than the files' sum).
CROSS_FIELD = {("CheckpointFile", "size"), ("CheckpointFile", "chunks"), ("CheckpointManifest", "sizeBytes"),
               ("CheckpointManifest", "files")}


def _is_int_like(value: Any) -> bool:
    def one(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    return one(value) or (isinstance(value, list) and bool(value) and all(one(v) for v in value))


@pytest.mark.parametrize("name", list(TYPES))
def test_schema_and_from_json_agree_on_bad_values(name: str) -> None:
    """Each property set to each value of a table: the schema accepts it exactly when from_json does."""
    validator = _validator(name)
    base = wire(full_instances()[name])
    disagreements = []
    for key in SCHEMAS[name]["properties"]:
        for value in BAD_VALUES:
            payload = {**base, key: value}
            by_schema = validator.is_valid(payload)
            try:
                parsed = parse(name, payload)
            except ProtocolError:
                by_python = False
            else:
                by_python = not getattr(parsed, "bad_tasks", [])
            if by_schema == by_python:
                continue
            if (name, key) in INT_TOLERANT and _is_int_like(value) and by_python and not by_schema:
                continue
            if (name, key) in CROSS_FIELD and by_schema and not by_python:
                continue
            disagreements.append(f"{key}={value!r}: schema {by_schema}, from_json {by_python}")
    assert not disagreements, f"{name}: " + "; ".join(disagreements)


# --------------------------------------------------------------------------- focused validation rules


def _task(**overrides: Any) -> dict[str, Any]:
    return {"id": "t1", "spiderId": "s1", "spiderName": "shop", "framework": "python", **overrides}


def test_error_names_the_nested_field_path_and_bad_tasks_do_not_spoil_the_rest() -> None:
    answer = PendingTasks.from_json(
        {
            "tasks": [
                _task(id="a"),
                _task(id="b", codePackage={"url": "http://m/p.zip", "sha256": "abc", "sizeBytes": 3}),
                _task(id=17, spiderId="s2"),
                {"spiderId": "s3", "framework": "python"},
                "not a task",
            ],
            "cancelTaskIds": ["z"],
        }
    )
    assert [t.id for t in answer.tasks] == ["a", "17"]
    assert answer.cancel_task_ids == ["z"]
    assert [(b.task_id, b.error.field) for b in answer.bad_tasks] == [
        ("b", "tasks[1].codePackage.sha256"),
        (None, "tasks[3].id"),
        (None, "tasks[4]"),
    ]
    assert str(answer.bad_tasks[0].error).startswith("tasks[1].codePackage.sha256: ")
    assert answer.to_json()["tasks"] == [t.to_json() for t in answer.tasks]


def test_envelope_errors_still_raise() -> None:
    with pytest.raises(ProtocolError) as caught:
        PendingTasks.from_json({"tasks": [], "cancelTaskIds": ["a", True]})
    assert caught.value.field == "cancelTaskIds[1]"
    with pytest.raises(ProtocolError) as caught:
        PendingTasks.from_json({"tasks": {"id": "a"}})
    assert caught.value.field == "tasks"
    with pytest.raises(ProtocolError) as caught:
        PendingTasks.from_json([])
    assert caught.value.field == ""
    assert str(caught.value).startswith("<body>: ")


def test_null_lists_mean_empty() -> None:
    assert PendingTasks.from_json({"tasks": None, "cancelTaskIds": None}) == PendingTasks()
    assert PendingTasks.from_json({}) == PendingTasks()
    assert HeartbeatResponse.from_json({"cancelTaskIds": None}) == HeartbeatResponse()


def test_command_string_is_shell_split() -> None:
    task = Task.from_json(_task(command="scrapy crawl 'my spider' -a x=\"1 2\" -s A=$HOME"))
    assert task.command == ["scrapy", "crawl", "my spider", "-a", "x=1 2", "-s", "A=$HOME"]
    assert task.to_json()["command"] == task.command
    assert Task.from_json(task.to_json()) == task
    assert Task.from_json(_task(command=["node", "index.js"])).command == ["node", "index.js"]
    assert Task.from_json(_task(command=None)).command is None
    assert "command" not in Task.from_json(_task()).to_json()
    for bad, reason in [
        ("scrapy crawl 'oops", "cannot split"),
        ("", "must not be empty"),
        ("  ", "must not be empty"),
    ]:
        with pytest.raises(ProtocolError, match=reason) as caught:
            Task.from_json(_task(command=bad))
        assert caught.value.field == "task.command"
    with pytest.raises(ProtocolError) as caught:
        Task.from_json(_task(command=[]))
    assert caught.value.field == "task.command"
    with pytest.raises(ProtocolError) as caught:
        Task.from_json(_task(command=["python", 3]))
    assert caught.value.field == "task.command[1]"


def test_integer_ids_become_strings() -> None:
    task = Task.from_json(_task(id=1041, spiderId=17))
    assert (task.id, task.spider_id) == ("1041", "17")
    assert RegisterResponse.from_json({"nodeId": 7, "apiKey": "k"}).node_id == "7"
    beat = {**wire(full_instances()["Heartbeat"]), "runningTaskIds": [1, "2"], "runningSpiderIds": [3]}
    parsed = Heartbeat.from_json(beat)
    assert (parsed.running_task_ids, parsed.running_spider_ids) == (["1", "2"], ["3"])
    assert HeartbeatResponse.from_json({"cancelTaskIds": [5]}).cancel_task_ids == ["5"]
    assert PendingTasks.from_json({"cancelTaskIds": [6]}).cancel_task_ids == ["6"]
    assert SpiderFile.from_json({"id": 9, "path": "a.py", "sizeBytes": 1, "sha256": SHA}).id == "9"
    bad = PendingTasks.from_json({"tasks": [_task(id=99, framework="ruby")]}).bad_tasks
    assert [(b.task_id, b.error.field) for b in bad] == [("99", "tasks[0].framework")]
    # but a boolean is no id, and neither is an empty string
    for not_an_id in (True, "", 1.5, None):
        with pytest.raises(ProtocolError) as caught:
            Task.from_json(_task(id=not_an_id))
        assert caught.value.field == "task.id"


NUMBER_FIELDS = [
    ("RegisterRequest", "port"),
    ("Heartbeat", "cpuPercent"),
    ("Heartbeat", "freeSlots"),
    ("Task", "timeoutSeconds"),
    ("TaskResult", "exitCode"),
    ("TaskResult", "durationMs"),
    ("TaskResult", "installMs"),
    ("LogBatch", "seq"),
    ("SeqAccepted", "acceptedSeq"),
    ("CodePackage", "sizeBytes"),
]


@pytest.mark.parametrize(("name", "key"), NUMBER_FIELDS)
def test_booleans_are_not_numbers(name: str, key: str) -> None:
    base = wire(full_instances()[name])
    for flag in (True, False):
        with pytest.raises(ProtocolError) as caught:
            parse(name, {**base, key: flag})
        assert caught.value.field == FIELD_PREFIX.get(name, "") + key


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_rejected(text: str) -> None:
    # Python's json module reads these non-standard literals, so a sloppy master can send them
    beat = json.loads(json.dumps(wire(full_instances()["Heartbeat"])).replace("12.5", text, 1))
    with pytest.raises(ProtocolError, match="finite") as caught:
        Heartbeat.from_json(beat)
    assert caught.value.field == "cpuPercent"
    with pytest.raises(ProtocolError) as caught:
        Task.from_json(json.loads(json.dumps(_task()).replace("}", f', "timeoutSeconds": {text}}}')))
    assert caught.value.field == "task.timeoutSeconds"
    with pytest.raises(ProtocolError) as caught:
        TaskResult.from_json(json.loads(f'{{"status": "SUCCESS", "exitCode": {text}}}'))
    assert caught.value.field == "exitCode"


def test_integers_reject_fractions_and_ranges_are_enforced() -> None:
    assert LogBatch.from_json({"seq": 3.0, "lines": []}).seq == 3
    with pytest.raises(ProtocolError, match="integer"):
        LogBatch.from_json({"seq": 3.5, "lines": []})
    with pytest.raises(ProtocolError, match=">= 0"):
        SeqConflict.from_json({"expectedSeq": -1})
    request = wire(full_instances()["RegisterRequest"])
    for key, value in [("port", 65536), ("maxWorkers", 0), ("memoryTotalBytes", -1)]:
        with pytest.raises(ProtocolError) as caught:
            RegisterRequest.from_json({**request, key: value})
        assert caught.value.field == key


def test_register_response_repr_hides_the_key() -> None:
    key = "nk_very-secret-4f1c0e9b"
    response = RegisterResponse.from_json({"nodeId": "7", "apiKey": key})
    assert response.api_key == key
    assert response.to_json() == {"nodeId": "7", "apiKey": key}
    for text in (repr(response), str(response), f"{response!r}", repr([response])):
        assert key not in text
        assert "***" in text and "'7'" in text


def test_secret_values_never_appear_in_errors() -> None:
    secret = "s3cret-value-0815"
    cases: list[tuple[Callable[[Any], Any], Any, str]] = [
        (Task.from_json, _task(env={"API_TOKEN": 123456789}), "task.env.API_TOKEN"),
        (Task.from_json, _task(env={"API_TOKEN": [secret]}), "task.env.API_TOKEN"),
        (Task.from_json, _task(env={"API_TOKEN": {"v": secret}}), "task.env.API_TOKEN"),
        (Task.from_json, _task(env=f"API_TOKEN={secret}"), "task.env"),
        (Task.from_json, _task(env=[f"API_TOKEN={secret}"]), "task.env"),
        (RegisterResponse.from_json, {"nodeId": "7", "apiKey": [secret]}, "apiKey"),
        (RegisterResponse.from_json, {"nodeId": "7", "apiKey": {"k": secret}}, "apiKey"),
        (RegisterResponse.from_json, {"nodeId": "7", "apiKey": ""}, "apiKey"),
    ]
    for from_json, payload, field in cases:
        with pytest.raises(ProtocolError) as caught:
            from_json(payload)
        assert caught.value.field == field
        assert secret not in str(caught.value) and "123456789" not in str(caught.value), str(caught.value)
    # a bad variable name is named (names are not secret), its value is not shown
    with pytest.raises(ProtocolError) as caught:
        Task.from_json(_task(env={"BAD-NAME": secret}))
    assert caught.value.field == "task.env.BAD-NAME"
    assert secret not in str(caught.value)
    # the check itself can fail: a non-secret string map does show what was wrong
    with pytest.raises(ProtocolError, match="12345"):
        RegisterRequest.from_json({**wire(full_instances()["RegisterRequest"]), "labels": {"a": 12345}})


def test_code_package_digest() -> None:
    upper = CodePackage.from_json({"url": "http://m/p.zip", "sha256": SHA.upper(), "sizeBytes": 1})
    assert upper.sha256 == SHA
    for bad in (SHA[:-1], SHA + "0", "g" * 64):
        with pytest.raises(ProtocolError, match="64 hex") as caught:
            CodePackage.from_json({"url": "http://m/p.zip", "sha256": bad, "sizeBytes": 1})
        assert caught.value.field == "codePackage.sha256"


def test_items_must_be_objects() -> None:
    with pytest.raises(ProtocolError) as caught:
        ItemBatch.from_json({"seq": 0, "items": [{"a": 1}, [1, 2]]})
    assert caught.value.field == "items[1]"
    with pytest.raises(ProtocolError) as caught:
        LogBatch.from_json({"seq": 0, "lines": ["ok", None]})
    assert caught.value.field == "lines[1]"


def test_unknown_fields_are_ignored() -> None:
    for name, instance in full_instances().items():
        payload = {**wire(instance), "someFutureField": {"x": 1}}
        assert parse(name, payload) == instance


def test_top_level_must_be_an_object() -> None:
    for name in TYPES:
        with pytest.raises(ProtocolError, match="expected an object"):
            parse(name, ["not", "an", "object"])


def test_timestamps() -> None:
    moment = datetime(2026, 11, 29, 16, 3, 50, 123999, tzinfo=timezone.utc)
    assert utc_iso(moment) == "2026-11-29T16:03:50.123Z"
    assert utc_iso(moment.astimezone(timezone(timedelta(hours=8)))) == "2026-11-29T16:03:50.123Z"
    assert utc_iso(moment.replace(tzinfo=None)) == "2026-11-29T16:03:50.123Z"  # naive = UTC
    assert utc_iso(moment.replace(microsecond=0)) == "2026-11-29T16:03:50.000Z"
    now = utc_now_iso()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", now)
    parsed = datetime.strptime(now, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=timezone.utc)
    assert abs((datetime.now(timezone.utc) - parsed).total_seconds()) < 5


# --------------------------------------------------------------------------- the prose document


def test_protocol_doc_covers_the_contract() -> None:
    doc = DOC_PATH.read_text(encoding="utf-8")
    missing = [path for path in SPEC["paths"] if path not in doc]
    missing += [code for code in ERROR_CODES if f"`{code}`" not in doc]
    missing += [
        name
        for name in (
            "CK_TASK_ID",
            "CK_SPIDER_ID",
            "CK_SPIDER_NAME",
            "CK_ITEMS_FILE",
            "CK_TASK_DIR",
            "CK_PARAMS",
        )
        if name not in doc
    ]
    missing += [
        word
        for word in (TIMEOUT_MESSAGE, "expectedSeq", "acceptedSeq", "X-Registration-Token")
        if word not in doc
    ]
    assert not missing, f"docs/protocol.md does not mention: {missing}"
