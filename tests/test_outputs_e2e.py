"""A task's files end to end: item files into the items stream, artifacts to the master, the rest kept.

Real dev master (its SQLite file and artifact blobs), in-process agent, real spider processes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import trio
from harness import agent_settings, running_agent, spider_zip

from ckagent.devmaster.client import AdminApiError, AdminClient
from ckagent.devmaster.server import DevMasterConfig, serve

WRITER = r"""
import csv, json, os, pathlib
pathlib.Path("results.json").write_text(json.dumps([{"n": i} for i in range(3)]))
with open("quotes.jsonl", "w") as f:
    for i in range(2):
        f.write(json.dumps({"q": i}) + "\n")
with open("rows.csv", "w", newline="") as f:
    w = csv.writer(f); w.writerow(["a", "b"]); w.writerow(["1", "2"])
os.makedirs("images/full", exist_ok=True)
for i in range(3):
    pathlib.Path(f"images/full/{i}.bin").write_bytes(bytes([i]) * (1000 + i))
pathlib.Path("books.db").write_bytes(b"SQLite format 3\0" + b"x" * 5000)
os.makedirs("__pycache__", exist_ok=True)
pathlib.Path("__pycache__/m.cpython-312.pyc").write_bytes(b"cache")
pathlib.Path("shipped.txt").write_text("changed by the task")
print("done")
"""


def _log_line(lines: list[str], prefix: str) -> str:
    # "outputs: streaming the items of X while the task runs" comes before the summary, even for a
    # file first seen at the task's end: the summary is the log's last outputs line.
    found = [line for line in lines if prefix in line]
    assert found, f"no {prefix!r} line in the log:\n" + "\n".join(lines[-20:])
    assert "streaming the items of" not in found[-1], "\n".join(found)
    return found[-1]


async def _spider(admin, name: str, files: dict[str, str | bytes], **spider) -> str:
    spider_id = await admin.create_spider(name=name, framework="python", **spider)
    await admin.upload_package(spider_id, spider_zip(files))
    return str(spider_id)


async def test_declared_outputs_and_artifacts(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    work = tmp_path / "agent"
    settings = agent_settings(work, dev_master.base_url, dev_master.registration_token,
                              AGENT_TASK_MAX_ARTIFACT_BYTES="4000")
    admin = dev_master.admin
    files = {"main.py": WRITER, "shipped.txt": "as shipped"}
    async with running_agent(nursery, settings) as agent:
        spider_id = await _spider(admin, "writer", files,
                                  outputs={"items": ["results.json", "*.jsonl", "rows.csv"]})
        task_id = await admin.create_task(spider_id)
        with trio.fail_after(90):
            task = await admin.wait_task_final(task_id, 90)
        # The master stores the result before it answers: the agent has the answer a moment after
        # wait_task_final saw the result (long enough on a loaded machine for the page to say 'sending').
        assert agent.outbox is not None
        with trio.fail_after(10):
            await agent.outbox.wait_delivered({task_id})
        # The agent's status page links the task's artifacts and serves them while the task dir is kept.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{agent.status_port}", timeout=10) as status:
            page = (await status.get("/")).text
            assert f'href="/tasks/{task_id}/artifacts/images/full/0.bin"' in page
            assert "<td>delivered</td>" in page, "the master has its result (marked in the outbox's next round)"
            got = await status.get(f"/tasks/{task_id}/artifacts/images/full/0.bin")
            assert got.status_code == 200 and got.content == bytes([0]) * 1000
            assert (await status.get(f"/tasks/{task_id}/artifacts/main.py")).status_code == 404
            assert (await status.get(f"/tasks/{task_id}/artifacts/..%2F..%2Fstate.db")).status_code == 404
    assert task["status"] == "SUCCESS", task
    assert task["outputs"] == {"items": ["results.json", "*.jsonl", "rows.csv"], "artifacts": []}
    items = await admin.get_items(task_id)
    # The JSON Lines file is streamed while the task runs when the live watch sees it before the task
    # ends (it writes and exits within milliseconds: on a loaded machine it may not); the rest is read
    # at the end in the order of the declared patterns. Each file's items in its own order, once.
    streamed = [{"q": 0}, {"q": 1}, {"n": 0}, {"n": 1}, {"n": 2}, {"a": "1", "b": "2"}]
    at_the_end = [{"n": 0}, {"n": 1}, {"n": 2}, {"q": 0}, {"q": 1}, {"a": "1", "b": "2"}]
    assert items in (streamed, at_the_end), items
    listed = {a["path"]: a for a in await admin.list_artifacts(task_id)}
    # Budget 4000 bytes, path order: images/full/0.bin (1000), 1.bin (1001), 2.bin (1002), then
    # shipped.txt (19) fits; books.db (5016) does not: kept on the node.
    assert set(listed) == {"images/full/0.bin", "images/full/1.bin", "images/full/2.bin", "shipped.txt"}
    for path, entry in listed.items():
        data = await admin.get_artifact(task_id, path)
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["sizeBytes"]
    assert await admin.get_artifact(task_id, "shipped.txt") == b"changed by the task"
    line = _log_line(await admin.get_logs(task_id), "outputs: ")
    assert "quotes.jsonl → 2 items" in line and "results.json → 3 items" in line and "rows.csv → 1 item" in line
    assert "images/ (3 files, " in line and "→ artifacts" in line
    assert "books.db (" in line and "kept at " in line and "over the artifact budget" in line
    assert "__pycache__" not in line and "main.py" not in line
    kept = next(work.glob(f"spider-data/*/outputs/{task_id}/books.db"))
    assert kept.read_bytes().startswith(b"SQLite format 3")


CRAWLEE_LIKE = r"""
import json, os, pathlib
d = pathlib.Path("storage/datasets/default"); d.mkdir(parents=True)
for i in range(1, 4):
    (d / f"{i:09d}.json").write_text(json.dumps({"title": f"t{i}"}))
