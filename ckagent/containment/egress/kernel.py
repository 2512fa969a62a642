"""The ``nftables`` level's conditions, shared by opening the level and judging it: the depth of the
tasks' cgroups in the v2 tree (:func:`v2_depth`), nftables itself (:func:`nft_backend`), the right to
change it (:func:`create_table`, :func:`has_net_admin`), and the start-up probe (:func:`run_probe`: the kernel
must refuse a connection from a task cgroup); :func:`judge_nftables` judges them all without changing the
machine (``ckagent config check``). Each raises :class:`~ckagent.containment.egress.errors.EgressError`
with the :class:`~ckagent.node.levels.Blocker` that says which condition failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

from ckagent.containment.egress.errors import EgressError
from ckagent.containment.egress.nft import Nft, NftError, open_nft
from ckagent.containment.egress.owners import TABLE_PREFIX
from ckagent.containment.egress.table import NFT_CGROUP_ROOT, EgressTable
from ckagent.node.levels import Blocker, EgressLevel, Judged

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 5.0
"""Seconds the start-up probe's child may take."""

CAP_NET_ADMIN = 12
"""The capability's bit in ``CapEff``."""


def judge_nftables(base: Path | None, where: str, nft: Nft | None) -> Judged:
    """Judge ``nftables`` for task cgroups that would be below ``base`` (see :func:`ckagent.containment.egress.judge_egress`).
    Raises EgressError with every unmet condition (``also``)."""
    from ckagent.containment.base import ContainmentError, throwaway_cgroup  # (imports Trio)

    found: list[EgressError] = []
    if base is None:
        found.append(EgressError(f"the tasks have no cgroup in a cgroup v2 tree (containment {where})",
                                 Blocker.NO_TASK_CGROUP))
    else:
        try:
            v2_depth(base / "ckagent-x")
        except EgressError as exc:
            found.append(exc)
    backend = None
    try:
        backend = nft_backend(nft)
    except EgressError as exc:
        found.append(exc)
    if backend is not None and not has_net_admin():
        found.append(EgressError(f"this process (uid {os.geteuid()}) has no CAP_NET_ADMIN: it may not change "
                                 "nftables", Blocker.NO_NET_ADMIN))
    elif backend is not None:  # the rights, where the capability says yes: a table of the check's own
        table = EgressTable(backend, f"{TABLE_PREFIX}check_{os.getpid()}", 1, netlink=False)
        try:
            create_table(table)
        except EgressError as exc:
            found.append(exc)
        else:
            drop_table(table)
    if found:
        raise EgressError(str(found[0]), found[0].blocker, also=tuple(found[1:]))
    assert base is not None and backend is not None
    try:
        with throwaway_cgroup(base) as group:
            _, depth = v2_depth(group)
            table = EgressTable(backend, f"{TABLE_PREFIX}check_{os.getpid()}", depth, netlink=False)
            create_table(table)
            try:
                run_probe(table, group)
            finally:
                drop_table(table)
    except ContainmentError as exc:
        raise EgressError(f"no cgroup for the probe: {exc}", exc.blocker) from exc
    return Judged(EgressLevel.NFTABLES, f"nftables ({backend.kind}), task cgroups at level {depth} below "
                  f"{base}; the probe was refused by the kernel")


def has_net_admin() -> bool:
    """Whether this process's effective capabilities hold CAP_NET_ADMIN (/proc/self/status ``CapEff``;
    True when it cannot be read: the table's creation then tells)."""
    for line in read_file("/proc/self/status").splitlines():
        if line.startswith("CapEff:"):
            with contextlib.suppress(ValueError):
                return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    return True


def drop_table(table: EgressTable) -> None:
    """Delete a check's table; a table that cannot be deleted is logged with how to remove it."""
    try:
        table.close()
    except NftError as exc:
        log.warning("egress: cannot delete the check's table inet %s (%s): nft delete table inet %s",
                    table.name, exc, table.name)


def v2_depth(group: Path) -> tuple[Path, int]:
    """(the v2 tree's mount point, the level of the task cgroups below ``group`` in nft's terms).
    Raises EgressError."""
    from ckagent.containment.hierarchy import mounts  # (the containment package imports Trio)

    v2 = mounts(read_file("/proc/self/mountinfo")).get("unified")
    if v2 is None:
        raise EgressError("no cgroup v2 tree is mounted", Blocker.NO_V2_TREE)
    point, root = v2
    try:
        group.relative_to(NFT_CGROUP_ROOT)
        return point, len(group.relative_to(point).parts) + len(Path(root).parts[1:]) + 1
    except ValueError:
        raise EgressError(f"the v2 tree {point} is not below {NFT_CGROUP_ROOT}, where nft looks",
                          Blocker.V2_TREE_ELSEWHERE) from None


def nft_backend(nft: Nft | None) -> Nft:
    """``nft``, or libnftables / the nft program. Raises EgressError (NO_NFTABLES)."""
    try:
        return nft or open_nft()
    except NftError as exc:
        raise EgressError(str(exc), Blocker.NO_NFTABLES) from exc


def create_table(table: EgressTable) -> None:
    """Create ``table`` (afresh). Raises EgressError (NO_NET_ADMIN when nftables said not permitted)."""
    try:
        table.create()
    except NftError as exc:
        raise EgressError(f"cannot create the nftables table {table.name} ({exc}; the agent needs "
                          "CAP_NET_ADMIN: run it as root or grant the capability)",
                          Blocker.NO_NET_ADMIN if "not permitted" in str(exc) else Blocker.FAILED) from exc


def run_probe(table: EgressTable, group: Path) -> None:
    """A child in a throw-away cgroup below ``group`` connects to a loopback listener of ours under
    a policy that denies it: the kernel must refuse it (a wrong cgroup level would let it through)."""
    from ckagent.node.egress_policy import parse_deny

    cgroup = group / "egress-probe"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        cgroup.mkdir(exist_ok=True)
        rules = None
        try:
            rules = table.add("probe", str(cgroup.relative_to(NFT_CGROUP_ROOT)),
                              parse_deny(["127.0.0.1/32"], "probe"), None)
            code = ("import socket,sys\ntry:\n socket.create_connection(('127.0.0.1', int(sys.argv[1])), 2)\n"
                    "except ConnectionRefusedError:\n sys.exit(0)\nsys.exit(3)")
            script = 'echo 0 >"$1/cgroup.procs" || exit 4\nshift\nexec "$@"'
            try:
                done = subprocess.run(["/bin/sh", "-c", script, "sh", str(cgroup), sys.executable, "-I", "-S",
                                       "-c", code, str(port)], timeout=PROBE_TIMEOUT, check=False,
                                      capture_output=True)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise EgressError(f"the probe child could not run: {exc}") from exc
            refused = table.refusals(rules)
            table.remove(rules, refused)
            if done.returncode != 0 or not refused:
                raise EgressError(f"the kernel did not refuse a probe connection from a task cgroup (exit "
                                  f"{done.returncode}, {len(refused)} counted): socket cgroupv2 does not match here",
                                  Blocker.KERNEL_NO_MATCH)
        except NftError as exc:
            raise EgressError(f"the probe's rules were refused: {exc}") from exc
        finally:
            if rules is not None:
                with contextlib.suppress(NftError):
                    table.remove(rules)
            with contextlib.suppress(OSError):
                cgroup.rmdir()


def read_file(path: str) -> str:
    """The file's text, '' when it cannot be read."""
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""
