"""Prepare cost of a spider that ran here before: what a cached run adds before the spider starts.

A task's prepare is deploy (the code version is already on disk: reused, no download) plus
dependencies (the dependency files' hash matches the last successful install: no uv/npm run). Both
are measured with the real :class:`~ckagent.code.workspace.Workspaces` and
:class:`~ckagent.code.deps.Dependencies` on a real venv / node install made once beforehand, next to the
baseline of a bare ``python -c pass`` spawn measured in the same run.

Target: a cached prepare adds well under 100 ms (p95 < 100 ms).
Run: ``python -m bench.prepare [--quick]``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from typing import Any

import trio

from bench._harness import markdown_table, summary, work_directory
from ckagent.code.deps import Dependencies, IndexChooser, spider_base_env
from ckagent.code.workspace import Workspaces
from ckagent.master.client import MasterClient
from ckagent.master.protocol import CodePackage, RegisterRequest

TARGET_SECONDS = 0.1
PACKAGE_JSON = {"name": "bench", "version": "1.0.0", "private": True}
LOCK = {"name": "bench", "version": "1.0.0", "lockfileVersion": 3, "requires": True,
        "packages": {"": {"name": "bench", "version": "1.0.0"}}}


async def _timed(repeat: int, fn: Any) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - started)
    return out


async def run_async(quick: bool) -> dict[str, Any]:
    """Measure (see module docstring); returns the figures and a Markdown table."""
    repeat = 20 if quick else 200
    rows: list[list[Any]] = []
    figures: dict[str, dict[str, float]] = {}
    with work_directory("bench-prepare-") as workdir:
        # Baseline: the cheapest thing a task does anyway — start a Python process.
        async def bare_spawn() -> None:
            await trio.run_process([sys.executable, "-c", "pass"])

        spawn = await _timed(repeat, bare_spawn)
        figures["bare python -c pass spawn"] = summary(spawn)

        # Deploy of a version already on disk (no master call happens: the client points nowhere).
        body = RegisterRequest(name="bench", ip="127.0.0.1", port=0, version="b", os="linux", arch="x",
                               python="3", cpu_count=1, memory_total_bytes=1, max_workers=1)
        master = MasterClient("http://127.0.0.1:9", "unused", lambda: body)
        workspaces = Workspaces(workdir / "spiders", master)
        code = workspaces.spider_dir("bench-spider") / "v1"
        code.mkdir(parents=True)
        (code / "main.py").write_text("print(1)\n")
        (code / "requirements.txt").write_text("# no dependencies\n")
        package = CodePackage(url="http://127.0.0.1:9/never.zip", sha256="0" * 64, size_bytes=1)

        async def deploy() -> None:
            await workspaces.deploy_package("bench-spider", "v1", package)

        figures["deploy (version present)"] = summary(await _timed(repeat, deploy))

        index = "https://pypi.org/simple"
        deps = Dependencies(workdir / "venvs", uv_path=None, index=IndexChooser(index, index), uv_cache_dir=None,
                            timeout=300, base_env=spider_base_env())
        first = await deps.prepare("python", "bench-spider", code, lambda _: None)
        assert not first.cache_hit

        async def python_cached() -> None:
            prepared = await deps.prepare("python", "bench-spider", code, lambda _: None)
            assert prepared.cache_hit

        async def python_whole() -> None:
            await deploy()
            await python_cached()

        figures["python deps (cached)"] = summary(await _timed(repeat, python_cached))
        figures["python prepare = deploy + deps (cached)"] = summary(await _timed(repeat, python_whole))

        if shutil.which("npm"):
            node_code = workspaces.spider_dir("bench-node") / "v1"
            node_code.mkdir(parents=True)
            (node_code / "package.json").write_text(json.dumps(PACKAGE_JSON))
            (node_code / "package-lock.json").write_text(json.dumps(LOCK))
            await deps.prepare("node", "bench-node", node_code, lambda _: None)

            async def node_cached() -> None:
                prepared = await deps.prepare("node", "bench-node", node_code, lambda _: None)
                assert prepared.cache_hit

            figures["node deps (cached)"] = summary(await _timed(repeat, node_cached))
        await master.aclose()
    base = figures["bare python -c pass spawn"]["p50"]
    for name, f in figures.items():
        rows.append([name, f["n"], f["p50"] * 1000, f["p95"] * 1000, f["max"] * 1000, f["p50"] / base])
    table = markdown_table(["prepare step", "n", "p50 ms", "p95 ms", "max ms", "÷ bare spawn p50"], rows)
    whole = figures["python prepare = deploy + deps (cached)"]
    return {
        "name": "prepare",
        "table": table,
        "figures": figures,
        "target": f"cached prepare p95 < {TARGET_SECONDS * 1000:.0f} ms",
        "target_met": whole["p95"] < TARGET_SECONDS,
        "headline": f"cached prepare p50 {whole['p50'] * 1000:.2f} ms, p95 {whole['p95'] * 1000:.2f} ms "
                    f"(bare spawn p50 {base * 1000:.1f} ms)",
    }


def run(quick: bool) -> dict[str, Any]:
    """Measure the cached prepare cost (see module docstring); blocking (runs its own Trio loop)."""
    return trio.run(run_async, quick)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.prepare [--quick]``: print the table."""
    args = sys.argv[1:] if argv is None else argv
    result = run("--quick" in args)
    print(result["table"])
    print(f"target {result['target']}: {'met' if result['target_met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