q = pathlib.Path("storage/request_queues/default"); q.mkdir(parents=True)
(q / "r.json").write_text("{}")
kv = pathlib.Path("storage/key_value_stores/default"); kv.mkdir(parents=True)
(kv / "SDK_CRAWLER_STATISTICS_0.json").write_text("{}")
(kv / "OUTPUT.json").write_text('{"ok": true}')
"""


async def test_conventions_without_outputs(dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    admin = dev_master.admin
    async with running_agent(nursery, settings):
        spider_id = await _spider(admin, "crawlee-like", {"main.py": CRAWLEE_LIKE})
        task_id = await admin.create_task(spider_id)
        with trio.fail_after(90):
            task = await admin.wait_task_final(task_id, 90)
    assert task["status"] == "SUCCESS", task
    assert await admin.get_items(task_id) == [{"title": "t1"}, {"title": "t2"}, {"title": "t3"}]
    assert [a["path"] for a in await admin.list_artifacts(task_id)] == ["storage/key_value_stores/default/OUTPUT.json"]
    line = _log_line(await admin.get_logs(task_id), "outputs: ")
    assert "storage/datasets/ (3 files) → 3 items" in line, line


LATE_WRITER = r"""
import json, os, pathlib, time
os.makedirs("data", exist_ok=True)
pathlib.Path("data/products.json").write_text(json.dumps([{"p": 1}, {"p": 2}]))
pathlib.Path("data/state.db").write_bytes(b"state" * 1600)
time.sleep(1.5)  # the once-a-second scans have run; late.jsonl is first seen by the end-of-task collection
pathlib.Path("late.jsonl").write_text('{"late": 1}\n')
"""


async def test_an_items_glob_keeps_its_non_item_files_says_a_glob_matching_nothing_and_ends_with_the_summary(
        dev_master, nursery: trio.Nursery, tmp_path: Path) -> None:
    settings = agent_settings(tmp_path / "agent", dev_master.base_url, dev_master.registration_token)
    admin = dev_master.admin
    async with running_agent(nursery, settings):
        spider_id = await _spider(admin, "late-writer", {"main.py": LATE_WRITER},
                                  outputs={"items": ["data/*", "late.jsonl", "quotes.json"]})
        task_id = await admin.create_task(spider_id)
        with trio.fail_after(90):
            task = await admin.wait_task_final(task_id, 90)
    assert task["status"] == "SUCCESS", task
    assert await admin.get_items(task_id) == [{"late": 1}, {"p": 1}, {"p": 2}]
    # data/state.db is not an item file: an artifact like any other file, sent whole (never deleted).
    assert [a["path"] for a in await admin.list_artifacts(task_id)] == ["data/state.db"]
    assert await admin.get_artifact(task_id, "data/state.db") == b"state" * 1600
    logs = await admin.get_logs(task_id)
    line = _log_line(logs, "outputs: ")  # the last outputs line is the summary
    assert any("streaming the items of late.jsonl while the task runs" in entry for entry in logs)
    assert "data/products.json → 2 items" in line and "late.jsonl → 1 item" in line, line
    assert "data/ (1 file, 7.8 KiB) → artifacts" in line, line
    assert "data/state.db is named by outputs.items but is not an item file" in line, line
    assert "outputs.items 'quotes.json' matched no file" in line, line


async def test_older_master_keeps_the_files(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A master without the ``artifacts`` feature (and endpoints): the task log says so, the files stay."""
    config = DevMasterConfig(db_path=tmp_path / "old.sqlite", registration_token="reg-token-old-master",
                             admin_token="admin-token-old-master", port=0, artifacts=False)
    base_url = await nursery.start(serve, config)
    work = tmp_path / "agent"
    async with AdminClient(base_url, config.admin_token) as admin:
        settings = agent_settings(work, base_url, config.registration_token)
        async with running_agent(nursery, settings):
            spider_id = await _spider(admin, "old", {"main.py": "open('out.txt', 'w').write('x' * 10)\n"})
            task_id = await admin.create_task(spider_id)
            with trio.fail_after(90):
                task = await admin.wait_task_final(task_id, 90)
        assert task["status"] == "SUCCESS", task
        line = _log_line(await admin.get_logs(task_id), "outputs: ")
    assert "out.txt (10 B) kept at" in line and "the master does not take artifacts" in line, line
    assert next(work.glob(f"spider-data/*/outputs/{task_id}/out.txt")).read_text() == "x" * 10


async def test_spider_outputs_patch_and_validation(dev_master) -> None:
    admin = dev_master.admin
    spider_id = await admin.create_spider(name="p", framework="python")
    spider = await admin.update_spider(spider_id, outputs={"items": ["out/*.jsonl"], "artifacts": ["img/"]})
    assert spider["outputs"] == {"items": ["out/*.jsonl"], "artifacts": ["img/"]}
    for bad, said in (({"items": ["/etc/passwd"]}, "absolute"), ({"items": ["../x.json"]}, "climbs out"),
                      ({"artefacts": []}, "unknown key"), ({"items": [1]}, "glob")):
        with pytest.raises(AdminApiError) as caught:
            await admin.update_spider(spider_id, outputs=bad)
        assert caught.value.status_code == 422 and said in caught.value.message, caught.value
    assert (await admin.update_spider(spider_id, outputs=None))["outputs"] is None
