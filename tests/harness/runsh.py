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
import zipfile
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


# ----------------------------------------------------------------- upgrades that must not take a node down

_STAND_IN_MAIN = """
import os, signal, socket, subprocess, sys, time
VERSION, CHECK, HOLD = {version!r}, {check!r}, {hold!r}
if sys.argv[1:2] == ["version"]:
    print("ckagent %s (a stand-in release)" % VERSION)
    sys.exit(0)
if sys.argv[1:3] == ["config", "check"]:
    if CHECK == "crash":
        raise RuntimeError("this release is broken: its config check crashes")
    print("config OK: (a stand-in release)")
    sys.exit(0)
if sys.argv[1:2] == ["config"]:
    sys.exit(2)
if HOLD:  # a stray process left behind, holding the agent's port and answering nothing
    port = int(os.environ["STAND_IN_HOLD_PORT"])
    stray = subprocess.Popen([sys.executable, "-c", "import socket, time\\n"
                              "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\\n"
                              "s.bind(('127.0.0.1', %d)); s.listen()\\n"
                              "while True: time.sleep(60)\\n" % port],
                             start_new_session=True, stdin=subprocess.DEVNULL)
    with open(os.environ["STAND_IN_STRAY_PID"], "w") as out:
        out.write(str(stray.pid))
    time.sleep(1)
    sys.exit(1)
signal.signal(signal.SIGTERM, lambda *args: sys.exit(0))
while True:
    time.sleep(1)
"""


def stand_in_release(path: Path, version: str, *, check: str = "ok", hold_port: bool = False) -> Path:
    """Write a tiny zipapp at ``path`` that run.sh takes for a ckagent.pyz of ``version``: ``version``
    answers as ckagent's; ``config check`` says OK (``check="ok"``) or crashes with a traceback and exit 1
    (``check="crash"``: a broken release); ``config show`` fails (exit 2). Started, it never answers
    /healthz — or, with ``hold_port``, starts a stray process in a session of its own that binds
    127.0.0.1:$STAND_IN_HOLD_PORT (its pid written to $STAND_IN_STRAY_PID: the test kills it) and exits 1
    a second later. Returns ``path``. Blocking (writes one small file)."""
    with path.open("wb") as out:
        out.write(b"#!/usr/bin/env python3\n")
        with zipfile.ZipFile(out, "w") as archive:
            archive.writestr("__main__.py", _STAND_IN_MAIN.format(version=version, check=check, hold=hold_port))
            archive.writestr("site-packages/ckagent/__init__.py", f'__version__ = "{version}"\n')
    return path


@dataclass
class Watched:
    """A run.sh command run while /healthz was polled: its result and every status seen (0: no answer)."""

    result: subprocess.CompletedProcess[bytes]
    codes: list[int]

    @property
    def healthy_throughout(self) -> bool:
        """Every poll (at least two) answered 200."""
        return len(self.codes) >= 2 and set(self.codes) == {200}


async def watch_health(node: RunShNode, *args: str, env: dict[str, str] | None = None,
                       options: dict[str, Any] | None = None) -> Watched:
    """Run ``bash run.sh args`` (≤ 120 s; ``env`` over the node's environment; ``options``: more keyword
    arguments for the process, e.g. another user's) while polling the node's /healthz every 0.1 s, from before it starts until it ended. Each
    poll waits ≤ 2 s for its answer. Cancellation: stops both (the process is killed)."""
    codes: list[int] = [await node.healthz()]
    result: subprocess.CompletedProcess[bytes] | None = None
    done = trio.Event()

    async def poll() -> None:
        while not done.is_set():
            codes.append(await node.healthz())
            with trio.move_on_after(0.1):
                await done.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll)
        try:
            with trio.fail_after(120):
                result = await trio.run_process(["bash", str(node.run_sh), *args], env={**node.env, **(env or {})},
                                                capture_stdout=True, capture_stderr=True, check=False,
                                                **(options or {}))
        finally:
            done.set()
    codes.append(await node.healthz())
    assert result is not None
    return Watched(result, codes)


def last_change(node: RunShNode) -> dict[str, Any]:
    """run.sh's record of the last upgrade, rollback or restart (``.ckagent/last-change.json``)."""
    found: dict[str, Any] = json.loads((node.directory / ".ckagent" / "last-change.json").read_text())
    return found


def failed_versions(node: RunShNode) -> list[str]:
    """The versions run.sh remembers as failed here (``.ckagent/failed_versions``; [] without the file)."""
    path = node.directory / ".ckagent" / "failed_versions"
    return path.read_text().split() if path.exists() else []
