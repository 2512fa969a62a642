"""`ckagent config check` explains the identity level (whom spiders run as: ckagent.node.identity) as it
explains containment and egress: the level the agent's start would give with these settings, what it
guarantees, what it is here, why each stronger level is not had and what would give it; a
``task.run_as_user`` the start would refuse fails the check. Judged without recording anything: no state
store, no uid held.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness import config_check, spider_python, spider_reachable

from ckagent.containment.levelcheck import explain
from ckagent.node.configvalues import UidRange
from ckagent.node.identity import judge_identities
from ckagent.node.levels import Blocker, IdentityLevel

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="spiders get uids of their own only from a root agent")


@root_only
def test_as_root_with_a_reachable_work_dir_the_check_names_spider_uids(tmp_path: Path) -> None:
    spider_reachable(tmp_path)
    run = config_check(tmp_path, AGENT_DEPS_PYTHON=spider_python())
    assert run.returncode == 0, run.stderr
    identity = run.section("identity")
    assert identity[0] == "identity: spider-uids (task.run_as_user: unset)"
    assert identity[1] == f"  guarantees: {IdentityLevel.SPIDER_UIDS.guarantees}"
    assert identity[2].startswith("  here: each spider its own uid and gid from task.spider_uids 61184-65519")
    assert not [line for line in identity if line.startswith("  not ")]
    assert not (tmp_path / "work" / "state.db").exists()  # nothing recorded: no uid held


@root_only
def test_a_work_dir_spiders_cannot_reach_is_named_with_what_to_change(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)  # root's alone: no spider's uid can pass through it
    spider_reachable(tmp_path)
    closed.chmod(0o700)
    run = config_check(closed, AGENT_DEPS_PYTHON=spider_python())
    assert run.returncode == 0, run.stderr  # the agent would start (spiders as root), and says so
    identity = run.text("identity")
    assert run.section("identity")[0] == "identity: root (task.run_as_user: unset)"
    assert "  not spider-uids: a spider's uid (" in identity and f"cannot reach {closed}/." in identity
    assert f"    to get it: {Blocker.UNREACHABLE.remedy}" in identity


@root_only
def test_one_user_named_says_the_setting_stands_in_the_way(tmp_path: Path) -> None:
    spider_reachable(tmp_path)
    run = config_check(tmp_path, AGENT_DEPS_PYTHON=spider_python(), AGENT_TASK_RUN_AS_USER="nobody")
    assert run.returncode == 0, run.stderr
    assert run.section("identity")[:3] == [
        "identity: one-user (task.run_as_user: nobody)", f"  guarantees: {IdentityLevel.ONE_USER.guarantees}",
        "  here: every spider as nobody (uid 65534, gid 65534)"]
    assert run.section("identity")[3:] == ["  not spider-uids: task.run_as_user is nobody",
                                           f"    to get it: {Blocker.RUN_AS_USER.remedy}"]


def test_an_unknown_run_as_user_fails_the_check_as_it_fails_the_start(tmp_path: Path) -> None:
    run = config_check(tmp_path, AGENT_TASK_RUN_AS_USER="no-such-user-ck35")
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert run.section("identity")[0].startswith("identity: none (task.run_as_user: no-such-user-ck35): ")
    assert ("error: task.run_as_user (AGENT_TASK_RUN_AS_USER): no user 'no-such-user-ck35' on this node; create "
            "the user or unset the setting") in run.stderr
    assert "config OK" not in run.stdout


def test_a_non_root_agent_is_told_what_root_would_give(tmp_path: Path) -> None:
    """Judged for an agent that is not root (``euid``): agent-user, and why not spider-uids."""
    judged = judge_identities(None, UidRange(3_210_002_000, 3_210_002_009), tmp_path / "work",
                              python=spider_python(), sdk_dir=None, euid=4321)
    lines = explain(judged, "task.run_as_user", "unset", concern="identity")
    assert lines[0] == "identity: agent-user (task.run_as_user: unset)"
    assert lines[1] == f"  guarantees: {IdentityLevel.AGENT_USER.guarantees}"
    assert lines[3:] == ["  not spider-uids: the agent runs as uid 4321, not root",
                         f"    to get it: {Blocker.NOT_ROOT.remedy}"]
