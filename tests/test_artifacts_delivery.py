"""Artifact delivery is durable: master outages and an agent kill -9 mid-upload change nothing at the
master — every artifact once, byte for byte (sha256). Real dev master, the fault proxy, real agents."""

from __future__ import annotations

import contextlib
import hashlib
import random
import signal
import sqlite3
from pathlib import Path
from typing import Any

import trio
from faultproxy import FaultProxy, Request
from harness import AgentProcess, agent_settings, running_agent, submit

from ckagent.devmaster.artifacts import blob_dir

FILES = 24


def writer(files: int, size: int) -> str:
    """A spider writing ``files`` files of ``size`` pseudo-random bytes (seeded by the name) under out/."""
    return (
        "import os, random\n"
        "os.makedirs('out/deep', exist_ok=True)\n"
        f"for i in range({files}):\n"
        f"    data = random.Random(i).randbytes({size} + i)\n"
        "    open(f'out/deep/f{i:03d}.bin' if i % 2 else f'out/f{i:03d}.bin', 'wb').write(data)\n"
    )


def expected(files: int, size: int) -> dict[str, str]:
    return {(f"out/deep/f{i:03d}.bin" if i % 2 else f"out/f{i:03d}.bin"):
            hashlib.sha256(random.Random(i).randbytes(size + i)).hexdigest() for i in range(files)}


async def check_artifacts(admin: Any, task_id: str, want: dict[str, str], db_path: Path) -> None:
    listed = await admin.list_artifacts(task_id)
    assert [a["path"] for a in listed] == sorted(want)  # each once
    for entry in listed:
        data = await admin.get_artifact(task_id, entry["path"])
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] == want[entry["path"]]
        assert len(data) == entry["sizeBytes"]
    files = [p for p in blob_dir(db_path).rglob("*") if p.is_file()] if blob_dir(db_path).exists() else []
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        inline = db.execute("SELECT count(*) FROM artifact_blobs").fetchone()[0]
    assert len(files) + inline == len(set(want.values()))  # stored once each, no half-written leftovers


def flaky_artifacts(seed: int) -> Any:
    """Artifact uploads: pass, the answer lost after the master stored it, 503, a reset, a slow answer."""
    rng = random.Random(seed)

    def choose(request: Request) -> str:
        if request.call != "artifact":
            return "pass"
        return rng.choices(["pass", "drop_answer", "503", "reset", "html", "delay"], [40, 20, 10, 10, 10, 10])[0]

    return choose


async def test_artifacts_survive_master_outages(dev_master: Any, nursery: trio.Nursery, tmp_path: Path) -> None:
    master_port = int(dev_master.base_url.rsplit(":", 1)[1])
    proxy = FaultProxy(master_port, chooser=flaky_artifacts(seed=7))
    proxy_port = await nursery.start(proxy.serve)
    settings = agent_settings(tmp_path / "agent", f"http://127.0.0.1:{proxy_port}", dev_master.registration_token)
    async with running_agent(nursery, settings):
        task_id = await submit(dev_master.admin, "files", {"main.py": writer(FILES, 3000)})
        with trio.fail_after(180):
            task = await dev_master.admin.wait_task_final(task_id, 180)
    assert task["status"] == "SUCCESS", task
    assert proxy.faults["drop_answer"] and proxy.faults["503"] and proxy.faults["html"]
    await check_artifacts(dev_master.admin, task_id, expected(FILES, 3000), dev_master.db_path)
    sent = (tmp_path / "agent" / "tasks" / task_id / "artifacts.sent").read_text().split()
    assert sorted(sent) == sorted(expected(FILES, 3000))


async def test_artifacts_survive_an_agent_kill_mid_upload(dev_master: Any, nursery: trio.Nursery,
                                                          tmp_path: Path) -> None:
    master_port = int(dev_master.base_url.rsplit(":", 1)[1])
    proxy = FaultProxy(master_port)
    proxy_port = await nursery.start(proxy.serve)
    proxy.set("delay", ["artifact"])  # 0.05-0.8 s per upload: the kill lands in the middle
    (tmp_path / "a").mkdir()
    agent = AgentProcess(tmp_path / "a", f"http://127.0.0.1:{proxy_port}", dev_master.registration_token)
    admin = dev_master.admin
    task_id = await submit(admin, "files", {"main.py": writer(FILES, 20_000)})
    try:
        await agent.start()
        with trio.fail_after(120):
            while len(await admin.list_artifacts(task_id)) < 4:  # noqa: ASYNC110 - remote state: polled
                await trio.sleep(0.1)
        agent.signal(signal.SIGKILL)
        await agent.wait()
        held = len(await admin.list_artifacts(task_id))
        assert 4 <= held < FILES, held
        assert (await admin.get_task(task_id))["status"] == "RUNNING"  # the result waits for the artifacts
        proxy.heal()
        await agent.start()
        with trio.fail_after(120):
            task = await admin.wait_task_final(task_id, 120)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await agent.kill()
    assert task["status"] == "SUCCESS", (task, agent.log_text()[-3000:])
    await check_artifacts(admin, task_id, expected(FILES, 20_000), dev_master.db_path)
