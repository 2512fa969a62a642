"""`ckagent config check` says which containment and egress levels this node gets with its settings, why,
and what would raise each — at the levels this machine gives: as root (the kernel level, where nftables is
installed), as root with ``task.egress: proxy``, and as an unprivileged user (the pyz with the system's
python3). The levels it names are the ones the agent's start then opens; a named level the node cannot have
fails the check as it fails the start; and the check leaves nothing behind (no cgroup, no nft table), also
when a probe fails.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from harness import check_leftovers, config_check, unprivileged_config_check

from ckagent.containment import (
    ContainmentError,
    ContainmentLevel,
    judge_containment,
    open_containment,
)
from ckagent.containment.base import throwaway_cgroup
from ckagent.containment.egress import EgressError, EgressLevel, judge_egress, open_egress, parse_text
from ckagent.containment.egress.nft import Nft, NftError, open_nft
from ckagent.containment.hierarchy import agent_group_name, own_dirs
from ckagent.node.levels import Blocker

DEFAULT_POLICY = parse_text("metadata,link-local,agent", "")

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the kernel levels of this machine need root")


def _head(run: Any, concern: str) -> str:
    """The level a check's head line names (``egress: proxy (task.egress: auto)`` → ``proxy``)."""
    match = re.match(rf"{concern}: (\S+) \(", run.section(concern)[0])
    assert match, run.section(concern)
    return match.group(1)


@pytest.fixture(autouse=True)
def _nothing_left_behind() -> Any:
    before = check_leftovers()
    yield
    assert check_leftovers() == before, "a level check left a cgroup or an nft table behind"


