"""``ckagent stop --migrate`` where the agent runs as a user without root (the ``agent-user`` level, the
pyz on the system's python3, as a developer or a pod runs it): that user finds its agent by the work
dir's lock (/proc/locks shows it to any user) and migrates its running task."""

from __future__ import annotations

import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    SystemUser,
    no_strays,
    submit,
    unprivileged_user,
    user_agent_process,
    wait_exit,
    wait_for_log,
    wait_registered,
)
from harness.demo import demo_environ
from harness.stopping import moved_on
from harness.useragent import SYSTEM_PYTHON

LONG = textwrap.dedent("""
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("started", flush=True)
    time.sleep(600)
""")

pytestmark = pytest.mark.slow


@pytest.fixture
def agent_user() -> Iterator[SystemUser]:
    """The user the agent runs as: a throwaway system user as root (conftest.py's SERIAL_GROUPS
    "system-users"), the suite's own user otherwise."""
    with unprivileged_user("ckagentu") as user:
        yield user


async def test_a_plain_user_migrates_its_own_agent(dev_master, agent_user: SystemUser, pyz: Path) -> None:
    admin = dev_master.admin
    migrate = 5.0
    agent = await trio.to_thread.run_sync(lambda: user_agent_process(
        agent_user, pyz, dev_master.base_url, dev_master.registration_token, task__migrate_timeout=migrate,
        task__kill_grace=30))
    await agent.start()
    async with agent:
        with trio.fail_after(120):
            await wait_registered(admin, agent)
            task_id = await submit(admin, "long", {"main.py": LONG})
            await wait_for_log(admin, task_id, "started", timeout=60)
            started = time.monotonic()
            done = await trio.run_process(
                [str(SYSTEM_PYTHON), str(agent.pyz), "stop", "--migrate", "-c", str(agent.config_path)],
                capture_stdout=True, capture_stderr=True, check=False, stdin=subprocess.DEVNULL,
                env=agent_user.environ(demo_environ(PATH=f"{agent.tools}:/usr/bin:/bin")),
                **agent_user.popen_options())  # type: ignore[arg-type]
            seconds = time.monotonic() - started
            said = done.stderr.decode(errors="replace")
            assert done.returncode == 0, said + agent.log_text()[-3000:]
            assert await wait_exit(agent, 5) == 0
    assert seconds < migrate + 8, seconds
    first = moved_on(await admin.get_task(task_id))
    assert (first["status"], first["errorCode"]) == ("FAILED", "MIGRATED"), first
    assert "identity: agent-user" in agent.log_text()
