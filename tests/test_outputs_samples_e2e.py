"""A package that ships a sample of its output: the master gets only what the run wrote.

Real dev master, in-process agent (its default identity level: each spider under a uid of its own
as root), real spider processes. Each package commits ``output.jsonl`` (the author's three sample
items) and declares it in ``outputs.items``. One task appends two items (and waits, so the agent's
once-a-second scan streams them while it runs), one writes the file anew, one times out before
writing anything: the last delivers nothing, and its log says the sample was left alone instead of
a glob "matching no file". The same as a plain user's agent (the ``agent-user`` identity level: a
throwaway user runs the session's ckagent.pyz).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from harness import agent_settings, running_agent, spider_zip, unprivileged_user, user_agent_process
from harness.users import SystemUser

pytestmark = pytest.mark.slow

SAMPLE = "".join(json.dumps({"n": i, "from": "the author's sample"}) + "\n" for i in range(3))
SPIDERS = {
    "appends": 'import json, time\nwith open("output.jsonl", "a") as f:\n'
               '    f.write("".join(json.dumps({"n": 100 + i}) + "\\n" for i in range(2)))\n'
               'time.sleep(2.5)\nprint("appended")\n',
    "rewrites": 'import json\nwith open("output.jsonl", "w") as f:\n'
                '    f.write(json.dumps({"n": 200}) + "\\n")\nprint("rewritten")\n',
    "times-out": 'import time\nprint("crawling slowly", flush=True)\ntime.sleep(60)\n',
}
EXPECTED = {"appends": [{"n": 100}, {"n": 101}], "rewrites": [{"n": 200}], "times-out": []}


async def _submit(admin) -> dict[str, str]:
    tasks: dict[str, str] = {}
    for name, code in SPIDERS.items():
        spider = await admin.create_spider(name=f"sample-{name}", framework="python",
                                           outputs={"items": ["output.jsonl"]})
        await admin.upload_package(spider, spider_zip({"main.py": code, "output.jsonl": SAMPLE}))
        tasks[name] = await admin.create_task(spider, timeout_seconds=3 if name == "times-out" else None)
    return tasks


async def _check(admin, tasks: dict[str, str]) -> None:
    with trio.fail_after(120):
        results = {name: await admin.wait_task_final(task, 120) for name, task in tasks.items()}
    for name, task_id in tasks.items():
        log = await admin.get_logs(task_id)
        text = "\n".join(log)
        want = ("FAILED", "TIMEOUT") if name == "times-out" else ("SUCCESS", None)
        assert (results[name]["status"], results[name].get("errorCode")) == want, (name, results[name], text[-3000:])
        assert await admin.get_items(task_id) == EXPECTED[name], (name, text[-3000:])
        summary = [line for line in log if "outputs: " in line][-1]
        assert "matched no file" not in text, (name, text[-3000:])
        if name == "appends":
            assert "output.jsonl → 2 items (after the package's sample of 120 B)" in summary, summary
            assert "this run appends to it: streaming the items it appends" in text, text[-3000:]  # streamed live
        elif name == "rewrites":
            assert summary.endswith("outputs: output.jsonl → 1 item"), summary
        else:
            assert summary.endswith("outputs: output.jsonl: the package's sample (120 B), not written by this run: "
                                    "left alone"), summary


async def test_a_committed_sample_is_not_delivered_only_what_the_run_wrote(
        dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_MAX_WORKERS="3")
    async with running_agent(nursery, settings):
        tasks = await _submit(dev_master.admin)
        await _check(dev_master.admin, tasks)


@pytest.fixture
def agent_user() -> Iterator[SystemUser]:
    """The user the agent runs as: a throwaway system user as root (conftest.py's SERIAL_GROUPS
    "system-users"), the suite's own user otherwise."""
    with unprivileged_user("ckagentu") as user:
        yield user


async def test_a_plain_users_agent_delivers_only_what_the_run_wrote(
        dev_master, agent_user: SystemUser, pyz: Path) -> None:
    agent = await trio.to_thread.run_sync(lambda: user_agent_process(
        agent_user, pyz, dev_master.base_url, dev_master.registration_token, agent__max_workers=3))
    async with agent:
        await agent.start({"AGENT_REGISTRATION_TOKEN": dev_master.registration_token})
        tasks = await _submit(dev_master.admin)
        try:
            await _check(dev_master.admin, tasks)
        except BaseException:
            print(agent.log_text()[-4000:])
            raise
