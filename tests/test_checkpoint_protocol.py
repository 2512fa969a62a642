"""Attempts, checkpoints, causes and retries on the wire (ckagent.master.protocol: vocabulary, checkpoints,
the new fields of Task/TaskResult/batches): the cause table, the hostile-manifest matrix, and hypothesis
fuzz of every new ``from_json`` — whatever bytes or JSON come, nothing but ProtocolError leaves it."""

from __future__ import annotations

import contextlib
import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckagent.delivery.pending import Pending
from ckagent.master.endpoints import checkpoint_accepted, chunk_stored
from ckagent.master.protocol import (
    CHUNK_BYTES,
    ERROR_CODES,
    OUTCOME_STATUS,
    CauseClass,
    CheckpointFile,
    CheckpointManifest,
    CheckpointRef,
    ItemBatch,
    LogBatch,
    PendingTasks,
    ProtocolError,
    ResumeMode,
    RetryPolicy,
    Task,
    TaskResult,
    cause_of,
)
from ckagent.master.protocol.checkpoints import MAX_FILES, MAX_PATH_CHARS

SHA = "ab" * 32
SHA2 = "cd" * 32

# --------------------------------------------------------------------------- causes

CAUSES = {
    "AGENT_LOST": (CauseClass.DISRUPTION, True),
    "AGENT_ERROR": (CauseClass.DISRUPTION, True),
    "MIGRATED": (CauseClass.DISRUPTION, True),
    "NODE_LOST": (CauseClass.DISRUPTION, True),
    "OOM_KILLED": (CauseClass.RESOURCE, True),
    "MEMORY_LIMIT": (CauseClass.RESOURCE, True),
    "TIMEOUT": (CauseClass.RESOURCE, True),
    "STALLED": (CauseClass.RESOURCE, True),
    "DISK_FULL": (CauseClass.RESOURCE, True),
    "EXIT_NONZERO": (CauseClass.SPIDER, True),
    "SIGNALED": (CauseClass.SPIDER, True),
    "DEPLOY_FAILED": (CauseClass.SETUP, True),
    "DEPS_FAILED": (CauseClass.SETUP, True),
    "BAD_TASK": (CauseClass.SETUP, False),
    "CANCELLED": (None, False),
    "LOG_BUDGET": (None, False),
}


def test_every_error_code_has_its_cause_class() -> None:
    assert set(CAUSES) == set(ERROR_CODES)
    for code, expected in CAUSES.items():
        assert cause_of(code) == expected, code
    assert cause_of(None) == cause_of("SUCCESS") == (None, False)
    assert cause_of("DISK_FULL", disk_culprit=False) == (CauseClass.DISRUPTION, True)
    assert cause_of("SOMETHING_NEWER") == (None, False)


def test_new_codes_are_failures() -> None:
    assert {OUTCOME_STATUS[c] for c in ("MIGRATED", "MEMORY_LIMIT", "NODE_LOST")} == {"FAILED"}


# --------------------------------------------------------------------------- fields round trip


def _task(**extra: Any) -> dict[str, Any]:
    return {"id": "t1", "spiderId": "s1", "framework": "python", **extra}


def test_task_defaults_and_the_new_fields() -> None:
    plain = Task.from_json(_task())
    assert (plain.attempt, plain.item_seq_start, plain.log_seq_start) == (1, 0, 0)
    assert (plain.checkpoint, plain.checkpoint_interval_seconds, plain.retry) == (None, None, None)
    assert plain.resume is ResumeMode.RESTART_REPLACE
    assert not {"attempt", "itemSeqStart", "logSeqStart", "resume", "checkpoint", "retry"} & set(plain.to_json())
    task = Task.from_json(_task(attempt=3, itemSeqStart=450, logSeqStart=12, checkpointIntervalSeconds=5,
                                resume="restart-keep", retry={"on": ["spider"], "exitCodes": [75]},
                                checkpoint={"id": "2-4", "attempt": 2, "itemSeq": 450, "logSeq": 12},
                                resources={"memorySoftBytes": 1 << 30}))
    assert task.attempt == 3 and task.checkpoint == CheckpointRef("2-4", 2, 450, 12)
    assert task.retry == RetryPolicy(on=[CauseClass.SPIDER], exit_codes=[75])
    assert task.resources.memory_soft_bytes == 1 << 30 and task.resume is ResumeMode.RESTART_KEEP
    assert Task.from_json(task.to_json()) == task


