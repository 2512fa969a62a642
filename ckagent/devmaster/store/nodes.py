"""The dev master's nodes: registration (one identity per name), leaving, api keys, heartbeats, the agent
version policy."""

from __future__ import annotations

import logging
import secrets
import sqlite3
from typing import Any

from ckagent.devmaster.errors import BadRequestError, ConflictError, UnauthorizedError
from ckagent.devmaster.store.attempts import lose_node_attempts
from ckagent.devmaster.store.claims import cancel_ids_of
from ckagent.devmaster.store.database import Database, dumps, hash_key, loads, new_id, seconds_since
from ckagent.master.protocol import (
    FINAL_STATUSES,
    Heartbeat,
    NodeLeaving,
    RegisterRequest,
    VersionPolicy,
    utc_now_iso,
)
from ckagent.node.versions import InvalidVersion, Version

_log = logging.getLogger(__name__)

NODE_LIVE_SECONDS = 90.0
"""A node that heartbeated this recently (seconds) and has not said it is leaving is live: its name is not
given to another nodeUid."""
DISPLACED_KEPT = 32
"""How many nodeUids a name remembers it moved away from (the newest): they take it back by no exclusive
registration while the holder is live."""


class NodeStore(Database):
    """Nodes and what they report (part of :class:`ckagent.devmaster.store.Store`)."""

    node_live_seconds: float = NODE_LIVE_SECONDS
    """Seconds after its last heartbeat a node that did not leave holds its name (DevMasterConfig.node_live_after)."""

    def register_node(self, req: RegisterRequest, *, at: float | None = None) -> tuple[str, str]:
        """Register (or re-register by name) a node. Returns ``(node_id, api_key)``.

        Re-registering the same name keeps the node id and issues a new key; the old key stops working.
        Only the key's sha256 is stored. One identity per name (docs/protocol.md, "Register"), when the
        request carries a ``nodeUid`` and the name's holder registered another one:

        - the holder is **live** — heartbeated within :attr:`node_live_seconds` (``at``: epoch seconds,
          default the clock) and has not left (:meth:`leave_node`): ConflictError (409), two live agents
          with one name would otherwise take each other's key on every re-registration — unless the
          request says ``nameExclusive`` (the orchestrator runs at most one agent with this name): then
          the name is **taken over** at once;
        - **no taking back**: whenever the name moves to another nodeUid (taken over, or its holder not
          live or left), the earlier holder's nodeUid is remembered as displaced, and a displaced
          nodeUid's exclusive registration is refused (409) while the holder is live — of two exclusive
          agents with one name (a misconfiguration, or a partitioned pod that comes back), the newer
          keeps the name and the other waits, instead of each taking it from the other at every 401.
          Each move displaces one more nodeUid, so live agents settle after at most one takeover each.
          A displaced nodeUid gets the name again as anyone does, once the holder is not live (then it
          is no longer displaced); the newest DISPLACED_KEPT are remembered;
        - whenever the name moves to the new nodeUid (taken over, or the holder is not live or left), the
          holder's RUNNING tasks end their attempt FAILED AGENT_LOST at once (a disruption: a new attempt
          from the newest checkpoint, not counted): the new agent has another work dir and cannot re-adopt
          them, and the earlier one's key is gone (its late reports get 401, then 409 ``supersededBy``).

        Agents that send no nodeUid keep the old rule (re-registration by name). A registration clears
        the name's ``left_at``.
        """
        api_key = secrets.token_urlsafe(32)
        now = utc_now_iso()
        values = (
            hash_key(api_key),
            req.ip,
            req.port,
            req.version,
            req.max_workers,
            dumps(req.labels),
            dumps(req.runtimes),
            dumps(req.to_json()),
            now,
        )
        with self._tx() as db:
            row = db.execute("SELECT id, info, last_heartbeat_at, left_at, displaced_uids FROM nodes WHERE name = ?",
                             (req.name,)).fetchone()
            displaced: list[str] = [] if row is None else [u for u in loads(row["displaced_uids"]) or [] if u]
            other = None if row is None else (loads(row["info"]) or {}).get("nodeUid")
            moved = False
            if row is not None and req.node_uid and other and other != req.node_uid:
                live = row["left_at"] is None and seconds_since(row["last_heartbeat_at"], at) < self.node_live_seconds
                if live:
                    self._check_takeover(req, displaced)
                displaced = [*(u for u in displaced if u != other), other][-DISPLACED_KEPT:]
                moved = True
            displaced = [u for u in displaced if u != req.node_uid]
            if row is None:
                node_id = new_id()
                db.execute(
                    "INSERT INTO nodes (api_key_sha256, ip, port, version, max_workers, labels, runtimes,"
                    " info, registered_at, id, name) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (*values, node_id, req.name),
                )
            else:
                node_id = row["id"]
                db.execute(
                    "UPDATE nodes SET api_key_sha256 = ?, ip = ?, port = ?, version = ?, max_workers = ?,"
                    " labels = ?, runtimes = ?, info = ?, registered_at = ?, left_at = NULL, displaced_uids = ?"
                    " WHERE id = ?",
                    (*values, dumps(displaced) if displaced else None, node_id),
                )
            if moved:
                lost = lose_node_attempts(db, node_id, f"node {req.name}'s name was registered by another agent"
                                          f" (nodeUid {req.node_uid}{', nameExclusive' if req.name_exclusive else ''}):"
                                          f" the agent that ran this attempt (nodeUid {other}) is gone")
                if lost:
                    _log.warning("node %s: its name moved to nodeUid %s; the earlier agent's %d running task(s) end"
                                 " their attempt AGENT_LOST: %s", req.name, req.node_uid, len(lost), ", ".join(lost))
        return node_id, api_key

    def _check_takeover(self, req: RegisterRequest, displaced: list[str]) -> None:
        """Raise ConflictError (409) unless ``req`` may take the name from its live holder (register_node)."""
        if not req.name_exclusive:
            raise ConflictError(
                f"node name {req.name!r} belongs to another live agent (another nodeUid, heartbeat "
                f"within {self.node_live_seconds:g} s): give this agent its own agent.name (AGENT_NAME), "
                "or stop the other one and retry after its heartbeats stop")
        if req.node_uid in displaced:
            raise ConflictError(
                f"node name {req.name!r} was taken from this agent (nodeUid {req.node_uid}) by another agent's "
                "exclusive registration, and that agent is live: an exclusive agent does not take a name back "
                "(two would take it from each other for ever); waiting until the other one's heartbeats stop "
                "or it leaves. agent.name_exclusive promises one agent per name: check the orchestrator")

    def leave_node(self, node_id: str, api_key: str, leaving: NodeLeaving) -> None:
        """The node's agent stopped on purpose (``POST /api/nodes/{id}/leaving``): release its name, so
        another ``nodeUid`` may register it at once, and revoke ``api_key``.

        Checked in the same transaction as a registration would be (no race between the two): the key
        must still be the node's current one — a registration since (the same agent's or another's,
        the name moved on) issued another, so a late leaving of an earlier holder changes nothing:
        UnauthorizedError (401). A ``leaving.node_uid`` other than the holder's: ConflictError (409),
        nothing changes. Tasks the node still has RUNNING stay its own (another nodeUid registering
        the name ends their attempts AGENT_LOST: :meth:`register_node`).
        """
        with self._tx() as db:
            row = db.execute("SELECT info FROM nodes WHERE id = ? AND api_key_sha256 = ?",
                             (node_id, hash_key(api_key))).fetchone()
            if row is None:
                raise UnauthorizedError("this api key no longer holds the node's name (it registered again since,"
                                        " or left already)")
            holder = (loads(row["info"]) or {}).get("nodeUid")
            if leaving.node_uid and holder and holder != leaving.node_uid:
                raise ConflictError("not the holder: the node's name was registered by another nodeUid")
            db.execute("UPDATE nodes SET left_at = ?, api_key_sha256 = ? WHERE id = ?",
                       (utc_now_iso(), hash_key(secrets.token_urlsafe(32)), node_id))

    def version_policy(self) -> VersionPolicy:
        """The agent version policy set through the admin API (both None when never set)."""
        rows = self._read(lambda db: db.execute(
            "SELECT key, value FROM master_settings WHERE key IN ('minAgentVersion', 'desiredAgentVersion')").fetchall())
        values = {r["key"]: r["value"] for r in rows}
        return VersionPolicy(values.get("minAgentVersion"), values.get("desiredAgentVersion"))

    def below_minimum(self, node_id: str) -> bool:
        """Whether the node's agent version is below the minimum agent version (such a node gets no
        tasks: it has been told, at registration and with every heartbeat). An unknown or unparsable
        version counts as below a set minimum."""
        minimum = self.version_policy().min_agent_version
        if minimum is None:
            return False
        row = self._read(lambda db: db.execute("SELECT version FROM nodes WHERE id = ?", (node_id,)).fetchone())
        try:
            return row is None or Version(row["version"]) < Version(minimum)
        except InvalidVersion:
            return True

    def set_version_policy(self, policy: VersionPolicy) -> None:
        """Store both fields (None clears one). Raises BadRequestError for a version that is not PEP 440."""
        for key, value in (("minAgentVersion", policy.min_agent_version),
                           ("desiredAgentVersion", policy.desired_agent_version)):
            if value is not None:
                try:
                    Version(value)
                except InvalidVersion:
                    raise BadRequestError(f"{key}: {value!r} is not a PEP 440 version (e.g. 0.2.0)") from None
        with self._tx() as db:
            for key, value in (("minAgentVersion", policy.min_agent_version),
                               ("desiredAgentVersion", policy.desired_agent_version)):
                if value is None:
                    db.execute("DELETE FROM master_settings WHERE key = ?", (key,))
                else:
                    db.execute("INSERT OR REPLACE INTO master_settings (key, value) VALUES (?, ?)", (key, value))

    def node_for_key(self, api_key: str) -> str | None:
        """The id of the node holding ``api_key``, or None for an unknown or revoked key."""
        digest = hash_key(api_key)
        row = self._read(
            lambda db: db.execute("SELECT id FROM nodes WHERE api_key_sha256 = ?", (digest,)).fetchone()
        )
        return None if row is None else str(row["id"])

    def heartbeat(self, node_id: str, beat: Heartbeat) -> list[str]:
        """Store a heartbeat's figures (and its ``runtimes``, when sent); returns ``cancelTaskIds``.

        Those are the node's RUNNING tasks with a cancel request, plus every id in the beat's
        ``runningTaskIds`` that is final or claimed by another node (the node should not be running
        it), or PENDING at a later attempt than one this node ran and the master ended NODE_LOST (a lost
        node come back: the task moved on). Other pending or unknown ids are left alone: a node lists a
        task before its claim lands.
        """
        with self._tx() as db:
            db.execute(
                "UPDATE nodes SET last_heartbeat = ?, last_heartbeat_at = ? WHERE id = ?",
                (dumps(beat.to_json()), utc_now_iso(), node_id),
            )
            if beat.runtimes is not None:  # a fresher scan than the one sent at registration
                db.execute("UPDATE nodes SET runtimes = ? WHERE id = ?", (dumps(beat.runtimes), node_id))
            cancel = cancel_ids_of(db, node_id)
            for task_id in beat.running_task_ids:
                row = db.execute("SELECT status, node_id, attempt FROM tasks WHERE id = ?", (task_id,)).fetchone()
                if row is None or task_id in cancel:
                    continue
                if row["status"] in FINAL_STATUSES or (
                    row["status"] == "RUNNING" and row["node_id"] != node_id
                ) or (row["status"] == "PENDING" and _lost_here(db, task_id, node_id, int(row["attempt"] or 1))):
                    cancel.append(task_id)
            return cancel


    def list_nodes(self) -> list[dict[str, Any]]:
        """Every node as admin JSON, in registration order of first appearance (name)."""
        rows = self._read(lambda db: db.execute("SELECT * FROM nodes ORDER BY name").fetchall())
        return [
            {
                "id": r["id"],
                "name": r["name"],
                "ip": r["ip"],
                "port": r["port"],
                "version": r["version"],
                "maxWorkers": r["max_workers"],
                "labels": loads(r["labels"]),
                "runtimes": loads(r["runtimes"]),
                "containment": loads(r["info"]).get("containment"),
                "egress": loads(r["info"]).get("egress"),
                "identity": _identity(loads(r["info"])),
                "registeredAt": r["registered_at"],
                "lastHeartbeatAt": r["last_heartbeat_at"],
                "lastHeartbeat": loads(r["last_heartbeat"]),
                "leftAt": r["left_at"],
                "nameExclusive": bool(loads(r["info"]).get("nameExclusive")),
                "displacedNodeUids": loads(r["displaced_uids"]) or [],
                "pausedReason": (loads(r["last_heartbeat"]) or {}).get("pausedReason"),
            }
            for r in rows
        ]


def _lost_here(db: sqlite3.Connection, task_id: str, node_id: str, current: int) -> bool:
    """Whether an attempt of the task older than ``current`` ran on ``node_id`` and ended NODE_LOST."""
    return db.execute("SELECT 1 FROM task_attempts WHERE task_id = ? AND node_id = ? AND attempt < ?"
                      " AND error_code = 'NODE_LOST' LIMIT 1", (task_id, node_id, current)).fetchone() is not None


def _identity(info: Any) -> Any:
    """Whom the node's spiders run as: its registration's ``containment.spiderUser`` (the identity level;
    None from an agent that sends none)."""
    containment = info.get("containment") if isinstance(info, dict) else None
    return containment.get("spiderUser") or None if isinstance(containment, dict) else None
