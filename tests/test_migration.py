"""A node an older agent made, started by this one (ckagent.task.migration): the spiders' data and home
dirs an older agent left (root's, or the one ``--spider-user``'s) are given to each spider's own uid at
start, once, in one log line, with every byte kept and no link followed; the environments it built are
removed, not re-owned; its finished task dirs are left as they are; and a task the older agent left
running is re-adopted untouched (its dirs stay whose they were until it ends), while the spider's next
task runs under its own uid with its data.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    NOBODY_UID,
    RecordingMaster,
    agent_process,
    agent_settings,
    eventually,
    no_strays,
    running_agent,
    spider_zip,
    wait_exit,
    wait_for_log,
    wait_registered,
)

from ckagent.code.envstore import MARKER
from ckagent.master.ids import task_dir

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to spiders' uids needs a root agent")


def _tree_owners(top: Path) -> set[int]:
    """The uids owning ``top`` and every entry below it (links themselves, not followed)."""
    owners = {top.lstat().st_uid}
    for path in top.rglob("*"):
        owners.add(path.lstat().st_uid)
    return owners


def _older_node(work: Path, outside: Path) -> dict[str, bytes]:
    """``work`` as an older agent leaves it: spider-a's dirs root's (with a link and a hard link to a
    file outside its tree), spider-b's those of the one user spiders ran as (nobody), a dir of a spider
    id nobody can tell, an environment built before the builder (no ``sealed``), a finished task's dir.
    Returns spider-a's and spider-b's files (relative to the work dir) → their bytes."""
    files = {"spider-data/spider-a/items.db": b"a's data", "spider-data/spider-a/deep/er/page.html": b"<p>kept",
             "spider-home/spider-a/.cache/tool/c.bin": bytes(range(256)),
             "spider-data/spider-b/state.json": b'{"cursor": 42}'}
    for rel, data in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(data)
    (work / "spider-data/spider-a/to-outside").symlink_to(outside)
    os.link(outside, work / "spider-data/spider-a/hard-outside")
    for path in [work / "spider-data/spider-b", *(work / "spider-data/spider-b").rglob("*")]:
        os.lchown(path, NOBODY_UID, NOBODY_UID)
    (work / "spider-data/_lost-0123456789").mkdir()
    (work / "spider-data/spider-c").symlink_to(outside.parent / "agent-dir")  # a planted link: never entered
    old_env = work / "envs" / "py-0123456789abcdef"
    (old_env / "bin").mkdir(parents=True)
    (old_env / "bin" / "python").write_text("#!/bin/sh\n")
    (old_env / MARKER).write_text(json.dumps({"key": "0123456789abcdef", "kind": "py"}))
    old_task = work / "tasks" / "old-task"
    old_task.mkdir(parents=True)
    (old_task / "output.log").write_text("an old task's log\n")
    for path in (old_task, old_task / "output.log"):
        os.chown(path, NOBODY_UID, NOBODY_UID)
    return files


async def test_an_older_agents_node_is_migrated_at_start_once_losing_nothing(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    work = tmp_path / "node"
    settings = agent_settings(work, recording_master.base_url, recording_master.registration_token)
    outside = tmp_path / "agent-secret"  # a file of the agent's, outside the spiders' trees
    outside.write_text("the agent's")
    outside.chmod(0o600)
    (tmp_path / "agent-dir").mkdir()
    (tmp_path / "agent-dir" / "key").write_text("the agent's")
    files = await trio.to_thread.run_sync(_older_node, work, outside)
    with trio.fail_after(60), caplog.at_level(logging.INFO):
        async with running_agent(nursery, settings) as agent:
            identities = agent.identities
            assert identities is not None and str(identities.level) == "spider-uids"
            held = identities.held()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("migration: ")]
    assert len(said) == 1, said  # one line for the spiders' dirs
    a_uid, b_uid = held["spider-a"], held["spider-b"]
    assert said[0].startswith("migration: the data and home dirs of 2 spider(s) an earlier agent left are given to "
                              "each spider's own uid (")
    assert f"spider-a (uid {a_uid}; was 0)" in said[0] and f"spider-b (uid {b_uid}; was {NOBODY_UID})" in said[0]
    assert "1 hard-linked file(s) copied" in said[0]
    assert "left for their next task: _lost-0123456789 (spider id unknown)" in said[0]
    for rel, data in files.items():
        assert (work / rel).read_bytes() == data, rel  # every byte kept
    assert _tree_owners(work / "spider-data/spider-a") == _tree_owners(work / "spider-home/spider-a") == {a_uid}
    assert _tree_owners(work / "spider-data/spider-b") == {b_uid}
    assert (outside.stat().st_uid, outside.read_text()) == (0, "the agent's")  # the link was not followed
    hard = work / "spider-data/spider-a/hard-outside"
    assert (hard.read_text(), hard.stat().st_ino != outside.stat().st_ino) == ("the agent's", True)  # its own copy
    assert _tree_owners(work / "spider-data/_lost-0123456789") == {0}  # left for its spider's next task
    assert _tree_owners(tmp_path / "agent-dir") == {0} and "spider-c" not in held  # the link led nowhere
    assert not (work / "envs" / "py-0123456789abcdef").exists()  # removed, not re-owned: rebuilt when needed
    assert any(r.getMessage().startswith("removed 1 environment(s) an older agent built and spiders could write")
               for r in caplog.records)
    assert _tree_owners(work / "tasks" / "old-task") == {NOBODY_UID}  # the agent's spool: left as it was
    caplog.clear()
    with trio.fail_after(60), caplog.at_level(logging.INFO):
        async with running_agent(nursery, settings) as agent:  # the next start: nothing more to give
            assert agent.identities is not None and agent.identities.held() == held
    again = [r.getMessage() for r in caplog.records if r.getMessage().startswith("migration: ")]
    assert again == ["migration: the dirs of 1 spider(s) are left for their next task: _lost-0123456789 "
                     "(spider id unknown)"], again


KEEPER = """
import json, os, sys, time
data = os.path.join(os.environ["CK_DATA_DIR"], "notes.txt")
first = json.loads(os.environ["CK_PARAMS"]).get("first")
if first:
    with open(data, "w") as fh:
        fh.write("before the upgrade\\n")
    print("ready", flush=True)
    go = os.path.join(os.environ["CK_TASK_DIR"], "go")
    for _ in range(1200):  # at most a minute: the test creates "go" in the task dir
        if os.path.exists(go):
            break
        time.sleep(0.05)
    with open(data, "a") as fh:
        fh.write("after the upgrade\\n")