@pytest.mark.parametrize(("key", "value"), [("attempt", 0), ("itemSeqStart", -1), ("logSeqStart", "x"),
                                            ("checkpointIntervalSeconds", 0), ("resume", "restart"),
                                            ("retry", {"factor": 0.5}), ("retry", {"on": ["nope"]}),
                                            ("retry", {"exitCodes": [300]}), ("checkpoint", {"id": "1-1"})])
def test_task_refuses_bad_new_fields_naming_them(key: str, value: Any) -> None:
    with pytest.raises(ProtocolError) as caught:
        Task.from_json(_task(**{key: value}))
    assert caught.value.field.startswith(f"task.{key}")


def test_result_and_batches_carry_the_attempt() -> None:
    result = TaskResult(status="FAILED", error_code="MIGRATED", attempt=2, cause_class=CauseClass.DISRUPTION,
                        retryable=True, checkpoint_id="2-7")
    assert result.to_json()["causeClass"] == "disruption"
    assert TaskResult.from_json(result.to_json()) == result
    assert "attempt" not in LogBatch(seq=1, lines=[]).to_json()
    assert LogBatch.from_json({"seq": 1, "lines": [], "attempt": 2}).attempt == 2
    assert ItemBatch.from_json(ItemBatch(seq=1, items=[{}], attempt=4).to_json()).attempt == 4


async def test_a_batch_body_carries_the_attempt_only_when_given() -> None:
    pending = Pending()
    pending.add([b'"a"', b'"b"'], [1, 2])
    assert pending.body(2, 7, "lines") == b'{"seq":7,"lines":["a","b"]}'
    body = pending.body(2, 7, "lines", attempt=3)
    assert body == b'{"seq":7,"attempt":3,"lines":["a","b"]}'
    assert LogBatch.from_json(json.loads(body)) == LogBatch(seq=7, lines=["a", "b"], attempt=3)


# --------------------------------------------------------------------------- manifests


def _manifest(**extra: Any) -> dict[str, Any]:
    files = [
        {"path": "jobdir", "type": "dir", "size": 0, "mode": 0o755, "chunks": []},
        {"path": "jobdir/requests.seen", "type": "file", "size": CHUNK_BYTES + 1, "mode": 0o644, "chunks": [SHA, SHA2]},
        {"path": "state.json", "type": "file", "size": 0, "mode": 0o600, "chunks": []},
    ]
    return {"id": "2-5", "attempt": 2, "createdAt": "2026-12-05T18:00:00.000Z", "reason": "interval",
            "itemSeq": 450, "logSeq": 1210, "sizeBytes": CHUNK_BYTES + 1, "packedBytes": 4000, "files": files, **extra}


def test_a_manifest_round_trips() -> None:
    manifest = CheckpointManifest.from_json(_manifest())
    assert manifest.files[1] == CheckpointFile("jobdir/requests.seen", "file", CHUNK_BYTES + 1, 0o644, [SHA, SHA2])
    assert CheckpointManifest.from_json(manifest.to_json()) == manifest
    assert CheckpointManifest.from_json(json.loads(json.dumps(manifest.to_json()))) == manifest
    assert manifest.ref("/u").to_json() == {"id": "2-5", "attempt": 2, "itemSeq": 450, "logSeq": 1210,
                                            "createdAt": "2026-12-05T18:00:00.000Z", "sizeBytes": CHUNK_BYTES + 1,
                                            "url": "/u"}


def _with_file(**entry: Any) -> dict[str, Any]:
    base = {"path": "x", "type": "file", "size": 3, "mode": 0o644, "chunks": [SHA]}
    base.update(entry)
    m = _manifest()
    m["files"].append(base)
    m["sizeBytes"] += base["size"] if isinstance(base["size"], int) and base["size"] >= 0 else 0
    return m


HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("absolute path", _with_file(path="/etc/passwd"), "files[3].path"),
    ("climbing path", _with_file(path="../../x"), "files[3].path"),
    ("climbing inside", _with_file(path="jobdir/../../x"), "files[3].path"),
    ("dot part", _with_file(path="./x"), "files[3].path"),
    ("empty part", _with_file(path="a//b"), "files[3].path"),
    ("trailing slash", _with_file(path="a/"), "files[3].path"),
    ("NUL", _with_file(path="a\x00b"), "files[3].path"),
    ("lone surrogate", _with_file(path="a\ud800"), "files[3].path"),
    ("too long", _with_file(path="a" * (MAX_PATH_CHARS + 1)), "files[3].path"),
    ("not a string", _with_file(path=7), "files[3].path"),
    ("empty", _with_file(path=""), "files[3].path"),
    ("negative size", _with_file(size=-1, chunks=[]), "files[3].size"),
    ("huge size", _with_file(size=1 << 60, chunks=[]), "files[3].size"),
    ("too few chunks", _with_file(size=CHUNK_BYTES + 1, chunks=[SHA]), "files[3].chunks"),
    ("too many chunks", _with_file(size=1, chunks=[SHA, SHA]), "files[3].chunks"),
    ("chunk for empty file", _with_file(size=0, chunks=[SHA]), "files[3].chunks"),
    ("dir with chunks", _with_file(type="dir", size=0, chunks=[SHA]), "files[3].chunks"),
    ("dir with a size", _with_file(type="dir", size=3, chunks=[]), "files[3].size"),
    ("uppercase sha", _with_file(chunks=[SHA.upper()]), "files[3].chunks[0]"),
    ("short sha", _with_file(chunks=["ab" * 31]), "files[3].chunks[0]"),
    ("non-hex sha", _with_file(chunks=["zz" * 32]), "files[3].chunks[0]"),
    ("sha not a string", _with_file(chunks=[1]), "files[3].chunks[0]"),
    ("chunks not a list", _with_file(chunks="ab"), "files[3].chunks"),
    ("bad type", _with_file(type="symlink"), "files[3].type"),
    ("bad mode", _with_file(mode=0o17777), "files[3].mode"),
    ("duplicate path", _with_file(path="state.json"), "files[3].path"),
    ("beneath a file", _with_file(path="state.json/x"), "files[3].path"),
    ("entry not an object", {**_manifest(), "files": ["x"]}, "files[0]"),
    ("files not a list", _manifest(files={"a": 1}), "files"),
    ("too many files", _manifest(files=[{}] * (MAX_FILES + 1)), "files"),
    ("wrong total", _manifest(sizeBytes=3), "sizeBytes"),
    ("bad reason", _manifest(reason="whim"), "reason"),
    ("attempt 0", _manifest(attempt=0), "attempt"),
    ("negative itemSeq", _manifest(itemSeq=-1), "itemSeq"),
    ("no createdAt", _manifest(createdAt=None), "createdAt"),
    ("id with NUL", _manifest(id="1\x00"), "id"),
]


