"""The pod's PID 1: ``ckagent supervise`` keeps the agent up and restarts it in place.

In a container the process that is PID 1 takes every other process with it when it exits (tini exits
with its only child), so an agent that crashed there used to end every crawl of the pod. The
supervisor is PID 1 instead: it runs ``ckagent run`` as its child and, when the agent dies without
being asked, starts it again in the same container, where it re-adopts the running crawls
(ckagent.task.adoption) as on a server. Its parts:

- :mod:`.command`: the command line (``supervise [-c CONFIG] [--live-port PORT] [--start-timeout S]
  [-- AGENT_ARGS...]``), the settings it needs (read in a forked child, so the supervisor's own memory
  never holds the settings' modules), secrets out of its environment, non-dumpable;
- :mod:`.supervisor`: the agent's life — spawn, signal forwarding, orphan reaping (``waitpid(-1)``),
  restart with backoff, exit codes (:class:`~.supervisor.Supervisor`, its module docstring has the rules);
- :mod:`.livez`: ``GET /livez`` (h11), and the probe of the agent's ``/healthz`` it answers from;
- :mod:`.fdstore`: the descriptor store (systemd's ``FDSTORE=1`` model) that keeps the tasks' proxy
  listeners open across the agent's restarts, and the agent's start with them from fd 3;
- :mod:`.loop`: a one-thread selector loop with timers and the signals' wake-up descriptor.

It must stay small (measured: 17 MB resident of which 10 MB its own, no wake-up at idle): no Trio, httpx, prometheus or YAML.
May import: the standard library, h11, ``ckagent.node`` (the settings only in the forked reader) —
nothing else of the agent (tests/test_layers.py: node → pod → master → ...; tests/test_supervisor.py
checks what the running supervisor imported).
"""