@root_only
def test_as_root_the_check_names_the_levels_the_agent_then_gets(tmp_path: Path) -> None:
    run = config_check(tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "config OK: (no file: defaults + environment)"
    work = tmp_path / "work"
    work.mkdir()
    containment = open_containment("auto", work)
    try:
        egress = open_egress("auto", containment, agent_group_name(work), DEFAULT_POLICY, work_dir=work)
        egress.close()
    finally:
        containment.close()
    assert _head(run, "containment") == containment.level.value
    assert _head(run, "egress") == egress.level.value
    assert f"  guarantees: {containment.level.guarantees}" in run.section("containment")
    for unavailable in containment.passed_over:  # what the start passed over, the check explains
        assert any(line.startswith(f"  not {unavailable.level}: ") for line in run.section("containment"))
    if egress.level is EgressLevel.NFTABLES:
        assert not [line for line in run.section("egress") if line.startswith("  not ")]
        assert "the probe was refused by the kernel" in run.text("egress")
    assert "uid 0" in run.stdout


@root_only
def test_with_the_proxy_forced_the_check_says_what_the_kernel_level_needs(tmp_path: Path) -> None:
    run = config_check(tmp_path, AGENT_TASK_EGRESS="proxy")
    assert run.returncode == 0, run.stderr
    egress = run.text("egress")
    assert run.section("egress")[0] == "egress: proxy (task.egress: proxy)"
    assert f"  guarantees: {EgressLevel.PROXY.guarantees}" in egress and "advisory" in egress
    judged = judge_egress("auto", judge_containment("auto"), DEFAULT_POLICY)
    if judged.level is EgressLevel.NFTABLES:  # the kernel could: only the setting stands in the way
        assert "  not nftables: task.egress is proxy\n    to get it: set it to auto" in egress
    else:
        for unavailable in judged.passed_over:
            assert f"  not nftables: {unavailable.message}\n    to get it: {unavailable.blocker.remedy}" in egress


def test_a_named_level_the_node_cannot_have_fails_the_check_as_it_fails_the_start(tmp_path: Path) -> None:
    settings = {"AGENT_TASK_CONTAINMENT": "process-group", "AGENT_TASK_EGRESS": "nftables"}
    run = config_check(tmp_path, **settings)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert ("error: task.egress=nftables is not available here: the tasks have no cgroup in a cgroup v2 tree "
            "(containment process-group)") in run.stderr
    assert f"to get it: {Blocker.NO_TASK_CGROUP.remedy}" in run.stderr
    assert "config OK" not in run.stdout
    groups = open_containment("process-group", tmp_path)
    try:
        with pytest.raises(EgressError, match=r"task\.egress=nftables is not available here") as refused:
            open_egress("nftables", groups, agent_group_name(tmp_path), DEFAULT_POLICY)
    finally:
        groups.close()
    assert refused.value.blocker is Blocker.NO_TASK_CGROUP
    missing = [level for level in ContainmentLevel if level.has_cgroup and _cannot(level)]
    for level in missing[:1]:
        run = config_check(tmp_path, AGENT_TASK_CONTAINMENT=level.value)
        assert run.returncode == 2 and f"error: task.containment={level} is not available here" in run.stderr
        assert "egress: not judged" in run.stdout


def _cannot(level: ContainmentLevel) -> bool:
    try:
        judge_containment(level)
    except ContainmentError:
        return True
    return False


@pytest.mark.slow  # the session's pyz (built once, a minute) and its first extraction as that user
def test_as_an_unprivileged_user_the_check_says_what_root_delegation_and_net_admin_would_give(pyz: Path) -> None:
    with unprivileged_config_check(pyz) as run_as_user:
        run = run_as_user()
        assert run.returncode == 0, run.stderr
        containment, egress = run.text("containment"), run.text("egress")
        assert run.section("containment")[0] == "containment: process-group (task.containment: auto)"
        assert "  here: process groups + marker sweep; no limits, no resource figures" in containment
        if own_dirs():  # every cgroup level this host mounts is refused for want of rights, and says so
            assert re.search(r"  not cgroup-v[12]: .*Permission denied", containment), containment
            assert f"    to get it: {Blocker.CGROUP_NOT_WRITABLE.remedy}" in containment
            assert "Delegate=yes" in containment and "root" in containment
        assert run.section("egress")[0] == "egress: proxy (task.egress: auto)"
        assert "  not nftables: the tasks have no cgroup in a cgroup v2 tree (containment process-group)" in egress
        try:
            open_nft()
        except NftError:
            assert f"    to get it: {Blocker.NO_NFTABLES.remedy}" in egress
        else:  # nftables is installed: the rights are what is missing
            assert re.search(r"  not nftables: this process \(uid 65534\) has no CAP_NET_ADMIN",
                             egress), egress
            assert f"    to get it: {Blocker.NO_NET_ADMIN.remedy}" in egress
        assert "uid 65534" in run.stdout and run.stdout.splitlines()[-1].startswith("config OK")

        forced = run_as_user(AGENT_TASK_EGRESS="nftables")
        assert forced.returncode == 2, forced.stdout
        assert "error: task.egress=nftables is not available here: the tasks have no cgroup" in forced.stderr
        assert Blocker.NO_TASK_CGROUP.remedy in forced.stderr
        assert "also: " in forced.stderr  # every condition that is not met, each with what meets it


class _RefusingProbe(Nft):
    """The real nftables, refusing the probe's rules (what a kernel without the match could do)."""

    kind = "nft (refusing the probe)"

    def __init__(self, real: Nft) -> None:
        self.real = real

    def run(self, commands: str) -> None:
        if "egress-probe" in commands:
            raise NftError("Error: Could not process rule: No such file or directory (refused by the test)")
        self.real.run(commands)

    def run_json(self, command: str) -> Any:
        return self.real.run_json(command)


@root_only
def test_the_probes_remove_what_they_made_also_when_they_fail(tmp_path: Path) -> None:
    own = own_dirs()
    if "unified" not in own:
        pytest.skip("no cgroup v2 tree here")
    with pytest.raises(RuntimeError), throwaway_cgroup(own["unified"]) as made:
        assert made.is_dir()
        raise RuntimeError("the check failed")
    assert not made.exists()
    try:
        real = open_nft()
    except NftError:
        pytest.skip("nftables is not installed here")
    containment = judge_containment("auto")
    if containment.v2_base is None:
        pytest.skip("the tasks would have no cgroup in the v2 tree here")
    judged = judge_egress("auto", containment, DEFAULT_POLICY, nft=_RefusingProbe(real))
    assert judged.level is EgressLevel.PROXY
    assert [(u.level, u.blocker) for u in judged.passed_over] == [(EgressLevel.NFTABLES, Blocker.FAILED)]
    assert "the probe's rules were refused" in judged.passed_over[0].message
    # (the autouse fixture checks that neither the probe's cgroups nor the check's table are left)
