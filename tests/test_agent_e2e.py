"""End to end: the real dev master, an in-process agent, real spider processes (issue 3's "Done when").

Every spider here runs as a real subprocess in a real virtualenv made by uv (content-addressed:
``work_dir/envs/py-<key>``, shared by spiders with the same dependencies). The Scrapy test installs
Scrapy from PyPI (uv's default cache in ~/.cache/uv makes repeated runs fast) and is marked slow.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import agent_settings, assert_default_identity, running_agent, spider_writable, spider_zip, wheel

import ckagent
from ckagent.code.deps import bundled_sdk_dir
from ckagent.devmaster.client import zip_directory
from ckagent.master.protocol import PendingTasks, RegisterRequest, TaskResult, utc_now_iso
from ckagent.task.poller import Poller

EXAMPLES = Path(ckagent.__file__).resolve().parent.parent / "sdk" / "examples"
BUNDLED_SDK = bundled_sdk_dir()
REPO = EXAMPLES.parent.parent
SKUS = [f"SKU-{i:04d}" for i in range(1, 31)]

# A spider that reports what it sees: its argv, interpreter, environment and import path.
REPORT_PY = """\
import importlib.util, json, os, sys
import crawlerkeeper_sdk as ck
ck.save_item({
    "argv": sys.argv,
    "executable": sys.executable,
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "sys_path": sys.path,
    "sdk_version": ck.__version__,
    "sdk_file": ck.__file__,
    "importable": {m: importlib.util.find_spec(m) is not None
                   for m in ("trio", "httpx", "ckagent", "stamina", "psutil", "yaml", "starlette")},
})
"""

# Appends "start|end <task id> <time.time()>" to its spider's file in the directory $TIMELINE around a
# 1 s sleep (a file per spider: spiders run under uids of their own, one cannot append to another's).
TIMELINE_PY = """\
import os, time
def mark(what):
    with open(os.path.join(os.environ["TIMELINE"], os.environ["CK_SPIDER_ID"]), "a") as f:
        f.write("%s %s %.6f\\n" % (what, os.environ["CK_TASK_ID"], time.time()))
