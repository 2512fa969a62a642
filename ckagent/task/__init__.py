"""A task's run on this node: from the poll's answer to the reported outcome.

- :mod:`.poller` — asks the master for work when a slot is free, claims it, hands it on;
- :mod:`.admission` — slots, spider locks, the running set, the poller's claim bookkeeping;
- :mod:`.runner`, :mod:`.deploy` — the phases (open dir → slot → deploy + jail → install → run → judge);
- :mod:`.stop` — how a task is stopped: its reasons, the one request, the run-time and stall
  watchdog, what each stop becomes (the process side: ckagent.containment.stopping);
- :mod:`.outcome` — the outcome rules (exit → status, errorCode, errorMessage);
- :mod:`.diskshare` — a task's part in a full disk: its accounted trees, its judgement at its end,
  a blamed task's scratch removed after its result (the rules: ckagent.delivery.diskwatch);
- :mod:`.supervisor` — the handle the agent passes around: admission with the runner beside it;
  the outcome rules;
- :mod:`.execlimits` — the kernel's exec limits (MAX_ARG_STRLEN, ARG_MAX) checked before the spawn:
  a task over them is BAD_TASK naming the field;
- :mod:`.commands` — what a task runs (its framework's default from ckagent.code.frameworks) and the
  check that the package can run it;
- :mod:`.recovery`, :mod:`.adoption` — at start: tasks the previous agent left (lost, or carried on);
- :mod:`.nodelevels` — at start: the node's identity, containment and egress levels opened;
- :mod:`.lifespan` — an ephemeral worker's watch (ckagent.node.ephemeral) wired to the supervisor,
  poller and outbox, and the exit code its life ends with;
- :mod:`.migration` — at start: the spiders' dirs and environments an older agent left, brought to the
  identity level in force (given to each spider's uid; environments rebuilt, not re-owned).
- :mod:`.migrating` — a migrate (``ckagent stop --migrate``): every task checkpointed, stopped and
  reported MIGRATED within ``task.migrate_timeout``; :mod:`.memwatch` — the soft memory ceiling
  (checkpoint, then MEMORY_LIMIT).

May import: every lower layer — :mod:`ckagent.node`, :mod:`ckagent.master`, :mod:`ckagent.containment`,
:mod:`ckagent.code`, :mod:`ckagent.delivery`; never :mod:`ckagent.port` or the agent.
"""
