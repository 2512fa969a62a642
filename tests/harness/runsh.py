"""run.sh as an operator uses it: a node directory (run.sh + config/config.yaml) for the dev master, a
release index over HTTP, and the bumped ckagent.pyz an upgrade goes to. Their fixtures (``pyz``,
``bumped_pyz``, ``releases``, ``node``) are conftest.py's."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

import ckagent
from harness.core import eventually
from harness.examples import REPO
from harness.pyz import build_pyz

RUN_SH = REPO / "run.sh"
BUMPED = "99.0.0"


def bump_and_build(source: Path, output: Path) -> Path:
    """Bump the frozen ``source`` to :data:`BUMPED` (build/bump_version.sh) and build its pyz."""
    bumped = subprocess.run(["bash", str(REPO / "build" / "bump_version.sh"), "--root", str(source), BUMPED],
                            capture_output=True, text=True, timeout=120, check=False)
    assert bumped.returncode == 0 and bumped.stdout.strip() == f"{ckagent.__version__} -> {BUMPED}", bumped
    return build_pyz(source, output)


@dataclass
class Releases:
    """A release index served over HTTP: ``url`` is AGENT_RELEASE_URL, files live in ``directory``."""

    url: str
    directory: Path

    def publish(self, pyz: Path, version: str, *, latest: bool = True, sha256: str | None = None,
                uv: Path | None = None) -> str:
        """Copy ``pyz`` as ckagent-<version>.pyz and write <version>.json (and latest.json), naming ``uv``
        (copied as uv-<its version>-linux-x86_64) when given. Returns the pyz's sha256."""
        name = f"ckagent-{version}.pyz"
        shutil.copyfile(pyz, self.directory / name)
        digest = hashlib.sha256(pyz.read_bytes()).hexdigest()
        entry: dict[str, object] = {"version": version, "url": name, "sha256": sha256 or digest,
                                    "sizeBytes": pyz.stat().st_size}
        if uv is not None:
            uv_version = subprocess.run([str(uv), "--version"], capture_output=True, text=True,
                                        check=True).stdout.split()[1]
            uv_name = f"uv-{uv_version}-linux-x86_64"
            shutil.copyfile(uv, self.directory / uv_name)
            entry["uv"] = {"version": uv_version, "url": uv_name,
                           "sha256": hashlib.sha256((self.directory / uv_name).read_bytes()).hexdigest()}
        (self.directory / f"{version}.json").write_text(json.dumps(entry))
        if latest:
            (self.directory / "latest.json").write_text(json.dumps(entry))
        return digest


@dataclass
class RunShNode:
    """An operator's directory: run.sh + config/config.yaml; ``port`` is the agent's status port."""

    directory: Path
    port: int
    env: dict[str, str]

    @property
    def run_sh(self) -> Path:
        return self.directory / "run.sh"

    def pid(self) -> int | None:
        """The pid in agent.pid, if the file exists."""
        path = self.directory / "agent.pid"
        return int(path.read_text()) if path.exists() else None

    async def sh(self, *args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
        """Run ``bash run.sh args`` (≤ 120 s) from the test's cwd; returns the completed process (any rc)."""
        with trio.fail_after(120):
            return await trio.run_process(["bash", str(self.run_sh), *args], env={**self.env, **env},
                                          capture_stdout=True, capture_stderr=True, check=False)

    async def healthz(self) -> int:
        """The status code of the agent's /healthz (0 when nothing answers)."""
        try:
            async with httpx.AsyncClient(timeout=2) as client:
                return (await client.get(f"http://127.0.0.1:{self.port}/healthz")).status_code
        except httpx.HTTPError:
            return 0


def same(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes."""
    return a.read_bytes() == b.read_bytes()


def out(result: subprocess.CompletedProcess[bytes]) -> str:
    """stdout + stderr of a run.sh call, as text."""
    return result.stdout.decode(errors="replace") + result.stderr.decode(errors="replace")


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie does not: its cmdline is empty)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0) but has left /proc/<pid>/cmdline empty
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""
    return False





async def node_registered(dev_master: Any, name: str = "runsh-node") -> None:
    """Wait (≤ 30 s) until the node ``name`` has registered with ``dev_master`` and sent a heartbeat."""
    async def beating() -> bool:
        return any(n.get("name") == name and n.get("lastHeartbeatAt") for n in await dev_master.admin.list_nodes())

    await eventually(beating, 30)
