"""The master boundary: the wire protocol, the one connection to the master, and what the node tells it.

- :mod:`.protocol` — the wire types (docs/protocol.md, ``protocol/openapi.yaml``);
- :mod:`.endpoints` — the one table of the master's endpoints and a typed method per call (to add
  an endpoint, start here); :mod:`.checkpointcalls` — the checkpoint calls (chunks, manifests);
- :mod:`.client` — ``MasterClient``: the connection, auth, retries; :mod:`.wire` builds and sends
  a call's request, :mod:`.answers` classifies what came back into the exception tree of :mod:`.errors`
  (:mod:`.registration` a registration's answer: a 409 — the name held — is waited out);
- :mod:`.ids` — ids from the master as data: what is accepted, how each becomes a name or a URL;
- :mod:`.connectivity`, :mod:`.masterclock` — the master's health and clock as the agent sees them;
- :mod:`.heartbeat` — the node's health and running set, every ``heartbeat.interval`` seconds;
- :mod:`.fleet` — the node's identity and the master's wishes about agent versions.

May import: :mod:`ckagent.node` — nothing of a task's run (the heartbeat sends the snapshot the
agent hands it, a :class:`~ckagent.master.heartbeat.NodeReport`).
"""
