"""The endpoint table (``ckagent.master.endpoints``) against what it must agree with.

- ``ckagent/master/protocol/openapi.yaml``: every node operation is a row of the table and every row
  an operation (same method, same path with its parameters), answering the schema the row reads;
- the reference master: every row's route is served (read from the app's own route list);
- what derives from it: connectivity's node and task-data endpoints, the fault proxy's calls, the
  request metric's endpoint label;
- paths: each id quoted once, as one segment (or segments, for an artifact's path).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
import trio
from faultproxy import CALLS, call_of
from harness import load_yaml
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import BaseRoute, Match, Mount

from ckagent.devmaster.app import Notifier, create_app
from ckagent.devmaster.store import Store
from ckagent.master import connectivity, endpoints
from ckagent.master.endpoints import ENDPOINTS, TASK_DATA_ENDPOINTS, Endpoint
from ckagent.master.protocol import SpiderFile
from ckagent.port.metrics import AgentMetrics, LiveFigures

SPEC = load_yaml(Path(endpoints.__file__).with_name("protocol").joinpath("openapi.yaml").read_text())
HTTP_METHODS = {"get", "put", "post", "delete", "patch"}
SAMPLE_IDS = {"node": "node-1", "task": "task-1", "spider": "spider-1", "file": "file-1", "version": "v1",
              "sha": "ab" * 32, "checkpoint": "2-5",
              "path": "out/report.csv"}


def _shape(template: str) -> str:
    """A path template with its parameters' names and kinds left out: ``/api/tasks/{}/result``."""
    return re.sub(r"\{[^}]*\}", "{}", template)


def _operations() -> dict[tuple[str, str], dict[str, Any]]:
    return {(method.upper(), _shape(path)): op for path, item in SPEC["paths"].items()
            for method, op in item.items() if method in HTTP_METHODS}


def _schemas(op: dict[str, Any]) -> set[str | None]:
    """The answer schemas an operation names: one, or each of a ``oneOf`` (a claim and a final result
    share their route: any object, or ResultAccepted)."""
    content = op["responses"]["200"].get("content", {}).get("application/json")
    if content is None:
        return {None}
    return {_schema(schema) for schema in content["schema"].get("oneOf", [content["schema"]])}


def _schema(schema: dict[str, Any]) -> str | None:
    if schema.get("type") == "array":
        return str(schema["items"]["$ref"]).rsplit("/", 1)[1] + "[]"
    ref = schema.get("$ref")
    return None if ref is None else str(ref).rsplit("/", 1)[1]


def test_every_operation_of_the_node_protocol_is_a_row_and_every_row_an_operation() -> None:
    rows = {(e.method, _shape(e.template)) for e in ENDPOINTS.values()}
    assert rows == set(_operations())


def test_each_row_reads_the_answer_the_openapi_file_names() -> None:
    operations = _operations()
    for e in ENDPOINTS.values():
        op = operations[(e.method, _shape(e.template))]
        assert e.answer_schema in _schemas(op), e.name
        reader = e.answer
        owner = getattr(reader, "__self__", None)  # X.from_json / X.list_from_json: the type is the schema
        if isinstance(owner, type):
            suffix = "[]" if getattr(reader, "__name__", "") == "list_from_json" else ""
            assert e.answer_schema == owner.__name__ + suffix, e.name
        if e.answer is None:  # a download: bytes, no JSON answer
            assert "application/json" not in op["responses"]["200"].get("content", {}), e.name


def test_each_rows_parameters_are_the_operations_in_order() -> None:
    for path, item in SPEC["paths"].items():
        documented = re.findall(r"\{([^}]*)\}", path)
        for method in set(item) & HTTP_METHODS:
            for e in ENDPOINTS.values():
                if (e.method, _shape(e.template)) == (method.upper(), _shape(path)):
                    assert len(e.params) == len(documented), (e.name, path)


def _routes(routes: list[BaseRoute]) -> list[BaseRoute]:
    out: list[BaseRoute] = []
    for route in routes:
        out.extend(_routes(list(route.routes)) if isinstance(route, Mount) else [route])
    return out


