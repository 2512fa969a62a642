"""The pod is a node (issue 39): the agent started the way a Kubernetes pod starts it — a box of namespaces
on this machine (tests/harness/podbox.py: its own PID and mount namespaces, a non-root uid without
capabilities, a read-only root but for its volumes, a read-only cgroup, PID 1 the image's
``ckagent supervise``) — against the real reference master on 127.0.0.1 outside the box.

- ``ckagent config check`` in each variant the manifests describe (plain, net_admin, privileged) says
  the levels docs/deploy.md "What a pod gets" documents;
- a box leaves nothing on the host: its mounts die with its namespace.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio
from harness import eventually
from harness.levelcheck import CheckRun
from harness.podbox import POD_UID, VARIANTS, PodBox, box_cannot, box_processes, host_mounts, run_box

from ckagent.containment.egress.nft import NftError, open_nft


def _nftables_here() -> bool:
    """Whether root may drive nftables here: the nft program or libnftables (the agent uses either; a suite
    run with the program hidden still has the library)."""
    if os.geteuid() != 0:
        return False
    try:
        open_nft()
    except NftError:
        return False
    return True


NFT = _nftables_here()


def _variant(name: str) -> pytest.ParameterSet:
    reason = box_cannot(name)
    return pytest.param(name, id=name, marks=[pytest.mark.skipif(reason is not None, reason=reason or "")])


BOXES = [_variant(name) for name in VARIANTS]


def expected_levels(variant: str) -> tuple[str, str, str]:
    """(containment, egress, identity) a variant's agent gets on this machine (docs/deploy.md, "What a pod
    gets"): a plain or net_admin pod cannot write its cgroup, so no task cgroup and no kernel egress;
    a privileged one is root with a writable cgroup: what root gets on a host."""
    if variant == "privileged":
        return ("cgroup-v1" if Path("/sys/fs/cgroup/memory").is_dir() else "cgroup-v2",
                "nftables" if NFT else "proxy", "spider-uids")
    return "process-group", "proxy", "agent-user"


def _box(tmp_path: Path, pyz: Path, variant: str, **settings: object) -> PodBox:
    return PodBox(tmp_path / f"box-{variant}", "http://127.0.0.1:9", "no-token-here-0123456789", pyz=pyz,
                  variant=variant, **settings)


@pytest.mark.parametrize("variant", BOXES)
async def test_config_check_in_a_pod_says_its_levels(tmp_path: Path, pyz: Path, variant: str) -> None:
    box = await trio.to_thread.run_sync(lambda: _box(tmp_path, pyz, variant))
    before = await trio.to_thread.run_sync(host_mounts)
    run = await run_box(box, box.ckagent("config", "check", "-c", str(box.config_path)))
    check = CheckRun(run.returncode, run.stdout, "")
    assert run.returncode == 0, run.stdout
    got = tuple(check.section(concern)[0].split()[1] for concern in ("containment", "egress", "identity"))
    print(f"figures [{variant}] levels {got}\n" + run.stdout)
    assert got == expected_levels(variant), run.stdout
    uid = 0 if variant == "privileged" else (POD_UID if os.geteuid() == 0 else os.geteuid())
    assert f"uid {uid}" in run.stdout, run.stdout
    if variant != "privileged":
        assert "Read-only file system" in check.text("containment"), run.stdout
    assert await trio.to_thread.run_sync(host_mounts) == before


@pytest.mark.skipif(box_cannot() is not None, reason=box_cannot() or "")
async def test_a_box_is_a_pod_and_leaves_nothing_on_the_host(tmp_path: Path, pyz: Path) -> None:
    box = await trio.to_thread.run_sync(lambda: _box(tmp_path, pyz, "plain"))
    before = await trio.to_thread.run_sync(host_mounts)
    probe = ("import os, sys\n"
             "def w(p):\n"
             "    try:\n"
             "        open(p, 'w').close(); return 'rw'\n"
             "    except OSError as e:\n"
             "        return e.strerror\n"
             "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapBnd', 'CapAmb'))]\n"
             f"print('pid', os.getpid(), 'uid', os.getuid(), 'caps', *caps)\n"
             f"print('root', w('/etc/ckbox-probe'), 'cgroup', w('/sys/fs/cgroup/unified/ckbox-probe'))\n"
             f"print('data', w({str(box.work_dir / 'p')!r}), 'home', w({str(box.home / 'p')!r}), 'tmp', w('/tmp/p'))\n"
             "print('procs', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n")
    await box.start_argv([str(Path("/usr/bin/python3")), "-u", "-c", probe + "import time; time.sleep(60)"])
    async with box:
        with trio.fail_after(30):
            await eventually(lambda: trio.to_thread.run_sync(lambda: "procs" in box.log_text()), 30, "the probe's lines")
            pid1 = box.pid1()
            assert pid1 is not None
            assert await trio.to_thread.run_sync(box_processes, pid1) == [pid1]
        await box.kill()
    out = box.log_text()
    uid = POD_UID if os.geteuid() == 0 else os.geteuid()
    assert f"pid 1 uid {uid} caps 0000000000000000 0000000000000000 0000000000000000" in out, out
    assert "root Read-only file system cgroup Read-only file system" in out, out
    assert "data rw home rw tmp rw" in out, out
    assert "procs [1]" in out, out
    assert await trio.to_thread.run_sync(lambda: (box.tmp / "p").exists() and not Path("/tmp/p").exists())  # (its volume)
    assert await trio.to_thread.run_sync(host_mounts) == before
    assert await trio.to_thread.run_sync(box_processes, pid1) == []
