"""The agent's own HTTP port: /metrics, /healthz, /readyz, /status and the status page.

- :mod:`.status` — the routes, served by hypercorn on the agent's Trio loop;
- :mod:`.snapshot` — the frozen snapshot of the agent they render (and :class:`.snapshot.AgentHistory`);
- :mod:`.statuspage` — ``GET /``: one HTML page and a live tail of a task's log; :mod:`.statusrows`
  its node table's rows; :mod:`.statusrunsh` run.sh's records (the last upgrade, failed versions);
- :mod:`.metrics`, :mod:`.crawlmetrics` — the agent's Prometheus registry and the crawl figures.

May import: every layer below it (node, master, containment, code, delivery, task); only the agent
(``ckagent.agent``) and the command line import it.
"""
