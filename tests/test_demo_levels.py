"""The main job at every containment and egress level this machine can give (issue 34): ``ckagent demo``
— its own check: every spider's items against the demo shop — and a many-page Scrapy crawl over
kept-alive connections on the demo's agent (tests/harness/demo.py), once per level:

- as root at the kernel level (``task.egress: nftables`` forced; skipped without root or Debian's
  ``nftables`` package);
- as an unprivileged user (a throwaway one as root; the suite's own user when it is not root), as a
  developer runs it: the system's python3, the session's ckagent.pyz for the dependencies, uv copied
  where the user may run it, uv's cache and Scrapy from PyPI its own — the agent picks what such a user
  gets (process-group containment, the egress proxy);
- as root with ``task.egress: proxy`` forced (the kernel level would be chosen otherwise).

One demo per level: the same master, agent and Scrapy environment serve the demo's spiders and the
crawl. The fast tests of the demo's check are tests/test_demo.py.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from harness import DemoRun, SystemUser, demo_environ, demo_with_crawl, unprivileged_user, user_demo

pytestmark = pytest.mark.slow


ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason=f"the levels root gets need root; this test runs as "
                                                          f"uid {os.geteuid()}")


@pytest.fixture
def demo_user() -> Iterator[SystemUser]:
    """A user without root (tests/harness/users.py): a throwaway one as root (conftest.py's SERIAL_GROUPS
    "system-users"), the suite's own user otherwise."""
    with unprivileged_user("ckdemo") as user:
        yield user


async def _as_root(tmp_path: Path, **settings: str) -> DemoRun:
    return await demo_with_crawl(
        [sys.executable, "-m", "ckagent", "demo", "--keep", "--work-dir", str(tmp_path / "demo")],
        env=demo_environ(**settings), cwd=tmp_path, stderr_path=tmp_path / "demo.stderr")


def _assert_as_promised(run: DemoRun) -> None:
    problems = run.problems()
    assert not problems, "\n\n".join(problems)


@pytest.mark.skipif(shutil.which("nft") is None, reason="the kernel level needs nft (Debian's nftables package)")
@ROOT_ONLY  # (the mark nearest the test is the reason shown when both hold)
async def test_the_demo_and_a_scrapy_crawl_at_the_kernel_level(tmp_path: Path) -> None:
    run = await _as_root(tmp_path, AGENT_TASK_EGRESS="nftables")
    assert run.levels is not None and run.levels[1] == "nftables", run.stdout
    _assert_as_promised(run)


async def test_the_demo_and_a_scrapy_crawl_as_an_unprivileged_user(demo_user: SystemUser, pyz: Path) -> None:
    argv, env, run_dir = await trio.to_thread.run_sync(user_demo, demo_user, pyz)
    run = await demo_with_crawl(argv, env=env, cwd=run_dir, stderr_path=demo_user.reach / "demo.stderr",
                                **demo_user.popen_options())
    # What a user gets here: no cgroup of its own to write (no delegation), no right to change nftables.
    assert run.levels == ("process-group", "proxy"), run.stdout + run.stderr
    _assert_as_promised(run)


@ROOT_ONLY
async def test_the_demo_and_a_scrapy_crawl_as_root_at_the_proxy_level(tmp_path: Path) -> None:
    run = await _as_root(tmp_path, AGENT_TASK_EGRESS="proxy")
    assert run.levels is not None and run.levels[1] == "proxy", run.stdout
    _assert_as_promised(run)
