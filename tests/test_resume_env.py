"""Every task's resume channel in its environment (ckagent.task.taskenv): a real agent, the dev master,
a real spider that reports what it was given — at the strongest containment level here and at the
process-group level.

- ``CK_STATE_DIR``, ``CK_CONTROL_FILE``, ``CK_CONTROL_ACK_FILE``, ``CK_SNAPSHOT_DIR`` name the task dir's
  ``state``, ``control.jsonl``, ``control-ack.jsonl``, ``snapshots``; ``CK_ATTEMPT`` is 1 for a first attempt;
- the state and snapshot dirs and the ack file are the spider's (it writes them as its own uid); the
  control file is the agent's: a spider under a uid of its own reads it and cannot write it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    LEVELS_HERE,
    RecordingMaster,
    agent_settings,
    no_strays,
    running_agent,
    spider_zip,
)

from ckagent.master.ids import task_dir

SPIDER = """
import json, os
info = {k: os.environ.get(k) for k in ("CK_STATE_DIR", "CK_CONTROL_FILE", "CK_CONTROL_ACK_FILE",
                                       "CK_SNAPSHOT_DIR", "CK_ATTEMPT", "CK_TASK_DIR")}
with open(os.path.join(os.environ["CK_STATE_DIR"], "mine.json"), "w") as fh:
    fh.write("{}")
with open(os.environ["CK_CONTROL_ACK_FILE"], "a") as fh:
    fh.write('{"id": 0, "error": "nothing asked"}\\n')
os.mkdir(os.path.join(os.environ["CK_SNAPSHOT_DIR"], "1.tmp"))
info["control"] = open(os.environ["CK_CONTROL_FILE"]).read()
try:
    open(os.environ["CK_CONTROL_FILE"], "a").close()
    info["control_writable"] = True
except PermissionError:
    info["control_writable"] = False
info["uid"] = os.getuid()
print("INFO " + json.dumps(info), flush=True)
"""

LEVELS = sorted({LEVELS_HERE[0], "process-group"})


@pytest.mark.parametrize("level", LEVELS)
async def test_a_task_gets_its_state_dir_and_control_channel(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, level: str
) -> None:
    admin = recording_master.admin
    work = tmp_path / "node"
    settings = agent_settings(work, recording_master.base_url, recording_master.registration_token,
                              AGENT_TASK_CONTAINMENT=level)
    spider_id = await admin.create_spider(name="resume-env", framework="python")
    await admin.upload_package(spider_id, spider_zip({"main.py": SPIDER}))
    async with running_agent(nursery, settings):
        task_id = str(await admin.create_task(spider_id))
        final = await admin.wait_task_final(task_id, 120)
        logs = await admin.get_logs(task_id)
        assert final["status"] == "SUCCESS", (final, logs)
    [line] = [line for line in logs if line.startswith("INFO ")]
    info: dict[str, Any] = json.loads(line[5:])
    tdir = task_dir(work, task_id)
    assert info["CK_TASK_DIR"] == str(tdir)
    assert info["CK_STATE_DIR"] == str(tdir / "state")
    assert info["CK_CONTROL_FILE"] == str(tdir / "control.jsonl")
    assert info["CK_CONTROL_ACK_FILE"] == str(tdir / "control-ack.jsonl")
    assert info["CK_SNAPSHOT_DIR"] == str(tdir / "snapshots")
    assert info["CK_ATTEMPT"] == "1"
    assert info["control"] == ""  # no request in a task that lasted less than an interval
    uid = info["uid"]
    for rel in ("state", "state/mine.json", "snapshots", "snapshots/1.tmp", "control-ack.jsonl"):
        assert (tdir / rel).stat().st_uid == uid, rel
    assert (tdir / "control.jsonl").stat().st_uid == os.geteuid()
    assert info["control_writable"] is (uid == os.geteuid())
