"""Egress cost: adding and removing a task's network policy rules, and what 64 tasks' rules cost a connection.

Through the agent's own :mod:`ckagent.containment.egress` on this machine's containment (``auto``), in one run:

- **add + remove** of one task's rules (the map element, the counters read at the end, the removal of
  the element and the task's hit elements) with 0 and with 64 other tasks' rules in the table: the
  element changes over nfnetlink with the chains through libnftables (``netlink``: what the agent
  uses), everything through libnftables (``libnftables``: its cost grows with every table on the
  host, as it re-lists them before each change) and through the ``nft`` program (the fallback), 200
  rounds (20 quick) for the first two, 30 (5 quick) for the program. With 0 other tasks each round
  also adds and deletes the policy's chain (through nft). The egress has a registry of agents' ports
  with 8 other agents' entries (ckagent.node.agentports), looked at on each add as the agent does;
  one more row has another agent's ports change before each add (its set updated over netlink);
- **connect**: TCP connect + close to a loopback listener, back to back, from this process (not a
  task: one vmap lookup misses) and from a process in a task's cgroup under the default policy (the
  lookup hits and the policy chain is walked), without the table and with 64 tasks' rules in it.

Only loopback is connected to. Target: add + remove ≤ 1 ms at p50 as the agent does it (``netlink``,
64 other tasks); 64 tasks' rules add ≤ 10 µs to a connection at p50. The row also names how many
tables the host has (libnftables' cost depends on them). Needs root, nft and a v2 tree (else it reports why not).
Run: ``python -m bench.egress [--quick]``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._harness import markdown_table, summary, work_directory
from ckagent.containment import Limits, open_containment
from ckagent.containment.egress import EgressError, open_egress, parse_text
from ckagent.containment.egress.nft import BinaryNft, LibNft
from ckagent.containment.hierarchy import agent_group_name
from ckagent.node.agentports import PortRegistry

TARGET_ADD_REMOVE_SECONDS = 0.001
TARGET_CONNECT_ADDED_SECONDS = 10e-6
BACKGROUND_TASKS = 64
OTHER_AGENTS = 8

CONNECTS = """
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
out = []
for _ in range(n):
    t = time.perf_counter()
    socket.create_connection(("127.0.0.1", port)).close()
    out.append(time.perf_counter() - t)
