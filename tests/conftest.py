"""Shared fixtures: a real dev master, in-process (``dev_master``) or as a subprocess (``dev_master_process``).

Both listen on 127.0.0.1 with a port picked by the OS and keep their data in a SQLite file under the
test's ``tmp_path``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

import ckagent
from ckagent.devmaster.client import AdminClient
from ckagent.devmaster.server import DevMasterConfig, serve

_REPO_ROOT = Path(ckagent.__file__).resolve().parent.parent


def _remove_tables_under(root: Path) -> list[str]:
    """Delete the agents' nft tables whose work dir is below ``root`` (an agent killed with -9 leaves
    its table: the next start in that work dir would replace it, but a test's directory never sees
    one). Only where this process may change nftables."""
    if os.geteuid() != 0:
        return []
    from ckagent.containment.egress.table import remove_orphans

    return remove_orphans(lambda work_dir: work_dir.startswith(str(root) + os.sep))


@pytest.fixture(autouse=True)
def no_leftover_tables(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that had a ``tmp_path``: remove the nft tables of the agents it ran there,
    also when it failed (tests/test_egress.py checks its own tables besides)."""
    yield
    tmp = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") else None
    if isinstance(tmp, Path):
        _remove_tables_under(tmp)


@pytest.fixture(autouse=True, scope="session")
def no_leftover_tables_of_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end of the session: the tables of agents that ran anywhere below its temporary root."""
    yield
    _remove_tables_under(tmp_path_factory.getbasetemp())


@dataclass
class DevMaster:
    """A running dev master: where it listens, its secrets, its database and an admin client."""

    base_url: str
    registration_token: str
    admin_token: str
    db_path: Path
    admin: AdminClient


@pytest.fixture
async def dev_master(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[DevMaster]:
    """An in-process dev master (port 0, fresh SQLite file, random tokens), stopped after the test."""
    config = DevMasterConfig(
        db_path=tmp_path / "master.sqlite",
        registration_token=secrets.token_urlsafe(16),
        admin_token=secrets.token_urlsafe(16),
        port=0,
    )
    base_url = await nursery.start(serve, config)
    async with AdminClient(base_url, config.admin_token) as admin:
        yield DevMaster(
            base_url=base_url,
            registration_token=config.registration_token,
            admin_token=config.admin_token,
            db_path=config.db_path,
            admin=admin,
        )


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


class DevMasterProcess:
    """A dev master in its own process (``python -m ckagent.devmaster``), restartable on the same db.

    ``await start()`` launches it and returns the base URL (the port may change between starts);
    ``await stop()`` sends SIGTERM and returns the exit code; ``await kill()`` sends SIGKILL (a crash).
    The process's stderr goes to ``<tmp_path>/dev-master.stderr.log``.
    """

    def __init__(self, tmp_path: Path, *, startup_timeout: float = 20.0) -> None:
        self.db_path = tmp_path / "master.sqlite"
        self.registration_token = secrets.token_urlsafe(16)
        self.admin_token = secrets.token_urlsafe(16)
        self.stderr_path = tmp_path / "dev-master.stderr.log"
        self.startup_timeout = startup_timeout
        self.base_url: str | None = None
        self.process: trio.Process | None = None

    async def start(self, *, same_port: bool = False) -> str:
        """Start the process and wait for its "listening on URL" line. Returns the URL.

        ``same_port``: listen on the port of the previous start (agents configured with the old URL
        find it again); otherwise a free port is picked. Raises RuntimeError (with the stderr tail) if it exits or stays silent for ``startup_timeout`` s.
        """
        if self.process is not None and self.process.returncode is None:
            raise RuntimeError("the dev master is already running")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])),
            # tokens through the environment: flags would show in `ps` (and a token may start with "-")
            "DEVMASTER_REGISTRATION_TOKEN": self.registration_token,
            "DEVMASTER_ADMIN_TOKEN": self.admin_token,
        }
        command = [
            sys.executable,
            "-m",
            "ckagent.devmaster",
            f"--db={self.db_path}",
            "--host=127.0.0.1",
            f"--port={_port_of(self.base_url) if same_port and self.base_url else 0}",
        ]
        with self.stderr_path.open("ab") as stderr:
            self.process = await trio.lowlevel.open_process(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=env
            )
        assert self.process.stdout is not None
        line = b""
        with trio.move_on_after(self.startup_timeout):  # noqa: ASYNC912 - receive_some checkpoints
            while not line.endswith(b"\n"):
                chunk = await self.process.stdout.receive_some(1)
                if not chunk:
                    break
                line += chunk
        text = line.decode(errors="replace").strip()
        marker = "listening on "
        if marker not in text:
            await self.kill()
            tail = self.stderr_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"dev master did not start (stdout: {text!r}); stderr:\n{tail}")
        self.base_url = text.split(marker, 1)[1].split(" ", 1)[0]
        return self.base_url

    async def stop(self, grace: float = 10.0) -> int:
        """SIGTERM, then wait for the exit (SIGKILL after ``grace`` seconds). Returns the exit code."""
        return await self._end(signal.SIGTERM, grace)

    async def kill(self) -> int:
        """SIGKILL (simulates a crash) and reap. Returns the exit code (negative signal number)."""
        return await self._end(signal.SIGKILL, 10.0)

    async def _end(self, signum: int, grace: float) -> int:
        process = self.process
        if process is None:
            return 0
        if process.returncode is None:
            process.send_signal(signum)
            with trio.move_on_after(grace):
                await process.wait()
            if process.returncode is None:
                process.kill()
        code = await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()
        return code

    def admin(self) -> AdminClient:
        """A new AdminClient for the current URL (use it as an async context manager)."""
        assert self.base_url is not None, "start() first"
        return AdminClient(self.base_url, self.admin_token)


@pytest.fixture
async def dev_master_process(tmp_path: Path) -> AsyncIterator[DevMasterProcess]:
    """A not-yet-started ``DevMasterProcess`` on ``tmp_path``; killed after the test if still running."""
    handle = DevMasterProcess(tmp_path)
    try:
        yield handle
    finally:
        with trio.CancelScope(shield=True):
            await handle.kill()