mark("start")
time.sleep(1.0)
mark("end")
"""


async def new_spider(admin: Any, name: str, files: dict[str, str | bytes], framework: str = "python",
                     command: list[str] | str | None = None) -> str:
    """Create a spider with ``files`` as its code package; returns its id."""
    spider_id = await admin.create_spider(name=name, framework=framework, command=command)
    await admin.upload_package(spider_id, spider_zip(files))
    return str(spider_id)


async def final(admin: Any, task_id: str, within: float = 60.0) -> dict[str, Any]:
    """Wait (at most ``within`` seconds) for the task to be final; returns it."""
    with trio.fail_after(within + 5):
        return await admin.wait_task_final(task_id, within)


def resolved_under(path: str, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def site_packages(venv: Path) -> Path:
    [site] = list((venv / "lib").glob("python*/site-packages"))
    return site


# ---------------------------------------------------------------------------- the examples


@pytest.mark.slow
async def test_scrapy_example_runs_in_its_own_venv(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    spider_id = await admin.create_spider(name="products", framework="scrapy")
    await admin.upload_package(spider_id, await trio.to_thread.run_sync(zip_directory, EXAMPLES / "scrapy_demo"))
    task_id = await admin.create_task(spider_id, params={"start_url": f"{dev_master.base_url}/demo-site/"})
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                              AGENT_UV_SYNC_TIMEOUT="400")
    async with running_agent(nursery, settings):
        task = await final(admin, task_id, 420)
    logs = await admin.get_logs(task_id)
    assert task["status"] == "SUCCESS", (task, logs[-40:])
    assert task["exitCode"] == 0
    assert_default_identity("\n".join(logs))  # as root: Scrapy under a uid of the spider's own
    items = await admin.get_items(task_id)
    assert [item["sku"] for item in items] == SKUS
    assert items[0]["title"] == "Product 01" and items[-1]["page"] == 5
    assert task["itemCount"] == 30 and task["logLines"] == len(logs)
    assert any("Spider closed (finished)" in line for line in logs), logs[-20:]
    # Scrapy went into the spider's own venv, never into the agent's environment.
    [venv] = (work_dir / "envs").glob("py-*")
    assert (site_packages(venv) / "scrapy" / "__init__.py").is_file()
    assert importlib.util.find_spec("scrapy") is None


async def test_python_and_failing_examples(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    demo = await admin.create_spider(name="python_demo", framework="python")
    await admin.upload_package(demo, await trio.to_thread.run_sync(zip_directory, EXAMPLES / "python_demo"))
    fail = await admin.create_spider(name="fail_demo", framework="python")
    await admin.upload_package(fail, await trio.to_thread.run_sync(zip_directory, EXAMPLES / "fail_demo"))
    # A spider that prints its error on stdout and exits 4: the failure message shows that, not "nothing".
    quiet = await admin.create_spider(name="stdout_error", framework="python", command=[
        "python", "-c", "print('step 1 ok'); print('login failed: HTTP 403 from the shop'); raise SystemExit(4)"])
    await admin.upload_package(quiet, await trio.to_thread.run_sync(zip_directory, EXAMPLES / "fail_demo"))
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    async with running_agent(nursery, settings):
        ok_id = await admin.create_task(demo, params={"start_url": f"{dev_master.base_url}/demo-site/"})
        bad_id = await admin.create_task(fail)
        quiet_id = await admin.create_task(quiet)
        ok, bad, printed = await final(admin, ok_id), await final(admin, bad_id), await final(admin, quiet_id)
    assert (printed["errorCode"], printed["exitCode"]) == ("EXIT_NONZERO", 4), printed
    assert "exit code 4; last lines of output:" in printed["errorMessage"], printed
    assert "login failed: HTTP 403 from the shop" in printed["errorMessage"], printed
    assert ok["status"] == "SUCCESS" and ok["exitCode"] == 0, (ok, await admin.get_logs(ok_id))
    assert [item["sku"] for item in await admin.get_items(ok_id)] == SKUS
    assert ok["itemCount"] == 30
    # The phases apart, as the master stores them (docs/protocol.md: durationMs counts from the claim).
    assert ok["deployMs"] >= 0 and ok["installMs"] >= 0 and ok["runMs"] > 0, ok
    assert ok["durationMs"] >= ok["runMs"], ok
    assert (bad["status"], bad["errorCode"], bad["exitCode"]) == ("FAILED", "EXIT_NONZERO", 3)
    bad_logs = await admin.get_logs(bad_id)
    assert "something went wrong: demo failure" in bad_logs
    assert "fail_demo: starting, about to fail on purpose" in bad_logs
    assert bad["logLines"] == len(bad_logs) and bad["itemCount"] == 0


# ---------------------------------------------------------------------------- concurrency


def intervals(timeline: Path) -> dict[str, tuple[float, float]]:
    marks: dict[str, dict[str, float]] = {}
    for line in "".join(path.read_text() for path in sorted(timeline.iterdir())).splitlines():
        what, task_id, at = line.split()
        marks.setdefault(task_id, {})[what] = float(at)
    return {task_id: (m["start"], m["end"]) for task_id, m in marks.items()}


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("both_at_once", [False, True], ids=["one-per-spider", "master-hands-out-both"])
async def test_one_spider_is_serial_two_spiders_run_in_parallel(
    both_at_once: bool, dev_master, nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = dev_master.admin
    timeline = spider_writable(tmp_path / "timeline")  # outside every workspace
    env = {"TIMELINE": str(timeline)}
    spider_a = await new_spider(admin, "serial_a", {"main.py": TIMELINE_PY})
    spider_b = await new_spider(admin, "serial_b", {"main.py": TIMELINE_PY})
    a1 = await admin.create_task(spider_a, env=env)
    a2 = await admin.create_task(spider_a, env=env)
    b1 = await admin.create_task(spider_b, env=env)
    if both_at_once:
        # The dev master hands out one task per spider per poll; a master may hand out both: then
        # only the agent's per-spider lock keeps them apart. Add A2 to the answer that carries A1.
        real_poll = Poller.poll_once

        async def poll_once(self: Poller) -> PendingTasks:
            answer = await real_poll(self)
            # (A2 as handed out, not claimed: the agent claims it itself; A1 may come claimed.)
            extra = [dataclasses.replace(t, id=a2, claimed=False) for t in answer.tasks if t.id == a1]
            return dataclasses.replace(answer, tasks=[*answer.tasks, *extra])

        monkeypatch.setattr(Poller, "poll_once", poll_once)
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token,
                              AGENT_MAX_WORKERS="3")
    async with running_agent(nursery, settings):
        results = [await final(admin, t) for t in (a1, a2, b1)]
        logs = {t: await admin.get_logs(t) for t in (a1, a2, b1)}
    assert [r["status"] for r in results] == ["SUCCESS"] * 3, (results, logs)
    spans = intervals(timeline)
    assert set(spans) == {a1, a2, b1}
    assert not overlap(spans[a1], spans[a2]), spans
    assert overlap(spans[b1], spans[a1]) or overlap(spans[b1], spans[a2]), spans


async def test_a_task_claimed_elsewhere_is_not_run(
    dev_master, nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = dev_master.admin
    marker = tmp_path / "ran.txt"
    spider = await new_spider(admin, "contested", {
        "main.py": "import os\nopen(os.environ['MARKER'], 'w').write('ran')\n"})
    async with httpx.AsyncClient(base_url=dev_master.base_url, timeout=10) as http:
        reply = await http.post(
            "/api/nodes/register", headers={"X-Registration-Token": dev_master.registration_token},
            json=RegisterRequest(name="rival", ip="127.0.0.2", port=9000, version="0", os="linux", arch="x86_64",
                                 python="3.11", cpu_count=1, memory_total_bytes=1 << 30, max_workers=2).to_json())
        reply.raise_for_status()
        rival_id, rival_key = reply.json()["nodeId"], reply.json()["apiKey"]
        rival_claims: list[int] = []
        claimed_by_rival = trio.Event()
        polls_done = trio.Event()
        polls_after_claim = 0

        # The race made deterministic: the rival claims every task the agent's poll brings back,
        # after the master handed it out and before the agent claims it. The agent's claim gets a
        # real 409 from the real master.
        real_poll = Poller.poll_once

        async def poll_once(self: Poller) -> PendingTasks:
            nonlocal polls_after_claim
            answer = await real_poll(self)
            if claimed_by_rival.is_set():
                polls_after_claim += 1
                if polls_after_claim >= 3:  # a few more polls: the task is not picked up again
                    polls_done.set()
            for task in answer.tasks:
                claim = await http.post(f"/api/tasks/{task.id}/result",
                                        headers={"Authorization": f"Bearer {rival_key}"},
                                        json=TaskResult(status="RUNNING", started_at=utc_now_iso()).to_json())
                rival_claims.append(claim.status_code)
                claimed_by_rival.set()
            return answer

        monkeypatch.setattr(Poller, "poll_once", poll_once)
        # The claim path (POST .../result): the race staged here needs a poll that only hands out
        # (with claim-in-poll the poll itself claims, and the rival is the one refused).
        monkeypatch.setattr("ckagent.task.poller.CLAIM_IN_POLL", "not-offered")
        work_dir = tmp_path / "agent"
        settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                                  AGENT_TASK_LONG_POLL_WAIT="0.5", AGENT_TASK_POLL_INTERVAL="0.2")
        async with running_agent(nursery, settings) as agent:
            task_id = await admin.create_task(spider, env={"MARKER": str(marker)})
            with trio.fail_after(30):
                await claimed_by_rival.wait()
                await polls_done.wait()
            assert agent.supervisor is not None and agent.supervisor.running == {}
    assert rival_claims == [200]
    task = await admin.get_task(task_id)
    assert task["status"] == "RUNNING" and task["nodeId"] == rival_id, task
    assert not marker.exists()
    assert not (work_dir / "tasks" / task_id).exists()
    assert not list((work_dir / "envs").glob("py-*"))
    assert await admin.get_logs(task_id) == []


# ---------------------------------------------------------------------------- the spider's world


def fake_sdk_wheel(version: str) -> tuple[str, bytes]:
    """A minimal pure-Python wheel of a fake ``crawlerkeeper_sdk`` (no build backend, no network)."""
    return wheel("crawlerkeeper_sdk", version, (
        f'__version__ = "{version}"\n'
        "import json, os\n"
        "def save_item(item):\n"
        "    with open(os.environ['CK_ITEMS_FILE'], 'a') as f:\n"
        "        f.write(json.dumps(item) + '\\n')\n"
    ))


async def test_sdk_is_provided_and_a_pinned_sdk_wins(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    plain = await new_spider(admin, "sdk_plain", {"main.py": REPORT_PY})
    wheel_name, wheel = fake_sdk_wheel("9.9.9")
    pinned = await new_spider(admin, "sdk_pinned", {
        "main.py": REPORT_PY, "requirements.txt": f"./{wheel_name}\n", wheel_name: wheel})
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token)
    async with running_agent(nursery, settings):
        plain_task, pinned_task = await admin.create_task(plain), await admin.create_task(pinned)
        results = [await final(admin, plain_task), await final(admin, pinned_task)]
    assert [r["status"] for r in results] == ["SUCCESS", "SUCCESS"], [
        (r, await admin.get_logs(r["id"])) for r in results]
    [seen_plain] = await admin.get_items(plain_task)
    [seen_pinned] = await admin.get_items(pinned_task)
    # Without installing anything, the spider imports the agent's bundled SDK ...
    assert seen_plain["sdk_version"] != "9.9.9"
    assert BUNDLED_SDK is not None and resolved_under(seen_plain["sdk_file"], BUNDLED_SDK)
    # ... and a spider that installs its own version gets that one, from its own venv.
    assert seen_pinned["sdk_version"] == "9.9.9"
    assert Path(seen_pinned["sdk_file"]).is_relative_to(work_dir / "envs")
    assert "site-packages" in Path(seen_pinned["sdk_file"]).parts
    for seen in (seen_plain, seen_pinned):
        assert seen["importable"] == dict.fromkeys(seen["importable"], False), seen["importable"]
        assert "PYTHONPATH" not in seen["env"]
        # Of the agent's own files, only the SDK's directory is on the spider's import path.
        agent_paths = [p for p in seen["sys_path"] if p and resolved_under(p, REPO)]
        assert all(resolved_under(p, BUNDLED_SDK) for p in agent_paths), seen["sys_path"]


async def test_no_secret_reaches_the_spider(
    dev_master, nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = dev_master.admin
    # What a real agent's own environment holds: its secrets and settings, and unrelated secrets.
    monkeypatch.setenv("AGENT_REGISTRATION_TOKEN", dev_master.registration_token)
    monkeypatch.setenv("AGENT_SERVER_URL", dev_master.base_url)
    monkeypatch.setenv("DATABASE_PASSWORD", "hunter2-not-for-spiders")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "agent-only"))
    spider = await new_spider(admin, "env_dump", {"main.py": REPORT_PY})
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token)
    params = {"start_url": "http://example.invalid/", "pages": 3, "tags": ["a", "ü"]}
    async with running_agent(nursery, settings) as agent:
        api_key = agent.master._api_key
        task_id = await admin.create_task(spider, params=params, env={"SPIDER_SETTING": "kept"})
        result = await final(admin, task_id)
    assert result["status"] == "SUCCESS", (result, await admin.get_logs(task_id))
    [seen] = await admin.get_items(task_id)
    env: dict[str, str] = seen["env"]
    dump = json.dumps(env)
    assert api_key and api_key not in dump
    assert dev_master.registration_token not in dump
    assert dev_master.admin_token not in dump
    assert "hunter2-not-for-spiders" not in dump
    assert not [k for k in env if k.startswith("AGENT_")]
    assert "PYTHONPATH" not in env
    task_dir = work_dir / "tasks" / task_id
    assert env["CK_TASK_ID"] == task_id
    assert env["CK_SPIDER_ID"] == spider
    assert env["CK_SPIDER_NAME"] == "env_dump"
    assert env["CK_TASK_DIR"] == str(task_dir)
    assert env["CK_ITEMS_FILE"] == str(task_dir / "items.jsonl")
    assert json.loads(env["CK_PARAMS"]) == params
    assert env["SPIDER_SETTING"] == "kept"
    assert env["PATH"] and env["HOME"]
    logs = "\n".join(await admin.get_logs(task_id))
    assert dev_master.registration_token not in logs and api_key not in logs


async def test_default_and_given_commands(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    admin = dev_master.admin
    files = {"main.py": REPORT_PY, "run.py": REPORT_PY}
    default = await new_spider(admin, "cmd_default", files)
    as_string = await new_spider(admin, "cmd_string", files, command="python run.py --flag 'a b'")
    as_list = await new_spider(admin, "cmd_list", files, command=["python", "run.py", "it's"])
    work_dir = tmp_path / "agent"
    settings = agent_settings(work_dir, dev_master.base_url, dev_master.registration_token,
                              AGENT_MAX_WORKERS="3")
    async with running_agent(nursery, settings):
        tasks = {
            "default": await admin.create_task(default),
            "default+args": await admin.create_task(default, args=["x", "y z"]),
            "string+args": await admin.create_task(as_string, args=["extra"]),
            "list": await admin.create_task(as_list),
        }
        results = {name: await final(admin, t) for name, t in tasks.items()}
    assert {n: r["status"] for n, r in results.items()} == dict.fromkeys(tasks, "SUCCESS"), results
    seen = {name: (await admin.get_items(t))[0] for name, t in tasks.items()}
    assert seen["default"]["argv"] == ["main.py"]
    assert seen["default+args"]["argv"] == ["main.py", "x", "y z"]
    assert seen["string+args"]["argv"] == ["run.py", "--flag", "a b", "extra"]
    assert seen["list"]["argv"] == ["run.py", "it's"]
    # `python` is the spider venv's interpreter — one venv for the three spiders, whose dependencies
    # are the same — and each task runs in its own working copy of the code.
    [venv] = (work_dir / "envs").glob("py-*")
    assert {Path(s["executable"]).parent for s in seen.values()} == {venv / "bin"}
    assert len({s["cwd"] for s in seen.values()}) == 4
    assert all(Path(s["cwd"]).parent == work_dir / "spiders" / ".runs" for s in seen.values())
