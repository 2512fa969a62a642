"""``python -m bench [--quick] [--no-scrapyd] [--only NAME[,NAME]] [--out FILE]``: every benchmark, one report.

Runs each benchmark module it knows that is present (dispatch, makespan, overhead, flood, items,
manytasks, scrape, prepare, startup, adoption, containment, egress, outputs, proxy, checkpoint, fleet; each exposes ``run(quick) -> dict``;
``--agents N`` goes to those whose ``run`` takes ``agents``: the fleet's), prints one summary table (target, met or
not) followed by each module's own table, and writes the same Markdown — with the machine, Python,
versions, commit and date — to ``bench/results/latest.md`` (``bench/results/quick.md`` with
``--quick``) or ``--out``. A module that fails is reported as failed; the others still run.
Exit code: 0 when every module ran (missed targets included), 1 when one failed.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import platform
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from bench._harness import REPO, markdown_table

MODULES = ("dispatch", "makespan", "overhead", "flood", "items", "manytasks", "scrape", "prepare", "startup", "adoption",
           "containment", "egress", "outputs", "proxy", "checkpoint", "fleet")
RESULTS = Path(__file__).resolve().parent / "results"


def _load(name: str) -> Any | None:
    try:
        return importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"bench.{name}":
            return None  # not written (yet)
        raise


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "–"


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def environment(scrapyd: bool) -> list[tuple[str, str]]:
    """What the figures were measured on: machine, OS, Python, versions, commit, date."""
    rows = [
        ("date (UTC)", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")),
        ("machine", f"{_cpu_model()}, {psutil.cpu_count()} logical CPUs, "
                    f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM"),
        ("load average at start", " ".join(f"{x:.2f}" for x in os.getloadavg())),
        ("OS", platform.platform()),
        ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
        ("ckagent", _version("ckagent")),
        ("trio / httpx / hypercorn", f"{_version('trio')} / {_version('httpx')} / {_version('hypercorn')}"),
    ]
    commit = _git("rev-parse", "--short", "HEAD")
    if commit:
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", "ckagent"))
        rows.append(("commit", commit + (" (+ uncommitted changes in ckagent/)" if dirty else "")))
    if scrapyd:
        from bench import _scrapyd

        python = _scrapyd.venv_python()
        if python.exists():
            found = _scrapyd.versions(python)
            rows.append(("Scrapy / Scrapyd (bench venv)", f"{found['scrapy']} / {found['scrapyd']}"))
    return rows


def _module_table(module: Any, result: dict[str, Any]) -> str:
    if isinstance(result.get("table"), str):
        return str(result["table"])
    report = getattr(module, "report", None)
    if callable(report):
        return str(report(result))
    return markdown_table(["figure", "value"], [(k, v) for k, v in result.items() if not isinstance(v, dict | list)])


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks (see module docstring); returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few tasks each (smoke mode, ~1 min)")
    parser.add_argument("--no-scrapyd", action="store_true", help="skip Scrapyd and Scrapy (no package downloads)")
    parser.add_argument("--only", default="", help="comma-separated module names (default: all present)")
    parser.add_argument("--out", type=Path, default=None, help="Markdown report path")
    parser.add_argument("--agents", type=int, default=16, help="agents of the fleet benchmark (16..32)")
    args = parser.parse_args(argv)
    scrapyd = not args.no_scrapyd
    wanted = [m for m in (args.only.split(",") if args.only else MODULES) if m]
    out: Path = args.out or RESULTS / ("quick.md" if args.quick else "latest.md")

    env_rows = environment(scrapyd)
    summary_rows: list[list[Any]] = []
    sections: list[str] = []
    failed = False
    for name in wanted:
        module = _load(name)
        if module is None:
            summary_rows.append([name, "not present", "–", "–", "–"])
            continue
        print(f"== {name} …", file=sys.stderr, flush=True)
        started = time.monotonic()
        parameters = inspect.signature(module.run).parameters
        kwargs: dict[str, Any] = {"scrapyd": scrapyd} if "scrapyd" in parameters else {}
        if "agents" in parameters:
            kwargs["agents"] = args.agents
        try:
            result = module.run(args.quick, **kwargs)
        except Exception:
            failed = True
            text = traceback.format_exc()
            print(text, file=sys.stderr)
            summary_rows.append([name, "–", "FAILED", "–", f"{time.monotonic() - started:.0f} s"])
            sections.append(f"## {name}\n\nFAILED:\n\n```\n{text[-3000:]}\n```\n")
            continue
        met = result.get("target_met")
        summary_rows.append([name, result.get("target", "–"), "–" if met is None else ("met" if met else "MISSED"),
                             result.get("headline", "–"), f"{time.monotonic() - started:.0f} s"])
        sections.append(f"## {name}\n\n{_module_table(module, result)}")
        print(sections[-1], flush=True)

    mode = "quick (smoke: a few tasks, figures not meaningful)" if args.quick else "full"
    report = "\n".join([
        "# ckagent benchmarks\n",
        f"Mode: {mode}; Scrapyd: {'yes' if scrapyd else 'no'}. Produced by `python -m bench"
        f"{' --quick' if args.quick else ''}{'' if scrapyd else ' --no-scrapyd'}`; see bench/README.md.\n",
        markdown_table(["", ""], env_rows),
        "## Summary\n",
        markdown_table(["benchmark", "target", "result", "figure", "time"], summary_rows),
        *sections,
    ])
    print("\n## Summary\n\n" + markdown_table(["benchmark", "target", "result", "figure", "time"], summary_rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"written to {out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
