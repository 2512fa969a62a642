"""Start-up time of ckagent.pyz: cold and warm, to ``version`` and to the first heartbeat.

- cold: a fresh ``SHIV_ROOT`` (the pyz is extracted and its modules byte-compiled on the way);
- warm: the extraction (and the .pyc files) from an earlier start are there — every start after the
  first on a node;
- to ``version``: process start until ``ckagent.pyz version`` exits;
- to first heartbeat: process start of ``ckagent.pyz run`` until the dev master (a real process on
  127.0.0.1) has received the node's first heartbeat — the master's own receive time, so the polling
  of its admin API adds nothing.

Baselines measured in the same run: ``python -c pass`` (the interpreter alone) for ``version``, and
the agent run from the checkout's virtualenv (``python -m ckagent``, source mode) for both.
Target: warm start to first heartbeat ≤ 0.5 s (p50).

Run: ``python -m bench.startup [--quick] [--pyz FILE]`` (without --pyz it builds one first).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
import yaml

from bench._harness import REPO, DevMaster, free_port, markdown_table, parse_iso, summary, work_directory

TARGET_SECONDS = 0.5
def _real_python3() -> str:
    """The interpreter ``python3`` on PATH resolves to (not a pyenv shim, which adds its own start-up)."""
    found = shutil.which("python3")
    if found is None:
        return sys.executable
    result = subprocess.run([found, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                            check=False)
    return result.stdout.strip() or found


PYTHON = _real_python3()
"""The interpreter that runs the pyz (run.sh's python3)."""


def _env(shiv_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENT_", "SHIV_", "PYTHONPATH"))}
    env["SHIV_ROOT"] = str(shiv_root)
    return env


def _timed_run(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def measure_version(pyz: Path, workdir: Path, repeat: int) -> dict[str, list[float]]:
    """Seconds to ``version``: bare interpreter, source mode, pyz cold and warm (blocking)."""
    env = _env(workdir / "shiv-warm")
    source = [str(REPO / ".venv" / "bin" / "python"), "-m", "ckagent", "version"]
    results: dict[str, list[float]] = {"python -c pass": [], "source: python -m ckagent version": [],
                                       "pyz version, cold": [], "pyz version, warm": []}
    _timed_run([PYTHON, str(pyz), "version"], env)  # prime the warm root
    for i in range(repeat):
        results["python -c pass"].append(_timed_run([PYTHON, "-c", "pass"], env))
        results["source: python -m ckagent version"].append(_timed_run(source, env))
        cold_root = workdir / f"shiv-cold-{i}"
        results["pyz version, cold"].append(_timed_run([PYTHON, str(pyz), "version"], _env(cold_root)))
        shutil.rmtree(cold_root, ignore_errors=True)
        results["pyz version, warm"].append(_timed_run([PYTHON, str(pyz), "version"], env))
    return results


def _write_config(directory: Path, config: dict[str, Any]) -> None:
    directory.mkdir(parents=True)
    (directory / "agent.yaml").write_text(yaml.safe_dump(config))


async def first_heartbeat(master: DevMaster, argv: list[str], env: dict[str, str], directory: Path,
                          name: str) -> float:
    """Seconds from spawning ``argv run -c CONFIG`` to the master's receipt of its first heartbeat."""
    config = {
        "server": {"url": master.base_url},
        "agent": {"registration_token": master.registration_token, "name": name, "ip": "127.0.0.1",
                  "port": free_port(), "max_workers": 1},
        "heartbeat": {"interval": 30},
        "task": {"work_dir": str(directory / "data"), "drain_timeout": 0, "kill_grace": 1},
    }
    await trio.to_thread.run_sync(_write_config, directory, config)
    with (directory / "agent.log").open("wb") as log:
        spawned = time.time()
        process = await trio.lowlevel.open_process([*argv, "run", "-c", str(directory / "agent.yaml")],
                                                   env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        with trio.fail_after(60):
            while True:
                nodes = [n for n in await master.admin.list_nodes() if n.get("name") == name]
                if nodes and nodes[0].get("lastHeartbeatAt"):
                    return parse_iso(nodes[0]["lastHeartbeatAt"]) - spawned
                await trio.sleep(0.05)
    finally:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(20):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


async def measure_heartbeat(pyz: Path, workdir: Path, repeat: int) -> dict[str, list[float]]:
    """Seconds to the first heartbeat: source mode, pyz cold and warm."""
    master = DevMaster(workdir / "master")
    await master.start()
    results: dict[str, list[float]] = {"source: first heartbeat": [], "pyz first heartbeat, cold": [],
                                       "pyz first heartbeat, warm": []}
    warm = _env(workdir / "shiv-hb-warm")
    source = [str(REPO / ".venv" / "bin" / "python"), "-m", "ckagent"]
    try:
        await trio.to_thread.run_sync(_timed_run, [PYTHON, str(pyz), "version"], warm)
        for i in range(repeat):
            results["source: first heartbeat"].append(
                await first_heartbeat(master, source, _env(workdir / "unused"), workdir / f"src-{i}", f"src-{i}"))
            cold_root = workdir / f"shiv-hb-cold-{i}"
            results["pyz first heartbeat, cold"].append(
                await first_heartbeat(master, [PYTHON, str(pyz)], _env(cold_root), workdir / f"cold-{i}", f"cold-{i}"))
            shutil.rmtree(cold_root, ignore_errors=True)
            results["pyz first heartbeat, warm"].append(
                await first_heartbeat(master, [PYTHON, str(pyz)], warm, workdir / f"warm-{i}", f"warm-{i}"))
    finally:
        await master.stop()
    return results


def run(quick: bool, pyz: Path | None = None) -> dict[str, Any]:
    """Measure (module docstring); returns figures (seconds), a Markdown table and whether the target is met."""
    repeat = 3 if quick else 10
    with work_directory("bench-startup-") as workdir:
        if pyz is None:
            pyz = workdir / "ckagent.pyz"
            subprocess.run([sys.executable, str(REPO / "build" / "build_pyz.py"), "--output", str(pyz)],
                           check=True, stdout=subprocess.DEVNULL)
        raw = measure_version(pyz, workdir, repeat)
        raw.update(trio.run(measure_heartbeat, pyz, workdir, repeat))
    figures = {name: summary(values) for name, values in raw.items()}
    baselines = {"version": figures["python -c pass"]["p50"],
                 "source version": figures["source: python -m ckagent version"]["p50"],
                 "heartbeat": figures["source: first heartbeat"]["p50"]}
    rows = []
    for name, stats in figures.items():
        if "heartbeat" in name:
            ratio = f"{stats['p50'] / baselines['heartbeat']:.2f}× source"
        elif name.startswith("pyz"):
            ratio = (f"{stats['p50'] / baselines['version']:.1f}× python, "
                     f"{stats['p50'] / baselines['source version']:.2f}× source")
        else:
            ratio = f"{stats['p50'] / baselines['version']:.1f}× python"
        rows.append([name, stats["n"], f"{stats['p50'] * 1000:.0f}", f"{stats['p95'] * 1000:.0f}", ratio])
    warm = figures["pyz first heartbeat, warm"]["p50"]
    table = markdown_table(["start-up", "n", "p50 ms", "p95 ms", "ratio (p50)"], rows)
    return {
        "table": table,
        "figures": figures,
        "python": PYTHON,
        "target": f"warm start to first heartbeat p50 <= {TARGET_SECONDS * 1000:.0f} ms",
        "target_met": warm <= TARGET_SECONDS,
        "headline": f"pyz warm start to first heartbeat p50 {warm * 1000:.0f} ms "
                    f"(cold {figures['pyz first heartbeat, cold']['p50'] * 1000:.0f} ms, "
                    f"python -c pass {baselines['version'] * 1000:.0f} ms)",
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.startup [--quick] [--pyz FILE]``: print the table."""
    args = sys.argv[1:] if argv is None else argv
    pyz = Path(args[args.index("--pyz") + 1]).resolve() if "--pyz" in args else None
    result = run("--quick" in args, pyz)
    print(f"interpreter: {result['python']}")
    print(result["table"])
    print(f"target {result['target']}: {'met' if result['target_met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