print("WHO " + json.dumps({"uid": os.getuid(), "notes": open(data).read(),
                           "owner": os.stat(os.environ["CK_DATA_DIR"]).st_uid}), flush=True)
"""


async def _who(admin: Any, task_id: str) -> dict[str, Any]:
    [line] = [line for line in await admin.get_logs(task_id) if line.startswith("WHO ")]
    found: dict[str, Any] = json.loads(line[4:])
    return found


async def test_a_task_the_one_user_node_left_running_is_re_adopted_untouched(
    recording_master: RecordingMaster, tmp_path: Path
) -> None:
    """``run.sh --spider-user=nobody`` as nodes ran until now, then an upgrade (the hand-over signal) to an
    agent at the default level: real agent processes."""
    admin = recording_master.admin
    work = tmp_path / "node" / "data"
    spider_id = str(await admin.create_spider(name="keeper", framework="python"))
    await admin.upload_package(spider_id, spider_zip({"main.py": KEEPER}))
    older = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token,
                          task__run_as_user="nobody")
    with trio.fail_after(240):
        await older.start()
        async with older:
            await wait_registered(admin, older)
            task_id = str(await admin.create_task(spider_id, params={"first": True}))
            output = task_dir(work, task_id) / "output.log"

            async def ready() -> bool:
                return output.exists() and "ready" in await trio.Path(output).read_text()

            await eventually(ready, 60, "the spider started")
            older.signal(signal.SIGUSR2)  # an upgrade: the task runs on
            assert await wait_exit(older, 15) == 0
        data = work / "spider-data" / spider_id
        assert data.stat().st_uid == NOBODY_UID
        newer = agent_process(tmp_path, recording_master.base_url, recording_master.registration_token)
        await newer.start()
        async with newer:
            await wait_for_log(admin, task_id, "re-adopted", 60)
            assert "identity: spider-uids" in newer.log_text()
            assert (f"migration: the dirs of 1 spider(s) are left for their next task: {spider_id} "
                    "(a re-adopted task runs)") in newer.log_text()
            assert data.stat().st_uid == NOBODY_UID  # untouched under the running task
            (task_dir(work, task_id) / "go").touch()
            final = await admin.wait_task_final(task_id, 60)
            assert final["status"] == "SUCCESS", (final, await admin.get_logs(task_id))
            next_id = str(await admin.create_task(spider_id, params={}))
            final = await admin.wait_task_final(next_id, 120)
            assert final["status"] == "SUCCESS", (final, await admin.get_logs(next_id))
            newer.signal(signal.SIGTERM)
            assert await wait_exit(newer, 30) == 0
    adopted, mine = await _who(admin, task_id), await _who(admin, next_id)
    assert adopted["uid"] == NOBODY_UID  # the re-adopted task kept the identity it was started as
    assert 61184 <= mine["uid"] <= 65519 and mine["owner"] == mine["uid"]  # the next: its own uid, its dirs
    assert mine["notes"] == "before the upgrade\nafter the upgrade\n"  # every byte of its data
