"""The forward proxy of the ``proxy`` egress level: a real HTTP/1.1 proxy, every request routed and checked.

Where the kernel cannot filter a task's sockets (a non-root agent, a pod without ``CAP_NET_ADMIN``,
a host without nftables) the task's ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` name this proxy.
It is advisory: a program that ignores the variables is not stopped (docs/operations.md, "Egress").

- :mod:`.server`     one listener per task on 127.0.0.1; each connection in an error boundary of its own
- :mod:`.taskproxy`  a task's identity (port, user name, secret password), its pool, its counts
- :mod:`.exchange`   a client connection, request by request (h11 both ways), and CONNECT tunnels
- :mod:`.connection` its heads, its I/O (one deadline per exchange) and the proxy's own answers
- :mod:`.relay`      bytes socket to socket (tunnels, large bodies), by splice(2) once large
- :mod:`.limits`     the timeouts and sizes
- :mod:`.target`     request targets and hosts read strictly (IDNA included), hop-by-hop headers
- :mod:`.upstream`   resolution judged by the task's policy, connections, the kept-alive pool
- :mod:`.routes`     the task's own proxies (HTTP, SOCKS5) chained behind this one; NO_PROXY
- :mod:`.errors`     the answers of the proxy's own (400/403/407/408/431/502/504)

Use (``ckagent.containment.egress.Egress`` does this for the agent)::

    server = ProxyServer()
    await nursery.start(server.run)
    port = server.open(TaskProxy(task_id, user, password, Dialer(judge)))   # on the Trio thread
    ...
    server.close(task_id)
"""

from __future__ import annotations

from ckagent.containment.egress.proxy.errors import ProxyError
from ckagent.containment.egress.proxy.fdstore import FdStore
from ckagent.containment.egress.proxy.limits import Limits
from ckagent.containment.egress.proxy.routes import PROXY_VARIABLES, Routes, routes_from_env
from ckagent.containment.egress.proxy.server import ProxyServer
from ckagent.containment.egress.proxy.taskproxy import TaskProxy
from ckagent.containment.egress.proxy.upstream import Dialer, Resolve, system_resolve

__all__ = [
    "PROXY_VARIABLES",
    "Dialer",
    "FdStore",
    "Limits",
    "ProxyError",
    "ProxyServer",
    "Resolve",
    "Routes",
    "TaskProxy",
    "routes_from_env",
    "system_resolve",
]
