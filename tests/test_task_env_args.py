"""A task's arguments and env, as the docs promise: arguments shown in the running line with the
secret-named argument values masked, like env values, and ``HOME``/``PATH``/``CK_*`` set by the agent only (a task that tries
to override one is FAILED/BAD_TASK naming the variable)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import agent_settings, running_agent, submit

from ckagent.delivery.lines import secret_args, secret_values
from ckagent.master.protocol import ProtocolError, Task

PRINT_ARGS = "import sys\nprint('args:', ' '.join(sys.argv[1:]))\n"


def task_json(**extra: Any) -> dict[str, Any]:
    return {"id": "t1", "spiderId": "s1", "framework": "python", **extra}


@pytest.mark.parametrize("name", ["HOME", "PATH", "CK_ITEMS_FILE", "CK_TASK_DIR", "CK_ANYTHING"])
def test_a_task_env_naming_an_agent_variable_is_refused_naming_it(name: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        Task.from_json(task_json(env={"OK": "1", name: "/tmp/x"}))
    assert caught.value.field == f"env.{name}" or caught.value.field.endswith(f"env.{name}")
    assert name in str(caught.value) and "set by the agent" in str(caught.value)
    assert "/tmp/x" not in str(caught.value)


def test_other_env_names_pass() -> None:
    assert Task.from_json(task_json(env={"HOMEPAGE": "x", "MY_PATH": "y", "XCK_Z": "z"})).env["MY_PATH"] == "y"


def test_secret_named_argument_values_are_found() -> None:
    args = ["--db-password", "hunter2", "--api-key=k3y", "-a", "token=t0k", "--verbose", "plain", "--last-secret"]
    assert secret_args(args) == ["hunter2", "k3y", "t0k"]
    assert set(secret_values({}, (), args)) == {"hunter2", "k3y", "t0k"}


async def test_arguments_are_shown_and_secret_ones_are_masked(dev_master: Any, nursery: trio.Nursery,
                                                                      tmp_path: Path) -> None:
    admin = dev_master.admin
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    async with running_agent(nursery, settings) as agent:
        if os.geteuid() == 0:  # no task.run_as_user here: each spider a uid of its own, nothing runs as root
            assert not any("spiders run as root" in text for text in agent.notices.texts())
            async with httpx.AsyncClient(timeout=10) as client:
                status = (await client.get(f"http://127.0.0.1:{agent.status_port}/status")).json()
                page = (await client.get(f"http://127.0.0.1:{agent.status_port}/")).text
            assert not any("spiders run as root" in w for w in status["warnings"]) and "spiders run as root" not in page
            nodes = await admin.list_nodes()
            user = nodes[0]["containment"]["spiderUser"]
            assert (user["level"], user["root"], user["uid"], user["name"]) == ("spider-uids", False, None, "ck-<uid>")
        ok = await submit(admin, "argy", {"main.py": PRINT_ARGS}, args=["--db-password", "hunter2", "visible-word"])
        bad = await submit(admin, "homey", {"main.py": PRINT_ARGS}, env={"HOME": "/root"})
        done = await admin.wait_task_final(ok, 180)
        refused = await admin.wait_task_final(bad, 60)
    assert done["status"] == "SUCCESS", done
    text = "\n".join(await admin.get_logs(ok))
    assert "hunter2" not in text
    running = [line for line in text.splitlines() if "] running " in line]
    assert running and running[0].split("] running ", 1)[1].startswith(
        "python main.py --db-password '***' visible-word (timeout"), running
    assert "args: --db-password *** visible-word" in text  # the spider's own output: only the secret masked
    assert refused["status"] == "FAILED" and refused["errorCode"] == "BAD_TASK", refused
    assert "HOME" in refused["errorMessage"]
