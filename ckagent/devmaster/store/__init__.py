"""The dev master's storage: one SQLite file (WAL) holding nodes, spiders, packages, tasks, logs and items.

Every method of :class:`Store` is synchronous and thread-safe (one connection guarded by a lock); the
HTTP layer calls them through ``trio.to_thread.run_sync``. The rules of the wire protocol that depend
on stored state (claims, final results, sequence numbers) live here, each inside one transaction, so
the SQL reads as the contract. One module per concern::

    schema.py     the tables, the schema version (``PRAGMA user_version``), columns added since
    database.py   the connection, transactions, WAL checkpoints; helpers shared by the parts
    nodes.py      registration, api keys, heartbeats, the agent version policy
    spiders.py    spiders, code packages and their files
    tasks.py      tasks on the admin side (create, list, cancel), stats snapshots, artifacts
    claims.py     the queue, claims, releases, reconciliation, final results
    streams.py    log lines and items, once each by sequence number
    supersede.py  the rule that refuses what an older attempt of a task sends (409 supersededBy)
    attempts.py   a task's attempts: the next attempt (items cut back to its checkpoint), the retry
                  decision after a final result (ckagent.devmaster.retrypolicy), the node-lost sweep
    checkpoints.py checkpoint chunks and manifests; a task keeps what its newest checkpoint needs
    queue.py      the queue's figures for /metrics (pending, running, nodes by state, slots), on a reader
                  connection of its own

The exceptions it raises are drawn in :mod:`ckagent.devmaster.errors`; code packages are read by
:mod:`ckagent.devmaster.packages`. A payload that breaks the schema raises
``ckagent.master.protocol.ProtocolError`` (422) instead.
"""

from __future__ import annotations

from ckagent.devmaster.store.attempts import AttemptStore
from ckagent.devmaster.store.checkpoints import CheckpointStore
from ckagent.devmaster.store.claims import CLAIM_GRACE_SECONDS, ClaimStore
from ckagent.devmaster.store.database import CHECKPOINT_BYTES, WAL_LIMIT_BYTES
from ckagent.devmaster.store.nodes import NODE_LIVE_SECONDS, NodeStore
from ckagent.devmaster.store.queue import QueueFigures, QueueStore
from ckagent.devmaster.store.schema import SCHEMA_VERSION
from ckagent.devmaster.store.spiders import SpiderStore
from ckagent.devmaster.store.streams import StreamStore
from ckagent.devmaster.store.tasks import TaskStore

__all__ = ["CHECKPOINT_BYTES", "CLAIM_GRACE_SECONDS", "NODE_LIVE_SECONDS", "SCHEMA_VERSION", "WAL_LIMIT_BYTES",
           "QueueFigures", "Store"]


class Store(NodeStore, SpiderStore, TaskStore, ClaimStore, StreamStore, AttemptStore, CheckpointStore,
            QueueStore):
    """The dev master's state in one SQLite file (WAL mode). Thread-safe; every method blocks.

    Open with ``Store(db_path)`` (creates the file and the schema), close with ``close()``.
    Raises SchemaError if the file holds another layout (e.g. one written by an older dev master)
    and sqlite3.Error if it cannot be opened. Its methods are those of its parts (see the module doc).
    """
