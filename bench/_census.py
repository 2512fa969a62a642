"""How many Trio tasks and thread hops the agent spends per task: counted, not guessed.

A real :class:`ckagent.agent.Agent` runs in this process (the dev master in its own) with its
default intervals (long poll 20 s, heartbeat 30 s); a Trio instrument counts every task the agent
spawns (a task whose ancestry reaches the agent's own root task) and every thread hop its tasks make
(``trio.to_thread.run_sync`` and everything built on it, e.g. ``trio.Path``: each call starts one
worker job on trio's thread cache) and every request its tasks send (``httpx.AsyncHTTPTransport.handle_async_request``: the master client's
calls go to the transport directly). After a warm-up, ``tasks`` tasks of one ``python -c`` spider
run one after another; the counts over that window ÷ ``tasks`` are the figures per task.

The hook is the benchmark's and the tests' alone: nothing of it ships in the agent. It replaces
``trio._threads.start_thread_soon`` (the one place every ``to_thread.run_sync`` goes through) while
a :class:`Census` is open and puts the original back afterwards.

Each counted task and hop is named (the task's name; the hop's nearest ``ckagent`` frame and the
function it runs) so a regression shows where it came from.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import trio
import trio._threads as trio_threads

from bench._harness import (
    STAMP_SPIDER,
    DevMaster,
    check_success,
    create_spiders,
    markdown_table,
    stamp_command,
    wait_final,
)
from ckagent.agent import Agent
from ckagent.devmaster.client import zip_files
from ckagent.node.config import load_settings

TARGET_TASKS = 4
"""Trio tasks of the agent's own per task, at most (issue 26, item 7)."""
TARGET_HOPS = 6
"""Thread hops of the agent's own per task, at most (issue 26, item 7)."""

_PACKAGE = str(Path(str(__import__("ckagent").__file__)).resolve().parent)


