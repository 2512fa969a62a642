"""The agent's own HTTP port: /metrics, /healthz, /readyz, /status and the status page.

- :mod:`.status` — the routes, served by hypercorn on the agent's Trio loop;
- :mod:`.statuspage` — ``GET /``: one HTML page and a live tail of a task's log;
- :mod:`.metrics`, :mod:`.crawlmetrics` — the agent's Prometheus registry and the crawl figures.

May import: every layer below it (node, master, containment, code, delivery, task); only the agent
(``ckagent.agent``) and the command line import it.
"""
