"""The hostile file matrix with a real agent, real spiders and the master's stored items and artifacts.

A spider owns its task dir, working copy and data dir. Here it plants, where the agent will read or
write: symlinks to another tenant's file (a file of another uid, 0600 in a 0700 folder), to
``/etc/shadow`` and to the agent's own ``state.db``; a folder swapped for a link; FIFOs; a forged log
journal naming files outside its task dir; a hard link to a file it does not own (refused by the
kernel where ``fs.protected_hardlinks`` is 1, as here); and, as root, a device file. Whatever it did:
the task ends with exactly its own items and artifacts at the master, no byte of anyone else's data
in its items, log or artifacts, and the agent (its status port, its next task) goes on.

Spiders run as a user of their own where the test is root (``nobody``: the spider cannot read the
victim's file, /etc/shadow or state.db itself — only the agent could), else as the test's own user
(the agent's: every file but /etc/shadow is its own too, so it plants no hard link — linking its own
file is reading it, the level's limit — and the links it plants are ones the agent could follow).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from harness import (  # noqa: F401 -- no_strays: autouse fixture
    RecordingMaster,
    agent_settings,
    no_strays,
    running_agent,
    spider_python,
    spider_reachable,
    spider_zip,
    submit,
)

ROOT = os.geteuid() == 0
VICTIM_UID = 61997
MARK = "victim-secret-7f3a"

HOSTILE = r"""
import json, os, sys
from pathlib import Path
P = json.loads(os.environ["CK_PARAMS"])
task = Path(os.environ["CK_TASK_DIR"])
work_dir = task.parent.parent
report = {}
def attempt(name, act):
    try:
        act()
        report[name] = "done"
    except OSError as exc:
        report[name] = exc.strerror
secrets = {"victim": P["victim"], "shadow": "/etc/shadow", "state": str(work_dir / "state.db")}
for name, path in secrets.items():
    try:
        open(path, "rb").read(1)
        report["read " + name] = "READ"
    except OSError as exc:
        report["read " + name] = exc.strerror
# its task dir: the stats file, a log-file folder, its own items first (the SDK's way)
with open(os.environ["CK_ITEMS_FILE"], "a") as fh:
    fh.write(json.dumps({"own": "sdk"}) + "\n")
attempt("stats link", lambda: os.symlink(secrets["state"], os.environ["CK_STATS_FILE"]))
attempt("logs folder link", lambda: os.symlink(os.path.dirname(P["victim"]), task / "logs"))
attempt("log link", lambda: os.symlink(secrets["shadow"], task / "shadow.log"))
attempt("log fifo", lambda: os.mkfifo(task / "pipe.log"))
if P["hardlinks"]:  # (as the agent's own uid the spider owns state.db: linking it is reading it, the level's limit)
    attempt("hard link state.db", lambda: os.link(secrets["state"], task / "state.log"))
# its working copy: declared item files that are links, a FIFO, a folder that is a link; real ones
attempt("item link", lambda: os.symlink(secrets["victim"], "stolen.json"))
attempt("item folder link", lambda: os.symlink("/etc", "out"))
attempt("item fifo", lambda: os.mkfifo("fifo.jsonl"))
if P["hardlinks"]:
    attempt("hard link victim", lambda: os.link(secrets["victim"], "hard.json"))
Path("rows.csv").write_text("title,price\nA,1\nB,2\n")
Path("feed.jsonl").write_text(json.dumps({"own": "feed"}) + "\n")
# artifacts: a real page, links to the secrets
Path("page.html").write_text("<p>the task's own page</p>")
attempt("artifact link", lambda: os.symlink(secrets["shadow"], "shadow.txt"))
attempt("artifact folder link", lambda: os.symlink(work_dir, "node"))
# the agent's own journal, forged: sources outside the task dir
def forge():
    journal = task / "output.journal"
    os.rename(journal, task / "journal.real")
    journal.write_text(f"S 0 output.log\nS 1 {secrets['state']}\nD 1 4096\nS 2 ../../state.db\nD 2 4096\n"
                       f"S 3 logs/{os.path.basename(P['victim'])}\nD 3 4096\n")
