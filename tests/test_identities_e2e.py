"""Who a real spider runs as, under a real agent and the dev master, at each identity level this machine
gives (ckagent.node.identity): read from ``/proc/<pid>/status`` of the running spider, not from what the
agent says.

- spider-uids (root, the default): two spiders get two uids of the range, no passwd entry; a spider keeps
  its uid for its next task and after an agent restart; HOME/USER/LOGNAME come from the task;
- root (``task.run_as_user: root``): spiders run as root, and the agent says so.
"""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    RecordingMaster,
    agent_settings,
    eventually,
    no_strays,
    process_ids,
    running_agent,
    spider_zip,
)

from ckagent.master.ids import task_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="spiders run under other uids only for a root agent")

SPIDER = """
import getpass, json, os, time
task_dir = os.environ["CK_TASK_DIR"]
with open(os.path.join(task_dir, "mine.txt"), "w") as fh:
    fh.write("written by the spider")
print("INFO " + json.dumps({"pid": os.getpid(), "home": os.environ["HOME"], "user": os.environ.get("USER"),
                            "logname": os.environ.get("LOGNAME"), "getuser": getpass.getuser()}), flush=True)
wait = json.loads(os.environ["CK_PARAMS"]).get("wait")
for _ in range(1200 if wait else 0):  # at most a minute: the test creates "go" in the task dir
    if os.path.exists(os.path.join(task_dir, "go")):
        break
    time.sleep(0.05)
"""


async def _info(work: Path, task_id: str) -> dict[str, Any]:
    """What the spider said of itself (its INFO line in output.log), once it said it."""
    log = task_dir(work, task_id) / "output.log"

    async def said() -> dict[str, Any] | None:
        text = await trio.to_thread.run_sync(lambda: log.read_text(errors="replace") if log.exists() else "")
        lines = [line for line in text.splitlines() if line.startswith("INFO ")]
        return json.loads(lines[0][5:]) if lines else None

    found: dict[str, Any] = await eventually(said, 120, f"task {task_id} started")
    return found


async def _spider(admin: Any, name: str) -> str:
    spider_id = await admin.create_spider(name=name, framework="python")
    await admin.upload_package(spider_id, spider_zip({"main.py": SPIDER}))
    return str(spider_id)


async def _run(admin: Any, work: Path, spider_id: str) -> dict[str, Any]:
    """One task of the spider to its end; what it said of itself, and who owns what it wrote."""
    task_id = str(await admin.create_task(spider_id, params={"wait": False}))
    info = await _info(work, task_id)
    final = await admin.wait_task_final(task_id, 120)
    assert final["status"] == "SUCCESS", (final, await admin.get_logs(task_id))
    info["owner"] = (task_dir(work, task_id) / "mine.txt").stat().st_uid
    return info


async def test_each_spider_runs_under_a_uid_of_its_own_kept_across_tasks_and_restarts(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    admin = recording_master.admin
    work = tmp_path / "node"
    settings = agent_settings(work, recording_master.base_url, recording_master.registration_token)
    first, second = await _spider(admin, "tenant-a"), await _spider(admin, "tenant-b")
    async with running_agent(nursery, settings) as agent:
        assert agent.identities is not None and str(agent.identities.level) == "spider-uids", agent.identities
        low, high = settings.task.spider_uids.first, settings.task.spider_uids.last
        a_task = str(await admin.create_task(first, params={"wait": True}))
        b_task = str(await admin.create_task(second, params={"wait": True}))
        a, b = await _info(work, a_task), await _info(work, b_task)
        (a_uid, a_gid, a_groups), (b_uid, _b_gid, _) = process_ids(a["pid"]), process_ids(b["pid"])
        assert low <= a_uid <= high and low <= b_uid <= high and a_uid != b_uid, (a_uid, b_uid)
        assert (a_gid, a_groups) == (a_uid, ()), "its gid is the same number; no supplementary group (root's dropped)"
        for uid in (a_uid, b_uid):
            with pytest.raises(KeyError):
                pwd.getpwuid(uid)  # no passwd entry
        assert a["home"] == str(work / "spider-home" / first)
        assert a["user"] == a["logname"] == a["getuser"] == f"ck-{a_uid}"
        assert agent.identities.held() == {first: a_uid, second: b_uid}
        for task_id in (a_task, b_task):
            (task_dir(work, task_id) / "go").touch()
            final = await admin.wait_task_final(task_id, 120)
            assert final["status"] == "SUCCESS", (final, await admin.get_logs(task_id))
        assert (task_dir(work, a_task) / "mine.txt").stat().st_uid == a_uid
        again = await _run(admin, work, first)  # the spider's next task: the same uid
        assert again["owner"] == a_uid and again["user"] == f"ck-{a_uid}"
    async with running_agent(nursery, settings) as agent:  # an agent restart on the same work dir
        after_b, after_a = await _run(admin, work, second), await _run(admin, work, first)
        assert (after_a["owner"], after_b["owner"]) == (a_uid, b_uid)


async def test_root_named_runs_spiders_as_root_and_says_so(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    admin = recording_master.admin
    work = tmp_path / "node"
    settings = agent_settings(work, recording_master.base_url, recording_master.registration_token,
                              AGENT_TASK_RUN_AS_USER="root")
    spider_id = await _spider(admin, "as-root")
    async with running_agent(nursery, settings) as agent:
        assert agent.identities is not None and str(agent.identities.level) == "root"
        assert any(text.startswith("spiders run as root: task.run_as_user is root") for text in agent.notices.texts())
        task_id = str(await admin.create_task(spider_id, params={"wait": True}))
        info = await _info(work, task_id)
        assert process_ids(info["pid"])[0] == 0
        (task_dir(work, task_id) / "go").touch()
        assert (await admin.wait_task_final(task_id, 120))["status"] == "SUCCESS"
        [node] = await admin.list_nodes()
        user = node["containment"]["spiderUser"]
        assert (user["level"], user["name"], user["uid"], user["root"]) == ("root", "root", 0, True)