out.sort()
print(out[len(out) // 2])
"""


def _connect_p50(n: int, port: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        socket.create_connection(("127.0.0.1", port)).close()
        times.append(time.perf_counter() - started)
    return float(summary(times)["p50"])


def run(quick: bool) -> dict[str, Any]:
    """Run the benchmark; returns the report dict of bench/__main__.py."""
    rounds = {"netlink": 20 if quick else 200, "libnftables": 20 if quick else 200, "nft": 5 if quick else 30}
    connects = 300 if quick else 3000
    with work_directory("ckagent-bench-egress-") as workdir:
        containment = open_containment("auto", workdir)
        try:
            return _run(containment, workdir, rounds, connects)
        except EgressError as exc:
            return {"name": "egress", "table": f"not measured: {exc}\n", "figures": {}, "target": "—",
                    "target_met": True, "headline": f"not measured here ({exc})"}
        finally:
            containment.close()


def _run(containment: Any, workdir: Path, rounds: dict[str, int], connects: int) -> dict[str, Any]:
    policy = parse_text("metadata,link-local,agent", "")
    group = agent_group_name(workdir)
    rows: list[list[Any]] = []
    figures: dict[str, Any] = {}
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    port = listener.getsockname()[1]
    accepting = True

    def drain() -> None:
        while accepting:
            try:
                conn, _ = listener.accept()
                conn.close()
            except OSError:
                return

    import threading

    acceptor = threading.Thread(target=drain, daemon=True)
    acceptor.start()
    registry = PortRegistry(workdir / "agent-ports")
    others = [PortRegistry(workdir / "agent-ports") for _ in range(OTHER_AGENTS)]
    for i, other in enumerate(others):  # (this process's identity: alive, as the agents' would be)
        other.register([20000 + i])
    baseline_self = _connect_p50(connects, port)
    probe_jail = containment.jail("bench-connect", Limits())
    try:
        baseline_task = _task_connect_p50(probe_jail, port, connects)
        for kind, nft_cls in (("netlink", LibNft), ("libnftables", LibNft), ("nft", BinaryNft)):
            egress = open_egress("nftables", containment, group, policy, agent_port=9, nft=nft_cls(),
                                 registry=registry)
            if kind != "netlink" and egress.table is not None and egress.table.elements is not None:
                egress.table.elements.close()  # every change through nft
                egress.table.elements = None
            background = [containment.jail(f"bench-bg-{i}", Limits()) for i in range(BACKGROUND_TASKS)]
            one = [containment.jail(f"bench-one-{i}", Limits()) for i in range(rounds[kind])]
            try:
                for label, count in (("0 other tasks", 0), (f"{BACKGROUND_TASKS} other tasks", BACKGROUND_TASKS)):
                    rules_bg = [egress.attach(j, j.task_id) for j in background[:count]]
                    times = []
                    for jail in one:
                        started = time.perf_counter()
                        rules = egress.attach(jail, jail.task_id)
                        egress.detach(rules, egress.refusals(rules))
                        times.append(time.perf_counter() - started)
                    s = summary(times)
                    figures[f"{kind} {label}"] = s
                    rows.append([f"add + remove ({kind}, {label})", s["n"], s["p50"] * 1e3, s["p95"] * 1e3])
                    if count and kind == "netlink":
                        times = []
                        for i, jail in enumerate(one):  # another agent's ports change before each add
                            others[0].register([30000 + i])
                            others[0].unregister([30000 + i - 1])
                            started = time.perf_counter()
                            rules = egress.attach(jail, jail.task_id)
                            egress.detach(rules, egress.refusals(rules))
                            times.append(time.perf_counter() - started)
                        s = summary(times)
                        figures[f"{kind} {label} ports changed"] = s
                        rows.append([f"add + remove ({kind}, {label}, an agent's ports changed)", s["n"],
                                     s["p50"] * 1e3, s["p95"] * 1e3])
                        task_rules = egress.attach(probe_jail, probe_jail.task_id)
                        with_self = _connect_p50(connects, port)
                        with_task = _task_connect_p50(probe_jail, port, connects)
                        egress.detach(task_rules)
                        figures["connect"] = {"self": [baseline_self, with_self], "task": [baseline_task, with_task]}
                    for rules in rules_bg:
                        egress.detach(rules)
            finally:
                for jail in background + one:
                    jail.close()
                egress.close()
    finally:
        probe_jail.close()
        for other in [registry, *others]:
            other.close()
        accepting = False
        listener.close()
    self_added = figures["connect"]["self"][1] - figures["connect"]["self"][0]
    task_added = figures["connect"]["task"][1] - figures["connect"]["task"][0]
    table = markdown_table(["operation", "n", "p50 ms", "p95 ms"], rows)
    table += "\n" + markdown_table(
        ["connect + close to 127.0.0.1, p50", "no table µs", f"{BACKGROUND_TASKS + 1} tasks' rules µs", "added µs"],
        [["from the agent (not a task)", baseline_self * 1e6, figures["connect"]["self"][1] * 1e6, self_added * 1e6],
         ["from a task (default policy)", baseline_task * 1e6, figures["connect"]["task"][1] * 1e6, task_added * 1e6]])
    p50 = figures[f"netlink {BACKGROUND_TASKS} other tasks"]["p50"]
    figures["host_tables"] = _host_tables()
    table += f"\nnftables tables on this host during the run: {figures['host_tables']}\n"
    met = p50 <= TARGET_ADD_REMOVE_SECONDS and max(self_added, task_added) <= TARGET_CONNECT_ADDED_SECONDS
    return {
        "name": "egress",
        "table": table,
        "figures": figures,
        "target": f"add + remove ≤ {TARGET_ADD_REMOVE_SECONDS * 1e3:g} ms at p50 (netlink, "
                  f"{BACKGROUND_TASKS} tasks); {BACKGROUND_TASKS} tasks' rules add ≤ "
                  f"{TARGET_CONNECT_ADDED_SECONDS * 1e6:g} µs to a connect",
        "target_met": met,
        "headline": f"add + remove p50 {p50 * 1e3:.2f} ms; connect +{max(self_added, task_added) * 1e6:.1f} µs",
    }


def _host_tables() -> int:
    from ckagent.containment.egress.netlink import Netlink, NetlinkError

    try:
        netlink = Netlink()
    except NetlinkError:
        return -1
    try:
        return len(netlink.tables())
    finally:
        netlink.close()


def _task_connect_p50(jail: Any, port: int, n: int) -> float:
    env = {"PATH": "/usr/bin:/bin"}
    argv, options = jail.spawn([sys.executable, "-I", "-S", "-c", CONNECTS, str(port), str(n)], env)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=True, **options)
    return float(done.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.egress [--quick]``: print the table."""
    args = sys.argv[1:] if argv is None else argv
    report = run("--quick" in args)
    print(report["table"])
    print(report["headline"], "— target met" if report["target_met"] else "— target MISSED")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