attempt("forge journal", forge)
print("REPORT " + json.dumps(report), flush=True)
"""

DEVICE = r"""
import os, stat
os.mknod(os.environ["CK_ITEMS_FILE"], stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero: endless bytes
os.mknod("zero.jsonl", stat.S_IFCHR | 0o666, os.makedev(1, 5))
print("made device files", flush=True)
"""


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """Another tenant's file: 0600 in a 0700 folder, of another uid where the test is root."""
    folder = tmp_path / "victim"
    folder.mkdir(mode=0o700)
    path = folder / "items.log"
    path.write_text(json.dumps({"stolen": MARK}) + "\n")
    path.chmod(0o600)
    if ROOT:
        os.chown(path, VICTIM_UID, VICTIM_UID)
        os.chown(folder, VICTIM_UID, VICTIM_UID)
    return path


def _settings(tmp_path: Path, master: RecordingMaster, **env: str) -> Any:
    work = spider_reachable(tmp_path / "node")
    extra = {"AGENT_TASK_RUN_AS_USER": "nobody", "AGENT_DEPS_PYTHON": spider_python()} if ROOT else {}
    return agent_settings(work, master.base_url, master.registration_token, **{**extra, **env})


def _secrets(settings: Any) -> list[bytes]:
    """What must appear nowhere: the victim's mark, /etc/shadow's first line, state.db's header."""
    found = [MARK.encode(), b"SQLite format 3"]
    if ROOT:
        with open("/etc/shadow", "rb") as fh:
            first = fh.readline().strip()
        if first:
            found.append(first)
    return found


async def test_a_spider_planting_links_fifos_and_a_forged_journal_ships_only_its_own(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path, victim: Path
) -> None:
    admin = recording_master.admin
    settings = _settings(tmp_path, recording_master)
    async with running_agent(nursery, settings) as agent:
        spider = await admin.create_spider(name="hostile-files", framework="python", outputs={
            "items": ["stolen.json", "out/*", "fifo.jsonl", "hard.json", "rows.csv", "feed.jsonl"]})
        await admin.upload_package(spider, spider_zip({"main.py": HOSTILE}))
        task_id = str(await admin.create_task(spider, params={"victim": str(victim), "hardlinks": ROOT,
                                                              "logFiles": ["*.log", "logs/*.log"]}))
        with trio.fail_after(120):
            task = await admin.wait_task_final(task_id, 120)
        logs = await admin.get_logs(task_id)
        assert task["status"] == "SUCCESS", (task, logs[-30:])
        async with httpx.AsyncClient() as client:  # the agent is fine: its status port answers
            assert (await client.get(f"http://127.0.0.1:{agent.status_port}/status")).status_code == 200
        after = await submit(admin, "after-hostile", {"main.py": "print('next task fine')\n"})
        with trio.fail_after(120):
            next_task = await admin.wait_task_final(after, 120)
        assert next_task["status"] == "SUCCESS"
    report = json.loads(next(line for line in logs if "REPORT " in line).split("REPORT ", 1)[1])
    if ROOT:  # the spider itself can read none of them: only the agent could have leaked them
        assert report["read victim"] == report["read shadow"] == report["read state"] == "Permission denied", report
    items = await admin.get_items(task_id)
    assert sorted(json.dumps(i, sort_keys=True) for i in items) == sorted(json.dumps(i, sort_keys=True) for i in [
        {"own": "sdk"}, {"own": "feed"}, {"title": "A", "price": "1"}, {"title": "B", "price": "2"}]), items
    artifacts = await admin.list_artifacts(task_id)
    assert [a["path"] for a in artifacts] == ["page.html"], artifacts
    stored = "\n".join(logs).encode() + json.dumps(items).encode()
    stored += b"".join([await admin.get_artifact(task_id, a["path"]) for a in artifacts])
    for secret in _secrets(settings):
        assert secret not in stored, secret
    if report.get("hard link victim") == "done" or report.get("hard link state.db") == "done":
        # fs.protected_hardlinks is 0 here: the links were made, and the agent refused them itself
        assert any("a hard link to a file the task does not own" in line for line in logs), logs[-20:]


@pytest.mark.skipif(not ROOT, reason="only root makes device files (a spider running as root could)")
async def test_a_spider_running_as_root_planting_device_files_does_not_hang_the_agent(
    recording_master: RecordingMaster, nursery: trio.Nursery, tmp_path: Path
) -> None:
    admin = recording_master.admin
    settings = agent_settings(tmp_path / "node", recording_master.base_url, recording_master.registration_token,
                              AGENT_TASK_RUN_AS_USER="root")
    async with running_agent(nursery, settings):
        spider = await admin.create_spider(name="device-files", framework="python", outputs={"items": ["zero.jsonl"]})
        await admin.upload_package(spider, spider_zip({"main.py": DEVICE}))
        task_id = str(await admin.create_task(spider))
        with trio.fail_after(120):
            task = await admin.wait_task_final(task_id, 120)
    assert task["status"] == "SUCCESS", (task, await admin.get_logs(task_id))
    assert await admin.get_items(task_id) == []
