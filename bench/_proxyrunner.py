"""The agent's egress proxy alone in a process of its own, for :mod:`bench.proxy`.

``python -m bench._proxyrunner WORK_DIR [--cprofile FILE]`` opens the ``proxy`` egress level exactly
as the agent does (:func:`ckagent.containment.egress.open_egress` with the node's default policy, no
jail), starts :meth:`Egress.serve` and attaches one task, then prints one JSON line on stdout:
``{"url": <the task's HTTP_PROXY>, "pid": <this process>}``. Its CPU is then the proxy's own (the
benchmark reads it from ``/proc``; nothing else runs here but Trio's loop and a reader of stdin).

On stdin, each line ``stats`` is answered with a JSON line ``{"cpu", "connections", "errors",
"outcomes"}`` (the task's requests by outcome: ``forwarded``, ``refused``...; the benchmark checks that the proxied runs really went through the proxy
and that it counted no error), each line ``cpu`` with ``{"cpu"}``: this process's CPU seconds so far
(``time.process_time()``: user + system of every thread, to the nanosecond, where ``/proc``'s figures
count 10 ms ticks); end of stdin stops the proxy (the task detached, the loop ended) and exits 0.
``--cprofile FILE`` runs the whole loop under cProfile (timed by CPU time, not wall time: other
processes on the machine do not count) and writes its stats to FILE at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import trio

from ckagent.containment.egress import DEFAULT_DENY, Egress, open_egress, parse_text
from ckagent.node.levels import EgressLevel

TASK_ID = "bench-proxy"


async def serve(work_dir: Path) -> None:
    """Run the proxy with one attached task until stdin ends (see the module docstring)."""
    # agent_port 9: the agent's own port the policy denies (nothing here listens on it).
    egress = open_egress(EgressLevel.PROXY, None, "ckagent_bench_proxy", parse_text(DEFAULT_DENY, ""),
                         agent_port=9, work_dir=work_dir)
    stdin = trio.lowlevel.FdStream(os.dup(0))
    async with trio.open_nursery() as nursery:
        await nursery.start(egress.serve)
        rules = egress.attach(None, TASK_ID)
        url = egress.task_env(rules, {})["HTTP_PROXY"]
        print(json.dumps({"url": url, "pid": os.getpid()}), flush=True)
        buffer = b""
        async with stdin:
            while data := await stdin.receive_some(4096):
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip() == b"stats":
                        print(json.dumps(_stats(egress)), flush=True)
                    elif line.strip() == b"cpu":
                        print(json.dumps({"cpu": time.process_time()}), flush=True)
        egress.detach(rules)
        nursery.cancel_scope.cancel()


def _stats(egress: Egress) -> dict[str, object]:
    server = egress.server
    assert server is not None  # (the proxy level)
    task = server.tasks.get(TASK_ID)
    return {
        "cpu": time.process_time(),
        "connections": server.connections,
        "errors": dict(server.errors),
        "outcomes": dict(task.outcomes) if task is not None else {},
    }


def main(argv: list[str]) -> int:
    """Entry point (see the module docstring); returns the exit code."""
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    work_dir = Path(argv[0])
    work_dir.mkdir(parents=True, exist_ok=True)
    profile_to = argv[argv.index("--cprofile") + 1] if "--cprofile" in argv else None
    if profile_to is None:
        trio.run(serve, work_dir)
        return 0
    import cProfile

    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    try:
        trio.run(serve, work_dir)
    finally:
        profiler.disable()
        profiler.dump_stats(profile_to)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
