"""The SDKs' state API through a real agent and the reference master (a smoke test of the two sides of the
control channel together; the acceptance tests of issue 38 are tests/test_resume_*.py).

A spider saves items 0..total-1 with the SDK, its position its persisted state (on_persist / onPersist);
its first attempt fails once the agent has asked it to persist twice. The task's retry policy runs it
again on the same node, from the newest shipped checkpoint: load_state gives the position, the master
holds every item exactly once.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import trio
from harness import NODE_SDK, RecordingMaster, agent_settings, no_strays, running_agent, spider_zip  # noqa: F401

PYTHON_SPIDER = """
import sys, time
import crawlerkeeper_sdk as ck

context = ck.task_context()
total, pace = context.params["total"], context.params["pace"]
state = ck.load_state({"n": 0})
asked = []

def persist():
    asked.append(state["n"])
    return state

ck.on_persist(persist)
print(f"START {state['n']} {context.attempt}", flush=True)
while state["n"] < total:
    if context.attempt == 1 and len(asked) >= 2 and state["n"] >= total // 3:
        time.sleep(1.5)  # the agent ships the answered checkpoint while the spider lingers
        print("FAILING on purpose", flush=True)
        sys.exit(3)
    with ck.state_lock():
        ck.save_item({"n": state["n"]})
        state["n"] += 1
    time.sleep(pace)
"""

NODE_SPIDER = """
const ck = require("./crawlerkeeper-sdk.cjs");
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const context = ck.taskContext();
const { total, pace } = context.params;
const state = ck.loadState({ n: 0 });
let asked = 0;
ck.onPersist(() => { asked += 1; return state; });
(async () => {
  console.log(`START ${state.n} ${context.attempt}`);
  while (state.n < total) {
    if (context.attempt === 1 && asked >= 2 && state.n >= Math.floor(total / 3)) {
      await sleep(1500);
      console.log("FAILING on purpose");
      process.exit(3);
    }
    ck.saveItem({ n: state.n });
    state.n += 1;
    await sleep(pace * 1000);
  }
})();
"""


def _package(language: str) -> tuple[str, dict[str, str | bytes]]:
    if language == "python":
        return "python", {"main.py": PYTHON_SPIDER}
    manifest = '{"name": "resume-smoke", "version": "1.0.0", "private": true, "main": "index.js"}\n'
    lock = ('{"name": "resume-smoke", "version": "1.0.0", "lockfileVersion": 3, "requires": true, '
            '"packages": {"": {"name": "resume-smoke", "version": "1.0.0"}}}\n')
    return "node", {"index.js": NODE_SPIDER, "package.json": manifest, "package-lock.json": lock,
                    "crawlerkeeper-sdk.cjs": NODE_SDK.read_bytes()}


@pytest.mark.slow  # a real agent, two attempts of a few seconds each
@pytest.mark.parametrize("language", ["python", "node"])
async def test_an_sdk_spider_resumes_from_its_checkpoint_with_every_item_once(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, language: str
) -> None:
    if language == "node" and (shutil.which("node") is None or shutil.which("npm") is None):
        pytest.skip("node/npm are not installed")
    admin = recording_master.admin
    framework, files = _package(language)
    spider_id = await admin.create_spider(name=f"resume-{language}", framework=framework)
    await admin.upload_package(spider_id, spider_zip(files))
    settings = agent_settings(tmp_path / "node", recording_master.base_url, recording_master.registration_token)
    total = 60
    async with running_agent(nursery, settings):
        task_id = str(await admin.create_task(
            spider_id, params={"total": total, "pace": 0.05}, checkpoint_interval_seconds=0.5,
            retry={"maxAttempts": 2, "on": ["spider"], "backoffSeconds": 0}))
        final = await admin.wait_task_final(task_id, 180)
        logs: list[Any] = await admin.get_logs(task_id)
        task = await admin.get_task(task_id)
    assert final["status"] == "SUCCESS", (final, logs)
    starts = [line.split() for line in logs if line.startswith("START ")]
    assert [s[2] for s in starts] == ["1", "2"] and starts[0][1] == "0", logs
    resumed_at = int(starts[1][1])
    assert 0 < resumed_at < total, starts  # attempt 2 began where a checkpoint of attempt 1 stood
    assert any("attempt 2: resuming from checkpoint 1-" in line for line in logs), logs
    assert [a.get("attempt") for a in task.get("attempts", [])][:2] == [1, 2], task
    assert [item["n"] for item in await admin.get_items(task_id)] == list(range(total))
