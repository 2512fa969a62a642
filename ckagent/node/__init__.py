"""The node and the agent's own process: settings, its log, its durable state, this machine's facts.

Lowest layer of the agent. What lives here knows nothing of tasks' runs or of the master's answers:

- settings: :mod:`.config` (one YAML file + ``AGENT_*`` → a frozen ``Settings``), :mod:`.preflight`
  (the loaded settings checked against this node), :mod:`.egress_policy` (the policy's data type, and
  what an address reaches), :mod:`.agentports` (the host's registry of agents' ports), :mod:`.levels`
  (the containment and egress levels as types: what each guarantees and needs, why one is not available);
- the agent process: :mod:`.logs`, :mod:`.workdir` (one agent per work dir), :mod:`.secretenv`,
  :mod:`.hardening`, :mod:`.listen` (its listening socket), :mod:`.runas` (who spiders run as);
- durable state: :mod:`.state` (SQLite state store), :mod:`.diskfull` (a full disk is a task's failure);
- this machine: :mod:`.resources` (health figures), :mod:`.intake` (whether the node takes tasks),
  :mod:`.ephemeral` and :mod:`.taskbudget` (an ephemeral worker: when it stops, the tasks its life claimed),
  :mod:`.notices` (operator notices), :mod:`.procid` (a process's proven identity: boot id, pid,
  start time, held by its pidfd — every signal, watch, oom_score_adj write and group kill of a process
  the agent did not just start goes through it);
- pure helpers: :mod:`.errors` (the agent's exception tree), :mod:`.versions`, :mod:`.noderange`.

May import: the standard library, third-party packages, ``ckagent`` (its version) — nothing else of
the agent. Layers, lowest first: node → pod → master → containment → code → delivery → task → port →
agent/cli, with ``pod`` (the container's PID 1) above node (``tests/test_layers.py`` holds them).
"""
