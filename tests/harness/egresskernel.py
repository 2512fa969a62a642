"""Tasks under the ``nftables`` egress level for a test: the condition to skip on, a containment, a
loopback listener to be refused, a child in a task's jail that connects (ignoring every proxy
variable), and the agent's table read back with ``nft``. Only loopback addresses are ever a target
(127.0.0.x aliases: this host routes all of 127/8 to ``lo``); a test deletes or reads only the table
of the agent it made, never another (the machine has its own firewall tables)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from ckagent.containment import Containment, TaskJail, open_containment

__all__ = ["ESCAPER", "connect_from", "containment_at", "delete_table", "egress_kernel_missing",
           "loopback_listener", "table_text", "tables_deleted"]


def egress_kernel_missing() -> str | None:
    """Why tasks cannot be filtered by nftables here (None: they can): root, nft, a cgroup v2 tree."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN)"
    if shutil.which("nft") is None:
        return "the nft program is not installed (apt-get install nftables)"
    if not Path("/sys/fs/cgroup/unified").is_dir() and not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return "no cgroup v2 tree"
    return None


@contextlib.contextmanager
def containment_at(level: str, work_dir: Path, *, use_unified: bool = True) -> Iterator[Containment]:
    """The containment ``level`` for ``work_dir`` (``use_unified=False``: a pure v1 one), closed at the end."""
    containment = open_containment(level, work_dir, use_unified=use_unified)
    try:
        yield containment
    finally:
        containment.close()


@contextlib.contextmanager
def loopback_listener(address: str) -> Iterator[int]:
    """A listening TCP socket on a loopback ``address`` (IPv4 or IPv6); yields its port."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
        sock.bind((address, 0))
        sock.listen(16)
        yield sock.getsockname()[1]


ESCAPER = """
import os, socket, sys
os.setsid()
for name in list(os.environ):
    del os.environ[name]
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
except ConnectionRefusedError:
    sys.exit(7)
sys.exit(0)
"""
"""A child that leaves its session, empties its environment and connects straight to the address it
is given: exit 0 connected, 7 refused."""


def connect_from(jail: TaskJail, address: str, port: int) -> int:
    """Run :data:`ESCAPER` inside ``jail`` (joined before exec, as every task process); its exit code.
    Blocking (≤ 30 s)."""
    env = {"PATH": os.environ.get("PATH", ""), "HTTP_PROXY": "http://127.0.0.1:9", "ALL_PROXY": "http://127.0.0.1:9"}
    argv, options = jail.spawn([sys.executable, "-I", "-S", "-c", ESCAPER, address, str(port)], env)
    return subprocess.run(argv, env={}, timeout=30, check=False, **options).returncode


def delete_table(name: str) -> bool:
    """``nft delete table inet <name>`` (the agent's own table, as someone else would); True when it went."""
    return subprocess.run(["nft", "delete", "table", "inet", name], capture_output=True, timeout=30,
                          check=False).returncode == 0


def table_text(name: str) -> str | None:
    """``nft list table inet <name>`` (None: there is no such table)."""
    done = subprocess.run(["nft", "list", "table", "inet", name], capture_output=True, text=True, timeout=30,
                          check=False)
    return done.stdout if done.returncode == 0 else None


@contextlib.contextmanager
def tables_deleted(*names: str) -> Iterator[None]:
    """Delete the tables ``names`` (the test's agents' own) at the end, also when the test fails."""
    try:
        yield
    finally:
        for name in names:
            delete_table(name)