def _site() -> str:
    """``module:function`` of the nearest frame in the ckagent package (the caller of the hop)."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_PACKAGE):
            return f"{filename[len(_PACKAGE) + 1:-3].replace('/', '.')}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "<outside ckagent>"


class Census(trio.abc.Instrument):
    """Counts the Trio tasks and thread hops descended from one root task (``root``, set by :meth:`watch`).

    ``tasks`` and ``hops`` are Counters by name (the task's name; ``site → function`` for a hop);
    :meth:`snapshot` copies both. Use :meth:`installed` around the run (it adds the instrument and
    the thread hook, and removes both on exit).
    """

    def __init__(self) -> None:
        self.root: trio.lowlevel.Task | None = None
        self.tasks: collections.Counter[str] = collections.Counter()
        self.hops: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()

    def _ours(self, task: trio.lowlevel.Task | None) -> bool:
        while task is not None:
            if task is self.root:
                return True
            nursery = task.parent_nursery
            task = nursery.parent_task if nursery is not None else None
        return False

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        """Instrument hook: count ``task`` when it belongs to the watched root."""
        if self.root is not None and self._ours(task):
            self.tasks[_short_name(task.name)] += 1

    @contextlib.contextmanager
    def installed(self) -> Iterator[Census]:
        """Add the instrument and the thread-hop hook for the block (must run inside trio.run)."""
        original: Callable[..., None] = trio_threads.start_thread_soon

        def counting_start(fn: Callable[[], Any], deliver: Callable[[Any], None], name: str | None = None) -> None:
            if self.root is not None:
                try:
                    current = trio.lowlevel.current_task()
                except RuntimeError:
                    current = None
                if self._ours(current):
                    self.hops[f"{_site()} → {(name or '?').split(' from ')[0]}"] += 1
            original(fn, deliver, name)

        original_send = httpx.AsyncHTTPTransport.handle_async_request

        async def counting_send(transport: httpx.AsyncHTTPTransport, request: httpx.Request) -> httpx.Response:
            if self.root is not None and self._ours(trio.lowlevel.current_task()):
                path = "/".join(":id" if len(part) >= 16 or part.isdigit() else part
                                for part in request.url.path.split("/"))
                self.requests[f"{request.method} {path}"] += 1
            return await original_send(transport, request)

        trio.lowlevel.add_instrument(self)
        trio_threads.start_thread_soon = counting_start  # type: ignore[assignment]
        httpx.AsyncHTTPTransport.handle_async_request = counting_send  # type: ignore[method-assign]
        try:
            yield self
        finally:
            httpx.AsyncHTTPTransport.handle_async_request = original_send  # type: ignore[method-assign]
            trio_threads.start_thread_soon = original
            trio.lowlevel.remove_instrument(self)

    def snapshot(self) -> tuple[collections.Counter[str], collections.Counter[str], collections.Counter[str]]:
        """Copies of (tasks, hops, requests to the master) counted so far."""
        return collections.Counter(self.tasks), collections.Counter(self.hops), collections.Counter(self.requests)


def _short_name(name: str) -> str:
    """A task's name without the ids that make each one unique (``task 01H…`` → ``task``)."""
    words = [w for w in name.replace("<locals>.", "").split(" ") if not (len(w) >= 16 and w.isalnum())]
    return " ".join(words)


async def agent_census(workdir: Path, tasks: int = 10, **env: str) -> dict[str, Any]:
    """Run ``tasks`` ``python -c`` tasks one after another through an in-process agent; counts per task.

    ``env``: extra ``AGENT_*`` settings. Returns ``{"tasks_per_task", "hops_per_task", "task_names",
    "hop_sites", "containment", "egress"}`` (``task_names``, ``hop_sites``: ``{name: count per task}``,
    largest first; the last two: the levels the agent ran at, as their settings' text). Raises
    RuntimeError if a task does not succeed, TimeoutError if one takes over a minute.
    """
    master = DevMaster(workdir / "master")
    await master.start()
    census = Census()
    settings = load_settings(None, env={
        "AGENT_SERVER_URL": master.base_url, "AGENT_REGISTRATION_TOKEN": master.registration_token,
        "AGENT_WORK_DIR": str(workdir / "agent"), "AGENT_NAME": "bench-census", "AGENT_IP": "127.0.0.1",
        "AGENT_PORT": "0", "AGENT_MAX_WORKERS": "2",
        # its own registry of agents' ports: other agents on the host coming and going (their entries
        # in /run/ckagent/ports) would add the egress watch's hops to what this agent's tasks cost
        "AGENT_PORTS_REGISTRY": str(workdir / "agent-ports"),
        # the stamps directory beside the work dir stays seen in each task's private /tmp
        "AGENT_TASK_PRIVATE_TMP_SHARED": str(workdir), **env}, require_token=True)
    agent = Agent(settings)
    try:
        with census.installed():
            async with trio.open_nursery() as nursery:

                async def run_agent() -> None:
                    census.root = trio.lowlevel.current_task()
                    await agent.run()

                nursery.start_soon(run_agent)
                with trio.fail_after(60):
                    await agent.started.wait()
                stamps = workdir / "stamps"
                stamps.mkdir()
                (spider,) = await create_spiders(master.admin, "census", 1, stamp_command(), zip_files(STAMP_SPIDER),
                                                 stamps)
                for _ in range(2):  # warm-up: the virtualenv, first-use imports, the first poll's set-up
                    check_success(await wait_final(master.admin, [await master.admin.create_task(spider)], 120))
                await trio.sleep(0.3)  # what the last warm-up task's end set off has settled
                tasks0, hops0, requests0 = census.snapshot()
                for _ in range(tasks):
                    check_success(await wait_final(master.admin, [await master.admin.create_task(spider)], 60))
                await trio.sleep(0.3)
                tasks1, hops1, requests1 = census.snapshot()
                agent.terminate()
    finally:
        await master.stop()
    spawned = tasks1 - tasks0
    hopped = hops1 - hops0
    requested = requests1 - requests0
    return {
        "tasks_per_task": sum(spawned.values()) / tasks,
        "hops_per_task": sum(hopped.values()) / tasks,
        "requests_per_task": sum(requested.values()) / tasks,
        "task_names": {k: v / tasks for k, v in spawned.most_common()},
        "hop_sites": {k: v / tasks for k, v in hopped.most_common()},
        "requests": {k: v / tasks for k, v in requested.most_common()},
        "containment": agent.containment.level.value if agent.containment is not None else "",
        "egress": agent.egress.level.value if agent.egress is not None else "",
    }


def census_table(census: dict[str, Any]) -> str:
    """Markdown: the counts per task against their targets, then each task name and hop site."""
    levels = f"containment {census['containment']}, egress {census['egress']}"
    table = markdown_table(
        [f"path per task (in-process agent, one task at a time; {levels})", "per task", "target"],
        [["Trio tasks", census["tasks_per_task"], f"≤ {TARGET_TASKS}"],
         ["thread hops", census["hops_per_task"], f"≤ {TARGET_HOPS}"],
         ["requests to the master", census["requests_per_task"], "–"]])
    rows = [["task", name, count] for name, count in census["task_names"].items()]
    rows += [["thread hop", site, count] for site, count in census["hop_sites"].items()]
    rows += [["request", call, count] for call, count in census["requests"].items()]
    return table + "\n" + markdown_table(["kind", "spawned as / hop site → function", "per task"], rows)


def main() -> int:
    """``python -m bench._census [TASKS]``: print the counts per task and where they come from."""
    import json

    from bench._harness import work_directory

    tasks = int(sys.argv[1]) if len(sys.argv) > 1 else 10

    async def run() -> dict[str, Any]:
        with work_directory("bench-census-") as workdir:
            return await agent_census(workdir, tasks)

    print(json.dumps(trio.run(run), indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