@pytest.mark.parametrize(("payload", "field"), [pytest.param(p, f, id=label) for label, p, f in HOSTILE])
def test_a_hostile_manifest_is_refused_naming_the_field(payload: dict[str, Any], field: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        CheckpointManifest.from_json(payload)
    assert caught.value.field == field


def test_a_path_beneath_a_file_is_found_whatever_the_order() -> None:
    m = _manifest()
    m["files"].insert(0, {"path": "state.json/x", "type": "file", "size": 0, "mode": 0o644, "chunks": []})
    with pytest.raises(ProtocolError, match="beneath a file"):
        CheckpointManifest.from_json(m)
    m = _manifest()  # "a-b" sorts between "a" and "a/c" as text; the check still pairs "a" with "a/c"
    m["files"] += [{"path": p, "type": "file", "size": 0, "mode": 0o644, "chunks": []} for p in ("a", "a-b", "a/c")]
    with pytest.raises(ProtocolError, match="beneath a file"):
        CheckpointManifest.from_json(m)
    m["files"][-3]["type"] = "dir"  # a dir may hold it
    CheckpointManifest.from_json(m)


def test_ref_and_retry_policy_defaults() -> None:
    assert RetryPolicy.from_json(None) is None
    assert RetryPolicy.from_json({}) == RetryPolicy(max_attempts=1, backoff_seconds=30.0, factor=2.0, on=[], exit_codes=[])
    assert CheckpointRef.from_json({"id": 7, "attempt": 1, "itemSeq": 0, "logSeq": 0}).id == "7"
    with pytest.raises(ProtocolError) as caught:
        CheckpointRef.from_json({"id": "1-1", "attempt": 1, "itemSeq": 0, "logSeq": 0, "sizeBytes": 1 << 60})
    assert caught.value.field == "checkpoint.sizeBytes"


# --------------------------------------------------------------------------- fuzz: only ProtocolError

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 64), 1 << 64) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)
READERS: dict[str, Any] = {
    "Task": Task.from_json,
    "TaskResult": TaskResult.from_json,
    "LogBatch": LogBatch.from_json,
    "ItemBatch": ItemBatch.from_json,
    "CheckpointRef": CheckpointRef.from_json,
    "CheckpointFile": CheckpointFile.from_json,
    "CheckpointManifest": CheckpointManifest.from_json,
    "RetryPolicy": RetryPolicy.from_json,
}
VALID: dict[str, Any] = {
    "Task": _task(attempt=2, itemSeqStart=3, logSeqStart=4, checkpoint={"id": "1-1", "attempt": 1, "itemSeq": 3,
                                                                           "logSeq": 4}, retry={"on": ["resource"]},
                  resume="restart-keep", checkpointIntervalSeconds=60),
    "TaskResult": {"status": "FAILED", "errorCode": "MIGRATED", "attempt": 2, "causeClass": "disruption",
                   "retryable": True, "checkpointId": "2-1"},
    "LogBatch": {"seq": 0, "lines": ["a"], "attempt": 2},
    "ItemBatch": {"seq": 0, "items": [{}], "attempt": 2},
    "CheckpointRef": {"id": "1-1", "attempt": 1, "itemSeq": 3, "logSeq": 4, "sizeBytes": 9, "url": "/x"},
    "CheckpointFile": {"path": "a/b", "type": "file", "size": 1, "mode": 420, "chunks": [SHA]},
    "CheckpointManifest": _manifest(),
    "RetryPolicy": {"maxAttempts": 3, "backoffSeconds": 1, "factor": 2, "on": ["spider"], "exitCodes": [1]},
}


def _read(name: str, value: Any) -> None:
    try:
        parsed = READERS[name](value)
    except ProtocolError:
        return
    if parsed is not None:  # what was accepted writes back what reads the same
        assert READERS[name](json.loads(json.dumps(parsed.to_json()))) == parsed


@pytest.mark.parametrize("name", list(READERS))
@settings(max_examples=60, deadline=None)
@given(value=JSON)
def test_fuzz_any_json_gives_a_value_or_a_protocol_error(name: str, value: Any) -> None:
    _read(name, value)


@pytest.mark.parametrize("name", list(READERS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_fuzz_one_field_of_a_valid_payload_replaced(name: str, data: st.DataObject) -> None:
    payload = copy.deepcopy(VALID[name])
    target = payload
    if name == "CheckpointManifest" and data.draw(st.booleans()):
        target = payload["files"][data.draw(st.integers(0, len(payload["files"]) - 1))]
    key = data.draw(st.sampled_from(sorted(target)) | st.text(max_size=8))
    target[key] = data.draw(JSON)
    _read(name, payload)


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=300))
def test_fuzz_bytes_decoded_as_a_master_would(raw: bytes) -> None:
    try:
        value = json.loads(raw)
    except ValueError:
        return
    for name in READERS:
        _read(name, value)


@settings(max_examples=60, deadline=None)
@given(value=JSON)
def test_fuzz_the_checkpoint_answers_and_a_bad_tasks_attempt(value: Any) -> None:
    for reader in (chunk_stored, checkpoint_accepted):
        with contextlib.suppress(ProtocolError):
            reader(value)
    answer = PendingTasks.from_json({"tasks": [{"id": "t", "attempt": value}]})  # no spiderId: always bad
    (bad,) = answer.bad_tasks
    assert bad.attempt is None or (type(bad.attempt) is int and bad.attempt >= 1)