async def test_the_reference_master_serves_every_row(tmp_path: Path) -> None:
    store = await trio.to_thread.run_sync(Store, tmp_path / "master.sqlite")
    app = create_app(store, Notifier(), registration_token="t", admin_token="a")
    routes = _routes(list(app.routes))
    for e in ENDPOINTS.values():
        path = unquote(e.path(**{name: SAMPLE_IDS[name] for name in e.params}))  # as the ASGI server hands it over
        scope = {"type": "http", "method": e.method, "path": path, "root_path": ""}
        matched = [r for r in routes if r.matches(scope)[0] is Match.FULL]
        assert matched, f"the reference master has no route for {e.name}: {e.method} {path}"
    node_routes = [r for r in routes if getattr(r, "path", "").startswith("/api/nodes/")]
    for route in node_routes:  # everything under /api/nodes/ is the node protocol: a row of the table
        for method in set(getattr(route, "methods", None) or ()) - {"HEAD"}:
            sample = re.sub(r"\{[^}]*\}", "node-1", getattr(route, "path", ""))
            assert any(e.matches(method, sample) for e in ENDPOINTS.values()), f"{method} {sample}"


def test_ids_are_quoted_once_as_one_segment_each() -> None:
    hostile = "../a/b?c#d%2e"
    assert endpoints.RESULT.path(task=hostile) == "/api/tasks/..%2Fa%2Fb%3Fc%23d%252e/result"
    assert endpoints.RESULT.path(task="..") == "/api/tasks/%2E%2E/result"
    assert endpoints.ARTIFACT.path(task="t/1", path="out/a b.csv") == "/api/tasks/t%2F1/artifacts/out/a%20b.csv"
    assert endpoints.HEARTBEAT.path() == "/api/nodes/{node}/heartbeat"  # the client fills the node id
    assert endpoints.HEARTBEAT.path(node="n/1") == "/api/nodes/n%2F1/heartbeat"
    with pytest.raises(KeyError, match="needs"):
        endpoints.RESULT.path()
    with pytest.raises(KeyError, match="has no"):
        endpoints.RESULT.path(task="t", spider="s")


def test_a_path_built_by_the_table_is_matched_back_to_its_row() -> None:
    for e in ENDPOINTS.values():
        path = e.path(**{name: "a/b" for name in e.params})
        assert e.matches(e.method, path), e.name
        assert not e.matches("DELETE", path)
    assert not endpoints.SPIDER_FILE.matches("GET", endpoints.SPIDER_FILES.path(spider="s"))
    assert not endpoints.RESULT.matches("POST", "/api/tasks/a/b/result")  # an id is one segment


def test_connectivity_derives_its_endpoint_sets_from_the_table() -> None:
    assert {"logs", "items", "batches", "result"} == TASK_DATA_ENDPOINTS
    assert connectivity.TASK_DATA_ENDPOINTS is TASK_DATA_ENDPOINTS
    assert {"register", "heartbeat", "leaving", "poll"} | TASK_DATA_ENDPOINTS == connectivity._NODE_ENDPOINTS
    assert set(connectivity.ENDPOINT_CLASSES) == set(ENDPOINTS)
    assert {connectivity.endpoint_class(n) for n in ("download", "spider_files", "spider_file")} == {"downloads"}
    assert {connectivity.endpoint_class(n) for n in ("poll", "claim", "release")} == {"poll"}


def test_the_fault_proxy_names_every_call_of_the_table() -> None:
    assert set(ENDPOINTS) | {"other"} == CALLS
    for e in ENDPOINTS.values():
        path = e.path(**{name: SAMPLE_IDS[name] for name in e.params})
        payload = {"status": "RUNNING"} if e is endpoints.CLAIM else {"status": "SUCCESS"}
        assert call_of(e.method, path, payload) == e.name
    assert call_of("GET", "/api/spiders", None) == "other"


def test_an_endpoints_reader_is_its_answer_type() -> None:
    row: Endpoint[list[SpiderFile]] = endpoints.SPIDER_FILES
    assert row.answer is not None
    listing = row.answer([{"id": "f1", "path": "main.py", "sizeBytes": 3, "sha256": "a" * 64}])
    assert listing == [SpiderFile("f1", "main.py", 3, "a" * 64)]
    with pytest.raises(ValueError):
        endpoints.node_batch_results({"results": "no"})
    assert endpoints.node_batch_results({"results": [{"acceptedSeq": 1}]}) == [{"acceptedSeq": 1}]


def test_the_request_metric_has_one_series_per_endpoint_from_the_start() -> None:
    metrics = AgentMetrics("1.2.3", "node-a")
    body, _ = metrics.render(LiveFigures(state="RUNNING"))
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    series = {(s.labels["endpoint"], s.labels["outcome"]): s.value
              for s in families["ckagent_master_requests"].samples if s.name == "ckagent_master_requests_total"}
    assert series == {(name, "ok"): 0.0 for name in ENDPOINTS}


def test_the_protocol_docs_name_every_call_of_the_table() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    section = doc.split("\n## Endpoints\n", 1)[1].split("\n### ", 1)[0]
    named = {name for row in section.splitlines() if row.startswith("| `")
             for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert named == set(ENDPOINTS)
