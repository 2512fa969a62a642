"""``python -m bench --quick --no-scrapyd --only proxy`` runs in the suite, so the proxy benchmark cannot rot.

A real origin on 127.0.0.2, the agent's egress proxy in a process of its own (``bench._proxyrunner``),
httpx and curl fetching small pages and a body directly and through the proxy, and a cProfile of the
proxy. Figures are not asserted (speed targets live in bench/, the machine is noisy); what is asserted
is that it ran, that each table has its rows and that the report names the targets, the CPU per
request, the load and the profile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckagent

REPO = Path(ckagent.__file__).resolve().parent.parent


@pytest.mark.slow
def test_quick_proxy_benchmark_runs_and_reports_its_fields(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENT_") and "proxy" not in k.lower()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--no-scrapyd", "--only", "proxy", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = out.read_text()
    assert "FAILED" not in report, report
    for field in ("## proxy", "| client | direct p50 ms | proxy p50 ms | added p50 ms | direct req/s | proxy req/s "
                  "| proxy / direct | proxy CPU µs/req |", "| client | direct MB/s | proxy MB/s | proxy / direct "
                  "| proxy CPU s/100 MB |", "Load average (1 min) during the run:", "Scrapy crawl: not run",
                  "Profile of the proxy process, 200 small pages, httpx.Client (cProfile",
                  "Profile of the proxy process, 5 MB body", "| function (self time, top 20) | self % | inclusive % |",
                  "| package or module (self time) | % |", "through the proxy ≥ 0.9 × direct throughput",
                  "≤ +0.5 ms p50 per request"):
        assert field in report, f"{field!r} missing from:\n{report}"
    clients = ["httpx.Client"] + (["curl"] if shutil.which("curl") else [])
    for client in clients:  # a row per client in both tables: a name and numbers (a NaN prints as "–")
        rows = [line for line in report.splitlines() if line.startswith(f"| {client} | ")]
        assert len(rows) == 2 and all(" – " not in row for row in rows), rows
    assert "| ckagent containment.egress.proxy.exchange |" in report  # the proxy's own code was profiled
