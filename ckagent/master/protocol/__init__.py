"""The wire protocol between a node agent and the master (docs/protocol.md, openapi.yaml).

Every message is a frozen dataclass with snake_case attributes, built from JSON with
``X.from_json(obj)`` (which validates) and turned back into JSON with ``x.to_json()`` (camelCase
keys, ``None`` fields left out). Both the agent and the reference master use these types, so the
two sides cannot drift apart; ``tests/test_protocol.py`` checks them against ``openapi.yaml``.

Exceptions::

    ValueError
    └── ProtocolError      a payload breaks the schema; ``.field`` is the JSON path ("tasks[2].env.FOO")

The types live by concern — :mod:`.node` (registration, heartbeat, leaving), :mod:`.tasks` (a task and the
poll answer), :mod:`.results` (results, stats, log/item batches, releases, spider files),
:mod:`.outputs` (declared outputs, artifacts), :mod:`.checkpoints` (checkpoint references and
manifests, retry policies) and :mod:`.vocabulary` (statuses, error codes, features,
times) — and are all imported from here (``from ckagent.master.protocol import Task``).

Conventions: times are ISO-8601 UTC strings ("2026-11-29T16:03:50.123Z"), durations are integer
milliseconds, ids are strings (integers from an older backend are accepted and turned into strings).
"""

from __future__ import annotations

from ckagent.master.protocol._fields import ProtocolError
from ckagent.master.protocol.checkpoints import (
    CHECKPOINT_REASONS,
    CHUNK_BYTES,
    CheckpointFile,
    CheckpointManifest,
    CheckpointRef,
    RetryPolicy,
)
from ckagent.master.protocol.node import (
    Heartbeat,
    HeartbeatResponse,
    NodeLeaving,
    RegisterRequest,
    RegisterResponse,
    VersionPolicy,
)
from ckagent.master.protocol.outputs import ARTIFACTS, ArtifactRef, TaskOutputs
from ckagent.master.protocol.results import (
    ItemBatch,
    LogBatch,
    ResultAccepted,
    SeqAccepted,
    SeqConflict,
    SpiderFile,
    TaskRelease,
    TaskResult,
    TaskStats,
)
from ckagent.master.protocol.tasks import (
    STOP_SIGNALS,
    BadTask,
    CodePackage,
    PendingTasks,
    Task,
    TaskResources,
    parse_egress,
    parse_stop_signal,
)
from ckagent.master.protocol.vocabulary import (
    CAUSE_CLASSES,
    CLAIM_IN_POLL,
    ERROR_CODES,
    FEATURES,
    FINAL_STATUSES,
    FRAMEWORKS,
    MAX_SENDABLE_ID_CHARS,
    NODE_BATCHES,
    NODE_STATUSES,
    OUTCOME_STATUS,
    POLL_FOLLOWS_RESULTS,
    PROTOCOL_VERSION,
    RESUME_MODES,
    TASK_STATUSES,
    TIMEOUT_MESSAGE,
    CauseClass,
    ResumeMode,
    cause_of,
    utc_iso,
    utc_now_iso,
)

__all__ = [
    "ARTIFACTS",
    "CAUSE_CLASSES",
    "CHECKPOINT_REASONS",
    "CHUNK_BYTES",
    "CLAIM_IN_POLL",
    "ERROR_CODES",
    "FEATURES",
    "FINAL_STATUSES",
    "FRAMEWORKS",
    "MAX_SENDABLE_ID_CHARS",
    "NODE_BATCHES",
    "NODE_STATUSES",
    "OUTCOME_STATUS",
    "POLL_FOLLOWS_RESULTS",
    "PROTOCOL_VERSION",
    "RESUME_MODES",
    "STOP_SIGNALS",
    "TASK_STATUSES",
    "TIMEOUT_MESSAGE",
    "ArtifactRef",
    "BadTask",
    "CauseClass",
    "CheckpointFile",
    "CheckpointManifest",
    "CheckpointRef",
    "CodePackage",
    "Heartbeat",
    "HeartbeatResponse",
    "ItemBatch",
    "LogBatch",
    "NodeLeaving",
    "PendingTasks",
    "ProtocolError",
    "RegisterRequest",
    "RegisterResponse",
    "ResultAccepted",
    "ResumeMode",
    "RetryPolicy",
    "SeqAccepted",
    "SeqConflict",
    "SpiderFile",
    "Task",
    "TaskOutputs",
    "TaskRelease",
    "TaskResources",
    "TaskResult",
    "TaskStats",
    "VersionPolicy",
    "cause_of",
    "parse_egress",
    "parse_stop_signal",
    "utc_iso",
    "utc_now_iso",
]
