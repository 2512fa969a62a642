"""Containment cost per task: task start → the spider's first line, with and without containment.

Side by side in one run, rounds interleaved (the order rotating each round), through the agent's
own :func:`ckagent.containment.process.run_supervised`:

- ``none (before)``: what the agent did before containment — own session, no ``preexec_fn``
  (Python spawns with vfork), process group + marker sweep at the end;
- ``process-group``: the same plus the ``preexec_fn`` (oom_score_adj +500; Python must fork) and the
  subreaper;
- every cgroup level this machine allows: the task's cgroup(s) created with limits (memory, pids),
  the child joining them before exec, and at the end kill-all, the empty-wait, the figures and the
  removal of the cgroup(s).

Per task, as the agent runs it: jail created, then a real **cached prepare** (deploy of a version
on disk + a cached venv check, as ``bench.prepare`` measures it), then the spider through
``run_supervised``. **start** = from before the jail is created to the first stdout chunk of
``python -I -S -c "print('first')"``; **whole task** = from the same start until the jail is emptied
and removed. The benchmark process holds a 50 MiB ballast, about the agent's RSS, since a fork (the
``preexec_fn``) copies page tables. Target: the level ``auto`` picks adds ≤ 2 ms at p50 to the start.
Run: ``python -m bench.containment [--quick]``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from bench._harness import markdown_table, summary, work_directory
from ckagent.code.deps import Dependencies, IndexChooser, spider_base_env
from ckagent.code.workspace import Workspaces
from ckagent.containment import Containment, Limits, TaskJail, open_containment
from ckagent.containment.process import run_supervised
from ckagent.containment.process_group import ProcessGroupJail
from ckagent.master.client import MasterClient
from ckagent.master.protocol import CodePackage, RegisterRequest
from ckagent.node.levels import ContainmentLevel

TARGET_ADDED_SECONDS = 0.002
SPIDER = [sys.executable, "-I", "-S", "-c", "print('first', flush=True)"]


class _Before(ProcessGroupJail):
    """The agent before containment: no preexec_fn (vfork spawn), group + marker sweep."""

    level = ContainmentLevel.PROCESS_GROUP  # (no containment at all: the spawn without the shim)

    def spawn(self, argv: list[str], env: Any, *, forking: bool = False) -> tuple[list[str], dict[str, Any]]:
        return argv, {}


async def _one(name: str, containment: Containment | None, workdir: Path, n: int,
               prepare: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    task_id = f"bench-{name.replace(' ', '')}-{n}"
    first: list[float] = []
    started = time.perf_counter()
    jail: TaskJail
    if containment is None:
        jail = _Before(task_id)
    else:
        jail = containment.jail(task_id, Limits(memory_bytes=512 << 20, pids=256))
    await prepare()

    def output(chunk: bytes) -> None:
        if not first:
            first.append(time.perf_counter())

    outcome = await run_supervised(
        SPIDER, cwd=workdir, env={"CK_TASK_ID": task_id, "PATH": "/usr/bin:/bin"}, task_id=task_id,
        output=output, deadline_seconds=30, grace=1, stop=trio.Event(), notice=lambda _: None, jail=jail,
    )
    jail.figures()
    jail.close()
    ended = time.perf_counter()
    if outcome.returncode != 0 or not first:
        raise RuntimeError(f"{name}: the spider failed ({outcome})")
    return first[0] - started, ended - started


async def run_async(quick: bool) -> dict[str, Any]:
    """Measure (see module docstring); returns the figures and a Markdown table."""
    rounds = 8 if quick else 60
    ballast = bytearray(b"\x01") * (50 << 20)
    with work_directory("bench-containment-") as workdir:
        variants: dict[str, Containment | None] = {"none (before)": None}
        auto = open_containment("auto", workdir)
        for level in ContainmentLevel:
            try:
                variants[level.value] = auto if level is auto.level else open_containment(level, workdir)
            except Exception:
                continue
        prepare = await _cached_prepare(workdir)
        names = list(variants)
        starts: dict[str, list[float]] = {name: [] for name in names}
        wholes: dict[str, list[float]] = {name: [] for name in names}
        for name in names:  # warm-up (imports, page cache)
            await _one(name, variants[name], workdir, -1, prepare)
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                start, whole = await _one(name, variants[name], workdir, r, prepare)
                starts[name].append(start)
                wholes[name].append(whole)
        for containment in {id(c): c for c in variants.values() if c is not None}.values():
            containment.close()
    del ballast
    base_start = summary(starts["none (before)"])["p50"]
    base_whole = summary(wholes["none (before)"])["p50"]
    rows = []
    figures: dict[str, Any] = {}
    for name in names:
        s, w = summary(starts[name]), summary(wholes[name])
        figures[name] = {"start": s, "whole": w}
        rows.append([name + (" (auto)" if name == auto.level.value else ""), s["n"], s["p50"] * 1000, s["p95"] * 1000,
                     (s["p50"] - base_start) * 1000, w["p50"] * 1000, (w["p50"] - base_whole) * 1000])
    table = markdown_table(["containment", "n", "start p50 ms", "start p95 ms", "added to start p50 ms",
                            "whole task p50 ms", "added to whole p50 ms"], rows)
    added = figures[auto.level.value]["start"]["p50"] - base_start
    return {
        "name": "containment",
        "table": table + f"\n\nLevel picked by auto here: `{auto.level}` — {auto.details}\n",
        "figures": figures,
        "target": f"{auto.level} adds ≤ {TARGET_ADDED_SECONDS * 1000:.0f} ms to the start at p50",
        "target_met": added <= TARGET_ADDED_SECONDS,
        "headline": f"{auto.level}: +{added * 1000:.2f} ms at p50 (start {base_start * 1000:.1f} ms without)",
    }


async def _cached_prepare(workdir: Path) -> Callable[[], Awaitable[None]]:
    """A real cached prepare (deploy of a version present + cached venv), made ready once."""
    body = RegisterRequest(name="bench", ip="127.0.0.1", port=0, version="b", os="linux", arch="x",
                           python="3", cpu_count=1, memory_total_bytes=1, max_workers=1)
    master = MasterClient("http://127.0.0.1:9", "unused", lambda: body)
    workspaces = Workspaces(workdir / "spiders", master)
    code = workspaces.spider_dir("bench-spider") / "v1"
    code.mkdir(parents=True)
    (code / "main.py").write_text("print(1)\n")
    (code / "requirements.txt").write_text("# no dependencies\n")
    package = CodePackage(url="http://127.0.0.1:9/never.zip", sha256="0" * 64, size_bytes=1)
    index = "https://pypi.org/simple"
    deps = Dependencies(workdir / "venvs", uv_path=None, index=IndexChooser(index, index), uv_cache_dir=None,
                        timeout=300, base_env=spider_base_env())
    await deps.prepare("python", "bench-spider", code, lambda _: None)

    async def prepare() -> None:
        await workspaces.deploy_package("bench-spider", "v1", package)
        prepared = await deps.prepare("python", "bench-spider", code, lambda _: None)
        assert prepared.cache_hit

    return prepare


def run(quick: bool) -> dict[str, Any]:
    """Measure the containment cost (see module docstring); blocking (runs its own Trio loop)."""
    return trio.run(run_async, quick)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.containment [--quick]``: print the table."""
    args = sys.argv[1:] if argv is None else argv
    result = run("--quick" in args)
    print(result["table"])
    print(f"target {result['target']}: {'met' if result['target_met'] else 'MISSED'} ({result['headline']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
